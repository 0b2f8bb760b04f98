"""SPRINTER verifier: ``Linear(d, 1)`` (``depth=0``) or a residual MLP, on a draft feature."""

from __future__ import annotations

from specheads.heads.mlp import ResidualMLP


class VerifierHead(ResidualMLP):
    """Predicts the logit that a draft token is acceptable (``q(x) <= lambda * p(x)``).

    The feature it reads (the draft state before the token, after it, or the state before it
    concatenated with the token's input embedding) is recorded in the exported metadata;
    ``in_features`` is ``d`` or ``2d`` accordingly.

    Args:
        in_features: width of the feature.
        depth: residual blocks before the output layer (0: the paper's linear verifier).
    """
