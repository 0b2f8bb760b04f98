"""SpecDec++ acceptance head: the logit of a draft token's acceptance probability, from a draft state."""

from __future__ import annotations

import torch
from torch import nn

from specheads.heads.mlp import ResidualMLP

LOGQ_FLOOR = -30.0  # the confidence feature's floor: log q(y) below it (or -inf) reads as this
SIGNALS = ("entropy", "margin", "step")  # scalar features of the drafter's distribution a head may read too


class AcceptanceHead(ResidualMLP):
    """``depth`` residual blocks and an output layer on the draft's hidden state (``depth=0``: linear).

    Args:
        hidden_size: width ``d`` of the draft state; 0: the head reads no state, only ``log q(y)`` and the
            signals (with ``depth=0``, Platt scaling of the drafter's confidence).
        depth: number of residual blocks ``D``.
        confidence: the feature is the state joined to one more number, the drafter's log-probability
            ``log q(y)`` of the scored token (:meth:`features`): SpecDec++'s state and probability.
        signals: more numbers after it, of :data:`SIGNALS`, in that order (needs ``confidence``): the entropy
            ``H(q)`` of the distribution the token was drawn from (nats), its top-1 margin (``log q`` of the
            most likely token minus the second's, at most 30) and the token's step in its round
            (``min(step, 16) / 16``): :func:`signal_values`.
        skip: (needs ``confidence``) the logit is a linear function of ``log q(y)`` and the signals plus the
            residual body's output on everything, which starts at zero: the head starts as the drafter's own
            confidence (its ranking of candidates is q(y)'s) and the state only corrects it, so a head trained
            on little data is not worse than q(y) from the start.
    """

    def __init__(
        self,
        hidden_size: int,
        depth: int = 3,
        confidence: bool = False,
        signals: tuple[str, ...] = (),
        skip: bool = False,
    ):
        signals = tuple(signals)
        if any(s not in SIGNALS for s in signals) or (signals and not confidence):
            raise ValueError(f"signals={list(signals)}: choose from {list(SIGNALS)}, with confidence=True")
        if skip and not confidence:
            raise ValueError("skip=True reads log q(y): it needs confidence=True")
        super().__init__(hidden_size + int(confidence) + len(signals), depth)
        self.hidden_size, self.confidence, self.signals = hidden_size, confidence, signals
        self.skip = nn.Linear(1 + len(signals), 1) if skip else None
        if self.skip is not None:
            with torch.no_grad():  # logit = log q(y) at the start: the confidence's own order
                self.skip.weight.zero_()
                self.skip.weight[0, 0] = 1.0
                self.skip.bias.zero_()
                self.out.weight.zero_()
                self.out.bias.zero_()

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """``h``: ``[..., d + 1 (+ s)]`` (:meth:`features`) -> logits ``[...]``."""
        logit = super().forward(h)
        if self.skip is not None:
            logit = logit + self.skip(h[..., self.hidden_size :]).squeeze(-1)
        return logit

    @staticmethod
    def features(state: torch.Tensor, logq: torch.Tensor, extra: torch.Tensor | None = None) -> torch.Tensor:
        """``[..., d]`` states and ``[...]`` log-probabilities (and ``[..., s]`` signals) -> the head's input
        ``[..., d + 1 (+ s)]``."""
        logq = torch.nan_to_num(logq.to(state.dtype), neginf=LOGQ_FLOOR).clamp(LOGQ_FLOOR, 0.0)
        parts = [state, logq.unsqueeze(-1)] + ([extra.to(state.dtype)] if extra is not None else [])
        return torch.cat(parts, dim=-1)

    def config(self) -> dict:
        """Constructor arguments, stored in exported metadata (``head_config``)."""
        return (
            {"hidden_size": self.hidden_size, "depth": self.depth}
            | ({"confidence": True} if self.confidence else {})
            | ({"signals": list(self.signals)} if self.signals else {})
            | ({"skip": True} if self.skip is not None else {})
        )


MARGIN_CAP = 30.0
STEP_CAP = 16


def entropy(logq: torch.Tensor) -> torch.Tensor:
    """``H(q)`` in nats of fp32 log-probabilities ``[..., V]`` (``-inf`` allowed: ``0 log 0 = 0``)."""
    # -inf clamped to the lowest finite value, where p = 0 makes the product 0; 3x faster than xlogy
    return -(logq.exp() * logq.clamp_min(torch.finfo(torch.float32).min)).sum(-1)


def distribution_signals(logq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The entropy ``H(q)`` (nats) and the top-1 margin of log-probabilities ``[..., V]`` (``-inf`` allowed)."""
    logq = logq.float()
    ent = entropy(logq)
    top = logq.topk(min(2, logq.shape[-1]), dim=-1).values
    margin = (top[..., 0] - top[..., -1]).nan_to_num(posinf=MARGIN_CAP).clamp(0.0, MARGIN_CAP)
    return ent, margin


def signal_values(names, entropy: torch.Tensor, margin: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """The ``[..., len(names)]`` signals a head reads (:class:`AcceptanceHead`'s ``signals``) from their raw values."""
    raw = {"entropy": entropy.float(), "margin": margin.float(), "step": step.float().clamp(max=STEP_CAP) / STEP_CAP}
    return torch.stack([raw[n] for n in names], dim=-1)
