"""Resumable, rank-independent output: one Parquet file per chunk of prompts.

Chunk ``c`` holds the examples of prompts ``[c*S, (c+1)*S)``; its random draws are seeded from
``(seed, c)``. A chunk file appears atomically (written under a temporary name, then renamed)
and only when the whole chunk is labelled, so a killed run loses at most the chunks in flight
and a restart skips every finished chunk. Chunks are dealt to processes by ``c % world``
among the unfinished ones, so any process count, and any mix of counts across restarts,
yields the same files.
"""

from __future__ import annotations

import os
from pathlib import Path

SCHEMA_VERSION = 1


def chunk_path(out_dir: Path, chunk: int) -> Path:
    return Path(out_dir) / "data" / f"chunk-{chunk:06d}.parquet"


def num_chunks(num_prompts: int, chunk_size: int) -> int:
    return (num_prompts + chunk_size - 1) // chunk_size


def pending_chunks(out_dir: Path, num_prompts: int, chunk_size: int) -> list[int]:
    """Chunks without a finished file."""
    return [c for c in range(num_chunks(num_prompts, chunk_size)) if not chunk_path(out_dir, c).exists()]


def my_chunks(pending: list[int], rank: int, world: int) -> list[int]:
    """This process's share of the pending chunks."""
    return pending[rank::world]


def chunk_seed(seed: int, chunk: int) -> int:
    """The RNG seed of one chunk (independent of which process labels it)."""
    return ((seed & 0xFFFFFFFF) << 20) + chunk


def write_chunk(out_dir: Path, chunk: int, columns: dict[str, list]) -> Path:
    """Writes one chunk's examples as Parquet, atomically."""
    from datasets import Dataset
    from datasets.utils.logging import disable_progress_bar

    disable_progress_bar()  # one bar per run (the CLI's), not one per file
    path = chunk_path(out_dir, chunk)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    Dataset.from_dict(columns).to_parquet(str(tmp))
    with open(tmp, "rb") as fh:
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    return path


def chunk_files(out_dir: Path) -> list[Path]:
    """Finished chunk files, in chunk order."""
    return sorted((Path(out_dir) / "data").glob("chunk-*.parquet"))


class JudgeChunkFiles:
    """The side files of one ``labels=judge`` chunk, written before its Parquet file (which marks it done).

    ``features/chunk-N.safetensors``: ``features`` ``[M, d]`` fp16 (the target's states at the
    labelled answer tokens), ``labels`` ``[M]`` and ``offsets`` ``[rows + 1]`` (row ``i``'s tokens are
    ``offsets[i]:offsets[i+1]``, rows in Parquet order). ``tuples/chunk-N.jsonl``,
    ``review/chunk-N.jsonl`` and ``tuples/chunk-N.counts.json``: the chunk's tuples, review items
    and counts, merged into ``tuples.jsonl``, ``review.jsonl`` and the manifest at the end.
    """

    def __init__(self, out_dir: Path, chunk: int):
        root = Path(out_dir)
        self.features_path = root / "features" / f"chunk-{chunk:06d}.safetensors"
        self.tuples_path = root / "tuples" / f"chunk-{chunk:06d}.jsonl"
        self.review_path = root / "review" / f"chunk-{chunk:06d}.jsonl"
        self.counts_path = root / "tuples" / f"chunk-{chunk:06d}.counts.json"

    def write(self, features, labels, offsets, tuples: list[str], review: list[str], counts: dict) -> None:
        import json

        from safetensors.torch import save_file

        from specheads.outputs import atomic_write_text

        self.features_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.features_path.with_name(f".{self.features_path.name}.{os.getpid()}.tmp")
        save_file({"features": features.contiguous(), "labels": labels.contiguous(), "offsets": offsets.contiguous()},
                  str(tmp))
        os.replace(tmp, self.features_path)
        for path, lines in ((self.tuples_path, tuples), (self.review_path, review)):
            path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_text(path, "".join(x + "\n" for x in lines))
        atomic_write_text(self.counts_path, json.dumps(counts))

    def load(self) -> dict:
        from safetensors.torch import load_file

        return load_file(str(self.features_path))

    def labels(self):
        return self.load()["labels"]

    def counts(self) -> dict:
        import json

        return json.loads(self.counts_path.read_text(encoding="utf-8"))

    def tuples(self) -> list[str]:
        return [x for x in self.tuples_path.read_text(encoding="utf-8").splitlines() if x.strip()]

    def review(self) -> list[str]:
        return [x for x in self.review_path.read_text(encoding="utf-8").splitlines() if x.strip()]
