"""The baselines: one model alone, standard SD, and the training-free rules (docs/algorithms/topk.md, confidence.md):
top-K verification and draft-confidence stopping; and the draft gate the cost-aware stop rules share."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from specheads.shim.costs.cost_rules import DraftGate, draft_more
from specheads.shim.costs.cost_table import CostTable
from specheads.shim.policies.base import Policy, Round
from specheads.shim.policies.estimates import ESTIMATES, OnlineLogistic, entropy_bound, features
from specheads.shim.policies.settings import UNSET, Check, K, Settings, bounds, settle

STOPS = ("threshold", "cost")  # how SpecDecPP and ConfidenceStop decide to stop drafting
STOP = Check(lambda s: s in STOPS, "{key}={value!r}: expected threshold or cost")


def cost_problems(stop: str, costs: CostTable | None) -> list[str]:
    """The rule between ``stop`` and the cost table handed to a cost-aware policy."""
    if stop == "cost" and costs is None:
        return ["stop=cost needs a cost table (costs=...; see specheads.shim.costs.cost_table.cost_table)"]
    return []


def gate_problems(stop: str, gate: bool) -> list[str]:
    """The rule between ``stop`` and asking for the draft gate."""
    return ["gate=True needs stop=cost (the gate prices rounds with the cost table)"] if gate and stop != "cost" else []


class _Gated(Policy):
    """A policy whose rounds may skip drafting through a :class:`~..cost_rules.DraftGate` (``self.gate``): opt-in
    (``gate=True``), with ``stop="cost"`` only."""

    gate: DraftGate | None = None

    def reset(self) -> None:
        if self.gate is not None:
            self.gate.reset()

    def draft_round(self) -> bool:
        return self.gate is None or self.gate.open(self.batch)

    def end_round(self, drafted: int, accepted: int) -> None:
        if self.gate is not None:
            self.gate.observe(drafted, accepted)


@dataclass
class AloneSettings(Settings):
    """One model alone has nothing to set."""


class TargetOnly(Policy):
    """The target alone (``ar``): every round is one target step, no candidate."""

    name = "ar"
    Settings = AloneSettings
    models = ("target",)

    def __init__(self):
        self.settings = AloneSettings()
        super().__init__(0)

    @classmethod
    def from_settings(cls, s, pair=None, head=None, costs=None) -> Policy:
        return cls()


class DraftOnly(TargetOnly):
    """The draft alone (``draft``), in its own vocabulary: every round is one draft step."""

    name = "draft"
    lossless = False
    models = ("draft",)
    emitter = "draft"


@dataclass
class SDSettings(Settings):
    k: int = 4
    CHECKS = {"k": K}


class StandardSD(Policy):
    """Standard speculative decoding (Leviathan et al. 2023): fixed ``k``, lossless.

    Greedy: keep candidates while they equal the target's argmax, then emit the argmax.
    Sampling: accept ``y_j`` when ``u * q_j(y_j) <= p_j(y_j)``; at the first rejection emit a
    token from ``norm(max(0, p_j - q_j))``; after ``n`` acceptances a bonus from ``p_{n+1}``.
    """

    name = "sd"
    Settings = SDSettings

    def __init__(self, k: int = UNSET, *, settings: SDSettings | None = None):
        self.settings = settle(SDSettings, settings, {"k": k})
        super().__init__(self.settings.k)

    @classmethod
    def from_settings(cls, s, pair=None, head=None, costs=None) -> Policy:
        return cls(settings=s)


@dataclass
class ConfidenceSettings(Settings):
    tau: float | None = None  # None: DEFAULT_TAU
    k_max: int = 20
    stop: str = "threshold"
    k_min: int = 1
    gate: bool = False
    estimate: str = "q"
    entropy_gamma: float = 1.0
    THRESHOLD = "tau"
    CHECKS = {
        "tau": Check(
            lambda t: 0 <= t <= 1,
            "confidence threshold {key}={value} must be in [0, 1]",
            "{key}={values}: every tau must be in [0, 1]",
        ),
        "stop": STOP,
        "estimate": Check(lambda e: e in ESTIMATES, "{key}={value!r}: expected one of " + ", ".join(ESTIMATES)),
        "entropy_gamma": Check(lambda g: g > 0, "{key}={value} must be > 0"),
    }

    def relations(self) -> list[str]:
        return bounds(self.k_min, self.k_max) + gate_problems(self.stop, self.gate)


DEFAULT_TAU = 0.4  # the assistant_confidence_threshold transformers configs carry


@dataclass
class _Survival:
    """A round's ``S_n`` (the chance its candidates are all accepted) and ``sum_i S_i`` (stop="cost")."""

    keep: float = 1.0
    total: float = 0.0
    beta: float = 0.0  # the newest candidate's estimate (the next one's, for the vLLM plugin's batch cap)
    zs: list = field(default_factory=list)  # each candidate's logit(max q), for the online estimate


