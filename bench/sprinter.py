"""SPRINTER benchmark on the shared pair: labels, verifier, ROC, and decoding against SD in one run.

    python bench/sprinter.py                      # recipe sprinter_quickstart, writes bench/results/sprinter.json
    python bench/sprinter.py --specdecpp-head runs/specdecpp_smollm2-export/head.safetensors   # + SpecDec++ rows
    python bench/sprinter.py eval.num_prompts=2   # a quicker look (any pipeline override)
    python bench/sprinter.py --sweep runs/eval_at_scale   # report a heads-eval run that used this recipe's head
    python bench/sprinter.py --batches 16   # also at batch 16: fair.<batch> against SD's best K and the target
    python bench/sprinter.py --recipe sprinter_eagle --batches 1 --out bench/results/sprinter_eagle.json
        # on the EAGLE head (head=eagle_verifier), gated on the competent fact/extraction kinds, batch 16 and 1

Runs the recipe's pipeline: ``heads-datagen labels=sprinter`` (four equal prefix categories),
``heads-train head=verifier`` (the verifier at the recipe's lambda, plus one per ``verifier.roc_lambdas``
value for the ROC plot), ``heads-export``, and ``heads-eval`` on held-out GSM8K-test and MT-Bench
prompts, where target-only, draft-only, fixed-K SD (and SpecDec++ with ``--specdecpp-head``) and
SPRINTER at each ``eta`` decode every prompt, interleaved. Prints a table and writes
``bench/results/sprinter.json`` and ``bench/results/sprinter_roc.png``.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from _common import eval_and_gated, intervals, read_pipeline, run_info, run_pipeline

ROOT = Path(__file__).resolve().parents[1]
COLUMNS = (
    "config",
    "tokens",
    "tokens_per_s",
    "verification_rate",
    "tokens_per_call",
    "gflops_per_token",
    "verifier_calls_per_token",
)


def fair(sweep: dict) -> dict:
    """SPRINTER against SD at its best K and the target alone, in one sweep (one batch size): per SPRINTER row
    its tokens/s over the fastest SD row's and over the target alone's, its target calls per token against
    that SD row's, and whether it pays (faster than both)."""
    by = {r["config"]: r for r in sweep["table"]}
    sd = [r for n, r in by.items() if n.startswith("k") and n[1:].isdigit()]
    best = max(sd, key=lambda r: r["tokens_per_s"]) if sd else None
    ar = by.get("ar")
    rows = {}
    for name, r in by.items():
        if not (name.startswith("s") and name[1:2].isdigit()):
            continue
        rows[name] = {
            "tokens_per_s": r["tokens_per_s"],
            "vs_target_tokens_per_s": round(r["tokens_per_s"] / ar["tokens_per_s"], 4) if ar else None,
            "vs_best_sd_tokens_per_s": round(r["tokens_per_s"] / best["tokens_per_s"], 4) if best else None,
            "target_calls_per_token": r.get("verification_rate"),
            "best_sd_target_calls_per_token": best.get("verification_rate") if best else None,
        }
        rows[name]["pays"] = bool(
            rows[name]["vs_target_tokens_per_s"]
            and rows[name]["vs_target_tokens_per_s"] > 1
            and rows[name]["vs_best_sd_tokens_per_s"]
            and rows[name]["vs_best_sd_tokens_per_s"] > 1
        )
    return {
        "batch_size": sweep.get("batch_size", 1),
        "best_sd": best["config"] if best else None,
        "best_sd_vs_target_tokens_per_s": round(best["tokens_per_s"] / ar["tokens_per_s"], 4) if best and ar else None,
        "sprinter": rows,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", default="sprinter_quickstart")
    ap.add_argument("--specdecpp-head", default=None, help="an exported SpecDec++ head of the same pair: adds its rows")
    ap.add_argument("--thresholds", default="[0.5,0.8]", help="SpecDec++ thresholds with --specdecpp-head")
    ap.add_argument("--out", default=str(ROOT / "bench/results/sprinter.json"))
    ap.add_argument(
        "--sweep",
        default=None,
        help="run nothing: report this heads-eval output directory (its SPRINTER "
        "rows decoded with the recipe's exported verifier) and the "
        "recipe's datagen and train outputs",
    )
    ap.add_argument(
        "--batches",
        default="",
        help="more batch sizes (e.g. 16): the recipe's heads-eval again at each, for fair.<batch> (SPRINTER against "
        "SD at its best K and the target alone at the same batch)",
    )
    args, overrides = ap.parse_known_args(argv)
    extra = (
        [f"eval.head={args.specdecpp_head}", f"eval.thresholds={args.thresholds}", "eval.k_min=1"]
        if args.specdecpp_head
        else []
    )
    pipe_args = [f"recipe={args.recipe}", *extra, *overrides]
    code, ran = read_pipeline(pipe_args, args.sweep) if args.sweep else run_pipeline(pipe_args)
    if code:
        return code
    sweep, train, manifest = ran["sweep"], ran["metrics"], ran["manifest"]
    sp = sweep["sprinter"]
    main_row = next(r for r in sweep["table"] if r["config"] == sp["main"])
    png = Path(args.out).with_name(Path(args.out).stem + "_roc.png")
    png.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(train["roc_png"], png)
    table = [
        {c: r.get(c) for c in COLUMNS}
        | {
            "rouge_l_vs_target": (r.get("rouge_vs_target") or {}).get("rougeL"),
            "rouge_l_vs_reference": (r.get("rouge_vs_reference") or {}).get("rougeL"),
            **intervals(sweep, r),
        }
        for r in sweep["table"]
    ]
    result = {
        **run_info(__file__, argv, f"fp32, batch {sweep.get('batch_size', 1)} decoding"),
        "prompts": sweep["prompts"],
        "num_prompts": sweep["num_prompts"],
        "max_new_tokens": sweep["max_new_tokens"],
        "sampling": sweep["sampling"],
        **eval_and_gated(sweep, families=("sprinter",)),
        "datagen": {
            k: manifest.get(k)
            for k in ("prompts", "labelled_tokens", "category_shares", "prefixes_per_category", "label_mean_by_lambda")
        },
        "verifier": {
            k: train.get(k) for k in ("lam", "eta", "feature", "tpr_at_eta", "fpr_at_eta", "accuracy_at_eta", "alpha")
        }
        | {
            "auroc_by_lambda": {k: v["auroc"] for k, v in train["by_lambda"].items()},
            "held_out_tokens": train["by_lambda"][f"{train['lam']:g}"]["tokens"],
        },
        "auroc": train["auroc"],
        "alpha": sp["alpha"],
        "alpha_detail": sp["by_eta"][sp["main"]],
        "sprinter_by_eta": sp["by_eta"],
        "sprinter_config": sp["main"],
        "best_sd": sp.get("best_sd"),
        "table": table,
        "ratios": sp.get("ratios"),
        "rouge_l_vs_target": (main_row.get("rouge_vs_target") or {}).get("rougeL"),
        "rouge_vs_target": main_row.get("rouge_vs_target"),
        "roc_png": str(png.relative_to(ROOT)) if png.is_relative_to(ROOT) else str(png),
        "t_target_ms": sweep["t_target_ms"],
        "t_draft_ms": sweep["t_draft_ms"],
        "note": "verification_rate = target calls per generated token; tokens_per_call = mean tokens per target "
        "call; gflops_per_token = 2 x matmul parameters per processed token + 2 n_layer d_attn per attended "
        "position, + 2 x verifier parameters per verifier call; alpha = share of verifier decisions on "
        "tokens with q(x) > p(x) (lambda = 1 ground truth, teacher-forced on the decoded outputs) that "
        "approved them; auroc on the held-out 30% of the labelled prompts; best_sd = fastest SD row",
    }
    result["fair"] = {str(result.get("batch_size", sweep.get("batch_size", 1))): fair(sweep)}
    for b in [int(x) for x in filter(None, args.batches.split(","))]:
        from specheads.evaluate.cli import main as eval_main

        out = Path(ran["cfgs"]["eval"].output_dir + f"-b{b}")
        extra = [a[len("eval.") :] for a in pipe_args if a.startswith("eval.")]
        if eval_main([f"recipe={args.recipe}", *extra, f"batch_size={b}", f"output_dir={out}"]):
            return 1
        result["fair"][str(b)] = fair(json.loads((out / "sweep.json").read_text()))
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(" | ".join(COLUMNS + ("rouge_l_vs_target",)))
    for r in table:
        print(" | ".join("-" if r.get(c) is None else str(r.get(c)) for c in COLUMNS + ("rouge_l_vs_target",)))
    print(
        json.dumps(
            {
                "auroc": result["auroc"],
                "alpha": result["alpha"],
                "ratios": result["ratios"],
                "rouge_l_vs_target": result["rouge_l_vs_target"],
            }
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
