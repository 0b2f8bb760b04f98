"""What a training run reads and records about its data: the manifest of the data it trains on, the epoch's
batches, another run's output."""

from __future__ import annotations

import json
import random
from pathlib import Path

from specheads.config import to_yaml
from specheads.dataset import MIXED_DATA_LABELS
from specheads.errors import UserError
from specheads.outputs import holds_other_run
from specheads.train.config import TrainConfig


def _epoch_batches(n: int, batch: int, world: int, seed: int, epoch: int) -> list[list[int]]:
    """The epoch's micro-batches of example indices, padded so every process gets as many."""
    order = list(range(n))
    random.Random(seed * 1000 + epoch).shuffle(order)
    per_round = batch * world
    if len(order) % per_round:
        order += order[: per_round - len(order) % per_round]
    return [order[i : i + batch] for i in range(0, len(order), batch)]


def overwrites_another_run(cfg: TrainConfig) -> bool:
    """``overwrite=true`` into an output_dir that holds a run with another config (call it before
    ``prepare_output_dir`` rewrites config.yaml): that run's checkpoints must not be resumed."""
    return cfg.overwrite and holds_other_run(cfg.output_dir, to_yaml(cfg))


def data_manifest(cfg: TrainConfig) -> dict:
    """The manifest of ``data_dir``; for several comma-separated judge data sets (tuples mixed from several
    sources: arithmetic-localised, swap-mined, imported), the first one's, after checking that every one is
    judge data of the same target (fingerprint and hidden size)."""
    dirs = [d.strip() for d in cfg.data_dir.split(",") if d.strip()]
    if not dirs:
        raise UserError(f"data_dir={cfg.data_dir!r} names no directory; pass data_dir=<heads-datagen output_dir>")
    manifests = []
    for d in dirs:
        path = Path(d) / "manifest.json"
        if not path.is_file():
            raise UserError(f"{path} not found; data_dir must be a finished heads-datagen output_dir")
        manifests.append(json.loads(path.read_text()))
    if len(dirs) > 1:
        want = MIXED_DATA_LABELS.get(cfg.head)
        if want is None or any(m.get("labels") != want for m in manifests):
            raise UserError(
                f"data_dir={cfg.data_dir}: several data sets are mixed only for head=judge (labels=judge) "
                "and head=eagle or draft (labels=drafter)"
            )
        first = manifests[0]
        for d, m in zip(dirs[1:], manifests[1:]):
            if (m.get("target") or {}).get("fingerprint") != (first.get("target") or {}).get("fingerprint") or m.get(
                "hidden_size"
            ) != first.get("hidden_size"):
                raise UserError(
                    f"{d} was labelled on another target than {dirs[0]} (fingerprint or hidden size "
                    "differ); mix only data sets of one target"
                )
        return {**first, "data_dirs": dirs}
    return manifests[0]
