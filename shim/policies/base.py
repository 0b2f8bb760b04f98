"""The policy interface, the round it decides on and the one standard SD acceptance rule.

The engine (``engine.py``) owns the loop, the KV caches, committing tokens (EOS, length) and the
counting; a policy owns its decisions. The engine calls, in this order:

* ``reset()`` before every prompt (per-prompt state: counters, the draft gate's memory);
* every round: ``start_round(rnd)`` (a new round: its state goes on ``rnd.state``), ``draft_round()``
  (False: no candidates, the verifying model steps alone), ``stop_drafting(rnd)`` after every drafted
  candidate (the engine also stops at ``rnd.limit``, where it still asks a policy that
  ``may_skip_target``), ``needs_target(rnd)`` (such a policy may keep every candidate without a
  target pass), ``verify(rnd, logits, hidden)`` after the one pass over ``[last, y_1..y_n]``, and
  ``end_round(drafted, accepted)``;
* after the prompt, ``counters()`` (folded into the stats) and ``trace()`` (kept with the output).

What the engine sets up from the policy: ``max_candidates()`` and ``round_room(remaining)`` size
each round; ``draft_hidden`` / ``target_hidden`` name the final-norm states it captures; ``models``
are the models used, ``emitter`` the one that emits each round's token (``draft`` for the draft
alone) and ``bridge`` how candidates cross vocabularies (None: one vocabulary; TLI, SLEM).

Per-round state lives on the :class:`Round` (``rnd.state``), per-prompt state on the policy instance:
a batched engine drives one round per row, with one policy instance per row.

Each policy class also owns its settings (``Settings``: typed, its own names, the rules that check
them, used by ``heads-decode`` and ``heads-eval`` alike), the exported head it reads (``HEAD``), how it
is built from settings and a head (``from_settings``) and how it reads in a log (``describe``).
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from specheads.shim.core.sampling import SamplingConfig, probs_from_logits, sample, uniform
from specheads.shim.costs.cost_table import CostTable
from specheads.shim.policies.settings import HeadSpec, Settings
from specheads.shim.policies.settings import Settings as AnySettings


@dataclass
class Round:
    """One draft/verify round as the policy sees it.

    ``tokens[j]`` is candidate ``y_{j+1}`` (0-dim long tensor). ``q[j]`` is the warped
    distribution it was drawn from (sampling only). ``draft_hidden[j]`` is the draft state
    returned by the forward that produced ``y_{j+1}``: the state of the token before it.
    ``state`` is the policy's own state for this round (set by :meth:`Policy.start_round`).
    """

    sampling: SamplingConfig
    generator: torch.Generator | None
    limit: int
    position: int
    eos: frozenset[int] = frozenset()
    tokens: list[torch.Tensor] = field(default_factory=list)
    q: list[torch.Tensor] = field(default_factory=list)
    draft_logits: list[torch.Tensor] = field(default_factory=list)
    draft_hidden: list[torch.Tensor] = field(default_factory=list)
    state: Any = None

    @property
    def n(self) -> int:
        """Candidates drafted so far."""
        return len(self.tokens)

    def candidates(self, device: torch.device | None = None) -> torch.Tensor:
        """Candidates as one ``[n]`` long tensor."""
        if not self.tokens:
            return torch.empty(0, dtype=torch.long, device=device)
        out = torch.stack(self.tokens)
        return out if device is None else out.to(device)


@dataclass
class Verdict:
    """The round's outcome: the ``accepted`` leading candidates are kept, then ``token`` (the target's
    correction or bonus) is emitted. ``token`` is None when the round emits no token of its own: a round
    that made no target call (:meth:`Policy.needs_target`), or one whose last candidate the policy itself
    accepted and let the draft continue from (Judge)."""

    accepted: int
    token: int | None


class Policy:
    """Base policy: the defaults of standard speculative decoding with a fixed length ``k``.

    Attributes:
        draft_hidden / target_hidden: ``None``, ``"pre"`` or ``"post"``: which final-norm
            state the engine captures for ``stop_drafting`` / ``verify``.
        may_skip_target: a round may end without a target call (see ``needs_target``).
        models: the models decoding uses; emitter: the one whose pass ends each round and emits its
            token (``"target"`` or ``"draft"``).
        lossless: the outputs follow the target's distribution exactly (greedy: the target's own tokens);
            a policy whose rule accepts what SD rejects (or that never asks the target) sets it False, and the
            reports, ``select=`` and the sweep's rows read it instead of a row's name.
        bridge: None (candidates in the target's vocabulary) or how they cross vocabularies.
        head_file: the exported head a policy built by ``from_settings`` reads (for the log).
        head_metadata: that head's exported metadata; head_feature: its ``feature`` (whose states it reads: the
            draft model's, an EAGLE head's); both set by ``make_policy``, which checks it against the drafter
            (``head_drafter``: that EAGLE head's ``tensors_sha256``, None for the draft model); a decoder with
            another drafter checks again.
        batch: the rows the engine runs in the round about to start (1 at batch 1; set by the batched
            engine and the vLLM proposer before ``start_round``): the cost-aware rules price at it.
    """

    name = "base"
    batch = 1
    Settings: ClassVar[type[Settings]] = Settings
    HEAD: ClassVar[HeadSpec | None] = None
    draft_hidden: str | None = None
    target_hidden: str | None = None
    may_skip_target = False
    models: tuple[str, ...] = ("target", "draft")
    emitter = "target"
    lossless: ClassVar[bool] = True
    bridge: str | None = None
    head_file: str | None = None
    head_metadata: dict | None = None
    head_feature: dict | None = None
    head_drafter: str | None = None
    #: The policy's settings as its constructor resolved them (:func:`~.settings.settle`: the Settings' own
    #: defaults under the arguments passed; a threshold the head supplied is in them): written once, there.
    settings: AnySettings

    #: What a policy must define: its registered ``name`` and ``from_settings`` (how its settings build it).
    REQUIRED_HOOKS: ClassVar[tuple[str, ...]] = ("name", "from_settings")
    #: What a policy may override; the defaults are standard SD with a fixed ``k``.
    OPTIONAL_HOOKS: ClassVar[tuple[str, ...]] = (
        "Settings",
        "HEAD",
        "describe",
        "reset",
        "start_round",
        "draft_round",
        "stop_drafting",
        "needs_target",
        "verify",
        "end_round",
        "counters",
        "trace",
        "max_candidates",
        "round_room",
        "fork",
    )

    def __init__(self, k: int):
        self.k = k

    @classmethod
    def missing_hooks(cls) -> list[str]:
        """The required hooks this class leaves at the base's (an empty list: it can be registered)."""
        own = cls.__mro__[: cls.__mro__.index(Policy)]  # the classes between this one and Policy
        return [h for h in cls.REQUIRED_HOOKS if not any(h in c.__dict__ for c in own)]

    @classmethod
    def from_settings(cls, s, pair=None, head=None, costs=None) -> "Policy":
        """The policy for settings ``s`` (checked), the loaded ``pair``, its loaded head (a
        :class:`~specheads.export.package.LoadedHead` when ``HEAD`` names one) and the pair's cost table."""
        raise NotImplementedError

    def describe(self) -> dict:
        """The settings that define this policy, for the log and ``metrics.json``: its resolved settings (a
        policy adds what its head or drafter fixed, or leaves out what its rule does not read)."""
        own = getattr(self, "settings", None)
        return dataclasses.asdict(own) if own is not None else {}

    def fork(self) -> "Policy":
        """An independent copy for one row of a batch: its own per-prompt state (counters, the draft
        gate's memory), the same heads, tensors and cost table (shared, never written while decoding)."""
        shared: dict[int, Any] = {}
        todo: list[Any] = [self]
        while todo:  # through nested policies (FSD's stopper) too
            for v in vars(todo.pop()).values():
                if isinstance(v, (torch.nn.Module, torch.Tensor, CostTable)):
                    shared[id(v)] = v
                elif isinstance(v, Policy):
                    todo.append(v)
        return copy.deepcopy(self, shared)

    def max_candidates(self) -> int:
        """Upper bound on candidates per round (the engine also caps by remaining length)."""
        return self.k

    def round_room(self, remaining: int) -> int:
        """Most candidates a round may draft when ``remaining`` tokens are left: one slot stays free for
        the target's token, unless the policy may end a round without one."""
        return remaining if self.may_skip_target else remaining - 1

    def reset(self) -> None:
        """Called before every prompt."""

    def start_round(self, rnd: Round) -> None:
        """Called at every round's start, before anything is drafted: sets ``rnd.state``."""

    def draft_round(self) -> bool:
        """Called at every round's start: False to skip drafting, so the target steps alone (one token)."""
        return True

    def stop_drafting(self, rnd: Round) -> bool:
        """True to stop drafting and verify the ``rnd.n`` candidates drafted so far."""
        return rnd.n >= self.k

    def needs_target(self, rnd: Round) -> bool:
        """False to keep all ``rnd.n`` candidates without a target pass (only when ``may_skip_target``)."""
        return True

    def verify(self, rnd: Round, logits: torch.Tensor, hidden: torch.Tensor | None) -> Verdict:
        """Decides the round from the target logits ``[n+1, V]`` (positions ``last, y_1..y_n``).

        ``hidden`` is ``[n+1, d]`` at the same positions when ``target_hidden`` is set, else None.
        """
        return standard_verify(rnd, logits)

    def end_round(self, drafted: int, accepted: int) -> None:
        """Called after every round's verdict: ``accepted`` of the ``drafted`` candidates were kept."""

    def counters(self) -> dict[str, float]:
        """This prompt's counts of the policy's own events (e.g. verifier calls), for the stats."""
        return {}

    def trace(self) -> dict:
        """This prompt's record of the policy's decisions, kept beside its output (e.g. SPRINTER's)."""
        return {}


# ---- standard speculative decoding (docs/algorithms/cost-model.md) ----------------------------------


def standard_verify(rnd: Round, logits: torch.Tensor) -> Verdict:
    """The SD acceptance rule (greedy or lossless rejection sampling) on one round."""
    if not rnd.sampling.do_sample:
        return greedy_accept(rnd.candidates(logits.device), logits)
    p = probs_from_logits(logits, rnd.sampling)
    q = torch.stack(rnd.q).to(p.device) if rnd.q else p[:0]
    return speculative_accept(p, q, rnd.candidates(p.device), rnd.generator)


def greedy_accept(cand: torch.Tensor, logits: torch.Tensor) -> Verdict:
    """Longest prefix of ``cand`` ``[n]`` matching ``argmax(logits)`` ``[n+1, V]``, then the argmax."""
    top = logits.argmax(-1)
    n = cand.shape[0]
    matched = (cand == top[:n]).long().cumprod(0).sum().view(1)
    vals = torch.cat([matched, top]).tolist()  # one device sync
    m = vals[0]
    return Verdict(m, vals[1 + m])


def speculative_accept(p: torch.Tensor, q: torch.Tensor, cand: torch.Tensor, generator) -> Verdict:
    """Lossless rejection sampling (docs/algorithms/cost-model.md), all in fp32.

    Args:
        p: ``[n+1, V]`` warped target probabilities (row ``n`` is the bonus distribution).
        q: ``[n, V]`` warped draft probabilities the candidates were drawn from.
        cand: ``[n]`` candidate ids.
        generator: RNG for the uniforms and the correction draw.
    """
    m = int(sd_accepts(p, q, cand, generator).long().cumprod(0).sum()) if cand.shape[0] else 0
    return Verdict(m, sd_token(p, q, m, generator))


def sd_accepts(p: torch.Tensor, q: torch.Tensor, cand: torch.Tensor, generator) -> torch.Tensor:
    """``[n]`` bool: the SD test ``u_j * q_j(y_j) <= p_j(y_j)`` of every candidate, one uniform each, drawn
    in candidate order. Every policy that falls back on the SD rule draws through here, so it stays SD
    draw for draw."""
    n = cand.shape[0]
    idx = torch.arange(n, device=p.device)
    u = uniform(n, p.device, generator)
    return u * q[idx, cand] <= p[idx, cand]


def sd_token(p: torch.Tensor, q: torch.Tensor, m: int, generator) -> int:
    """The token SD emits after ``m`` of the ``n = len(q)`` candidates: the bonus from ``p_{n+1}`` when all
    were accepted, else a draw from the residual ``norm(max(0, p_m - q_m))``."""
    dist = p[m] if m == q.shape[0] else residual(p[m], q[m])
    return int(sample(dist, generator))


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``norm(max(0, p - q))``; when that mass is ~0 (``p ≈ q``) it falls back to ``p``."""
    r = (p - q).clamp_min(0)
    mass = r.sum(-1, keepdim=True)
    return torch.where(mass > 1e-12, r / mass.clamp_min(1e-30), p)
