"""The judge's stored features, whichever engine computed the target's states: the pre-norm state at each
labelled answer token and the target's verdict on it (:data:`~specheads.heads.judge_head.JUDGE_SIGNALS`)."""

from __future__ import annotations

import torch

from specheads.datagen.tuples import IGNORE
from specheads.heads.judge_head import JUDGE_SIGNALS, judge_signal_values
from specheads.shim import output_device

Features = tuple[torch.Tensor, torch.Tensor, list[int], list[int], torch.Tensor]


def labelled_positions(row: dict) -> tuple[list[int], torch.Tensor, torch.Tensor]:
    """A row's labelled answer tokens (label != IGNORE): their indices in the answer, their positions in
    ``input_ids`` and their token ids."""
    keep = [j for j, v in enumerate(row["labels"]) if v != IGNORE]
    pos = torch.tensor([row["answer_start"] + j for j in keep], dtype=torch.long)
    return keep, pos, torch.tensor(row["input_ids"], dtype=torch.long)[pos]


def gather_features(rows: list[dict], states, verdicts) -> Features:
    """Features ``[M, d]`` fp16, labels ``[M]``, tokens per kept row, the rows left out, signals ``[M, 4]`` fp32.

    ``states(i)`` is row ``i``'s pre-final-norm target states ``[T, d]`` (or None: left out, non-finite);
    ``verdicts(i, prev, tokens)`` the target's :data:`~specheads.heads.judge_head.JUDGE_SIGNALS` on ``tokens``
    from its logits at positions ``prev`` (each token's position minus one)."""
    feats, labels, counts, bad, signals = [], [], [], [], []
    for i, r in enumerate(rows):
        pre = states(i)
        if pre is None:
            bad.append(i)
            continue
        keep, pos, tokens = labelled_positions(r)
        feats.append(pre[pos.to(pre.device)].to(torch.float16).cpu())
        signals.append(verdicts(i, pos - 1, tokens).cpu())
        labels.append(torch.tensor([r["labels"][j] for j in keep], dtype=torch.float32))
        counts.append(len(keep))
    if not feats:
        return torch.empty(0, 0, dtype=torch.float16), torch.empty(0), counts, bad, torch.empty(0, len(JUDGE_SIGNALS))
    return torch.cat(feats), torch.cat(labels), counts, bad, torch.cat(signals)


def verdicts_from(model, final):
    """``verdicts(i, prev, tokens)`` for :func:`gather_features`: the target's output layer on ``final(i)``, row
    ``i``'s states after the final norm (``[T, d]``), at ``prev``, then
    :func:`~specheads.heads.judge_head.judge_signal_values`."""
    head, device = model.get_output_embeddings(), output_device(model)

    def verdicts(i: int, prev: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        with torch.inference_mode():
            post = final(i)
            rows = post[prev.to(post.device)].to(device=device, dtype=head.weight.dtype)
            return judge_signal_values(head(rows), tokens)

    return verdicts
