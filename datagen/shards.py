"""Resumable, rank-independent output: one Parquet file per chunk of prompts (layout: :mod:`specheads.dataset`).

Chunk ``c`` holds the examples of prompts ``[c*S, (c+1)*S)``; its random draws are seeded from
``(seed, c)``, so its content does not depend on which process labels it. Chunk ``c`` belongs to
process ``c % world``: each process knows its share without looking at the others' files (no
shared filesystem needed) and a restart, with any process count, finds every unfinished chunk
owned by exactly one process. A chunk file appears atomically (written under a temporary name,
fsynced, then renamed) and only when the whole chunk is labelled, so a killed run loses at most
the chunks in flight. Each file carries its own record in the Parquet footer, from which the
finished run's ``manifest.json`` is built (``manifest.py``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from specheads.dataset import FOOTER_KEY, SCHEMA_VERSION, chunk_path


def num_chunks(num_prompts: int, chunk_size: int) -> int:
    return (num_prompts + chunk_size - 1) // chunk_size


def pending_chunks(out_dir: Path, num_prompts: int, chunk_size: int) -> list[int]:
    """Chunks without a finished file."""
    return [c for c in range(num_chunks(num_prompts, chunk_size)) if not chunk_path(out_dir, c).exists()]


def owner(chunk: int, world: int) -> int:
    """The process that labels ``chunk`` in a run of ``world`` processes."""
    return chunk % world


def my_chunks(out_dir: Path, total: int, rank: int, world: int) -> list[int]:
    """This process's unfinished chunks (a function of the rank, the count and its own files only)."""
    return [c for c in range(rank, total, world) if not chunk_path(out_dir, c).exists()]


def chunk_seed(seed: int, chunk: int) -> int:
    """The RNG seed of one chunk (independent of which process labels it)."""
    return ((seed & 0xFFFFFFFF) << 20) + chunk


def write_chunk(out_dir: Path, chunk: int, columns: dict[str, list], info: dict) -> Path:
    """Writes one chunk's examples as Parquet, atomically, with ``info`` in its footer."""
    import pyarrow.parquet as pq
    from datasets import Dataset
    from datasets.utils.logging import disable_progress_bar

    disable_progress_bar()  # one bar per run (the CLI's), not one per file
    path = chunk_path(out_dir, chunk)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    table = Dataset.from_dict(columns).data.table  # the datasets library's types and its schema record
    meta = dict(table.schema.metadata or {})
    meta[FOOTER_KEY] = json.dumps({"chunk": chunk, "schema_version": SCHEMA_VERSION, **info}).encode()
    pq.write_table(table.replace_schema_metadata(meta), str(tmp))
    with open(tmp, "rb") as fh:
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    return path
