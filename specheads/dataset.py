"""The dataset contract: what ``heads-datagen`` writes and every later stage reads.

An output directory holds ``manifest.json`` (the single source of truth: its ``shards`` list
names every data file with its rows, bytes and SHA-256), ``data/chunk-NNNNNN.parquet`` (one file
per chunk of prompts, with its own record in the Parquet footer under ``specheads``: prompt
range, rows, skipped samples, models, numerics settings) and, for ``labels=judge``, the side
files of :class:`JudgeChunkFiles`. The columns each ``labels=`` mode writes:

* ``acceptance``: :data:`ACCEPTANCE_COLUMNS`; ``fsd`` adds ``div_<name>`` and ``fsd_<name>@<T>``
  per token (the manifest's ``fsd.divergence_columns`` and ``fsd.label_columns`` name them);
* ``sprinter``: :data:`SPRINTER_COLUMNS`;
* ``judge``: :data:`JUDGE_COLUMNS`, one row per tuple side, its features in
  ``features/chunk-NNNNNN.safetensors``;
* ``drafter``: :data:`DRAFTER_COLUMNS`, one row per prompt and the target's own response, its
  states and next-token distributions in :class:`DrafterChunkFiles`;
* ``eagle_rounds``: :data:`EAGLE_ROUNDS_COLUMNS`, one row per prompt decoded with an EAGLE head, lists
  per labelled candidate; the head's states at those candidates (``states`` ``[M, d]`` fp16, ``offsets``
  ``[rows + 1]``) in the same side file as ``drafter``'s, :class:`DrafterChunkFiles`.

Readers take the files from :func:`shard_paths` and check their columns with
:func:`require_columns`; ``heads-datagen verify`` checks a whole directory.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from specheads.errors import UserError

# 2: manifest lists the shards (file, rows, sha256) and the skipped samples; chunk footers.
SCHEMA_VERSION = 2
FOOTER_KEY = b"specheads"
# Every folder a run writes besides its top-level files (another run's must not mix with it).
RUN_DIRS = ("data", "features", "tuples", "review", "mined", "states")

ACCEPTANCE_COLUMNS = (
    "prompt_id",
    "prompt_index",
    "input_ids",
    "response_start",
    "draft_token",
    "label",
    "expected_label",
)
SPRINTER_COLUMNS = (
    "prompt_id",
    "prompt_index",
    "category",
    "input_ids",
    "positions",
    "draft_token",
    "q_token",
    "p_token",
    "ratio",
    "tv",
)
JUDGE_COLUMNS = ("tuple_id", "prompt_index", "side", "input_ids", "answer_start", "labels")
DRAFTER_COLUMNS = ("prompt_id", "prompt_index", "input_ids", "response_start")
EAGLE_ROUNDS_COLUMNS = (
    "prompt_id",
    "prompt_index",
    "input_ids",
    "response_start",
    "round_start",
    "step",
    "draft_token",
    "q_token",
    "p_token",
    "label",
    "outcome",
)
# eagle_rounds' per-candidate signals of the distribution a candidate was drawn from (a head with signals reads them)
EAGLE_ROUNDS_SIGNALS = ("q_entropy", "q_margin")
#: The heads whose training mixes several data sets (``data_dir=a,b``), each of the labels it names.
MIXED_DATA_LABELS = {"judge": "judge", "eagle": "drafter", "draft": "drafter"}


def chunk_path(out_dir: Path, chunk: int) -> Path:
    return Path(out_dir) / "data" / f"chunk-{chunk:06d}.parquet"


def chunk_files(out_dir: Path) -> list[Path]:
    """Finished chunk files, in chunk order (on disk; readers use :func:`shard_paths`)."""
    return sorted((Path(out_dir) / "data").glob("chunk-*.parquet"))


def chunk_info(path: Path) -> dict:
    """The ``specheads`` record in a chunk file's footer (raises UserError on an unreadable file)."""
    import pyarrow.parquet as pq

    try:
        meta = pq.read_schema(str(path)).metadata or {}
    except Exception as err:  # noqa: BLE001 - pyarrow raises several types for damaged files
        raise UserError(
            f"{path} is not a readable Parquet file ({str(err).splitlines()[0]}); delete it and run "
            "the same heads-datagen command again to relabel that chunk"
        ) from None
    if FOOTER_KEY not in meta:
        return {}
    return json.loads(meta[FOOTER_KEY])


