"""Decoding policies: when to stop drafting, which candidates to accept.

The engine (``engine.py``) owns the loop, the KV caches and the counting; a policy makes
exactly two decisions per round:

* ``stop_drafting(rnd)`` after every drafted candidate (the engine also stops at the
  round's length limit), and
* ``verify(rnd, logits, hidden)`` after the single target pass over
  ``[last, y_1..y_n]``: how many candidates to keep and which token the target adds.

SpecDec++, SPRINTER, Judge, FSD, top-K verification, draft-confidence stopping and the
heterogeneous-vocabulary methods are policies.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from specheads.errors import UserError

from .costs import CostTable, DraftGate, draft_more
from .divergence import DIVERGENCES, divergence
from .sampling import SamplingConfig, probs_from_logits, sample


@dataclass
class Round:
    """One draft/verify round as the policy sees it.

    ``tokens[j]`` is candidate ``y_{j+1}`` (0-dim long tensor). ``q[j]`` is the warped
    distribution it was drawn from (sampling only). ``draft_hidden[j]`` is the draft state
    returned by the forward that produced ``y_{j+1}``: the state of the token before it.
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
    """``accepted`` leading candidates are kept, then ``token`` (correction or bonus) is emitted;
    ``token`` is None only for a round that made no target call (:meth:`Policy.needs_target`)."""

    accepted: int
    token: int | None


class Policy:
    """Base policy: the defaults of standard speculative decoding with a fixed length ``k``.

    Attributes:
        draft_hidden / target_hidden: ``None``, ``"pre"`` or ``"post"``: which final-norm
            state the engine captures for ``stop_drafting`` / ``verify``.
    """

    name = "base"
    draft_hidden: str | None = None
    target_hidden: str | None = None
    may_skip_target = False  # True: a round may end without a target call (see needs_target)

    def __init__(self, k: int):
        if k < 1:
            raise UserError(f"k={k} must be >= 1 (candidates per round)")
        self.k = k

    def max_candidates(self) -> int:
        """Upper bound on candidates per round (the engine also caps by remaining length)."""
        return self.k

    def round_room(self, remaining: int) -> int:
        """Most candidates a round may draft when ``remaining`` tokens are left: one slot stays free for
        the target's token, unless the policy may end a round without one."""
        return remaining if self.may_skip_target else remaining - 1

    def reset(self) -> None:
        """Called before every prompt."""

    def draft_round(self) -> bool:
        """Called at every round's start: False to skip drafting, so the target steps alone (one token)."""
        return True

    def end_round(self, drafted: int, accepted: int) -> None:
        """Called after every round's verdict: ``accepted`` of the ``drafted`` candidates were kept."""

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


