"""A vLLM plugin that ends each request's EAGLE-3 draft where its stop rule says (``docs/vllm.md``, "The stop plugin").

vLLM's ``eagle3`` drafts ``num_speculative_tokens`` (``K``) candidates for every request at every step. With this
plugin selected (its settings in the ``speculative_config``: :mod:`specheads.vllm.stop_config`), each request's
round stops at its own length ``0..K``, decided as the candidates are drawn by one of the toolkit's own policies, one
per request: ``c-cost`` (:class:`~specheads.shim.policies.ConfidenceStop` ``stop="cost"`` on ``q(y)``),
``c-online-cost`` (the same on the online logistic estimate) or ``h-cost`` (:class:`~specheads.shim.policies.SpecDecPP`
``stop="cost"`` on a learned stop head on this EAGLE head's states, lag 0 when trained with
``eagle_rounds.position=previous``); ``fixed`` cuts every request at ``fixed_k``. Each is priced by a cost table of
vLLM's own steps at the running batch (:mod:`specheads.vllm.stop_tools`), with the draft gate when asked and, at
batches of 2 or more, the batch cap (:meth:`Controller._batch_pays`). Above ``rule_max_batch`` requests (default 1)
every request drafts the K the table prices best for the acceptance seen so far (:meth:`Controller.best_k`): there no
rule on ``q`` beats the best fixed K on the shared pair, even in hindsight (``bench/studies/vllm_stop_qceiling.py``).
A stopped request's candidates are cut at once; once every request of the step has stopped the rest is skipped.

:func:`register` is a ``vllm.general_plugins`` entry point, run in every vLLM process: it registers the
``specheads`` load format (vLLM's default loader, for a draft load config that also carries the settings), checks the
settings where vLLM builds its config (``EngineArgs.create_engine_config``: one line, before any model loads; async
scheduling turned off, as ``gpu_model_runner.py:1857`` takes the drafts as one tensor) and wraps the model runner's
``propose_draft_token_ids`` (``vllm/v1/worker/gpu_model_runner.py``, which the CPU runner inherits): per step it hands
each request's previous verdict to its policy, runs vLLM's own EAGLE proposer with the per-step sampling replaced by
the same argmax on the same logits that also asks every request's policy whether to go on, and returns one list per
request. Without the settings nothing changes. ``take_trace`` (over ``collective_rpc``) returns every round it
decided, which :mod:`specheads.vllm.stop_check` replays through the toolkit's own rule.
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specheads.vllm.stop_config import LOAD_FORMAT, SECTION, StopSettings, config_problems, rule_policy, settings_of

_REGISTERED = False  # the load format, once per process


class _AllStopped(Exception):
    """Raised inside vLLM's draft loop once every request of the step has stopped: the rest is skipped."""


# ---- the policies --------------------------------------------------------------------------------------------


def _survival(rnd) -> tuple[float, float, float]:
    """A round's ``S_n`` (all its candidates accepted), ``sum_i S_i`` and the estimate for its next candidate, from
    the cost rules' round state (:class:`~specheads.shim.policies.ConfidenceStop`'s or
    :class:`~specheads.shim.policies.SpecDecPP`'s); a round that drafted nothing: ``(1, 0, 0)``."""
    import math

    s = rnd.state
    if not rnd.n or s is None:
        return 1.0, 0.0, 0.0
    if hasattr(s, "log_keep"):  # SpecDecPP: the newest score is the next candidate's estimate
        keep = math.exp(s.log_keep)
        return keep, s.total, 1.0 if s.beta is None else s.beta
    return s.keep, s.total, s.beta


# ---- the controller (one per worker) ------------------------------------------------------------------------


@dataclass
class _Step:
    """One step's rounds: per batch row its request, round, length (None: still drafting)."""

    reqs: list[str]
    rounds: list[Any]
    lengths: list[int | None]
    capped: list[bool] = field(default_factory=list)  # the batch cap ended the row's round
    scheduled: bool = False  # a batch above rule_max_batch: every row drafts the table's best K
    drawn: int = 0
    last: float = 0.0