def read_manifest(data_dir: Path) -> dict:
    """A finished run's manifest; UserError when it is missing, damaged or from a newer specheads."""
    path = Path(data_dir) / "manifest.json"
    if not path.is_file():
        raise UserError(
            f"{path} not found; data_dir must be a finished heads-datagen output_dir "
            "(run heads-datagen, or the same command again if it was interrupted)"
        )
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as err:
        raise UserError(f"{path} is damaged ({err}); run the same heads-datagen command again to rewrite it") from None
    version = manifest.get("schema_version", 1)
    if not isinstance(version, int) or version > SCHEMA_VERSION:
        raise UserError(
            f"{data_dir} was written with data schema version {version}, newer than this specheads "
            f"reads ({SCHEMA_VERSION}); upgrade specheads (pip install -U specheads)"
        )
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
            raise UserError(
                f"{path} is missing or changed since heads-datagen wrote it (manifest: {shard['bytes']} "
                f"bytes); run `heads-datagen verify output_dir={root}` and relabel"
            )
        out.append(path)
    return out


def require_columns(path: Path, columns) -> None:
    """UserError naming the missing columns of a data file."""
    import pyarrow.parquet as pq

    try:
        names = pq.read_schema(str(path)).names
    except Exception as err:  # noqa: BLE001
        raise UserError(
            f"{path} is not a readable Parquet file ({str(err).splitlines()[0]}); "
            "run heads-datagen verify on its output_dir"
        ) from None
    missing = [c for c in dict.fromkeys(columns) if c not in names]
    if missing:
        raise UserError(
            f"{path} lacks columns {missing}; it was not written by this heads-datagen labels= mode, "
            "regenerate it with heads-datagen"
        )


