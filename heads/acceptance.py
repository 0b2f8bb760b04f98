"""SpecDec++ acceptance head: ``D`` residual blocks ``x + SiLU(Linear(x))`` then ``Linear(d, 1)``."""

from __future__ import annotations

import torch
from torch import nn


class ResidualBlock(nn.Module):
    """``x + SiLU(Linear(x))``."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + nn.functional.silu(self.linear(x))


class AcceptanceHead(nn.Module):
    """Predicts the logit of the acceptance probability of a draft token from a draft state.

    Each of the ``depth`` blocks has its own weights (the reference code ties them by
    repeating one module object; that is not copied). ``depth=0`` is a linear head.

    Args:
        hidden_size: width ``d`` of the feature.
        depth: number of residual blocks ``D``.
    """

    def __init__(self, hidden_size: int, depth: int = 3):
        super().__init__()
        self.hidden_size, self.depth = hidden_size, depth
        self.blocks = nn.ModuleList(ResidualBlock(hidden_size) for _ in range(depth))
        self.out = nn.Linear(hidden_size, 1)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """``h``: ``[..., d]`` -> logits ``[...]``."""
        for block in self.blocks:
            h = block(h)
        return self.out(h).squeeze(-1)

    def config(self) -> dict:
        """Constructor arguments, stored in exported metadata."""
        return {"hidden_size": self.hidden_size, "depth": self.depth}
