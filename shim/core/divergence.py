"""Divergences between the target's and the draft's next-token distributions (FSD, docs/algorithms/fsd.md).

All are computed in fp32 with the natural log over the last dimension of ``p`` (target) and
``q`` (draft), batched over the leading dimensions:

* ``kl``      ``KL(p || q) = sum_v p log(p / q)``  (``inf`` where ``q = 0 < p``)
* ``kl_rev``  ``KL(q || p)``
* ``js``      the textbook Jensen-Shannon ``1/2 KL(p || m) + 1/2 KL(q || m)``, ``m = (p + q) / 2``
  (at most ``ln 2``)
* ``tv``      total variation ``1/2 sum_v |p - q|`` (in [0, 1])

``top_k > 0`` restricts both distributions to the target's ``top_k`` most likely tokens plus one
bucket holding the rest of each distribution's mass, then applies the same formula. Terms with
``p = 0`` (or ``q = 0`` for ``kl_rev``) contribute 0 (``0 log 0 = 0``).
"""

from __future__ import annotations

import torch

from specheads.errors import UserError

DIVERGENCES = ("kl", "kl_rev", "js", "tv")


def _kl(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``sum a log(a / b)`` over the last dim, ``0 log 0 = 0``, ``inf`` where ``b = 0 < a``."""
    pos = a > 0
    safe_a = torch.where(pos, a, torch.ones_like(a))
    terms = torch.where(pos, a * (safe_a.log() - b.log()), torch.zeros_like(a))
    return terms.sum(-1)


def top_k_buckets(p: torch.Tensor, q: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Both distributions on the target's ``k`` most likely tokens plus a last bucket for the rest.

    Returns ``[..., k + 1]`` tensors (``k`` is capped at the vocabulary size; the rest bucket is
    clamped at 0 against rounding).
    """
    k = min(k, p.shape[-1])
    idx = p.topk(k, dim=-1).indices
    pk, qk = p.gather(-1, idx), q.gather(-1, idx)
    rest_p = (1 - pk.sum(-1, keepdim=True)).clamp_min(0)
    rest_q = (1 - qk.sum(-1, keepdim=True)).clamp_min(0)
    return torch.cat([pk, rest_p], -1), torch.cat([qk, rest_q], -1)


def divergence(name: str, p: torch.Tensor, q: torch.Tensor, top_k: int = 0) -> torch.Tensor:
    """``Div(p, q)`` over the last dimension.

    Args:
        name: one of ``kl``, ``kl_rev``, ``js``, ``tv``.
        p: ``[..., V]`` target probabilities.
        q: ``[..., V]`` draft probabilities (same shape).
        top_k: 0 for the full vocabulary, else the top-k-plus-rest restriction.

    Returns:
        ``[...]`` fp32 divergences.
    """
    if name not in DIVERGENCES:
        raise UserError(f"unknown divergence {name!r}; choose one of {list(DIVERGENCES)}")
    if top_k < 0:
        raise UserError(f"divergence top_k={top_k} must be >= 0 (0: the whole vocabulary)")
    if p.shape != q.shape:
        raise ValueError(f"p {tuple(p.shape)} and q {tuple(q.shape)} differ in shape")
    p, q = p.float(), q.float()
    if top_k:
        p, q = top_k_buckets(p, q, top_k)
    if name == "kl":
        return _kl(p, q)
    if name == "kl_rev":
        return _kl(q, p)
    if name == "tv":
        return 0.5 * (p - q).abs().sum(-1)
    m = 0.5 * (p + q)
    return 0.5 * _kl(p, m) + 0.5 * _kl(q, m)
