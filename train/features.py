"""Cached features: the frozen draft's states for each epoch's mixed sequences, computed once.

``features=online`` runs the draft inside training on every batch of every epoch (as the
reference does). ``features=cached`` runs it once per epoch's mixing draw (and once for the
held-out set) before training starts and stores the states, fp16, only at the positions the
loss uses, with their labels: ``<cache_dir>/<key>/epoch-<e>.safetensors``. The key covers
everything the states depend on (draft fingerprint, mixing ratio, seed, label kind, split), so
another training run with other head settings (depth, ``w_rej``, learning rate ...) on the same
data reuses the files, and a run with different mixing builds its own.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm import tqdm


def cache_key(draft_fingerprint: str, mix_ratio: float, seed: int, label: str, eval_fraction: float) -> str:
    blob = json.dumps(
        {
            "draft": draft_fingerprint,
            "mix_ratio": mix_ratio,
            "seed": seed,
            "label": label,
            "eval_fraction": eval_fraction,
            "format": 2,
        },
        sort_keys=True,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


class FeatureCache:
    """Per-epoch feature files; ``batch(epoch, examples)`` returns (features fp32, labels).

    Args:
        root: the key's directory.
        compute: ``compute(examples, epoch) -> (features [M, d], labels [M], rows per example)``
            (the online path).
        batch_size: examples per draft forward while building.
    """

    def __init__(self, root: Path, compute, batch_size: int):
        self.root, self.compute, self.batch_size = Path(root), compute, batch_size
        self._loaded: dict[int, tuple[torch.Tensor, torch.Tensor, dict[int, tuple[int, int]]]] = {}

    def path(self, epoch: int) -> Path:
        return self.root / f"epoch-{epoch}.safetensors"

    def build(self, epoch: int, examples, show: bool = True) -> Path:
        """Writes the epoch's file unless it is already there (atomic: a crash leaves no partial file)."""
        path = self.path(epoch)
        if path.is_file():
            return path
        self.root.mkdir(parents=True, exist_ok=True)
        feats, labels, counts = [], [], []
        for i in tqdm(
            range(0, len(examples), self.batch_size),
            desc=f"caching features (epoch {epoch})",
            unit="batch",
            disable=not show,
        ):
            x, y, rows = self.compute(examples[i : i + self.batch_size], epoch)
            feats.append(x.to(torch.float16).cpu())
            labels.append(y.float().cpu())
            counts.extend(rows)
        index = torch.tensor([ex.index for ex in examples], dtype=torch.int64)
        offsets = torch.zeros(len(examples) + 1, dtype=torch.int64)
        offsets[1:] = torch.tensor(counts, dtype=torch.int64).cumsum(0)
        tensors = {
            "features": torch.cat(feats).contiguous(),
            "labels": torch.cat(labels).contiguous(),
            "index": index,
            "offsets": offsets,
        }
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        save_file(tensors, str(tmp), metadata={"epoch": str(epoch), "examples": str(len(examples))})
        os.replace(tmp, path)
        return path

    def _load(self, epoch: int):
        if epoch not in self._loaded:
            with safe_open(str(self.path(epoch)), framework="pt") as f:
                t = {k: f.get_tensor(k) for k in f.keys()}
            off = t["offsets"].tolist()
            where = {int(ix): (off[j], off[j + 1]) for j, ix in enumerate(t["index"].tolist())}
            self._loaded = {epoch: (t["features"], t["labels"], where)}  # one epoch in memory at a time
        return self._loaded[epoch]

    def batch(self, epoch: int, examples, device) -> tuple[torch.Tensor, torch.Tensor]:
        feats, labels, where = self._load(epoch)
        spans = [where[ex.index] for ex in examples]
        x = torch.cat([feats[a:b] for a, b in spans]).float().to(device)
        y = torch.cat([labels[a:b] for a, b in spans]).to(device)
        return x, y

    def nbytes(self) -> int:
        return sum(p.stat().st_size for p in self.root.glob("epoch-*.safetensors"))
