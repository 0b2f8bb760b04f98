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