@dataclass
class Controller:
    """The plugin's state in one worker: the settings, one policy per request, the trace and the profile."""

    settings: StopSettings
    k: int
    eagle_meta: dict | None
    hidden: int | None = None
    proto: Any = None
    policies: dict = field(default_factory=dict)  # request id -> its policy
    pending: dict = field(default_factory=dict)  # request id -> candidates it was given last step
    trace: list = field(default_factory=list)
    samples: dict = field(default_factory=dict)  # profile: "t_t B k", "t_d B", "t_first B" -> ms
    steps: int = 0
    costs: Any = None
    reached: list = field(default_factory=list)  # scheduled rounds: per position j, rounds verified that far
    kept: list = field(default_factory=list)  # ... and of those, the ones whose candidate j the target accepted
    step: _Step | None = None
    _last: tuple | None = None  # profile: (end time, request ids, n) of the previous step

    def __post_init__(self):
        self.configure(self.settings)

    def configure(self, s: StopSettings) -> None:
        """Takes new settings (checked); every request starts again from the new policy."""
        bad = s.problems(self.k)
        if bad:
            raise ValueError("; ".join(bad))
        self.settings, self.proto = s, rule_policy(s, self.k, self.eagle_meta, self.hidden)
        self.costs = None if s.profile or s.rule == "fixed" else self.proto.costs  # the batch cap's prices
        self.policies, self.pending, self._last = {}, {}, None
        self.reached, self.kept = [0] * (self.k + 1), [0] * (self.k + 1)

    def outcomes(self, scheduler_output, req_ids: list[str], sampled) -> None:
        """Hands each request's previous round to its policy: ``drafted`` = the candidates vLLM verified, ``accepted`` =
        the sampled tokens past the first."""
        import torch

        for req in getattr(scheduler_output, "finished_req_ids", ()) or ():
            self.policies.pop(req, None)
            self.pending.pop(req, None)
        if not self.pending:
            return
        verified = scheduler_output.scheduled_spec_decode_tokens or {}
        counts = None
        for row, req in enumerate(req_ids):
            if req not in self.pending:
                continue
            _, scheduled = self.pending.pop(req)
            drafted = len(verified.get(req, ()))
            accepted = 0
            if drafted:
                if counts is None:
                    counts = (
                        (sampled != -1).sum(-1).tolist()
                        if isinstance(sampled, torch.Tensor)
                        else [len(t) for t in sampled]
                    )
                accepted = max(0, min(drafted, counts[row] - 1))
            self.policies[req].end_round(drafted, accepted)
            if scheduled:
                for j in range(1, drafted + 1):
                    self.reached[j] += 1
                    self.kept[j] += accepted >= j
            if self.settings.trace:
                self.trace.append({"req": req, "step": self.steps, "verified": drafted, "accepted": accepted})

    def begin(self, req_ids: list[str]) -> None:
        """A step's rounds start: one per request, the gate asked first."""
        from specheads.shim import Round, SamplingConfig

        now = time.perf_counter()
        if self.settings.profile and self._last is not None:
            end, before, n = self._last
            if before == req_ids:  # the same requests: vLLM's step verified n + 1 tokens each
                self.samples.setdefault(f"t_t {len(req_ids)} {n + 1}", []).append(1000 * (now - end))
        self.steps += 1
        rounds, lengths = [], []
        top = self.settings.rule_max_batch
        scheduled = not self.settings.profile and self.settings.rule != "fixed" and top is not None
        scheduled = scheduled and len(req_ids) > top
        k_now = self.best_k(len(req_ids)) if scheduled else None
        for req in req_ids:
            policy = self.policies.get(req)
            if policy is None:
                policy = self.policies[req] = self.proto.fork()
                policy.reset()
            policy.batch = len(req_ids)
            rnd = Round(sampling=SamplingConfig(), generator=None, limit=self.k, position=0)
            policy.start_round(rnd)
            if self.settings.profile:
                n = (self.steps - 1) % (self.k + 1)
            elif self.settings.rule == "fixed":
                n = int(self.settings.fixed_k or 0)
            elif scheduled:
                n = k_now
            else:
                n = None if policy.draft_round() else 0
            rounds.append(rnd)
            lengths.append(0 if n == 0 else None)
            if n:
                rnd.limit = n
        self.step = _Step(list(req_ids), rounds, lengths, [False] * len(rounds), scheduled, last=now)

    def drawn(self, hidden, logits, tokens) -> None:
        """Candidate ``j`` of every row was drawn (``hidden``: the post-norm states that drew them, ``logits``: over
        the EAGLE head's vocabulary, ``tokens`` its ids there): each request still drafting asks its policy; all
        stopped raises :class:`_AllStopped`."""
        st = self.step
        now = time.perf_counter()
        st.drawn += 1
        j = st.drawn
        if self.settings.profile:
            key = f"t_first {len(st.reqs)}" if j == 1 else f"t_d {len(st.reqs)}"
            self.samples.setdefault(key, []).append(1000 * (now - st.last))
        st.last = now
        for r, req in enumerate(st.reqs):
            if st.lengths[r] is not None:
                continue
            rnd = st.rounds[r]
            rnd.tokens.append(tokens[r])
            rnd.draft_logits.append(logits[r])
            rnd.draft_hidden.append(hidden[r])
            policy = self.policies[req]
            if st.scheduled:  # K decides; a rule that learns online still reads each candidate (no other pays a sync)
                if getattr(policy, "online", None) is not None:
                    policy.stop_drafting(rnd)
                if rnd.n >= rnd.limit:
                    st.lengths[r] = rnd.n
            elif rnd.n >= rnd.limit or policy.stop_drafting(rnd) or rnd.n >= self.k:
                st.lengths[r] = rnd.n
        cap = j < self.k and len(st.reqs) > 1 and self.costs is not None and not st.scheduled
        if cap and not self._batch_pays(st, j):
            for r, n in enumerate(st.lengths):
                if n is None:
                    st.lengths[r], st.capped[r] = st.rounds[r].n, True
        if j < self.k and all(n is not None for n in st.lengths):
            raise _AllStopped

    def best_k(self, b: int) -> int:
        """The K in ``k_min..K`` the cost table prices best at batch ``b`` for the acceptance the scheduled rounds saw:
        position ``j``'s chance ``(kept + 1) / (reached + 2)`` (a position never verified carries the one before, from
        1/2), a round of ``n`` yielding ``1 + sum_j S_j`` tokens for ``n t_d(b) + t_t(b, n + 1)``."""
        t, a, s, e = self.costs, 0.5, 1.0, 1.0
        best, rate = self.settings.k_min, -1.0
        for j in range(1, self.k + 1):
            if self.reached[j]:
                a = (self.kept[j] + 1) / (self.reached[j] + 2)
            s *= a
            e += s
            if j >= self.settings.k_min and e / t.round_ms(j, b) > rate:
                best, rate = j, e / t.round_ms(j, b)
        return best

    def _batch_pays(self, st: _Step, j: int) -> bool:
        """Whether one more draft step pays for the batch (the batch cap; ``B > 1``). Each request's rule prices its
        round as if every request drafted alike, but a step's draft loop runs as long as its longest round: one more
        step costs the whole batch ``t_d(B)`` plus the verification of the candidates it adds, for the expected
        tokens of the requests still drafting (each ``S_n * beta``: its survival and its newest estimate). It pays
        when that gain per ms beats the step's expected tokens per ms so far."""
        t, b = self.costs, len(st.reqs)
        tokens, gain, active = 0.0, 0.0, 0
        for r, rnd in enumerate(st.rounds):
            keep, total, beta = _survival(rnd)
            tokens += 1.0 + total
            if st.lengths[r] is None:
                gain += keep * beta
                active += 1
        mean = sum(rnd.n for rnd in st.rounds) / b
        cost = j * t.t_draft(b) + t.t_target(mean + 1, b)
        extra = t.t_draft(b) + t.t_target(mean + 1 + active / b, b) - t.t_target(mean + 1, b)
        return gain * cost > tokens * extra

    def finish(self, drafts: list[list[int]]) -> list[list[int]]:
        """The step's drafts (vLLM's ``[requests, candidates drawn]``) cut to each request's length."""
        st, self.step = self.step, None
        out = []
        for r, req in enumerate(st.reqs):
            n = st.lengths[r] if st.lengths[r] is not None else len(drafts[r])
            out.append([int(t) for t in drafts[r][:n]])
            self.pending[req] = (n, st.scheduled)
            if self.settings.trace:
                rec = {"req": req, "step": self.steps, "batch": len(st.reqs), "draft": out[-1]}
                rec |= {"capped": True} if st.capped[r] else {}
                self.trace.append(rec | ({"scheduled": True} if st.scheduled else {}))
        if self.settings.profile:
            self._last = (time.perf_counter(), list(st.reqs), len(out[0]) if out else 0)
        return out


