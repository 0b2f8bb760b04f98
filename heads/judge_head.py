"""Judge decoding's head: the logit that an answer token is correct, from the target's state."""

from __future__ import annotations

from specheads.heads.mlp import ResidualMLP


class JudgeHead(ResidualMLP):
    """``Linear(d, 1)`` on the target's last hidden state before the final norm at a token's own
    position; ``sigmoid > delta`` accepts the token (``depth > 0``: a residual MLP).

    Args:
        in_features: width ``d`` of the target state.
        depth: residual blocks before the output layer.
    """
