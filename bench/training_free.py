"""Training-free policies on the shared pair: FSD threshold sweeps, top-K verification and
draft-confidence stopping against SD, graded where the target is competent (the fact task in
``bench/at_scale.py``'s sweep; GSM8K-test otherwise).

    python bench/training_free.py                  # recipe fsd_quickstart, writes bench/results/training_free.json
    python bench/training_free.py eval.num_prompts=2 eval.max_new_tokens=16 eval.fsd.tv=[]   # a quick look
    python bench/training_free.py --sweep runs/eval_at_scale   # report an existing heads-eval run instead
    python bench/training_free.py --sweep runs/judge_margin-eval \
        --eagle-sweep runs/judge_margin-eval-eagle   # both drafters' runs of bench/judge.py, running nothing

Runs ``heads-eval`` with the recipe's ``eval`` section (any ``key=value`` or ``eval.key=value``
override): target-only, draft-only, SD at fixed K, top-K verification, FSD at every threshold of
every divergence and draft-confidence stopping at every tau decode every prompt, interleaved. Writes
``bench/results/training_free.json`` (the table with accuracy, tokens/s and accepted drafts per
target call for every row, the FSD sweep per divergence, the divergence settings, and a check of the
FSD paper's claim that small thresholds keep SD's accuracy at a higher speed: the fastest FSD row whose
accuracy is within 2 points of SD's and its speed ratio to SD, reported whether it holds or not)
and ``bench/results/training_free.png`` (quality against tokens/s and accepted drafts per call).
With ``--eagle-sweep`` the same report of the EAGLE head's run goes under ``eagle``. ``drafters`` gives, per
drafter, every lossy family's gated row with its tokens/s against the fastest lossless row, and the best gated
learned row against the best gated training-free one (``_common.lossy_block``, as ``bench/judge.py`` writes it).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

from _common import TRAINING_FREE, eval_and_gated, eval_config, intervals, lossy_block, run_info

from specheads.evaluate.cli import main as eval_main
from specheads.evaluate.rows import num

ROOT = Path(__file__).resolve().parents[1]
TOLERANCE = 0.02  # "within 2 points" of SD's accuracy
MIN_CORRECT = 5  # fewer correct SD answers than this: the accuracy comparison is noise
COLUMNS = ("config", "tokens_per_s", "accepted_per_call", "accuracy", "rouge_l_vs_target", "vs_sd_tokens_per_s")


def claim_source(sweep: dict) -> str:
    """The graded source the accuracy columns and the paper's claim read: the one where the target alone is
    competent (``competence``) with the most prompts, else GSM8K."""
    competent = {s: c["prompts"] for s, c in (sweep.get("competence") or {}).items() if c.get("informative")}
    return max(competent, key=competent.get) if competent else "gsm8k"


def _graded(accuracy: dict, config: str, source: str) -> dict:
    return accuracy.get(config, {}).get(source) or {}


def _table(sweep: dict) -> list[dict]:
    """Every configuration with the numbers the result reports (accuracy on :func:`claim_source`)."""
    source = claim_source(sweep)
    acc, tf = sweep.get("accuracy", {}), sweep["training_free"]
    sd = next((r for r in sweep["table"] if r["config"] == tf["sd_reference"]), None)
    out = []
    for r in sweep["table"]:
        g, extra = _graded(acc, r["config"], source), tf["rows"].get(r["config"], {})
        out.append(
            {
                "config": r["config"],
                "family": extra.get("family"),
                "tokens_per_s": r["tokens_per_s"],
                "accepted_per_call": r["accepted_per_call"],
                "tokens_per_call": r["tokens_per_call"],
                "accuracy_source": source,
                "accuracy": g.get("accuracy"),
                "correct": g.get("correct"),
                "graded": g.get("prompts"),
                "rouge_l_vs_target": 1.0 if r["config"] == "ar" else (r.get("rouge_vs_target") or {}).get("rougeL"),
                "fuzzy_only": extra.get("fuzzy_only"),
                "vs_sd_tokens_per_s": round(r["tokens_per_s"] / sd["tokens_per_s"], 4)
                if sd and sd["tokens_per_s"]
                else None,
                **intervals(sweep, r),
            }
        )
    return out


def paper_claim(table: list[dict], sd_config: str) -> dict:
    """The fastest FSD row whose accuracy (on the table's ``accuracy_source``) is within 2 points of SD's, and its
    speed ratio to SD.

    ``holds`` is True when that row is faster than SD, False when it is not or no row is within the
    tolerance, None when nothing was graded or SD answers fewer than ``MIN_CORRECT`` prompts
    correctly (then accuracy cannot tell the rows apart: ``holds_if_accuracy_counted`` keeps the
    verdict on the numbers, and ``fsd_faster_than_sd`` lists each faster FSD row with its ROUGE-L
    against the target's outputs, which greedy SD matches exactly).
    """
    by = {r["config"]: r for r in table}
    sd = by[sd_config]
    out = {
        "claim": "FSD keeps SD's accuracy at a higher speed for small thresholds (FSD paper, sections 5-6)",
        "sd_config": sd_config,
        "accuracy_source": sd["accuracy_source"],
        "sd_accuracy": sd["accuracy"],
        "sd_tokens_per_s": sd["tokens_per_s"],
        "tolerance": TOLERANCE,
        "graded_prompts": sd["graded"],
        "sd_correct": sd["correct"],
    }
    if sd["accuracy"] is None:
        return {**out, "holds": None, "why": f"no {sd['accuracy_source']} prompt was graded"}
    if sd["correct"] < MIN_CORRECT:
        out["caveat"] = (
            f"SD answers {sd['correct']} of {sd['graded']} prompts correctly: accuracy "
            "cannot separate the rows; see rouge_l_vs_target"
        )
    fsd = [r for r in table if r["config"].startswith("fsd-") and r["accuracy"] is not None]
    within = [r for r in fsd if abs(r["accuracy"] - sd["accuracy"]) <= TOLERANCE + 1e-9]
    out.update(
        fsd_within=[r["config"] for r in within],
        one_prompt_is_points=round(100 / sd["graded"], 2) if sd["graded"] else None,
    )
    if not within:
        return {**out, "holds": False, "fastest_fsd_within": None, "why": "no FSD row within the tolerance"}
    best = max(within, key=lambda r: r["tokens_per_s"])
    ratio = round(best["tokens_per_s"] / sd["tokens_per_s"], 4) if sd["tokens_per_s"] else None
    holds = ratio is not None and ratio > 1
    if sd["correct"] < MIN_CORRECT:
        out["holds_if_accuracy_counted"], holds = holds, None
    out["fsd_faster_than_sd"] = [
        {
            "config": r["config"],
            "speed_ratio_vs_sd": round(r["tokens_per_s"] / sd["tokens_per_s"], 4),
            "rouge_l_vs_target": r["rouge_l_vs_target"],
        }
        for r in sorted(fsd, key=lambda r: -r["tokens_per_s"])
        if sd["tokens_per_s"] and r["tokens_per_s"] > sd["tokens_per_s"]
    ]
    return {
        **out,
        "fastest_fsd_within": best["config"],
        "its_accuracy": best["accuracy"],
        "its_rouge_l_vs_target": best["rouge_l_vs_target"],
        "its_tokens_per_s": best["tokens_per_s"],
        "its_accepted_per_call": best["accepted_per_call"],
        "sd_accepted_per_call": sd["accepted_per_call"],
        "speed_ratio_vs_sd": ratio,
        "holds": holds,
    }


def report(sweep: dict) -> dict:
    """One heads-eval sweep's training-free rows: the table, the FSD sweep per divergence, top-K and confidence
    rows, the FSD paper's claim, and ``eval``/``competence``/``fidelity``/``gated`` for the lossy families."""
    tf = sweep["training_free"]
    table = _table(sweep)
    by = {r["config"]: r for r in table}
    fsd_sweep: dict[str, list[dict]] = {}
    for div, thresholds in tf["settings"]["fsd"]["thresholds"].items():
        fsd_sweep[div] = [
            {
                "threshold": t,
                **by[f"fsd-{div}-{num(t)}"],
                "fuzzy_only_share": tf["rows"][f"fsd-{div}-{num(t)}"].get("fuzzy_only_share"),
            }
            for t in sorted(thresholds)
        ]
    return {
        "prompts": sweep["prompts"],
        "num_prompts": sweep["num_prompts"],
        "max_new_tokens": sweep["max_new_tokens"],
        "sampling": sweep["sampling"],
        "t_target_ms": sweep["t_target_ms"],
        "t_draft_ms": sweep["t_draft_ms"],
        "settings": tf["settings"],
        "sd_config": tf["sd_reference"],
        "accepted_per_call": "accepted draft tokens per target call (tokens per call = that + 1 per round)",
        "table": table,
        "fsd_sweep": fsd_sweep,
        "topk": [by[f"t{k}"] for k in tf["settings"]["topk"]["values"]],
        "confidence": [by[f"c{num(t)}"] for t in tf["settings"]["confidence"]["taus"]],
        "paper_claim": paper_claim(table, tf["sd_reference"]) if tf["sd_reference"] else None,
        **eval_and_gated(sweep, families=TRAINING_FREE),
    }


def _gate_summary(sweep: dict) -> dict:
    """:func:`lossy_block` without what :func:`report` already holds (eval, competence, fidelity, each gated row's
    calibration half)."""
    block = lossy_block(sweep)
    gated = {fam: {k: v for k, v in e.items() if k != "calibration"} for fam, e in block.get("gated", {}).items()}
    return {
        "gated": gated,
        "best_lossless": block["best_lossless"],
        "learned_vs_training_free": block["learned_vs_training_free"],
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", default="fsd_quickstart")
    ap.add_argument("--out", default=str(ROOT / "bench/results/training_free.json"))
    ap.add_argument("--sweep", default=None, help="run nothing: report this heads-eval output directory")
    ap.add_argument(
        "--eagle-sweep",
        default=None,
        help="with --sweep: also report this heads-eval output directory (the same prompts drafted by an EAGLE "
        "head) as eagle and drafters.eagle",
    )
    args, overrides = ap.parse_known_args(argv)
    if args.eagle_sweep and not args.sweep:
        print("training_free.py: error: --eagle-sweep reports an existing run: give --sweep too", file=sys.stderr)
        return 2
    for d in filter(None, (args.sweep, args.eagle_sweep)):
        if not (Path(d) / "sweep.json").is_file():
            print(
                f"training_free.py: error: {Path(d) / 'sweep.json'} missing: run heads-eval there first",
                file=sys.stderr,
            )
            return 2
    if args.sweep:
        out_dir = Path(args.sweep)
    else:
        cfg, eval_args = eval_config("training_free.py", args.recipe, overrides)  # fail fast on a bad override
        if cfg is None:
            return 2
        code = eval_main(eval_args)
        if code:
            return code
        out_dir = Path(cfg.output_dir)
    sweep = json.loads((out_dir / "sweep.json").read_text())
    manifest = json.loads((out_dir / "manifest.json").read_text())
    eagle = json.loads((Path(args.eagle_sweep) / "sweep.json").read_text()) if args.eagle_sweep else None
    for name, s in (("", sweep), (" (--eagle-sweep)", eagle)):
        if s is not None and "training_free" not in s:
            print(
                f"training_free.py: error: the sweep{name} has no training-free rows; set fsd.js=[...], "
                "topk.ks=[...] or confidence.taus=[...]",
                file=sys.stderr,
            )
            return 2
    result = {
        **run_info(__file__, argv, f"fp32, batch {sweep.get('batch_size', 1)} decoding"),
        "recipe": str(out_dir / "config.yaml") if args.sweep else args.recipe,
        "wall_time_s": manifest["wall_time_s"],
        **report(sweep),
    }
    result["drafters"] = {"draft": _gate_summary(sweep)}
    if eagle is not None:
        result["eagle"] = {"sweep": str(args.eagle_sweep), **report(eagle)}
        result["drafters"]["eagle"] = _gate_summary(eagle)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    if sweep.get("quality_png"):
        shutil.copyfile(sweep["quality_png"], out.with_suffix(".png"))
    for name, rep in (("draft", result), ("eagle", result.get("eagle"))):
        if rep is None:
            continue
        print(f"{name}: " + " | ".join(COLUMNS))
        for r in rep["table"]:
            print(" | ".join("-" if r[c] is None else str(r[c]) for c in COLUMNS))
    print(json.dumps({"paper_claim": result["paper_claim"], "drafters": result["drafters"]}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
