"""Judge decoding's head: the logit that an answer token is correct, from the target's state and, optionally, the
target's own verdict on the token (its log-probability, its gap to the target's choice, the entropy, its rank)."""

from __future__ import annotations

import math

import torch

from specheads.heads.mlp import ResidualMLP

# the target's verdict on a candidate y at its position, from the distribution p that predicts it
JUDGE_SIGNALS = ("logp", "gap", "entropy", "rank")
LOGP_FLOOR = -30.0  # log p(y) and its gap below this read as this
RANK_CAP = 1000  # rank r (tokens the target prefers to y) reads as log(1 + min(r, cap)) / log(1 + cap)


class JudgeHead(ResidualMLP):
    """``Linear(d (+ s), 1)`` on the target's last hidden state before the final norm at a token's own
    position, joined to ``s`` numbers of the target's verdict on the token (``signals``); ``sigmoid > delta``
    accepts the token (``depth > 0``: a residual MLP).

    Args:
        in_features: width ``d`` of the target state.
        depth: residual blocks before the output layer.
        signals: of :data:`JUDGE_SIGNALS`, in that order, after the state: ``logp`` (the target's log p(y),
            floored at -30), ``gap`` (log p(y) minus the target's largest log-probability: 0 when y is its
            choice), ``entropy`` (of p, nats), ``rank`` (how many tokens p prefers to y, log-scaled to [0, 1]);
            :func:`judge_signal_values` computes them from the target's logits.
    """

    def __init__(self, in_features: int, depth: int = 0, signals: tuple[str, ...] | list[str] = ()):
        signals = tuple(signals)
        bad = [s for s in signals if s not in JUDGE_SIGNALS]
        if bad or len(set(signals)) < len(signals):
            raise ValueError(f"signals={list(signals)}: choose each at most once from {list(JUDGE_SIGNALS)}")
        super().__init__(in_features + len(signals), depth)
        self.state_size, self.signals = in_features, signals

    def config(self) -> dict:
        """Constructor arguments, stored in exported metadata (``head_config``)."""
        return {"in_features": self.state_size, "depth": self.depth} | (
            {"signals": list(self.signals)} if self.signals else {}
        )


@torch.no_grad()
def judge_signal_values(logits: torch.Tensor, tokens: torch.Tensor, names=JUDGE_SIGNALS) -> torch.Tensor:
    """``[n, len(names)]`` fp32: the target's verdict on ``tokens`` ``[n]``, each scored by the logits ``[n, V]``
    of the distribution that predicts it (temperature 1, the model's raw distribution)."""
    logp = logits.float().log_softmax(-1)
    tokens = tokens.to(logp.device).long().view(-1, 1)
    mine = logp.gather(-1, tokens).squeeze(-1)
    raw = {
        "logp": mine.nan_to_num(neginf=LOGP_FLOOR).clamp(LOGP_FLOOR, 0.0),
        "gap": (mine - logp.max(-1).values).nan_to_num(neginf=LOGP_FLOOR).clamp(LOGP_FLOOR, 0.0),
        "entropy": -(logp.exp() * logp.clamp_min(torch.finfo(torch.float32).min)).sum(-1),
        "rank": (logp > mine.unsqueeze(-1)).sum(-1).clamp(max=RANK_CAP).float().log1p() / math.log1p(RANK_CAP),
    }
    return torch.stack([raw[n] for n in names], dim=-1) if names else logp.new_zeros(len(mine), 0)
