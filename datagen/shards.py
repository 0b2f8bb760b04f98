"""Resumable, rank-independent output: one Parquet file per chunk of prompts.

Chunk ``c`` holds the examples of prompts ``[c*S, (c+1)*S)``; its random draws are seeded from
``(seed, c)``, so its content does not depend on which process labels it. Chunk ``c`` belongs to
process ``c % world``: each process knows its share without looking at the others' files (no
shared filesystem needed) and a restart, with any process count, finds every unfinished chunk
owned by exactly one process. A chunk file appears atomically (written under a temporary name,
fsynced, then renamed) and only when the whole chunk is labelled, so a killed run loses at most
the chunks in flight. Each file carries its own record in the Parquet footer (``specheads``:
prompt range, rows, skipped samples, models, numerics settings), from which the finished run's ``manifest.json``
is built: its ``shards`` list (file, rows, bytes, sha256) is what every reader uses.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from specheads.errors import UserError

# 2: manifest lists the shards (file, rows, sha256) and the skipped samples; chunk footers.
SCHEMA_VERSION = 2
FOOTER_KEY = b"specheads"


def chunk_path(out_dir: Path, chunk: int) -> Path:
    return Path(out_dir) / "data" / f"chunk-{chunk:06d}.parquet"


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


def chunk_info(path: Path) -> dict:
    """The ``specheads`` record in a chunk file's footer (raises UserError on an unreadable file)."""
    import pyarrow.parquet as pq

    try:
        meta = pq.read_schema(str(path)).metadata or {}
    except Exception as err:  # noqa: BLE001 - pyarrow raises several types for damaged files
        raise UserError(f"{path} is not a readable Parquet file ({str(err).splitlines()[0]}); delete it and run "
                        "the same heads-datagen command again to relabel that chunk") from None
    if FOOTER_KEY not in meta:
        return {}
    return json.loads(meta[FOOTER_KEY])


def chunk_files(out_dir: Path) -> list[Path]:
    """Finished chunk files, in chunk order (on disk; readers use :func:`shard_paths`)."""
    return sorted((Path(out_dir) / "data").glob("chunk-*.parquet"))


def read_manifest(data_dir: Path) -> dict:
    """A finished run's manifest; UserError when it is missing, damaged or from a newer specheads."""
    path = Path(data_dir) / "manifest.json"
    if not path.is_file():
        raise UserError(f"{path} not found; data_dir must be a finished heads-datagen output_dir "
                        "(run heads-datagen, or the same command again if it was interrupted)")
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as err:
        raise UserError(f"{path} is damaged ({err}); run the same heads-datagen command again to rewrite it") from None
    version = manifest.get("schema_version", 1)
    if not isinstance(version, int) or version > SCHEMA_VERSION:
        raise UserError(f"{data_dir} was written with data schema version {version}, newer than this specheads "
                        f"reads ({SCHEMA_VERSION}); upgrade specheads (pip install -U specheads)")
    return manifest


def shard_paths(data_dir: Path) -> list[Path]:
    """The data files of a finished run, as its manifest lists them (the single source of truth).

    Each listed file must exist with its recorded size (a full check of checksums and prompt
    coverage is ``heads-datagen verify``). Runs written before the manifest listed its shards
    (schema 1) fall back to the files on disk.
    """
    root = Path(data_dir)
    manifest = read_manifest(root)
    if "shards" not in manifest:
        return chunk_files(root)
    out = []
    for shard in manifest["shards"]:
        path = root / shard["file"]
        if not path.is_file() or path.stat().st_size != shard["bytes"]:
            raise UserError(f"{path} is missing or changed since heads-datagen wrote it (manifest: {shard['bytes']} "
                            f"bytes); run `heads-datagen verify output_dir={root}` and relabel")
        out.append(path)
    return out


def require_columns(path: Path, columns) -> None:
    """UserError naming the missing columns of a data file."""
    import pyarrow.parquet as pq

    try:
        names = pq.read_schema(str(path)).names
    except Exception as err:  # noqa: BLE001
        raise UserError(f"{path} is not a readable Parquet file ({str(err).splitlines()[0]}); "
                        "run heads-datagen verify on its output_dir") from None
    missing = [c for c in dict.fromkeys(columns) if c not in names]
    if missing:
        raise UserError(f"{path} lacks columns {missing}; it was not written by this heads-datagen labels= mode, "
                        "regenerate it with heads-datagen")


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
