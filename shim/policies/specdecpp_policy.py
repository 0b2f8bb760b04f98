"""SpecDec++ (docs/algorithms/specdecpp.md): an acceptance head decides when to stop drafting."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import torch

from specheads.heads.acceptance_head import distribution_signals, signal_values
from specheads.shim.costs.cost_rules import DraftGate, draft_more
from specheads.shim.costs.cost_table import CostTable
from specheads.shim.policies.base import Policy, Round
from specheads.shim.policies.baselines import STOP, _Gated, cost_problems, gate_problems
from specheads.shim.policies.settings import UNSET, Check, HeadSpec, Settings, bounds, settle

POSITIONS = ("own", "previous")  # which draft state the head was trained to read (see SpecDecPP)


@dataclass
class SpecDecPPSettings(Settings):
    head: str | None = None  # the exported acceptance head
    h: float | None = None  # None: the head's default_threshold, else 0.7
    k_min: int = 2
    k_max: int = 20
    stop: str = "threshold"
    gate: bool = False
    THRESHOLD = "h"
    CHECKS = {
        "h": Check(
            lambda h: 0 < h < 1,
            "threshold {key}={value} must be in (0, 1)",
            "{key}={values}: every h must be in (0, 1)",
        ),
        "stop": STOP,
    }

    def relations(self) -> list[str]:
        return bounds(self.k_min, self.k_max) + gate_problems(self.stop, self.gate)


@dataclass
class _Scores:
    """The round's scores so far: ``log prod beta_j``, ``sum_i S_i``, the newest ``beta`` (stop="cost") and
    every ``(j, beta_hat_j)``."""

    log_keep: float = 0.0
    total: float = 0.0
    beta: float | None = None
    scores: list = field(default_factory=list)  # (candidate position j, beta_hat_j)


class SpecDecPP(_Gated):
    """SpecDec++ adaptive candidate length (docs/algorithms/specdecpp.md): stop drafting when
    ``1 - prod_j beta_hat_j > h``, with ``beta_hat_j = sigmoid(head(h^D_j))`` from the draft
    state at candidate ``y_j``'s own position; never before ``k_min``, always at ``k_max``.

    ``stop="cost"`` replaces the threshold with the profiled costs ``costs``: with ``n`` candidates
    drafted, ``S_i = prod_{j<=i} beta_hat_j`` and the round's expected tokens
    ``E(n) = 1 + sum_{i<=n} S_i`` against its cost ``C(n) = n t_d + t_t(n + 1)``, drafting goes on
    while ``E(n+1) / C(n+1) > E(n) / C(n)`` (:func:`~..cost_rules.draft_more`). Candidates without a score
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
        costs: the pair's :class:`~..costs.CostTable` (``stop="cost"``).
        gate: opt-in, ``stop="cost"`` only: before each round, skip drafting when the
            prompt's recent acceptance says a round with candidates costs more per token than the
            target alone (:class:`~..cost_rules.DraftGate`).
    """

    name = "specdecpp"
    Settings = SpecDecPPSettings
    HEAD = HeadSpec("acceptance", "draft", 0.7)
    draft_hidden = "post"

    def __init__(
        self,
        head: torch.nn.Module,
        threshold: float | None = UNSET,
        k_min: int = UNSET,
        k_max: int = UNSET,
        position: str = "own",
        stop: str = UNSET,
        costs: CostTable | None = None,
        gate: bool = UNSET,
        *,
        settings: SpecDecPPSettings | None = None,
    ):
        bad = [] if position in POSITIONS else [f"head feature position {position!r}: expected own or previous"]
        given = {"h": threshold, "k_min": k_min, "k_max": k_max, "stop": stop, "gate": gate}
        s = settle(SpecDecPPSettings, settings, given, lambda s: bad + cost_problems(s.stop, costs))
        s = self.settings = dataclasses.replace(s, h=self.HEAD.threshold_for(s.h, None))  # type: ignore[union-attr]
        super().__init__(s.k_max)
        self.gate = DraftGate(costs) if s.gate else None
        self.head, self.threshold, self.k_min = head, s.h, s.k_min
        # the head's device: a split target's states may come out on another GPU
        self._device = next((p.device for p in head.parameters()), None) if isinstance(head, torch.nn.Module) else None
        self.with_confidence = bool(getattr(head, "confidence", False))  # the head also reads log q(y)
        self.signals = tuple(getattr(head, "signals", ()))  # and these of the distribution y was drawn from
        self.stateless = getattr(head, "hidden_size", None) == 0  # a calibration of q(y): no state read
        self.stop, self.costs = s.stop, costs
        self.lag = 1 if position == "own" else 0  # how many candidates behind the newest the scored one is
        self._prompt_betas = [0.0, 0]  # this prompt's scores: sum, count (stop="cost")
        self.scored = 0  # head evaluations
        self.outcomes: list[list] = []  # this prompt's [j, beta_hat_j, accepted] of every verified scored candidate

    @classmethod
    def from_settings(cls, s, pair=None, head=None, costs=None) -> Policy:
        position = head.metadata.get("feature", {}).get("position", "own")
        policy = cls(head.module, cls.HEAD.threshold_for(s.h, head), position=position, costs=costs, settings=s)
        policy.head_file = s.head
        return policy

    def describe(self) -> dict:
        return {
            "head": self.head_file,
            "stop": self.stop,
            "threshold": self.threshold if self.stop == "threshold" else None,
            "k_min": self.k_min,
            "k_max": self.k,
            "gate": self.gate is not None,
        }

    def reset(self) -> None:
        super().reset()
        self._prompt_betas = [0.0, 0]
        self.outcomes = []

    def start_round(self, rnd: Round) -> None:
        rnd.state = _Scores()
        self._round = rnd.state

    def end_round(self, drafted: int, accepted: int) -> None:
        """Records each scored candidate's outcome where the round decided it: the ``accepted`` first were
        accepted, the next one (when one was rejected) was not; later ones were never judged."""
        super().end_round(drafted, accepted)
        for j, beta in self._round.scores:
            if j <= accepted or (j == accepted + 1 and accepted < drafted):
                self.outcomes.append([j, round(beta, 6), int(j <= accepted)])

    def trace(self) -> dict:
        """``acceptance``: ``[position, beta_hat, accepted]`` per verified scored candidate (the head's
        calibration by draft position, ``heads-eval``)."""
        return {"acceptance": self.outcomes}

    def stop_drafting(self, rnd: Round) -> bool:
        n = rnd.n
        if n >= self.k:  # k_max: threshold_stop stops whatever the scores, so none is computed
            return True
        s = rnd.state
        if n > self.lag:  # own: the state returned with y_n belongs to y_{n-1}; the head has the draft's dtype
            state = rnd.draft_hidden[n - 1].to(self._device)
            if self.stateless:
                state = state[..., :0]
            if self.with_confidence:
                j = n - self.lag - 1
                extra = _signals(rnd, j, self.signals).to(state.device) if self.signals else None
                state = self.head.features(state, _log_q(rnd, j), extra)  # type: ignore[operator]
            logit = self.head(state)  # type: ignore[operator]  # an nn.Module
            log_beta = float(torch.nn.functional.logsigmoid(logit.float()))
            s.scores.append((n - self.lag, math.exp(log_beta)))
            s.log_keep += log_beta
            self.scored += 1
            if self.stop == "cost":
                s.beta = math.exp(log_beta)
                s.total += math.exp(s.log_keep)
                self._prompt_betas[0] += s.beta
                self._prompt_betas[1] += 1
        if self.stop == "cost":
            if n < self.k_min:
                return False
            total, count = self._prompt_betas
            beta = s.beta if s.beta is not None else (total / count if count else 1.0)
            return not draft_more(self.costs, n, n - self.lag, math.exp(s.log_keep), s.total, beta, self.batch)
        return self.threshold_stop(n, math.exp(s.log_keep), self.threshold, self.k_min, self.k)

    @staticmethod
    def threshold_stop(n: int, keep: float, threshold: float, k_min: int, k_max: int) -> bool:
        """SpecDec++'s stop rule (``stop="threshold"``), once ``n`` candidates are drafted: stop at ``k_max``, never
        before ``k_min``, else when ``P(a rejection among the scored candidates) = 1 - keep`` exceeds ``threshold``,
        ``keep = prod_j beta_hat_j`` over the candidates scored so far. The policy decides by it, and so does the
        oracle's perfect-head bound (``specheads.evaluate.oracle``), so the bound follows the rule."""
        return n >= k_max or (n >= k_min and 1.0 - keep > threshold)


def _signals(rnd: Round, j: int, names: tuple[str, ...]) -> torch.Tensor:
    """The ``[len(names)]`` signals of candidate ``j`` (0-based) as ``labels=eagle_rounds`` stores them: of the
    distribution it was drawn from (warped when sampling, else the raw softmax), and its step ``j + 1``."""
    step = torch.tensor(float(j + 1))
    if "entropy" not in names and "margin" not in names:  # no pass over the vocabulary for the step alone
        return signal_values(names, step, step, step)
    logq = rnd.q[j].float().log() if rnd.q else rnd.draft_logits[j].float().log_softmax(-1)
    ent, margin = distribution_signals(logq)
    return signal_values(names, ent, margin, step.to(ent.device))


def _log_q(rnd: Round, j: int) -> torch.Tensor:
    """``log q_j(y_j)`` of candidate ``j`` (0-based): from the distribution it was drawn from when sampling
    (warped), else from the softmax of the raw draft logits, as ``labels=eagle_rounds`` stores it."""
    token = rnd.tokens[j]
    if rnd.q:
        return rnd.q[j][token].float().log()
    logits = rnd.draft_logits[j].float()
    return logits[token] - logits.logsumexp(-1)