class StandardSD(Policy):
    """Standard speculative decoding (Leviathan et al. 2023): fixed ``k``, lossless.

    Greedy: keep candidates while they equal the target's argmax, then emit the argmax.
    Sampling: accept ``y_j`` when ``u * q_j(y_j) <= p_j(y_j)``; at the first rejection emit a
    token from ``norm(max(0, p_j - q_j))``; after ``n`` acceptances a bonus from ``p_{n+1}``.
    """

    name = "sd"


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
    """Lossless rejection sampling (ALGORITHMS.md section 0), all in fp32.

    Args:
        p: ``[n+1, V]`` warped target probabilities (row ``n`` is the bonus distribution).
        q: ``[n, V]`` warped draft probabilities the candidates were drawn from.
        cand: ``[n]`` candidate ids.
        generator: RNG for the uniforms and the correction draw.
    """
    n = cand.shape[0]
    m = 0
    if n:
        idx = torch.arange(n, device=p.device)
        py, qy = p[idx, cand], q[idx, cand]
        u = torch.rand(n, device=p.device, generator=generator)
        m = int((u * qy <= py).long().cumprod(0).sum())
    if m == n:
        return Verdict(n, int(sample(p[n], generator)))
    return Verdict(m, int(sample(residual(p[m], q[m]), generator)))


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``norm(max(0, p - q))``; when that mass is ~0 (``p ≈ q``) it falls back to ``p``."""
    r = (p - q).clamp_min(0)
    mass = r.sum(-1, keepdim=True)
    return torch.where(mass > 1e-12, r / mass.clamp_min(1e-30), p)


STOPS = ("threshold", "cost")  # how SpecDecPP and ConfidenceStop decide to stop drafting


def _stop_problems(stop: str, costs: CostTable | None, gate: bool | None = None) -> list[str]:
    if stop not in STOPS:
        return [f"stop={stop!r}: expected threshold or cost"]
    if stop == "cost" and costs is None:
        return ["stop=cost needs a cost table (costs=...; see specheads.export.shim.costs.cost_table)"]
    if gate and stop != "cost":
        return ["gate=True needs stop=cost (the gate prices rounds with the cost table)"]
    return []


class _Gated(Policy):
    """A policy whose rounds may skip drafting through a :class:`~.costs.DraftGate` (``self.gate``)."""

    gate: DraftGate | None = None

    def reset(self) -> None:
        if self.gate is not None:
            self.gate.reset()

    def draft_round(self) -> bool:
        return self.gate is None or self.gate.open()

    def end_round(self, drafted: int, accepted: int) -> None:
        if self.gate is not None:
            self.gate.observe(drafted, accepted)


class SpecDecPP(_Gated):
    """SpecDec++ adaptive candidate length (ALGORITHMS.md section 1): stop drafting when
    ``1 - prod_j beta_hat_j > h``, with ``beta_hat_j = sigmoid(head(h^D_j))`` from the draft
    state at candidate ``y_j``'s own position; never before ``k_min``, always at ``k_max``.

    ``stop="cost"`` replaces the threshold with the profiled costs ``costs``: with ``n`` candidates
    drafted, ``S_i = prod_{j<=i} beta_hat_j`` and the round's expected tokens
    ``E(n) = 1 + sum_{i<=n} S_i`` against its cost ``C(n) = n t_d + t_t(n + 1)``, drafting goes on
    while ``E(n+1) / C(n+1) > E(n) / C(n)`` (:func:`~.costs.draft_more`). Candidates without a score
    (the newest, in the reference order, and the next one) get the round's last score, or at a
    round's start the mean score of the prompt so far (1 before any).

    Scoring order (the reference's): the draft forward that produces ``y_n`` consumes
    ``y_{n-1}``, so its state scores ``y_{n-1}``; the round's first forward consumes verified
    tokens (score 1). When the round stops after ``y_n``, ``y_1..y_{n-1}`` are scored and the
    newest candidate ``y_n`` is not: no extra draft forward per round. Acceptance follows the
    standard rule, so the output is as lossless as SD's.

    A head trained on the expected label (``position="previous"``) reads the state that produced
    ``q_n``, i.e. the state returned with ``y_n`` itself: every candidate, the newest included,
    is scored as soon as it is drawn.

    Args:
        head: module mapping a draft state ``[d]`` to an acceptance logit.
        threshold: ``h`` in (0, 1); larger drafts longer.
        k_min, k_max: bounds on candidates per round.
        position: ``own`` (the soft-label head, reference order above) or ``previous``.
        stop: ``threshold`` (the rule above) or ``cost`` (no ``h``; needs ``costs``).
        costs: the pair's :class:`~.costs.CostTable` (``stop="cost"``).
        gate: ``stop="cost"`` only (its default there): before each round, skip drafting when the
            prompt's recent acceptance says a round with candidates costs more per token than the
            target alone (:class:`~.costs.DraftGate`).
    """

    name = "specdecpp"
    draft_hidden = "post"

    def __init__(self, head: torch.nn.Module, threshold: float = 0.7, k_min: int = 2, k_max: int = 20,
                 position: str = "own", stop: str = "threshold", costs: CostTable | None = None,
                 gate: bool | None = None):
        if not 0 < threshold < 1:
            raise UserError(f"threshold h={threshold} must be in (0, 1)")
        if not 1 <= k_min <= k_max:
            raise UserError(f"need 1 <= k_min <= k_max, got k_min={k_min}, k_max={k_max}")
        if position not in ("own", "previous"):
            raise UserError(f"head feature position {position!r}: expected own or previous")
        problems = _stop_problems(stop, costs, gate)
        if problems:
            raise UserError("; ".join(problems))
        super().__init__(k_max)
        self.gate = DraftGate(costs) if (stop == "cost" if gate is None else gate) else None
        self.head, self.threshold, self.k_min = head, threshold, k_min
        self.stop, self.costs = stop, costs
        self.lag = 1 if position == "own" else 0  # how many candidates behind the newest the scored one is
        self._log_keep = 0.0  # log prod of scored betas in the current round
        self._sum = 0.0  # sum of the round's S_i over the scored candidates (stop="cost")
        self._beta: float | None = None  # the round's last score (stop="cost")
        self._prompt_betas = [0.0, 0]  # this prompt's scores: sum, count (stop="cost")
        self.scored = 0  # head evaluations, for the stats

    def reset(self) -> None:
        super().reset()
        self._prompt_betas = [0.0, 0]

    def stop_drafting(self, rnd: Round) -> bool:
        n = rnd.n
        if n >= self.k:  # k_max: stop without scoring
            return True
        if n == 1:
            self._log_keep, self._sum, self._beta = 0.0, 0.0, None
        if n > self.lag:  # own: the state returned with y_n belongs to y_{n-1}; the head has the draft's dtype
            logit = self.head(rnd.draft_hidden[n - 1])
            log_beta = float(torch.nn.functional.logsigmoid(logit.float()))
            self._log_keep += log_beta
            self.scored += 1
            if self.stop == "cost":
                self._beta = math.exp(log_beta)
                self._sum += math.exp(self._log_keep)
                self._prompt_betas[0] += self._beta
                self._prompt_betas[1] += 1
        if n < self.k_min:
            return False
        if self.stop == "cost":
            total, count = self._prompt_betas
            beta = self._beta if self._beta is not None else (total / count if count else 1.0)
            return not draft_more(self.costs, n, n - self.lag, math.exp(self._log_keep), self._sum, beta)
        return 1.0 - math.exp(self._log_keep) > self.threshold


class Sprinter(Policy):
    """SPRINTER approximate verification (ALGORITHMS.md section 2), not lossless.

    One candidate at a time: the verifier scores the newest candidate ``y_n`` from the draft state
    that produced ``q_n`` (``feature="previous"``), that state concatenated with ``y_n``'s input
    embedding (``"previous+embedding"``), or the state after consuming ``y_n``
    (``"current"``, available one draft forward later, so the candidate drafted meanwhile is
    discarded if ``y_n`` is not approved). A score ``>= eta`` keeps ``y_n`` for good and drafting
    goes on; otherwise the round ends and one target pass judges ``y_n`` with the SD rule
    (accept with probability ``min(1, p/q)``, else a token from ``norm(max(0, p - q))``; greedy:
    accept iff ``y_n == argmax p``), emitting the target's next token after an acceptance (free
    in the same pass, exact). After ``max_run`` approved candidates the next one goes to the target
    unscored. A round whose candidates were all approved (an approved EOS, or the length limit)
    ends without a target call.

    With a verifier that approves exactly the tokens with ``q(y) <= p(y)`` the output follows the
    target distribution; with one that approves everything (and no cap) it is draft-only sampling.

    Args:
        head: module mapping a feature ``[d]`` (``[2d]`` with the embedding) to a logit.
        eta: approval threshold on ``sigmoid(logit)``.
        max_run: cap on consecutive approved candidates (None: no cap).
        feature: ``previous``, ``previous+embedding`` or ``current``.
        embedding: the draft's input embedding module (``previous+embedding`` only).
    """

    name = "sprinter"
    draft_hidden = "post"
    may_skip_target = True
    FEATURES = ("previous", "previous+embedding", "current")

    def __init__(self, head: torch.nn.Module, eta: float = 0.5, max_run: int | None = 20,
                 feature: str = "previous", embedding: torch.nn.Module | None = None):
        if not 0 <= eta <= 1:
            raise UserError(f"eta={eta} must be in [0, 1]")
        if max_run is not None and max_run < 0:
            raise UserError(f"max_run={max_run} must be >= 0 (or None for no cap)")
        if feature not in self.FEATURES:
            raise UserError(f"verifier feature {feature!r}: expected one of {list(self.FEATURES)}")
        if feature == "previous+embedding" and embedding is None:
            raise UserError("feature previous+embedding needs the draft's input embedding")
        super().__init__(1 << 30 if max_run is None else max_run + 1 + (feature == "current"))
        self.head, self.eta, self.max_run, self.feature, self.embedding = head, eta, max_run, feature, embedding
        self.lag = 1 if feature == "current" else 0
        self.verifier_calls = 0
        self.decisions: list[tuple[int, int, bool]] = []  # this prompt's (position, token, approved)
        self._approved = 0  # leading candidates of the round approved by the verifier
        self._round: Round | None = None

    def reset(self) -> None:
        self._approved, self._round = 0, None
        self.decisions = []

    def _sync(self, rnd: Round) -> None:
        if rnd is not self._round:  # a new round (the engine may end one before stop_drafting runs)
            self._approved, self._round = 0, rnd

    def _score(self, rnd: Round, j: int) -> float:
        """Verifier probability for candidate ``j`` (0-based) of the round."""
        if self.feature == "current":
            x = rnd.draft_hidden[j + 1]  # returned with y_{j+2}: the state after consuming y_{j+1}
        else:
            x = rnd.draft_hidden[j]  # returned with y_{j+1}: the state that produced q_{j+1}
            if self.embedding is not None:
                x = torch.cat([x, self.embedding(rnd.tokens[j].view(1))[0].to(x.dtype)])
        self.verifier_calls += 1
        return float(torch.sigmoid(self.head(x).float()).reshape(()))

    def stop_drafting(self, rnd: Round) -> bool:
        self._sync(rnd)
        n = rnd.n
        j = n - 1 - self.lag  # the candidate the newest state can score
        if self.max_run is not None and self._approved >= self.max_run:
            return True  # cap: the next unapproved candidate goes to the target
        if j < 0:
            return False
        approved = self._score(rnd, j) >= self.eta
        # Every scored candidate sits right after the committed sequence: its prefix is the
        # output's prefix, so a teacher-forced pass over the output can judge the decision later.
        token = int(rnd.tokens[j])
        self.decisions.append((rnd.position + j, token, approved))
        if not approved:
            return True
        self._approved = j + 1
        return token in rnd.eos

    def needs_target(self, rnd: Round) -> bool:
        self._sync(rnd)
        return self._approved < rnd.n and not (self._approved and int(rnd.tokens[self._approved - 1]) in rnd.eos)

    def verify(self, rnd: Round, logits: torch.Tensor, hidden: torch.Tensor | None) -> Verdict:
        self._sync(rnd)
        j = self._approved  # the first candidate the verifier did not approve: the target judges it
        n = rnd.n
        if j >= n:
            raise RuntimeError("verify called on a round whose candidates were all approved")
        sub = Round(rnd.sampling, rnd.generator, rnd.limit, rnd.position, rnd.eos, rnd.tokens[j:j + 1],
                    rnd.q[j:j + 1], rnd.draft_logits[j:j + 1], rnd.draft_hidden[j:j + 1])
        v = standard_verify(sub, logits[j:j + 2])
        return Verdict(j + v.accepted, v.token)


class Judge(Policy):
    """Judge decoding (ALGORITHMS.md section 3), not lossless: verify ``k`` candidates in one
    target pass and accept the longest prefix on which the judge mask ``sigmoid(head(h_j)) > delta``
    OR the SD rule holds; at the first candidate both reject, emit the target's token there
    (greedy: its argmax; sampling: a token from ``norm(max(0, p - q))``, as SD does).

    The head reads the target's last hidden state before the final norm at each candidate's own
    position, from the verification pass itself (no extra forward). When every candidate is
    accepted, the target's bonus token follows as in SD, unless the judge accepted the last
    candidate: then the round ends there and the draft continues from it. So ``delta = 1``
    (the judge never accepts) is SD, draw for draw, and a judge that accepts everything is
    draft-only decoding.

    Args:
        head: module mapping a target state ``[n, d]`` to logits ``[n]``.
        delta: judge threshold in [0, 1]; larger accepts less.
        k: candidates per round.
    """

    name = "judge"
    target_hidden = "pre"

    def __init__(self, head: torch.nn.Module, delta: float = 0.5, k: int = 10):
        if not 0 <= delta <= 1:
            raise UserError(f"delta={delta} must be in [0, 1]")
        super().__init__(k)
        self.head, self.delta = head, delta
        self._dtype = next(head.parameters()).dtype
        self.judge_only = 0  # candidates accepted by the judge that the SD rule rejected

    def round_room(self, remaining: int) -> int:
        # A judge that can accept may fill the last slot with a candidate; delta = 1 keeps SD's room.
        return remaining if self.delta < 1 else remaining - 1

    def verify(self, rnd: Round, logits: torch.Tensor, hidden: torch.Tensor | None) -> Verdict:
        n = rnd.n
        if n == 0:
            return standard_verify(rnd, logits)
        cand = rnd.candidates(logits.device)
        judge = self.head(hidden[1:n + 1].to(self._dtype)).float().reshape(n).sigmoid().to(logits.device) > self.delta
        if rnd.sampling.do_sample:
            p = probs_from_logits(logits, rnd.sampling)
            q = torch.stack(rnd.q).to(p.device)
            idx = torch.arange(n, device=p.device)
            u = torch.rand(n, device=p.device, generator=rnd.generator)  # the draws SD makes, in its order
            sd = u * q[idx, cand] <= p[idx, cand]
        else:
            top = logits.argmax(-1)
            sd = cand == top[:n]
        kept = (judge | sd).long().cumprod(0)
        counts = torch.stack([kept.sum(), ((judge & ~sd).long() * kept).sum(), judge[n - 1].long()])
        if rnd.sampling.do_sample:
            m, judge_only, judged_last = counts.tolist()  # the one sync of the round
        else:
            m, judge_only, judged_last, *tokens = torch.cat([counts, top]).tolist()
        self.judge_only += judge_only
        if m == n and judged_last:
            return Verdict(n, None)
        if not rnd.sampling.do_sample:
            return Verdict(m, tokens[m])
        dist = p[n] if m == n else residual(p[m], q[m])
        return Verdict(m, int(sample(dist, rnd.generator)))


class TopKVerify(Policy):
    """Top-K verification (ALGORITHMS.md section 4), a training-free baseline, not lossless: accept
    candidate ``y_i`` while it is among the target's ``top_k`` most likely tokens at its position; at
    the first candidate that is not, emit the target's token there (greedy: argmax; sampling: a draw
    from ``p_i``); after ``k`` accepted candidates the bonus from ``p_{k+1}``. ``top_k = 1`` is greedy SD.

    Args:
        k: candidates per round.
        top_k: how many of the target's most likely tokens count as acceptable.
    """

    name = "topk_verify"

    def __init__(self, k: int = 4, top_k: int = 2):
        if top_k < 1:
            raise UserError(f"top_k={top_k} must be >= 1")
        super().__init__(k)
        self.top_k = top_k

    def verify(self, rnd: Round, logits: torch.Tensor, hidden: torch.Tensor | None) -> Verdict:
        n = rnd.n
        cand = rnd.candidates(logits.device)
        top = logits[:n].topk(min(self.top_k, logits.shape[-1]), dim=-1).indices
        matched = (top == cand[:, None]).any(-1).long().cumprod(0).sum()
        if rnd.sampling.do_sample:
            m = int(matched)
            return Verdict(m, int(sample(probs_from_logits(logits[m], rnd.sampling), rnd.generator)))
        m, *tokens = torch.cat([matched.view(1), logits.argmax(-1)]).tolist()  # one sync
        return Verdict(m, tokens[m])


FSD_RULES = ("paper", "or")
DIV_DISTS = ("raw", "warped")


def fsd_problems(threshold: float | None, divergence_name: str, fsd_top_k: int, rule: str, fsd_dist: str) -> list[str]:
    """One line per invalid FSD setting (empty when valid), so a CLI can report them all at once.

    Args:
        threshold: ``T``; None when the user did not set it.
        divergence_name: one of :data:`~.divergence.DIVERGENCES`.
        fsd_top_k: 0 (full vocabulary) or the top-k-plus-rest restriction.
        rule: ``paper`` or ``or``.
        fsd_dist: ``raw`` or ``warped``.
    """
    out = []
    if threshold is None:
        out.append("FSD needs a divergence threshold T: set threshold=T (>= 0; sweep it with heads-eval fsd_js=[...])")
    elif not threshold >= 0:  # also catches nan
        out.append(f"FSD threshold T={threshold} must be >= 0")
    if divergence_name not in DIVERGENCES:
        out.append(f"unknown divergence {divergence_name!r}; choose one of {list(DIVERGENCES)}")
    if fsd_top_k < 0:
        out.append(f"fsd_top_k={fsd_top_k} must be >= 0 (0: the whole vocabulary)")
    if rule not in FSD_RULES:
        out.append(f"FSD rule {rule!r}: expected paper (Div < T) or or (SD accepts or Div < T)")
    if fsd_dist not in DIV_DISTS:
        out.append(f"fsd_dist={fsd_dist!r}: expected raw (unwarped softmax) or warped (after temperature/top-k/top-p)")
    return out


class FSD(Policy):
    """Fuzzy speculative decoding (ALGORITHMS.md section 4), training-free, not lossless.

    ``k`` candidates are verified in one target pass. Paper rule (default): accept candidate ``y_i``
    while ``Div(p_i, q_i) < T``; at the first rejection emit a token from ``p_i`` itself (greedy: its
    argmax; sampling: a draw from the warped ``p_i``); after ``k`` acceptances the bonus from
    ``p_{k+1}``. ``T = 0`` accepts nothing (target-exact output, every draft wasted). Rule ``or`` (the
    FSD author's later implementation): accept while the SD rule accepts OR ``Div < T``, at the first
    rejection the SD correction (residual; greedy: argmax); ``T = 0`` is SD draw for draw.

    Divergences are in fp32 on ``raw`` distributions (softmax of the unwarped logits, as the public
    FSD code) or ``warped`` ones (after temperature / top-k / top-p: the distributions decoding draws
    from). Greedy decoding warps nothing, so there ``warped`` is ``raw``. Divergences are clamped at 0
    against rounding, so ``T = 0`` never accepts.

    ``fuzzy_only`` counts accepted candidates that the strict SD rule would have rejected (greedy:
    ``y_i != argmax p_i``; rule ``or`` with sampling: the round's own SD draw failed), up to the first
    EOS (the engine drops what follows). The paper rule with sampling draws no uniforms, so there it
    adds the expected count ``sum(1 - min(1, p_i(y_i) / q_i(y_i)))``.

    Args:
        threshold: ``T >= 0``; larger accepts more.
        divergence: ``kl`` (KL(p||q)), ``kl_rev`` (KL(q||p)), ``js`` or ``tv``.
        k: candidates per round.
        fsd_top_k: 0 for the full vocabulary, else the target's top ``fsd_top_k`` tokens plus one bucket.
        rule: ``paper`` or ``or``.
        fsd_dist: ``raw`` or ``warped``.
        stopper: optional SpecDec++ policy whose head predicts FSD acceptance from draft states
            (``heads-datagen labels=fsd``, FSD paper section 7.1): it decides when to stop drafting
            (its ``k_max`` replaces ``k``); FSD still verifies.
    """

    name = "fsd"

    def __init__(self, threshold: float, divergence: str = "js", k: int = 4, fsd_top_k: int = 0,
                 rule: str = "paper", fsd_dist: str = "raw", stopper: SpecDecPP | None = None):
        problems = fsd_problems(threshold, divergence, fsd_top_k, rule, fsd_dist)
        if problems:
            raise UserError("; ".join(problems))
        super().__init__(k if stopper is None else stopper.k)
        self.threshold, self.divergence, self.fsd_top_k = float(threshold), divergence, fsd_top_k
        self.rule, self.fsd_dist = rule, fsd_dist
        self.stopper = stopper
        if stopper is not None:
            self.draft_hidden = stopper.draft_hidden
        self.fuzzy_only = 0.0
        self._eos: tuple[frozenset, torch.Tensor] | None = None

    def reset(self) -> None:
        if self.stopper is not None:
            self.stopper.reset()

    def stop_drafting(self, rnd: Round) -> bool:
        return super().stop_drafting(rnd) if self.stopper is None else self.stopper.stop_drafting(rnd)

    def _emitted(self, rnd: Round, cand: torch.Tensor) -> torch.Tensor:
        """``[n]`` 1 for candidates up to the first EOS among them, 0 after it (the engine cuts those)."""
        if not rnd.eos:
            return torch.ones_like(cand)
        if self._eos is None or self._eos[0] != rnd.eos or self._eos[1].device != cand.device:
            self._eos = (rnd.eos, torch.tensor(sorted(rnd.eos), device=cand.device))
        is_eos = torch.isin(cand, self._eos[1]).long()
        return (is_eos.cumsum(0) - is_eos == 0).long()

    def _divergences(self, rnd: Round, logits: torch.Tensor, p: torch.Tensor | None) -> torch.Tensor:
        """``[n]`` divergences between the target's and the draft's distributions at each candidate."""
        n = rnd.n
        if self.fsd_dist == "warped" and rnd.sampling.do_sample:
            p_div, q_div = p[:n], torch.stack(rnd.q).to(p.device)
        else:  # raw: in greedy mode rnd.q is empty, the draft's logits are always there
            p_div = logits[:n].float().softmax(-1)
            q_div = torch.stack(rnd.draft_logits).to(logits.device).float().softmax(-1)
        return divergence(self.divergence, p_div, q_div, self.fsd_top_k).clamp_min(0)

    def verify(self, rnd: Round, logits: torch.Tensor, hidden: torch.Tensor | None) -> Verdict:
        if rnd.n == 0:  # no room for a candidate: the target's own token
            return standard_verify(rnd, logits)
        cand = rnd.candidates(logits.device)
        if not rnd.sampling.do_sample:
            return self._verify_greedy(rnd, logits, cand)
        p = probs_from_logits(logits, rnd.sampling)  # [n+1, V] warped
        return self._verify_sampled(rnd, p, cand, self._divergences(rnd, logits, p) < self.threshold)

    def _verify_greedy(self, rnd: Round, logits: torch.Tensor, cand: torch.Tensor) -> Verdict:
        n = rnd.n
        fuzzy = self._divergences(rnd, logits, None) < self.threshold
        top = logits.argmax(-1)
        strict = cand == top[:n]
        kept = ((fuzzy | strict) if self.rule == "or" else fuzzy).long().cumprod(0)
        lenient = ((~strict).long() * kept * self._emitted(rnd, cand)).sum()
        m, lenient, *tokens = torch.cat([torch.stack([kept.sum(), lenient]), top]).tolist()  # the one sync
        self.fuzzy_only += lenient
        return Verdict(m, tokens[m])

    def _verify_sampled(self, rnd: Round, p: torch.Tensor, cand: torch.Tensor, fuzzy: torch.Tensor) -> Verdict:
        n = rnd.n
        q = torch.stack(rnd.q).to(p.device)
        idx = torch.arange(n, device=p.device)
        py, qy = p[idx, cand], q[idx, cand]
        emitted = self._emitted(rnd, cand)
        if self.rule == "or":
            u = torch.rand(n, device=p.device, generator=rnd.generator)  # the draws SD makes, in its order
            strict = u * qy <= py
            kept = (fuzzy | strict).long().cumprod(0)
            m, lenient = torch.stack([kept.sum(), ((~strict).long() * kept * emitted).sum()]).tolist()
            self.fuzzy_only += lenient
            dist = p[n] if m == n else residual(p[m], q[m])
            return Verdict(m, int(sample(dist, rnd.generator)))
        kept = fuzzy.long().cumprod(0)
        expected = ((1 - (py / qy).clamp(max=1)) * kept * emitted).sum()  # qy > 0: y_i was drawn from q_i
        draws = sample(p, rnd.generator)  # a token from every p_i; the decision does not depend on them
        m, lenient, *tokens = torch.cat([torch.stack([kept.sum().double(), expected.double()]),
                                         draws.double()]).tolist()  # the one sync
        self.fuzzy_only += lenient
        return Verdict(int(m), int(tokens[int(m)]))


class ConfidenceStop(_Gated):
    """Draft-confidence stopping (ALGORITHMS.md section 4; Hugging Face's
    ``assistant_confidence_threshold``), a training-free baseline: stop drafting after a candidate
    whose probability under the draft, ``q_i(y_i)`` from the softmax of the raw draft logits, is
    below ``tau``, and after ``k_max`` candidates at most. Verification is the standard SD rule,
    so the output is as lossless as SD's; ``tau = 0`` never stops early (SD with ``k = k_max``).

    ``stop="cost"``: no ``tau``; the rule of :class:`SpecDecPP` ``stop="cost"`` with ``q_i(y_i)`` as
    the acceptance estimate of ``y_i`` (every candidate has one as soon as it is drawn; the next
    candidate gets the newest one's).

    Args:
        tau: confidence threshold in [0, 1]; larger stops sooner.
        k_max: most candidates per round.
        stop: ``threshold`` or ``cost`` (needs ``costs``).
        costs: the pair's :class:`~.costs.CostTable` (``stop="cost"``).
        k_min: fewest candidates per round.
        gate: as :class:`SpecDecPP`'s (``stop="cost"`` only, its default there).
    """

    name = "confidence_stop"

    def __init__(self, tau: float = 0.4, k_max: int = 20, stop: str = "threshold", costs: CostTable | None = None,
                 k_min: int = 1, gate: bool | None = None):
        problems = [] if 0 <= tau <= 1 else [f"confidence threshold tau={tau} must be in [0, 1]"]
        if not 1 <= k_min <= k_max:
            problems.append(f"need 1 <= k_min <= k_max, got k_min={k_min}, k_max={k_max}")
        problems += _stop_problems(stop, costs, gate)
        if problems:
            raise UserError("; ".join(problems))
        super().__init__(k_max)
        self.tau, self.k_min, self.stop, self.costs = float(tau), k_min, stop, costs
        self.gate = DraftGate(costs) if (stop == "cost" if gate is None else gate) else None
        self._keep = self._sum = 0.0  # the round's S_n and sum of S_i (stop="cost")

    def stop_drafting(self, rnd: Round) -> bool:
        n = rnd.n
        if n >= self.k:
            return True
        logits = rnd.draft_logits[-1].float()  # [V]
        confidence = float((logits[rnd.tokens[-1]] - logits.logsumexp(-1)).exp())
        if self.stop == "cost":
            if n == 1:
                self._keep, self._sum = 1.0, 0.0
            self._keep *= confidence
            self._sum += self._keep
            return n >= self.k_min and not draft_more(self.costs, n, n, self._keep, self._sum, confidence)
        return n >= self.k_min and confidence < self.tau


POLICIES: dict[str, type[Policy]] = {"sd": StandardSD, "specdecpp": SpecDecPP, "sprinter": Sprinter, "judge": Judge,
                                     "topk_verify": TopKVerify, "fsd": FSD, "confidence_stop": ConfidenceStop}
BASELINES = ("ar", "draft")  # autoregressive target-only / draft-only, no policy object


def build_policy(name: str, **kwargs) -> Policy:
    """Instantiates a registered policy by name."""
    if name not in POLICIES:
        raise UserError(f"unknown policy {name!r}; choose one of {sorted(POLICIES) + list(BASELINES)}")
    return POLICIES[name](**kwargs)
