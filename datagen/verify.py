"""``heads-datagen verify`` and ``heads-datagen merge``: check a finished run, join per-node outputs.

    heads-datagen verify output_dir=runs/labels
    heads-datagen recipe=quickstart verify                      # the recipe's output_dir
    heads-datagen merge from=/nfs/node0/labels,/nfs/node1/labels output_dir=runs/labels

``verify`` reads the manifest (the single source of truth) and checks that every shard it lists
is there with its size and SHA-256, reads whole, holds the rows it should, and that every prompt
of the run is labelled exactly once or recorded as skipped (NaN/Inf logits); files on disk the
manifest does not list are reported too. It prints one line per problem and exits 1 if there is
any, 0 otherwise.

``merge`` joins the output directories of one run written on nodes that do not share a
filesystem (each node labels the chunks its processes own, see ``shards.py``): the runs must
have the same config; chunk files are copied in (a chunk present in several with different
bytes is an error: labelling is deterministic), then the manifest is built as at the end of a
run. The destination may be one of the sources.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

import yaml

from specheads.datagen import shards
from specheads.datagen.config import DatagenConfig
from specheads.datagen.manifest import finish
from specheads.datagen.registry import labeller
from specheads.dataset import chunk_files, chunk_info, chunk_path, read_manifest
from specheads.errors import UserError
from specheads.outputs import file_sha256

log = logging.getLogger(__name__)


def verify(out_dir: str | Path) -> tuple[list[str], dict]:
    """The problems found in a finished ``heads-datagen`` output directory, and a summary."""
    import pyarrow.parquet as pq

    out = Path(out_dir)
    if not out.is_dir():
        raise UserError(f"output_dir {str(out)!r} is not a directory; pass the heads-datagen output_dir to verify")
    manifest = read_manifest(out)
    problems: list[str] = []
    if "shards" not in manifest:
        return ["manifest lists no shards (written by specheads schema 1); rerun heads-datagen to rewrite it"], {}
    judge = manifest.get("labels") == "judge"
    listed = {s["file"] for s in manifest["shards"]}
    labelled: dict[int, int] = {}  # prompt index -> rows (one per prompt, except judge: tuple sides)
    sides: set[tuple[str, str]] = set()
    skipped_idx: list[int] = []
    rows_total = tokens = 0
    expected_prompts: set[int] = set()
    for i, shard in enumerate(manifest["shards"]):
        path = out / shard["file"]
        where = shard["file"]
        lo, n = shard["first_prompt"], shard["prompts"]
        expected_prompts.update(range(lo, lo + n))
        if shard["chunk"] != i:
            problems.append(f"{where}: listed as chunk {shard['chunk']} at position {i} (chunks must be 0..n-1)")
        if not path.is_file():
            problems.append(f"{where}: missing")
            continue
        if path.stat().st_size != shard["bytes"] or file_sha256(path) != shard["sha256"]:
            problems.append(f"{where}: bytes or SHA-256 differ from the manifest (changed after it was written)")
            continue
        try:
            table = pq.read_table(str(path))
        except Exception as err:  # noqa: BLE001 - any damage pyarrow reports
            problems.append(f"{where}: unreadable ({str(err).splitlines()[0]})")
            continue
        info = chunk_info(path)
        if table.num_rows != shard["rows"] or info.get("chunk") != shard["chunk"]:
            problems.append(
                f"{where}: {table.num_rows} rows / footer chunk {info.get('chunk')}, manifest says "
                f"{shard['rows']} rows / chunk {shard['chunk']}"
            )
        rows_total += table.num_rows
        tokens += shard.get("labelled_tokens") or 0
        skipped_here = [s["prompt_index"] for s in info.get("skipped", []) if "prompt_index" in s]
        if not judge:
            skipped_idx += skipped_here
            for index in table.column("prompt_index").to_pylist():
                labelled[index] = labelled.get(index, 0) + 1
                if not lo <= index < lo + n:
                    problems.append(f"{where}: prompt {index} is outside the chunk's prompts [{lo}, {lo + n})")
        else:
            for tid, side in zip(table.column("tuple_id").to_pylist(), table.column("side").to_pylist()):
                if (tid, side) in sides:
                    problems.append(f"{where}: tuple {tid} side {side} appears twice")
                sides.add((tid, side))
            problems += _verify_features(out, shard, table.num_rows)
    if not judge:
        twice = sorted(i for i, k in labelled.items() if k > 1)
        both = sorted(set(labelled) & set(skipped_idx))
        lost = sorted(expected_prompts - set(labelled) - set(skipped_idx))
        if twice:
            problems.append(f"{len(twice)} prompts labelled more than once (first: {twice[:5]})")
        if both:
            problems.append(f"{len(both)} prompts both labelled and skipped (first: {both[:5]})")
        if lost:
            problems.append(f"{len(lost)} prompts neither labelled nor skipped (first: {lost[:5]})")
    if len(manifest["shards"]) != manifest.get("chunks"):
        problems.append(f"manifest lists {len(manifest['shards'])} shards for {manifest.get('chunks')} chunks")
    stray = sorted(
        str(p.relative_to(out)) for p in (out / "data").glob("chunk-*.parquet") if str(p.relative_to(out)) not in listed
    )
    if stray:
        problems.append(
            f"{len(stray)} data files the manifest does not list (first: {stray[:3]}); they are not "
            "part of this run: delete them"
        )
    temporaries = [str(p.relative_to(out)) for p in out.glob("*/.chunk-*")]
    summary = {
        "shards": len(manifest["shards"]),
        "prompts": len(expected_prompts),
        "rows": rows_total,
        "labelled_prompts": len(labelled) if not judge else None,
        "skipped": manifest.get("skipped_nonfinite", 0),
        "labelled_tokens": tokens,
        "leftover_temporary_files": len(temporaries),
    }
    return problems, summary


def _verify_features(out: Path, shard: dict, rows: int) -> list[str]:
    from safetensors import safe_open

    feats = shard.get("features")
    if not feats:
        return [f"{shard['file']}: the manifest lists no features file"]
    path = out / feats["file"]
    if not path.is_file() or path.stat().st_size != feats["bytes"] or file_sha256(path) != feats["sha256"]:
        return [f"{feats['file']}: missing, or bytes/SHA-256 differ from the manifest"]
    try:
        with safe_open(str(path), framework="pt") as f:
            offsets = f.get_tensor("offsets")
            n_feat, n_lab = f.get_slice("features").get_shape()[0], f.get_slice("labels").get_shape()[0]
    except Exception as err:  # noqa: BLE001
        return [f"{feats['file']}: unreadable ({str(err).splitlines()[0]})"]
    if len(offsets) != rows + 1 or int(offsets[-1]) != n_feat or n_feat != n_lab:
        return [f"{feats['file']}: offsets/features/labels do not match the shard's {rows} rows"]
    return []


def verify_main(cfg: DatagenConfig) -> int:
    problems, summary = verify(cfg.output_dir)
    for p in problems:
        print(f"heads-datagen verify: {cfg.output_dir}: {p}")
    if problems:
        print(f"heads-datagen verify: FAILED, {len(problems)} problem(s)")
        return 1
    extra = (
        f", {summary['leftover_temporary_files']} temporary files left by killed writes (safe to delete)"
        if summary["leftover_temporary_files"]
        else ""
    )
    labelled = "" if summary["labelled_prompts"] is None else f"{summary['labelled_prompts']} labelled once, "
    print(
        f"heads-datagen verify: OK: {summary['shards']} shards, {summary['prompts']} prompts ({labelled}"
        f"{summary['skipped']} skipped for NaN/Inf), {summary['rows']} rows, {summary['labelled_tokens']} "
        f"labelled tokens{extra}"
    )
    return 0


def _load_run_config(src: Path) -> tuple[str, DatagenConfig]:
    from omegaconf import OmegaConf

    path = src / "config.yaml"
    if not path.is_file():
        raise UserError(f"{path} not found; every merge source must be a heads-datagen output_dir")
    text = path.read_text(encoding="utf-8")
    data = yaml.safe_load(text)
    data.pop("output_dir", None)  # each node may have written to its own path
    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(DatagenConfig), data))
    return json.dumps(data, sort_keys=True), cfg


def _copy_atomic(src: Path, dst: Path) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name(f".{dst.name}.{os.getpid()}.tmp")
    shutil.copyfile(src, tmp)
    with open(tmp, "rb") as fh:
        os.fsync(fh.fileno())
    os.replace(tmp, dst)


def merge(sources: list[str], dest: str | Path) -> dict:
    """Joins the chunk files of several output directories of one run into ``dest`` and finishes it."""
    from specheads.config import to_yaml
    from specheads.outputs import prepare_output_dir

    if not sources:
        raise UserError("merge needs from=<dir>,<dir>...: the output directories to join")
    dest = Path(dest)
    configs = []
    for src in map(Path, sources):
        if not src.is_dir():
            raise UserError(f"merge source {str(src)!r} is not a directory")
        configs.append((src, *_load_run_config(src)))
    for src, key, _ in configs[1:]:
        if key != configs[0][1]:
            raise UserError(
                f"{src} holds a different run than {configs[0][0]} (config.yaml differs beyond "
                "output_dir); merge only the outputs of one heads-datagen command"
            )
    cfg = configs[0][2]
    family = labeller(cfg.labels)
    cfg.output_dir = str(dest)
    prepare_output_dir(dest, to_yaml(cfg), overwrite=False)
    copied = 0
    for src, _, _ in configs:
        if src.resolve() == dest.resolve():
            continue
        for path in chunk_files(src):
            chunk = int(path.stem.split("-")[1])
            target = chunk_path(dest, chunk)
            if target.exists():
                if file_sha256(target) != file_sha256(path):
                    raise UserError(
                        f"chunk {chunk} differs between {src} and {dest}; labelling is deterministic, so "
                        "one of them is damaged: delete it there and relabel"
                    )
                continue
            for x, y in zip(family.side_files(src, chunk), family.side_files(dest, chunk)):
                if x.is_file():  # the side files first: the Parquet file marks the chunk done
                    _copy_atomic(x, y)
            _copy_atomic(path, target)
            copied += 1
        for metrics in src.glob("metrics.rank*.jsonl"):
            mine = dest / metrics.name
            with open(mine, "a", encoding="utf-8") as fh:
                fh.write(metrics.read_text(encoding="utf-8", errors="replace"))
    total = shards.num_chunks(family.count(cfg), cfg.chunk_size)
    stats = finish(cfg, dest, total)
    log.info("merged %d chunk files from %d directories into %s", copied, len(sources), dest)
    return stats