class JudgeChunkFiles:
    """The side files of one ``labels=judge`` chunk, written before its Parquet file (which marks it done).

    ``features/chunk-N.safetensors``: ``features`` ``[M, d]`` fp16 (the target's states at the
    labelled answer tokens), ``labels`` ``[M]``, ``offsets`` ``[rows + 1]`` (row ``i``'s tokens are
    ``offsets[i]:offsets[i+1]``, rows in Parquet order) and ``signals`` ``[M, 4]`` fp32 (the target's verdict on
    each token, :data:`~specheads.heads.judge_head.JUDGE_SIGNALS`; absent in data written before it).
    ``tuples/chunk-N.jsonl``, ``review/chunk-N.jsonl`` and ``tuples/chunk-N.counts.json``: the chunk's tuples,
    review items and counts, merged into ``tuples.jsonl``, ``review.jsonl`` and the manifest at the end; with
    ``judge.mining=swap`` also ``mined/chunk-N.jsonl`` (one searched prompt per line), merged into ``mined.jsonl``.
    """

    def __init__(self, out_dir: Path, chunk: int):
        root = Path(out_dir)
        self.features_path = root / "features" / f"chunk-{chunk:06d}.safetensors"
        self.tuples_path = root / "tuples" / f"chunk-{chunk:06d}.jsonl"
        self.review_path = root / "review" / f"chunk-{chunk:06d}.jsonl"
        self.counts_path = root / "tuples" / f"chunk-{chunk:06d}.counts.json"
        self.mined_path = root / "mined" / f"chunk-{chunk:06d}.jsonl"

    @property
    def paths(self) -> tuple[Path, ...]:
        """Every side file: features, tuples, review, counts, the mined records (``judge.mining=swap`` runs only)."""
        return self.features_path, self.tuples_path, self.review_path, self.counts_path, self.mined_path

    def write(
        self,
        features,
        labels,
        offsets,
        tuples: list[str],
        review: list[str],
        counts: dict,
        mined: list[str] | None = None,
        signals=None,
    ) -> None:
        from safetensors.torch import save_file

        from specheads.outputs import atomic_write_text, durable_replace

        self.features_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.features_path.with_name(f".{self.features_path.name}.{os.getpid()}.tmp")
        tensors = {"features": features.contiguous(), "labels": labels.contiguous(), "offsets": offsets.contiguous()}
        if signals is not None:
            tensors["signals"] = signals.float().contiguous()
        save_file(tensors, str(tmp))
        durable_replace(tmp, self.features_path)  # on disk before the chunk file that marks it done
        for path, lines in ((self.tuples_path, tuples), (self.review_path, review), (self.mined_path, mined)):
            if lines is None:
                continue
            path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_text(path, "".join(x + "\n" for x in lines))
        atomic_write_text(self.counts_path, json.dumps(counts))

    def load(self) -> dict:
        from safetensors.torch import load_file

        return load_file(str(self.features_path))

    def labels(self):
        return self.load()["labels"]

    def counts(self) -> dict:
        return json.loads(self.counts_path.read_text(encoding="utf-8"))

    def tuples(self) -> list[str]:
        return [x for x in self.tuples_path.read_text(encoding="utf-8").splitlines() if x.strip()]

    def review(self) -> list[str]:
        return [x for x in self.review_path.read_text(encoding="utf-8").splitlines() if x.strip()]

    def mined(self) -> list[str]:
        """The chunk's ``judge.mining=swap`` records (none for other judge runs)."""
        if not self.mined_path.is_file():
            return []
        return [x for x in self.mined_path.read_text(encoding="utf-8").splitlines() if x.strip()]


class DrafterChunkFiles:
    """The side file of one ``labels=drafter`` chunk, ``states/chunk-N.safetensors``, written before its
    Parquet file (which marks it done). Rows are in Parquet order:

    * ``states`` ``[sum T_i, len(layers) * d]`` fp16: the target's residual stream entering each of the
      manifest's ``drafter.layers`` at every position of ``input_ids`` (prompt and response), joined;
    * ``offsets`` ``[rows + 1]``: row ``i``'s positions are ``offsets[i]:offsets[i+1]``;
    * ``top_ids`` ``[sum R_i, K]`` int32 and ``top_logp`` ``[sum R_i, K]`` fp32: at every response token,
      the ``K`` most likely tokens of the target's (raw, temperature 1) distribution it was chosen from and
      their log-probabilities (the rest's mass is ``1 - sum exp(top_logp)``);
    * ``response_offsets`` ``[rows + 1]``: row ``i``'s response tokens are ``response_offsets[i]:...[i+1]``;
    * ``layers``: the layer indices of ``states``, in order.

    A ``labels=eagle_rounds`` chunk holds ``states`` ``[M, d]`` (the EAGLE head's post-norm state at each
    labelled candidate, in the order of the Parquet lists) and ``offsets`` ``[rows + 1]`` only.
    """

    def __init__(self, out_dir: Path, chunk: int):
        self.path = Path(out_dir) / "states" / f"chunk-{chunk:06d}.safetensors"

    def write(self, tensors: dict) -> None:
        from safetensors.torch import save_file

        from specheads.outputs import durable_replace

        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp))
        durable_replace(tmp, self.path)  # on disk before the chunk file that marks it done

    def load(self, skip: tuple[str, ...] = ()) -> dict:
        """Every tensor but those named in ``skip`` (``skip=("states",)``: what a standalone draft reads)."""
        from safetensors import safe_open

        if not self.path.is_file():
            raise UserError(f"{self.path} is missing; run heads-datagen verify on its output_dir")
        with safe_open(str(self.path), framework="pt") as f:
            return {k: f.get_tensor(k) for k in f.keys() if k not in skip}
