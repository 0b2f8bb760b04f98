"""The body every head shares: ``D`` residual blocks ``x + SiLU(Linear(x))``, then ``Linear(d, 1)``."""

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


class ResidualMLP(nn.Module):
    """The logit of a feature: ``depth`` residual blocks, then the output layer (``depth=0``: linear).

    Each block has its own weights (the SpecDec++ reference code ties them by repeating one
    module object; that is not copied). The parameter names, ``blocks.<i>.linear.*`` and
    ``out.*``, are the tensor names of every exported head file.

    Args:
        in_features: width ``d`` of the feature.
        depth: number of residual blocks ``D``.
    """

    def __init__(self, in_features: int, depth: int = 0):
        super().__init__()
        self.in_features, self.depth = in_features, depth
        self.blocks = nn.ModuleList(ResidualBlock(in_features) for _ in range(depth))
        self.out = nn.Linear(in_features, 1)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """``h``: ``[..., d]`` -> logits ``[...]``."""
        for block in self.blocks:
            h = block(h)
        return self.out(h).squeeze(-1)

    def config(self) -> dict:
        """Constructor arguments, stored in exported metadata (``head_config``)."""
        return {"in_features": self.in_features, "depth": self.depth}
