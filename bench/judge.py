"""Judge decoding benchmark on the shared pair: tuples, judge head, and the accuracy / speed table.

    python bench/judge.py                         # recipe judge_quickstart, writes bench/results/judge.json
    python bench/judge.py eval.num_prompts=4      # a quicker look (any pipeline override)
    python bench/judge.py --sweep runs/eval_at_scale   # report a heads-eval run that used this recipe's head


Runs the recipe's pipeline (``heads-datagen labels=judge`` on GSM8K-train answers of both models,
``heads-train head=judge``, ``heads-export``, ``heads-eval`` on held-out GSM8K-test, ARC-Challenge
and MT-Bench prompts with target-only, draft-only, SD, top-K verification and the judge over the
recipe's deltas, interleaved) and writes ``bench/results/judge.json``: tuple counts, AUROC, the
method table (accuracy per source, accepted tokens per target call, tokens/s), the ratios of the
judge to SD at the same K, and the GSM8K and ARC accuracies of target, draft, SD and the judge. The
judge row reported is the delta with the most accepted tokens per call whose GSM8K and ARC
accuracies both stay within 2 points of target-only (else the largest delta).
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path


from _common import eval_and_gated, intervals, read_pipeline, run_info, run_pipeline

ROOT = Path(__file__).resolve().parents[1]


def _acc(accuracy: dict, config: str, source: str):
    return (accuracy.get(config, {}).get(source) or {}).get("accuracy")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", default="judge_quickstart")
    ap.add_argument("--out", default=str(ROOT / "bench/results/judge.json"))
    ap.add_argument("--sweep", default=None, help="run nothing: report this heads-eval output directory (its judge "
                                                   "rows decoded with the recipe's exported head) and the recipe's "
                                                   "datagen and train outputs")
    args, overrides = ap.parse_known_args(argv)
    pipe_args = [f"recipe={args.recipe}", *overrides]
    code, ran = read_pipeline(pipe_args, args.sweep) if args.sweep else run_pipeline(pipe_args)
    if code:
        return code
    sweep, train, manifest = ran["sweep"], ran["metrics"], ran["manifest"]
    acc, judge = sweep["accuracy"], sweep["judge"]
    sd = judge["sd_reference"]

    def within(name: str) -> bool:
        return all(_acc(acc, name, s) is not None and _acc(acc, "ar", s) is not None
                   and abs(_acc(acc, name, s) - _acc(acc, "ar", s)) <= 0.02 for s in ("gsm8k", "arc"))

    rows = judge["by_delta"]
    ok = [n for n in rows if within(n)]
    pick = max(ok, key=lambda n: rows[n]["accepted_per_call"]) if ok else sorted(rows)[-1]
    table = [{"config": r["config"], "tokens_per_s": r["tokens_per_s"], "accepted_per_call": r["accepted_per_call"],
              "tokens_per_call": r["tokens_per_call"], "gsm8k_accuracy": _acc(acc, r["config"], "gsm8k"),
              "arc_accuracy": _acc(acc, r["config"], "arc"), **intervals(sweep, r)} for r in sweep["table"]]
    quality = {r["config"]: (r.get("rouge_vs_target") or {}).get("rougeL") for r in sweep["table"]}
    tradeoff = [{"config": n, "delta": float(n[1:]), "accepted_per_call": rows[n]["accepted_per_call"],
                 "tokens_per_s": rows[n]["tokens_per_s"], "gsm8k_accuracy": _acc(acc, n, "gsm8k"),
                 "arc_accuracy": _acc(acc, n, "arc"), "rougeL_vs_target": quality.get(n)}
                for n in sorted(rows, key=lambda n: rows[n]["accepted_per_call"])]
    png = Path(args.out).with_name(Path(args.out).stem + "_tradeoff.png")
    src = ran["sweep_dir"] / "quality.png"
    if src.is_file():
        shutil.copyfile(src, png)
    result = {
        **run_info(__file__, argv, f"fp32, batch {sweep.get('batch_size', 1)} decoding"),
        "prompts": sweep["prompts"], "num_prompts": sweep["num_prompts"], "max_new_tokens": sweep["max_new_tokens"],
        "tuple_counts": manifest["tuple_counts"], "positive_tokens": manifest["positive_tokens"],
        "negative_tokens": manifest["negative_tokens"], "auroc": train["auroc"], "judge_metrics": train,
        "table": table, "tradeoff": tradeoff,
        "tradeoff_png": str(png.relative_to(ROOT)) if png.is_relative_to(ROOT) and png.is_file() else None,
        "judge_config": pick, "judge_within_2_points": pick in ok, "sd_config": sd,
        "ratios": {"judge_vs_sd_accepted_per_call": rows[pick]["vs_sd_accepted_per_call"],
                   "judge_vs_sd_tokens_per_s": rows[pick]["vs_sd_tokens_per_s"]},
        "gsm8k_accuracy": {k: _acc(acc, c, "gsm8k") for k, c in (("target", "ar"), ("judge", pick), ("draft", "draft"),
                                                                   ("sd", sd))},
        "arc_accuracy": {k: _acc(acc, c, "arc") for k, c in (("target", "ar"), ("judge", pick), ("draft", "draft"),
                                                               ("sd", sd))},
        **eval_and_gated(sweep),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    cols = ("config", "tokens_per_s", "accepted_per_call", "gsm8k_accuracy", "arc_accuracy")
    print(" | ".join(cols))
    for r in table:
        print(" | ".join("-" if r[c] is None else str(r[c]) for c in cols))
    print(json.dumps({k: result[k] for k in ("auroc", "judge_config", "ratios", "gsm8k_accuracy", "arc_accuracy")}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
