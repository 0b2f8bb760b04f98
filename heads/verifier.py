"""SPRINTER verifier: ``Linear(d, 1)`` (``depth=0``) or the acceptance head's residual MLP, on a draft feature."""

from __future__ import annotations

from .acceptance import AcceptanceHead


class VerifierHead(AcceptanceHead):
    """Predicts the logit that a draft token is acceptable (``q(x) <= lambda * p(x)``).

    The feature it reads (the draft state before the token, after it, or the state before it
    concatenated with the token's input embedding) is recorded in the exported metadata;
    ``in_features`` is ``d`` or ``2d`` accordingly.

    Args:
        in_features: width of the feature.
        depth: residual blocks before the output layer (0: the paper's linear verifier).
    """

    def __init__(self, in_features: int, depth: int = 0):
        super().__init__(in_features, depth)
        self.in_features = in_features

    def config(self) -> dict:
        return {"in_features": self.in_features, "depth": self.depth}


class JudgeHead(VerifierHead):
    """Judge decoding's head: ``Linear(d, 1)`` on the target's last hidden state before the final norm
    at a token's own position; ``sigmoid > delta`` accepts the token (``depth > 0``: a residual MLP)."""
