"""What every benchmark result records about how it was produced."""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from pathlib import Path

import torch


def run_info(script: str, argv: list[str] | None, setting: str) -> dict:
    """``command`` (to rerun it), ``machine`` and ``cpu`` (where it ran) for a result file."""
    from specheads.machine import cpu_model

    args = argv if argv is not None else sys.argv[1:]
    here = Path(script).resolve()
    root = Path(__file__).resolve().parents[1]
    name = here.relative_to(root).as_posix() if here.is_relative_to(root) else f"bench/{here.name}"
    return {
        "command": f"python {name} " + " ".join(args),
        "machine": f"{platform.machine()} {os.cpu_count()} cpus, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads, {setting}",
        "cpu": cpu_model(),
    }


def write_result(path: str | Path, result: dict) -> None:
    """Writes a result file (its folder created) and says where on stderr."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {path}", file=sys.stderr)


def eval_config(prog: str, recipe: str, overrides: list[str]):
    """The resolved ``heads-eval`` config of ``recipe`` with ``overrides`` (``eval.`` prefix optional) and the
    argument list that gives it; a bad override prints one line and gives ``(None, None)``."""
    from specheads.config import UserError, load_config
    from specheads.evaluate.config import EvalConfig

    eval_args = [f"recipe={recipe}", *(o.removeprefix("eval.") for o in overrides)]
    try:
        return load_config(EvalConfig, "eval", eval_args), eval_args
    except UserError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return None, None


def run_pipeline(pipe_args: list[str]) -> tuple[int, dict]:
    """Runs ``heads-pipeline`` with ``pipe_args`` (a bad override fails before any work).

    Returns ``(exit code, outputs)``; on success ``outputs`` holds the resolved stage configs
    (``cfgs``) and the eval ``sweep``, train ``metrics`` and datagen ``manifest`` the run wrote.
    """
    from specheads.pipeline import load_configs
    from specheads.pipeline import main as pipeline_main

    _, cfgs = load_configs(pipe_args)
    code = pipeline_main(pipe_args)
    if code:
        return code, {}
    return 0, _outputs(cfgs, Path(cfgs["eval"].output_dir))


def read_pipeline(pipe_args: list[str], sweep_dir: str) -> tuple[int, dict]:
    """:func:`run_pipeline` without running anything: the recipe's datagen and train outputs as they are,
    and the sweep of another ``heads-eval`` run in ``sweep_dir`` that decoded with this recipe's head
    (``bench/at_scale.py``). A missing file is a one-line error (exit code 2)."""
    from specheads.pipeline import load_configs

    _, cfgs = load_configs(pipe_args)
    need = [
        Path(sweep_dir) / "sweep.json",
        Path(cfgs["train"].output_dir) / "metrics.json",
        Path(cfgs["datagen"].output_dir) / "manifest.json",
    ]
    missing = [str(p) for p in need if not p.is_file()]
    if missing:
        print(
            f"error: {', '.join(missing)} missing: run bench/at_scale.py (or the pipeline and heads-eval) first",
            file=sys.stderr,
        )
        return 2, {}
    return 0, _outputs(cfgs, Path(sweep_dir))


def _outputs(cfgs: dict, sweep_dir: Path) -> dict:
    def read(stage: str, name: str) -> dict:
        return json.loads((Path(cfgs[stage].output_dir) / name).read_text())

    return {
        "cfgs": cfgs,
        "sweep": json.loads((sweep_dir / "sweep.json").read_text()),
        "sweep_dir": sweep_dir,
        "metrics": read("train", "metrics.json"),
        "manifest": read("datagen", "manifest.json"),
    }


def intervals(sweep: dict, row: dict) -> dict:
    """A table row's 95% intervals: tokens/s and accepted tokens per target call, and per graded prompt source
    the accuracy, the paired drop against the target alone and the answer agreement with it."""
    acc = sweep.get("accuracy", {}).get(row["config"], {})
    return {
        "tokens_per_s_interval": row.get("tokens_per_s_interval"),
        "accepted_per_call_interval": row.get("accepted_per_call_interval"),
        "accuracy_by_source": {src: dict(fig) for src, fig in acc.items()},
    }


def interleave(configs: dict, items: list, warmup) -> tuple[dict[str, list], dict[str, list[list[int]]]]:
    """Runs every configuration on every item, rotating the order from one item to the next so that
    machine noise hits all alike, after one untimed warm-up call each on ``warmup``.

    ``configs`` maps a name to a callable returning ``(tokens, stats)`` or an object with ``.tokens``
    and ``.stats``. Returns ``(stats, outputs)``: per name, one entry per item.
    """
    names = list(configs)
    for name in names:  # warm-up, not timed
        configs[name](warmup)
    stats = {n: [] for n in names}
    outputs = {n: [] for n in names}
    for i, item in enumerate(items):
        for name in names[i % len(names) :] + names[: i % len(names)]:
            res = configs[name](item)
            toks, st = (res.tokens, res.stats) if hasattr(res, "tokens") else res
            stats[name].append(st)
            outputs[name].append(toks)
        print(f"prompt {i + 1}/{len(items)} done", file=sys.stderr, flush=True)
    return stats, outputs


def shared_pair(shared: Path, vocab: str, draft_top_n: int):
    """The shared pair on CPU (SmolLM2-135M-Instruct GGUF target, the 4-layer draft), the draft's output
    layer pruned to the ``draft_top_n`` most frequent tokens of the ``heads-vocab`` ranking ``vocab``
    (written by ``heads-vocab recipe=specdecpp_draft_quickstart`` when absent; 0: not pruned)."""
    from specheads.shim import load_pair
    from specheads.shim.runners.models import ModelSpec
    from specheads.shim.runners.vocab_pruning import prune, read_ranking, subset_from_ranking

    pair = load_pair(
        ModelSpec(
            path=str(shared / "models/smollm2-135m-instruct"), gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf", device="cpu"
        ),
        ModelSpec(path=str(shared / "models/smollm2-draft-4l"), device="cpu"),
    )
    if draft_top_n:
        if not Path(vocab).is_file():
            from specheads.datagen.vocab_ranking import main as vocab_main

            vocab_main(["recipe=specdecpp_draft_quickstart", f"output={vocab}"])
        full = pair.draft.model.get_output_embeddings().weight.shape[0]
        prune(
            pair.draft.model,
            subset_from_ranking(read_ranking(vocab), draft_top_n, pair.eos_token_ids, full),
            Path(vocab).name,
        )
    return pair


GATED_KEYS = (
    "threshold",
    "acc_drop",
    "acc_drop_upper",
    "tokens_per_s_vs_target",
    "tokens_per_s_vs_sd",
    "accepted_per_call_vs_sd",
    "acc_drop_low",
    "tokens_per_s_vs_target_interval",
    "sd_reference",
    "tokens_per_s_vs_sd_interval",
    "accepted_per_call_vs_sd_interval",
    "disagree_by_source",
    "disagree_upper",
    "gap_by_source",
    "gap_lower",
    "within_gate_on_test",
)


# what a result file's ``eval`` block repeats of the sweep's gate
GATE_KEYS = (
    "select",
    "max_drop",
    "max_disagree",
    "max_gap",
    "competent_sources",
    "note",
    "calibration_prompts",
    "test_prompts",
)


def eval_and_gated(sweep: dict, names: dict[str, str] | None = None, families: tuple[str, ...] = ()) -> dict:
    """The ``eval`` (graded prompts per source, the interval method, the gate), ``competence`` (per graded
    source, the target alone against chance), ``fidelity`` (per lossy row of ``families``, e.g. ``("judge",
    "fsd_kl")``, matched as prefixes; all lossy rows without) and ``gated`` (per lossy policy, the row ``select=``
    chose with its figures, or why none was) keys of a result file. ``gated`` is keyed by the policy's family
    (``judge``, ``sprinter``, ``topk_verify``, ``fsd_kl`` ...), renamed by ``names`` where given
    (``{"fsd_kl": "kl_judge"}``)."""
    from specheads.evaluate.intervals import DESCRIPTION
    from specheads.evaluate.select import family

    target = sweep.get("accuracy", {}).get("ar", {})
    out = {
        "eval": {
            "arc_prompts": target.get("arc", {}).get("prompts", 0),
            "gsm8k_prompts": target.get("gsm8k", {}).get("prompts", 0),
            "prompts_by_source": {src: v.get("prompts", 0) for src, v in target.items()},
            "interval": DESCRIPTION,
        }
    }
    if "competence" in sweep:
        out["competence"] = sweep["competence"]
    if "fidelity" in sweep:
        out["fidelity"] = {
            row: e
            for row, e in sweep["fidelity"].items()
            if family(row) and (not families or family(row).startswith(families))
        }
    if "gated" in sweep:
        g = sweep["gated"]
        out["eval"].update({k: g[k] for k in GATE_KEYS if k in g})
        out["gated"] = {
            (names or {}).get(family, family): {
                "family": family,
                "row": e["row"],
                **({k: e.get(k) for k in GATED_KEYS} if e["row"] else {"reason": e["reason"]}),
                "calibration": e.get("calibration"),
            }
            for family, e in g["rows"].items()
        }
    return out


LEARNED = ("judge",)  # gated families of learned heads; the rest are training-free
TRAINING_FREE = ("topk_verify", "relaxed", "fsd")


def lossy_block(sweep: dict) -> dict:
    """One drafter's lossy rows, gated: ``gated`` (per family, as :func:`eval_and_gated`, each chosen row with
    ``tokens_per_s_vs_best_lossless``: its tokens/s over the fastest lossless row of the sweep, SD at any K),
    ``competence``, ``fidelity``, ``best_lossless`` and ``learned_vs_training_free``: the gated learned row with
    the most accepted tokens per target call against the best gated training-free row, and which wins."""
    block = eval_and_gated(sweep)
    by = {r["config"]: r for r in sweep["table"]}
    lossless = [r for r in sweep["table"] if r["config"].startswith("k") and r["config"][1:].isdigit()]
    best = max(lossless, key=lambda r: r["tokens_per_s"]) if lossless else None
    block["best_lossless"] = {"row": best["config"], "tokens_per_s": best["tokens_per_s"]} if best else None
    picks: dict[str, list] = {"learned": [], "training_free": []}
    for fam, e in block.get("gated", {}).items():
        if not e["row"]:
            continue
        row = by[e["row"]]
        if best:
            e["tokens_per_s_vs_best_lossless"] = round(row["tokens_per_s"] / best["tokens_per_s"], 4)
        kind = "learned" if fam.startswith(LEARNED) else "training_free" if fam.startswith(TRAINING_FREE) else None
        if kind:
            picks[kind].append({"family": fam, "row": e["row"], "accepted_per_call": row["accepted_per_call"]})
    top = {k: max(v, key=lambda x: x["accepted_per_call"]) if v else None for k, v in picks.items()}
    learned, free = top["learned"], top["training_free"]
    winner = None
    if learned and free:
        winner = "learned" if learned["accepted_per_call"] > free["accepted_per_call"] else "training_free"
    block["learned_vs_training_free"] = {
        **top,
        "accepted_per_call_ratio": round(learned["accepted_per_call"] / free["accepted_per_call"], 4)
        if learned and free
        else None,
        "winner": winner or ("learned" if learned else "training_free" if free else None),
        "note": "by accepted tokens per target call, all prompts; a family with no row within the gate is left out",
    }
    return block


def run_datagen(recipe: str, extra: list[str], out: Path) -> tuple[float, dict]:
    """One ``heads-datagen`` run in this process; its wall seconds and manifest."""
    from specheads.datagen.cli import main

    t = time.perf_counter()
    code = main([f"recipe={recipe}", *extra, f"output_dir={out}"])
    if code:
        raise RuntimeError(f"heads-datagen recipe={recipe} {' '.join(extra)} exited {code}")
    return time.perf_counter() - t, json.loads((out / "manifest.json").read_text())


def rows(out: Path) -> list[dict]:
    """A datagen output's rows, chunk by chunk."""
    import pyarrow.parquet as pq

    return [r for p in sorted((out / "data").glob("chunk-*.parquet")) for r in pq.read_table(p).to_pylist()]
