"""``heads-pipeline``'s multi-run stages: ``pipeline.datagen_parts`` (several datagen runs, one training set) and
``pipeline.train_stages`` (several training runs, each starting from the one before), and what they cost.

A part is the recipe's ``datagen`` section with the part's keys changed, a training stage the recipe's ``train``
section with the stage's (both after what the pipeline chains: the pruned draft, the data). Command-line overrides
(``datagen.num_prompts=8``) apply to every part or stage after its own keys, but for the keys that name a run
(``output_dir``; a stage's ``eagle.init_head``): there the part's or stage's own value stays. A part without
``output_dir`` writes ``<datagen.output_dir>-part<i>``. Training reads every part's ``output_dir`` but those of
``labels=prompts`` parts, which write a prompt file a later part reads (``prompts: <its output_dir>/prompts.jsonl``).
Stage ``i`` writes ``<train.output_dir>-stage<i>`` (the last: ``train.output_dir``) unless it names its own, and
starts from the stage before's head unless it sets ``eagle.init_head``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

from specheads import _schema
from specheads.dataset import MIXED_DATA_LABELS
from specheads.errors import UserError

NOT_TRAINING_DATA = ("prompts", "passages")  # labels whose output is a prompt file, not examples


def overrides(keys: dict[str, Any]) -> list[str]:
    """``key=value`` items (nested keys dotted, values as JSON: YAML reads them back unchanged)."""
    return [f"{k}={json.dumps(v, ensure_ascii=False)}" for k, v in _schema.flatten(dict(keys))]


IDENTITY = {"datagen": ("output_dir",), "train": ("output_dir", "eagle.init_head")}


def _split(stage: str, keys: dict[str, Any]) -> tuple[list[str], list[str]]:
    """A run's overrides: ``(own keys, the keys naming the run)``: those go before the command line, these after."""
    keys = dict(_schema.flatten(dict(keys)))  # a section's keys dotted: eagle.init_head
    own = {k: v for k, v in keys.items() if k not in IDENTITY[stage]}
    return overrides(own), overrides({k: v for k, v in keys.items() if k in IDENTITY[stage]})


def expand(
    pipe,
    cfgs: dict,
    chained: dict[str, list[str]],
    stage_args: Callable[..., list[str]],
    load: Callable[[str, list[str]], Any],
) -> None:
    """Fills ``cfgs["datagen_parts"]`` and ``cfgs["train_stages"]`` (each a list of configs) and rechains
    ``train`` (the last stage) and ``export`` to them (``chained``: what the pipeline hands each stage);
    UserError lists every problem."""
    problems: list[str] = []
    if pipe.regimes and (pipe.datagen_parts or pipe.train_stages):
        problems.append("pipeline.regimes cannot rerun datagen_parts or train_stages; run one pipeline per regime")
    parts = []
    for i, keys in enumerate(pipe.datagen_parts):
        mine = {"output_dir": f"{cfgs['datagen'].output_dir}-part{i + 1}", **keys}
        try:
            own, names = _split("datagen", mine)
            parts.append(load("datagen", stage_args("datagen", chained.get("datagen", []) + own, names)))
        except UserError as err:
            problems.append(f"[datagen part {i + 1}] {err}")
    dirs = [p.output_dir for p in parts]
    twice = sorted({d for d in dirs if dirs.count(d) > 1})
    if twice:
        problems.append(f"pipeline.datagen_parts: output_dir {twice} is shared by parts; give each its own")
    data = [p.output_dir for p in parts if p.labels not in NOT_TRAINING_DATA]
    if parts and not data:
        problems.append("pipeline.datagen_parts: every part writes prompts (labels=prompts); add one with examples")
    head = getattr(cfgs.get("train"), "head", None)
    labels = {p.labels for p in parts if p.labels not in NOT_TRAINING_DATA}
    if len(data) > 1 and "train" in cfgs and (head not in MIXED_DATA_LABELS or labels != {MIXED_DATA_LABELS[head]}):
        problems.append(
            "pipeline.datagen_parts: several parts feed one training set only for head=judge (labels=judge) and "
            f"head=eagle or draft (labels=drafter); here head={head}, labels={sorted(labels)}"
        )
    train_chain = [c for c in chained.get("train", []) if not (data and c.startswith("data_dir="))]
    train_chain += [f"data_dir={','.join(data)}"] if data else []
    stages = []
    for i, keys in enumerate(pipe.train_stages):
        mine = dict(_schema.flatten(dict(keys)))
        if "output_dir" not in mine and i < len(pipe.train_stages) - 1:
            mine["output_dir"] = f"{cfgs['train'].output_dir}-stage{i + 1}"
        if stages and "eagle.init_head" not in mine:
            mine["eagle.init_head"] = str(Path(stages[-1].output_dir) / "head.safetensors")
        try:
            own, names = _split("train", mine)
            stages.append(load("train", stage_args("train", train_chain + own, names)))
        except UserError as err:
            problems.append(f"[train stage {i + 1}] {err}")
    dirs = [c.output_dir for c in stages]
    if len(set(dirs)) < len(dirs):
        problems.append(f"pipeline.train_stages: two stages write {dirs}; give each its own output_dir")
    if problems:
        raise UserError("; ".join(problems))
    if parts:
        cfgs["datagen_parts"] = parts
    if stages:
        cfgs["train_stages"] = stages
        cfgs["train"] = stages[-1]
    elif parts and "train" in cfgs:
        cfgs["train"] = load("train", stage_args("train", train_chain))
    if "export" in cfgs and "train" in cfgs:
        cfgs["export"] = load("export", stage_args("export", [f"train_dir={cfgs['train'].output_dir}"]))


