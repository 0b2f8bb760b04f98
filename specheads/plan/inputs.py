"""What a plan (:mod:`specheads.plan`) reads besides shapes: prompt counts, the rate an earlier run recorded,
and the data ``heads-train`` will read (a finished ``heads-datagen`` output, or the recipe that writes it).
Nothing here loads a model."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from specheads.errors import UserError
from specheads.model_shapes import shape_of
from specheads.plan.memory import datagen_disk, datagen_rows

#: Help of the plan's settings, the same on both CLIs' schemas (``DatagenConfig``, ``TrainConfig``).
PLAN_HELP = {
    "plan": (
        "print the run's memory per process, disk and time on nodes x gpus GPUs of gpu_memory_gb, then stop "
        "(loads no model, downloads nothing); exit code 2 with one line when it cannot fit"
    ),
    "nodes": "plan: nodes of the cluster",
    "gpus": "plan: GPUs per node",
    "gpu_memory_gb": "plan: memory of one GPU in GB (10^9 bytes); the plan counts on 90% of it",
    "gpu_bandwidth_gbs": (
        "plan: memory bandwidth of one GPU in GB/s (H100 SXM 3350, H200 4800), for datagen's time bound when "
        "no rate is given or recorded"
    ),
    "tokens_per_s": (
        "plan: tokens per second of one process (null: for heads-datagen the rate an earlier run in "
        "output_dir recorded, else the memory-bandwidth bound; heads-train gives no time without it)"
    ),
    "prompt_tokens": "plan: prompt length in tokens (a forward's rows: batch x (prompt_tokens + max_new_tokens))",
    "disk_gb": (
        "plan (heads-train head=eagle): the disk the run's data may take in GB; a mode whose states do not fit "
        "is refused, naming those that do (null: not checked)"
    ),
}
#: The plan's settings a train plan hands to the datagen config it plans its data with.
SHARED_FIELDS = ("prompt_tokens", "gpus", "nodes", "gpu_memory_gb")


def count_prompts(cfg) -> tuple[int, str]:
    """Prompts (or imported judge tuples) a datagen run labels and how the count was had: counted from the
    files when they are readable here, else ``num_prompts`` per file."""
    from specheads.prompts import iter_prompt_files

    if cfg.labels == "prompts":  # the turns it writes: no file is read
        return cfg.num_prompts or 0, "num_prompts"
    tuples = cfg.labels == "judge" and cfg.judge.tuples
    spec = cfg.judge.tuples if tuples else cfg.prompts
    try:
        if tuples:
            with open(spec) as f:
                lines = sum(1 for line in f if line.strip())
            return max(0, min(lines - cfg.offset, cfg.num_prompts or lines)), "counted"
        return sum(1 for _ in iter_prompt_files(spec, limit=cfg.num_prompts, offset=cfg.offset)), "counted"
    except (OSError, UserError, ValueError):
        if cfg.num_prompts is None:
            raise UserError(
                f"plan: cannot count the prompts of {spec!r} (not readable here) and num_prompts is null; "
                "pass num_prompts=N"
            ) from None
        return cfg.num_prompts * len([p for p in str(spec).split(",") if p.strip()]), "num_prompts per file"


def recorded_rate(output_dir: str) -> float | None:
    """Prompts per second of one process in an earlier (or unfinished) run's ``metrics*.jsonl`` lines
    (``heads-datagen`` records each chunk's prompts and seconds), or None."""
    prompts = seconds = 0.0
    for path in sorted(Path(output_dir).glob("metrics*.jsonl")):
        for line in path.read_text().splitlines():
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if isinstance(row, dict) and row.get("seconds") and row.get("prompts"):
                prompts, seconds = prompts + row["prompts"], seconds + row["seconds"]
    return prompts / seconds if seconds else None


def _finished(path: Path, schema):
    """A finished datagen output's config and measured rows and state bytes, or None."""
    from omegaconf import OmegaConf

    if not ((path / "manifest.json").is_file() and (path / "config.yaml").is_file()):
        return None
    dcfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(schema), OmegaConf.load(path / "config.yaml")))
    shards = json.loads((path / "manifest.json").read_text()).get("shards", [])
    rows = {
        "prompts": sum(s.get("prompts") or 0 for s in shards),
        "labelled_tokens": sum(s.get("labelled_tokens") or 0 for s in shards),
    }
    return dcfg, rows, float(sum(f.stat().st_size for f in path.rglob("*.safetensors")))


