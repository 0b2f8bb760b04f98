"""The end of a ``heads-datagen`` run (or ``merge``): ``metrics.jsonl`` and ``manifest.json`` from the chunk files."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from specheads.datagen.config import PROG, DatagenConfig
from specheads.datagen.engines import runtime_of
from specheads.datagen.registry import labeller
from specheads.dataset import SCHEMA_VERSION, chunk_info, chunk_path
from specheads.errors import UserError
from specheads.outputs import MetricsWriter, file_sha256, write_manifest
from specheads.runtime.numerics import differences

log = logging.getLogger(__name__)


def _metrics_rows(path: Path) -> list[dict]:
    """The complete lines of a per-rank metrics file (a line torn by a kill is dropped)."""
    rows = []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:
            continue
    return rows


def chunk_metrics(chunk: int, info: dict) -> dict:
    """A chunk's ``metrics.jsonl`` line from what its file records (the labelling process adds its rank and
    seconds; a line rebuilt after a kill has ``recovered: true`` instead)."""
    return {
        "chunk": chunk,
        "prompts": info.get("prompts"),
        "rows": info.get("rows"),
        "labelled_tokens": info.get("labelled_tokens"),
        "skipped": len(info.get("skipped") or []),
    }


def finish(cfg: DatagenConfig, out: Path, total: int, processes: int | None = None) -> dict:
    """Checks every chunk is there and writes ``metrics.jsonl`` and ``manifest.json`` from the chunk files.

    The manifest's ``numerics`` are chunk 0's settings with ``processes`` (the count of the run that
    finishes; ``None`` from ``merge``); chunks labelled otherwise are warned about and listed.
    """
    family = labeller(cfg.labels)
    missing = [c for c in range(total) if not chunk_path(out, c).exists()]
    if missing:
        raise UserError(
            f"{len(missing)} of {total} chunks (first: {missing[:5]}) are not in {out}: run the same "
            "command again to label them; if the nodes do not share a filesystem, run "
            "`heads-datagen merge from=<dir>,<dir>... output_dir=<dir>` over every node's output_dir"
        )
    with MetricsWriter(out) as metrics:  # merge the per-rank logs in chunk order, one line per chunk
        rows = {}
        for path in sorted(out.glob("metrics.rank*.jsonl")):
            for row in _metrics_rows(path):
                rows[row["chunk"]] = row
            path.unlink()
        for chunk in range(total):  # a chunk whose process died before its line: the line from the chunk file
            metrics.write(
                rows.get(chunk) or {**chunk_metrics(chunk, chunk_info(chunk_path(out, chunk))), "recovered": True}
            )
    shard_list, skipped, models, numerics, otherwise = [], [], None, None, {}
    for c in range(total):
        path = chunk_path(out, c)
        info = chunk_info(path)
        if c == 0:
            numerics = info.get("numerics")
        elif info.get("numerics") != numerics:
            otherwise[c] = info.get("numerics") or {}
        here = {k: info.get(k) for k in ("target", "draft", "hidden_size")}
        if models is None:
            models = here
        elif here != models:
            raise UserError(
                f"{path} was labelled with other models ({here['target']}, {here['draft']}) than chunk 0 "
                f"({models['target']}, {models['draft']}); relabel it (delete it and rerun)"
            )
        shard_list.append(
            {
                "file": f"data/{path.name}",
                "chunk": c,
                "first_prompt": info.get("first_prompt"),
                "prompts": info.get("prompts"),
                "rows": info.get("rows"),
                "labelled_tokens": info.get("labelled_tokens"),
                "skipped": len(info.get("skipped", [])),
                "bytes": path.stat().st_size,
                "sha256": file_sha256(path),
                **family.shard_entry(out, c),
            }
        )
        skipped += info.get("skipped", [])
    stats, extra = family.summarise(cfg, out, models)
    prompts_read = sum(s["prompts"] or 0 for s in shard_list)
    if otherwise:  # a resume under other settings (it warned too), or a merge of such nodes
        first = next(iter(otherwise))
        log.warning(
            "%d chunks (first: %d) were labelled with other numerics settings (%s) than chunk 0: %s is not "
            "byte-identical to a run with one setting",
            len(otherwise),
            first,
            ", ".join(differences(numerics or {}, otherwise[first])),
            out,
        )
        extra["numerics_otherwise"] = list(otherwise)[:1000]
    extra |= runtime_of(cfg).manifest()  # who generated the target's responses (none: this package)
    write_manifest(
        out,
        command=PROG,
        labels=cfg.labels,
        schema_version=SCHEMA_VERSION,
        **extra,
        prompts_file=cfg.prompts,
        offset=cfg.offset,
        chunk_size=cfg.chunk_size,
        chunks=total,
        target=models["target"],
        draft=models["draft"],
        sampling=cfg.sampling.to_dict(),
        seed=cfg.seed,
        max_new_tokens=cfg.max_new_tokens,
        numerics={**(numerics or {}), "processes": processes},
        prompts_read=prompts_read,
        skipped_nonfinite=len(skipped),
        skipped_samples=skipped[:1000],
        **stats,
        shards=shard_list,
    )
    log.info(
        "%d prompts, %d labelled tokens, mean label %.3f, %d skipped (non-finite) -> %s",
        stats["prompts"],
        stats["labelled_tokens"],
        stats["label_mean"] or 0.0,
        len(skipped),
        out,
    )
    return stats