# ---- inside vLLM ----------------------------------------------------------------------------------------------


def _controller(runner) -> Controller | None:
    ctl = getattr(runner, "_specheads_stop", None)
    if ctl is None:
        s = settings_of(getattr(runner, "speculative_config", None))
        if s is None:
            return None
        spec, meta = runner.speculative_config, None
        cfg = Path(spec.model, "config.json")
        if spec.method == "eagle3" and cfg.is_file():  # the EAGLE head's own metadata (a stop head is checked on it)
            meta = json.loads(cfg.read_text()).get("specheads") or {}
        hidden = spec.draft_model_config.get_hidden_size()
        ctl = runner._specheads_stop = Controller(s, int(spec.num_speculative_tokens), meta, hidden)
    return ctl


def _draw(model, hidden):
    """vLLM's greedy draft step: the logits over the EAGLE head's own vocabulary, their argmax there, and that
    token's target id (``compute_logits`` then argmax, as vLLM's ``_greedy_sample``, without the scatter into the
    target's vocabulary: the scores the rules read are the same, over a sixth of the width on the shared pair)."""
    d2t = getattr(model, "draft_id_to_target_id", None)
    if d2t is None or not hasattr(model, "logits_processor"):
        logits = model.compute_logits(hidden)
        ids = logits.argmax(dim=-1)
        return logits, ids, ids
    logits = model.logits_processor(model.lm_head, hidden)
    ids = logits.argmax(dim=-1)
    return logits, ids, ids + d2t[ids]