def runs(cfgs: dict, stage: str) -> list[tuple[str | None, Any]]:
    """``(label, config)`` of each run of ``stage``: its parts or training stages, else the stage itself."""
    many = cfgs.get({"datagen": "datagen_parts", "train": "train_stages"}.get(stage, ""))
    if not many:
        return [(None, cfgs[stage])]
    word = "part" if stage == "datagen" else "stage"
    return [(f"{word} {i + 1}", c) for i, c in enumerate(many)]


def _manifest(out: str) -> dict:
    path = Path(out) / "manifest.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def _disk_bytes(out: str) -> int:
    root = Path(out)
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file()) if root.is_dir() else 0


def earlier_seconds(metrics: Path) -> dict[str, float]:
    """Per run (``"datagen part 1"``, ``"train"``), the seconds that earlier invocations into this pipeline
    directory recorded in its ``metrics.jsonl`` (a run that was killed records nothing for that try)."""
    out: dict[str, float] = {}
    if not metrics.is_file():
        return out
    for line in metrics.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut short by a crash
        if isinstance(row, dict) and "stage" in row and "seconds" in row and "regime" not in row:
            name = f"{row['stage']} {row['run']}" if row.get("run") else row["stage"]
            out[name] = out.get(name, 0.0) + float(row["seconds"])
    return out


def cost(cfgs: dict, seconds: dict[str, float], earlier: dict[str, float] | None = None) -> list[dict]:
    """One row per run of the datagen and train stages: seconds (this invocation's), ``seconds_total`` (with
    every ``earlier`` invocation's: what a run resumed over several tries cost), tokens, disk, what it wrote."""
    earlier = earlier or {}
    rows = []
    for stage in ("datagen", "train"):
        if stage not in cfgs:
            continue
        for label, cfg in runs(cfgs, stage):
            name = f"{stage} {label}" if label else stage
            m = _manifest(cfg.output_dir)
            rows.append(
                {
                    "run": name,
                    "output_dir": cfg.output_dir,
                    "seconds": round(seconds.get(name, 0.0), 3),
                    "seconds_total": round(seconds.get(name, 0.0) + earlier.get(name, 0.0), 3),
                    "tokens": m.get("labelled_tokens") if stage == "datagen" else None,
                    "steps": m.get("step") if stage == "train" else None,
                    "disk_bytes": _disk_bytes(cfg.output_dir),
                    "labels": getattr(cfg, "labels", None),
                    "kept": m.get("kept"),
                }
            )
    return rows


def cost_lines(rows: list[dict]) -> list[str]:
    """The cost table as printed lines."""
    if not rows:
        return []
    out = ["", f"{'what it cost':<22} {'minutes':>8} {'tokens':>10} {'steps':>7} {'disk MB':>9}  output"]
    for r in rows:
        tokens = "-" if r["tokens"] is None else f"{r['tokens']:,}"
        steps = "-" if r.get("steps") is None else str(r["steps"])
        out.append(
            f"{r['run']:<22} {r['seconds_total'] / 60:>8.1f} {tokens:>10} {steps:>7} {r['disk_bytes'] / 2**20:>9.1f}  "
            f"{r['output_dir']}"
        )
    total = sum(r["seconds_total"] for r in rows) / 60
    out.append(f"{'total':<22} {total:>8.1f} {'':>10} {'':>7} {sum(r['disk_bytes'] for r in rows) / 2**20:>9.1f}")
    return out
