"""SpecDec++ acceptance head: the logit of a draft token's acceptance probability, from a draft state."""

from __future__ import annotations

from .mlp import ResidualMLP


class AcceptanceHead(ResidualMLP):
    """``depth`` residual blocks and an output layer on the draft's hidden state (``depth=0``: linear).

    Args:
        hidden_size: width ``d`` of the draft state.
        depth: number of residual blocks ``D``.
    """

    def __init__(self, hidden_size: int, depth: int = 3):
        super().__init__(hidden_size, depth)
        self.hidden_size = hidden_size

    def config(self) -> dict:
        """Constructor arguments, stored in exported metadata (``head_config``)."""
        return {"hidden_size": self.hidden_size, "depth": self.depth}