def _propose(original):
    def propose_draft_token_ids(self, scheduler_output, sampled_token_ids, *args, **kwargs):
        ctl = _controller(self)
        if ctl is None:
            return original(self, scheduler_output, sampled_token_ids, *args, **kwargs)
        req_ids = list(self.input_batch.req_ids)
        ctl.outcomes(scheduler_output, req_ids, sampled_token_ids)
        ctl.begin(req_ids)
        drafter = self.drafter
        model = drafter.model
        drawn: list = []

        def sample(hidden, sampling_metadata):
            logits, ids, tokens = _draw(model, hidden)
            drawn.append(tokens)
            ctl.drawn(hidden, logits, ids)
            return tokens, None

        drafter._sample_draft_tokens = sample
        try:
            original(self, scheduler_output, sampled_token_ids, *args, **kwargs)
        except _AllStopped:
            pass
        finally:
            del drafter._sample_draft_tokens  # back to the class's
        ids = [t.view(-1, 1) for t in drawn]
        import torch

        drafts = torch.cat(ids, 1).tolist() if ids else [[] for _ in req_ids]
        return ctl.finish(drafts)

    propose_draft_token_ids._specheads = True
    return propose_draft_token_ids


def _config_check(original):
    def create_engine_config(self, *args, **kwargs):
        bad = config_problems(self)
        if bad:
            raise ValueError("; ".join(bad))
        return original(self, *args, **kwargs)

    create_engine_config._specheads = True
    return create_engine_config


def register() -> None:
    """vLLM's ``vllm.general_plugins`` entry point (every vLLM process): the ``specheads`` load format and the two
    wrappers. Idempotent; inert until a ``speculative_config`` carries the plugin's settings."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader import register_model_loader
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    if not getattr(GPUModelRunner.propose_draft_token_ids, "_specheads", False):
        GPUModelRunner.propose_draft_token_ids = _propose(GPUModelRunner.propose_draft_token_ids)
    if not getattr(EngineArgs.create_engine_config, "_specheads", False):
        EngineArgs.create_engine_config = _config_check(EngineArgs.create_engine_config)

    global _REGISTERED
    if _REGISTERED:
        return
    _REGISTERED = True

    @register_model_loader(LOAD_FORMAT)
    class SpecheadsLoader(DefaultModelLoader):
        """vLLM's default loader, for a draft whose load config also carries the stop plugin's settings."""

        def __init__(self, load_config):
            own = dataclasses.replace(
                load_config,
                load_format="auto",
                model_loader_extra_config={
                    k: v for k, v in (load_config.model_loader_extra_config or {}).items() if k != SECTION
                },
            )
            super().__init__(own)


# ---- collective_rpc helpers (the bench, the tests) ----------------------------------------------------------


def configure(worker, settings: dict) -> bool:
    """``llm.collective_rpc(configure, args=(settings,))``: new settings for the next requests (none in flight)."""
    ctl = _controller(worker.model_runner)
    if ctl is None:
        return False
    ctl.configure(StopSettings(**settings))
    return True


def take_trace(worker) -> dict | None:
    """``llm.collective_rpc(take_trace)``: the rounds kept since the last call (``trace=True``) and the profile's
    samples; both are cleared."""
    ctl = getattr(worker.model_runner, "_specheads_stop", None)
    if ctl is None:
        return None
    out = {"trace": ctl.trace, "samples": ctl.samples}
    ctl.trace, ctl.samples = [], {}
    return out