class ConfidenceStop(_Gated):
    """Draft-confidence stopping (docs/algorithms/confidence.md; Hugging Face's
    ``assistant_confidence_threshold``), a training-free baseline: stop drafting after a candidate
    whose probability under the draft, ``q_i(y_i)`` from the softmax of the raw draft logits, is
    below ``tau``, and after ``k_max`` candidates at most. Verification is the standard SD rule,
    so the output is as lossless as SD's; ``tau = 0`` never stops early (SD with ``k = k_max``).

    ``stop="cost"``: no ``tau``; the rule of :class:`SpecDecPP` ``stop="cost"`` with ``q_i(y_i)`` as
    the acceptance estimate of ``y_i`` (every candidate has one as soon as it is drawn; the next
    candidate gets the newest one's).

    ``estimate``: the acceptance estimate both rules read in place of ``q_i(y_i)``: ``q`` (that), ``entropy``
    (AdaEDL's bound, with ``entropy_gamma``) or ``online`` (a logistic model on ``logit(max q)`` learnt from
    the rounds already verified); see :mod:`.estimates`.

    Args:
        tau: confidence threshold in [0, 1]; larger stops sooner.
        k_max: most candidates per round.
        stop: ``threshold`` or ``cost`` (needs ``costs``).
        costs: the pair's :class:`~..costs.CostTable` (``stop="cost"``).
        k_min: fewest candidates per round.
        gate: as :class:`SpecDecPP`'s (opt-in, ``stop="cost"`` only).
    """

    name = "confidence_stop"
    Settings = ConfidenceSettings

    def __init__(
        self,
        tau: float | None = UNSET,
        k_max: int = UNSET,
        stop: str = UNSET,
        costs: CostTable | None = None,
        k_min: int = UNSET,
        gate: bool = UNSET,
        estimate: str = UNSET,
        entropy_gamma: float = UNSET,
        *,
        settings: ConfidenceSettings | None = None,
    ):
        given = {"tau": tau, "k_max": k_max, "stop": stop, "k_min": k_min, "gate": gate, "estimate": estimate}
        given["entropy_gamma"] = entropy_gamma
        s = settle(ConfidenceSettings, settings, given, lambda s: cost_problems(s.stop, costs))
        s = self.settings = dataclasses.replace(s, tau=DEFAULT_TAU if s.tau is None else float(s.tau))
        super().__init__(s.k_max)
        self.tau, self.k_min, self.stop, self.costs = float(s.tau), s.k_min, s.stop, costs
        self.gate = DraftGate(costs) if s.gate else None
        self.estimate, self.entropy_gamma = s.estimate, float(s.entropy_gamma)
        self.online = OnlineLogistic() if s.estimate == "online" else None

    @classmethod
    def from_settings(cls, s, pair=None, head=None, costs=None) -> Policy:
        return cls(costs=costs, settings=s)

    def describe(self) -> dict:
        return {
            "stop": self.stop,
            "tau": self.tau if self.stop == "threshold" else None,
            "k_max": self.k,
            "gate": self.gate is not None,
            "estimate": self.estimate,
            **({"entropy_gamma": self.entropy_gamma} if self.estimate == "entropy" else {}),
        }

    def reset(self) -> None:
        super().reset()
        if self.online is not None:
            self.online.reset()

    def start_round(self, rnd: Round) -> None:
        rnd.state = _Survival()
        self._round = rnd.state  # end_round hands the outcome to the online estimate with these features

    def end_round(self, drafted: int, accepted: int) -> None:
        super().end_round(drafted, accepted)
        if self.online is not None and drafted:
            self.online.observe(self._round.zs[:drafted], accepted)

    def trace(self) -> dict:
        if self.online is None:
            return {}
        o = self.online  # rounded: a batched forward's logits differ from one row's in the last bits
        return {"online": {"w": round(o.w, 4), "b": round(o.b, 4), "observed": o.seen}}

    def _confidence(self, rnd: Round) -> float:
        """The newest candidate's acceptance estimate (``estimate``)."""
        logits = rnd.draft_logits[-1]  # [V]
        if self.estimate == "q":
            logits = logits.float()
            return float((logits[rnd.tokens[-1]] - logits.logsumexp(-1)).exp())
        _, z, ent = features(logits, int(rnd.tokens[-1]))
        if self.online is None:  # estimate == "entropy"
            return entropy_bound(ent, self.entropy_gamma)
        rnd.state.zs.append(z)
        return self.online.predict(z)

    def stop_drafting(self, rnd: Round) -> bool:
        n = rnd.n
        if n >= self.k:
            if self.online is not None:
                self._confidence(rnd)  # its features: the round's outcome teaches the estimate about it too
            return True
        confidence = self._confidence(rnd)
        if self.stop == "cost":
            s = rnd.state
            s.keep *= confidence
            s.total += s.keep
            s.beta = confidence
            return n >= self.k_min and not draft_more(self.costs, n, n, s.keep, s.total, confidence, self.batch)
        return n >= self.k_min and confidence < self.tau
