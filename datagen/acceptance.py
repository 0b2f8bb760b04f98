"""SpecDec++ acceptance labels from teacher-forced target and draft logits (ALGORITHMS.md section 1)."""

from __future__ import annotations

import torch

from specheads.export.shim.sampling import SamplingConfig, probs_from_logits, sample


def acceptance_labels(p_logits: torch.Tensor, q_logits: torch.Tensor, sampling: SamplingConfig,
                      generator: torch.Generator | None) -> dict[str, torch.Tensor]:
    """Samples ``y_i ~ q_i`` and labels it, at every position.

    Both distributions are warped with the decoding settings (labels must match decoding).
    Greedy settings make ``q`` one-hot on the draft's argmax and ``p`` one-hot on the target's.

    Args:
        p_logits, q_logits: ``[N, V]`` target and draft logits at the same positions
            (the distributions of the token after each prefix ``c, x_<i``).
        sampling: the deployment sampling settings.
        generator: RNG for the draws.

    Returns:
        ``draft_token`` ``[N]`` (``y_i``), ``label`` ``[N]`` (``min(1, p(y)/q(y))``) and
        ``expected_label`` ``[N]`` (``1 - TV(p, q) = sum_v min(p, q)``).
    """
    if sampling.do_sample:
        p, q = probs_from_logits(p_logits, sampling), probs_from_logits(q_logits, sampling)
        y = sample(q, generator)
    else:
        v = p_logits.shape[-1]
        p = torch.nn.functional.one_hot(p_logits.argmax(-1), v).float()
        q = torch.nn.functional.one_hot(q_logits.argmax(-1), v).float()
        y = q_logits.argmax(-1)
    py = p.gather(-1, y[:, None]).squeeze(-1)
    qy = q.gather(-1, y[:, None]).squeeze(-1)
    label = torch.where(qy > 0, (py / qy.clamp_min(1e-30)).clamp(max=1.0), torch.ones_like(py))
    return {"draft_token": y, "label": label, "expected_label": torch.minimum(p, q).sum(-1)}
