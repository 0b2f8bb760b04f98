"""SPRINTER's ratio measure of a draft token against the target (docs/algorithms/sprinter.md), shared by the stages.

A draft token ``x`` drawn from ``q`` at a prefix is acceptable at threshold ``lambda`` when
``q(x) <= lambda * p(x)`` (no division: ``p(x)`` may be 0). ``heads-datagen labels=sprinter``
stores the raw ``q(x)``, ``p(x)``, the ratio and ``TV(p, q)`` so that one data set serves every
``lambda``; ``heads-eval`` measures the same quantities on decoded outputs (SPRINTER's ``alpha``).

Which distributions are compared: the deployment's warped ``p`` and ``q`` when sampling. Greedy
drafts (the official code's setting) take ``x = argmax q`` and compare the raw (T = 1)
probabilities: the warped ones are one-hot and would make every ``lambda`` the same label.
"""

from __future__ import annotations

import torch

from specheads.shim import SamplingConfig, probs_from_logits, sample


def ratio_label(q_token: torch.Tensor, p_token: torch.Tensor, lam: float) -> torch.Tensor:
    """``q(x) <= lambda * p(x)`` as a float tensor of 0/1."""
    return (q_token <= lam * p_token).float()


def label_distributions(
    p_logits: torch.Tensor,
    q_logits: torch.Tensor,
    sampling: SamplingConfig,
    generator: torch.Generator | None,
    x: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """Draws ``x`` from the draft (or takes the given ``x``) and measures it against the target, at every row.

    Args:
        p_logits, q_logits: ``[N, V]`` target and draft logits at the same prefixes.
        sampling: the deployment settings (see the module docstring for greedy).
        generator: RNG for the draws.
        x: ``[N]`` tokens to measure instead of drawing them (e.g. the ones a decoder drew).

    Returns:
        ``draft_token`` ``[N]``, ``q_token``/``p_token`` ``[N]`` (the probability of ``x`` under
        each model), ``ratio`` ``[N]`` (``q/p``, ``inf`` where ``p = 0``) and ``tv`` ``[N]``.
    """
    if sampling.do_sample:
        p, q = probs_from_logits(p_logits, sampling), probs_from_logits(q_logits, sampling)
        x = sample(q, generator) if x is None else x
    else:
        p, q = p_logits.float().softmax(-1), q_logits.float().softmax(-1)
        x = q_logits.argmax(-1) if x is None else x
    qx = q.gather(-1, x[:, None]).squeeze(-1)
    px = p.gather(-1, x[:, None]).squeeze(-1)
    ratio = torch.where(px > 0, qx / px.clamp_min(1e-38), torch.full_like(qx, float("inf")))
    tv = 0.5 * (p - q).abs().sum(-1)
    return {"draft_token": x, "q_token": qx, "p_token": px, "ratio": ratio, "tv": tv}
