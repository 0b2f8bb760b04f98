"""Weighted soft binary cross-entropy (SpecDec++, docs/algorithms/specdecpp.md)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def weighted_soft_bce(
    logits: torch.Tensor, labels: torch.Tensor, w_acc: float = 1.0, w_rej: float = 6.0, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """``-sum[w_acc*b*log s + w_rej*(1-b)*log(1-s)] / sum[w_acc*b + w_rej*(1-b)]`` over the mask.

    Args:
        logits: ``[...]`` head logits, ``s = sigmoid(logits)``.
        labels: ``[...]`` soft labels ``b`` in [0, 1].
        w_acc, w_rej: weights of the accept and reject parts.
        mask: ``[...]`` bool, positions that carry a loss (all when None).
    """
    x, b = logits.float(), labels.float()
    num = w_acc * b * F.logsigmoid(x) + w_rej * (1 - b) * F.logsigmoid(-x)
    den = w_acc * b + w_rej * (1 - b)
    if mask is not None:
        num, den = num[mask], den[mask]
    return -num.sum() / den.sum().clamp_min(1e-12)


def binary_kl(labels: torch.Tensor, logits: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Mean unweighted ``KL(Bernoulli(b) || Bernoulli(sigmoid(logits)))`` (the eval metric)."""
    b, x = labels.float(), logits.float()
    kl = (
        torch.special.xlogy(b, b) - b * F.logsigmoid(x) + torch.special.xlogy(1 - b, 1 - b) - (1 - b) * F.logsigmoid(-x)
    )
    return (kl[mask] if mask is not None else kl).mean()