def _writes(recipe: Path, data_dir: str, schema, load_config):
    """The resolved datagen config of ``recipe`` when its ``datagen.output_dir``, or one of its
    ``pipeline.datagen_parts``' (that part's settings over the section's), is ``data_dir``, else None (only a
    recipe that may match is resolved)."""
    raw = yaml.safe_load(recipe.read_text()) or {}
    parts = [{}] + [p for p in (raw.get("pipeline") or {}).get("datagen_parts") or [] if p.get("output_dir")]
    for part in parts:
        out = str(part.get("output_dir") or (raw.get("datagen") or {}).get("output_dir", ""))
        if "${" not in out and Path(out) != Path(data_dir):
            continue
        cfg = load_config(schema, "datagen", [f"recipe={recipe}", *_dotted(part)])
        if Path(cfg.output_dir) == Path(data_dir):
            return cfg
    return None


def _dotted(part: dict, prefix: str = "") -> list[str]:
    """A pipeline part's settings as ``key=value`` overrides (nested sections dotted, lists as JSON)."""
    out = []
    for k, v in part.items():
        if isinstance(v, dict):
            out += _dotted(v, f"{prefix}{k}.")
        else:
            out.append(f"{prefix}{k}={json.dumps(v) if isinstance(v, list) else ('null' if v is None else v)}")
    return out


def train_data(cfg) -> dict:
    """What a ``heads-train`` run reads from each of its ``data_dir`` folders, summed: measured from a finished
    ``heads-datagen`` output, else planned from the recipe whose ``datagen.output_dir`` it is.

    Returns ``prompts``, ``labelled_tokens``, ``states`` (bytes on disk), ``sequence_tokens`` (``prompt_tokens +
    max_new_tokens``), ``top_k`` (stored top-k per token), ``layers`` and ``target_shape`` of the data's target.
    """
    from specheads.config import list_recipes, load_config, schema_for

    schema, recipes = schema_for("datagen"), None
    total = {"prompts": 0, "labelled_tokens": 0, "states": 0.0, "sequence_tokens": 0, "top_k": 0, "layers": None}
    for d in [x.strip() for x in cfg.data_dir.split(",") if x.strip()]:
        found = _finished(Path(d), schema)
        if found:
            dcfg, rows, states = found
        else:
            if recipes is None:
                recipes = list_recipes("datagen").values()
            dcfg = next((r for r in (_writes(p, d, schema, load_config) for p in recipes) if r is not None), None)
            if dcfg is None:
                raise UserError(
                    f"plan: data_dir {d!r} holds no finished heads-datagen output and no recipe's datagen section "
                    "writes it; run (or plan) heads-datagen first, or pass data_dir= of a finished run"
                )
        for key in SHARED_FIELDS:
            setattr(dcfg, key, getattr(cfg, key))
        if not found:
            rows = datagen_rows(dcfg, count_prompts(dcfg)[0])
            states = datagen_disk(dcfg, rows)["states"]
        total["prompts"] += rows["prompts"]
        total["labelled_tokens"] += rows["labelled_tokens"]
        total["states"] += states
        total["sequence_tokens"] = max(total["sequence_tokens"], cfg.prompt_tokens + dcfg.max_new_tokens)
        total["top_k"] = dcfg.drafter.top_k if dcfg.labels == "drafter" else 0
        total["layers"] = list(dcfg.drafter.layers) or None
        total["stores_states"] = total.get("stores_states", True) and (
            dcfg.labels != "drafter" or dcfg.drafter.store_states
        )
        total["target_shape"] = shape_of(dcfg.target, "target")
    if not total["sequence_tokens"]:
        raise UserError("plan: data_dir is not set; pass data_dir=<heads-datagen output_dir>")
    return total
