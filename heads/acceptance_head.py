"""SpecDec++ acceptance head: the logit of a draft token's acceptance probability, from a draft state."""

from __future__ import annotations

import torch

from specheads.heads.mlp import ResidualMLP

LOGQ_FLOOR = -30.0  # the confidence feature's floor: log q(y) below it (or -inf) reads as this


class AcceptanceHead(ResidualMLP):
    """``depth`` residual blocks and an output layer on the draft's hidden state (``depth=0``: linear).

    Args:
        hidden_size: width ``d`` of the draft state.
        depth: number of residual blocks ``D``.
        confidence: the feature is the state joined to one more number, the drafter's log-probability
            ``log q(y)`` of the scored token (:meth:`features`): SpecDec++'s state and probability.
    """

    def __init__(self, hidden_size: int, depth: int = 3, confidence: bool = False):
        super().__init__(hidden_size + int(confidence), depth)
        self.hidden_size, self.confidence = hidden_size, confidence

    @staticmethod
    def features(state: torch.Tensor, logq: torch.Tensor) -> torch.Tensor:
        """``[..., d]`` states and ``[...]`` log-probabilities -> the ``[..., d + 1]`` input of a confidence head."""
        logq = torch.nan_to_num(logq.to(state.dtype), neginf=LOGQ_FLOOR).clamp(LOGQ_FLOOR, 0.0)
        return torch.cat([state, logq.unsqueeze(-1)], dim=-1)

    def config(self) -> dict:
        """Constructor arguments, stored in exported metadata (``head_config``)."""
        return {"hidden_size": self.hidden_size, "depth": self.depth} | (
            {"confidence": True} if self.confidence else {}
        )
