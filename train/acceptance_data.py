"""SpecDec++ acceptance-head training data: labelled chunks, token mixing, the draft's features."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from specheads.errors import UserError
from specheads.shim import pad_batch

COLUMNS = ("prompt_index", "input_ids", "response_start", "draft_token", "label")


@dataclass
class Example:
    """One prompt's response with a draft token and a label per response position (soft, or 0/1 for FSD)."""

    index: int
    input_ids: list[int]
    start: int
    draft_token: list[int]
    label: list[float]


def load_examples(data_dir: str | Path, label_column: str = "label") -> list[Example]:
    """Reads every chunk written by ``heads-datagen`` (only the columns training needs)."""
    import pyarrow.parquet as pq

    from specheads.dataset import require_columns, shard_paths

    files = shard_paths(data_dir)  # the manifest's list; UserError for a missing/newer-schema manifest
    if not files:
        raise UserError(
            f"{data_dir} holds no labelled examples (its manifest lists no shards); run heads-datagen with more prompts"
        )
    out = []
    for path in files:
        require_columns(path, (*COLUMNS, label_column))
        table = pq.read_table(path, columns=list(dict.fromkeys((*COLUMNS[:-1], label_column))))
        for row in table.to_pylist():
            out.append(
                Example(
                    row["prompt_index"],
                    row["input_ids"],
                    row["response_start"],
                    row["draft_token"],
                    [float(v) for v in row[label_column]],
                )
            )  # FSD decisions are stored as bools
    out.sort(key=lambda e: e.index)
    return out


def mix(example: Example, ratio: float, seed: int) -> tuple[list[int], list[bool]]:
    """Token mixing (docs/algorithms/specdecpp.md): ``z_i = x_i`` where ``m_i ~ Bernoulli(ratio)``, else ``y_i``.

    Returns the mixed sequence (prompt + z) and the loss mask over response positions
    (``m_i = 0``: decided by the draw, not by token equality). The draw depends only on
    ``seed`` (derive it from the run seed, the epoch and the example), so any batching or
    process count sees the same mixing.
    """
    g = torch.Generator().manual_seed(seed)
    n = len(example.label)
    m = (torch.rand(n, generator=g) < ratio).tolist()
    x = example.input_ids[example.start :]
    z = [xi if mi else yi for xi, yi, mi in zip(x, example.draft_token, m)]
    return example.input_ids[: example.start] + z, [not mi for mi in m]


def mix_seed(seed: int, epoch: int, index: int) -> int:
    return ((seed & 0xFFFF) << 40) + (epoch << 28) + index


@torch.no_grad()
def draft_features(
    draft,
    capture,
    seqs: list[list[int]],
    starts: list[int],
    masks: list[list[bool]],
    labels: list[list[float]],
    pad: int,
    device,
    shift: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The frozen draft's post-norm states at the labelled response positions of a batch.

    ``shift=0``: the state at a response token's own position (after consuming it), the
    SpecDec++ feature ``h^D_i`` for the soft label. ``shift=1``: the state one position earlier,
    the one that produced ``q_i`` before ``y_i`` was drawn, the only valid feature for the
    expected label ``1 - TV(p_i, q_i)``. Returns features ``[M, d]`` and labels ``[M]``.
    """
    ids, attn = pad_batch(seqs, pad, device)
    draft(input_ids=ids, attention_mask=attn, logits_to_keep=1)
    states = capture.post
    feats, ys = [], []
    for b, (start, mask, lab) in enumerate(zip(starts, masks, labels)):
        pos = torch.tensor(
            [start + i - shift for i, keep in enumerate(mask) if keep], dtype=torch.long, device=states.device
        )
        feats.append(states[b].index_select(0, pos))
        ys.append(torch.tensor([v for v, keep in zip(lab, mask) if keep], dtype=torch.float32))
    return torch.cat(feats).float(), torch.cat(ys).to(states.device)
