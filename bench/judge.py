"""Judge decoding benchmark on the shared pair: labels, judge heads, and the accuracy / speed table.

    python bench/judge.py --recipe judge_mined_quickstart   # swap-mined judge against the arithmetic one,
                                                            # the KL judge, SD and the target: bench/results/judge.json
    python bench/judge.py                         # recipe judge_quickstart (arithmetic labels only)
    python bench/judge.py eval.num_prompts=8      # a quicker look (any pipeline override)
    python bench/judge.py --sweep runs/eval_at_scale   # report a heads-eval run that used this recipe's head
    python bench/judge.py --recipe judge_margin --eagle recipes/heads/eagle_smollm2.safetensors   # issue 42's run
    python bench/judge.py --recipe judge_margin --sweep runs/judge_margin-eval \
        --eagle-sweep runs/judge_margin-eval-eagle   # report both drafters' heads-eval runs, running nothing

Runs the recipe's pipeline (``heads-datagen labels=judge``: graded GSM8K-train answers with the false
arithmetic step localised, or with ``mining=swap`` the draft's mismatches that change the final answer;
``heads-train head=judge``, ``heads-export``, then ``heads-eval`` on held-out prompts with the target
alone, the draft alone, SD and each judge over its deltas, and the recipe's baselines, interleaved) and
writes the result file: label counts (``mining``: prompts, mismatches tried, important, unimportant,
budget hits, mismatches per minute), AUROC, the method table (accuracy per source with intervals,
accepted tokens per target call, tokens/s), ``gated`` (per policy, the fastest delta whose paired
accuracy drop against the target is at most one point at its upper bound, chosen on one half of the
prompts and reported on the other; ``judge_arith``, ``judge_mined``, ``kl_judge`` = FSD with KL), and
``comparison`` (the target, SD and each gated policy side by side, and whether the mined judge accepts
at least 1.5x SD's and the KL judge's tokens per target call; ``mined_gated``: the mined judge's gated
setting against SD on the test half, with the interval). With ``--sweep`` of ``bench/at_scale.py`` the file
also holds ``competence`` (the target against chance per source) and ``fidelity`` (each judge and KL row
against the target's outputs). ``drafters`` holds each drafter's lossy rows gated (the draft; with ``--eagle``
the EAGLE head too, the recipe's heads-eval run again with ``eagle=``): ``gated`` with each chosen row's
``tokens_per_s_vs_best_lossless``, ``competence``, ``fidelity`` and ``learned_vs_training_free`` (also at the
top level, per drafter). ``judge_config`` is the older rule: the delta with the most accepted tokens
per call whose accuracy on every graded source stays within 2 points of target-only (else the largest delta).
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from _common import eval_and_gated, intervals, lossy_block, read_pipeline, run_info, run_pipeline

from specheads.evaluate.select import family, threshold

ROOT = Path(__file__).resolve().parents[1]


def _acc(accuracy: dict, config: str, source: str):
    return (accuracy.get(config, {}).get(source) or {}).get("accuracy")


def comparison(gated: dict, table: list[dict], sd: str | None) -> dict:
    """The target alone, SD and each judge-like policy at its gated threshold: accuracy per source with
    intervals and accepted tokens per target call (all prompts), and whether the mined judge accepts at
    least 1.5x SD's and at least the KL judge's tokens per call."""
    by = {r["config"]: r for r in table}
    rows = {
        "target": "ar",
        "sd": sd,
        **{k: e["row"] for k, e in gated.items() if k in ("judge_mined", "judge_arith", "kl_judge") and e.get("row")},
    }
    out = {
        name: {
            "row": row,
            "accepted_per_call": by[row]["accepted_per_call"],
            "accepted_per_call_interval": by[row]["accepted_per_call_interval"],
            "tokens_per_s": by[row]["tokens_per_s"],
            "tokens_per_s_interval": by[row]["tokens_per_s_interval"],
            "accuracy": by[row]["accuracy_by_source"],
        }
        for name, row in rows.items()
        if row in by
    }
    mined, sd_row, kl = (out.get(k, {}).get("accepted_per_call") for k in ("judge_mined", "sd", "kl_judge"))
    g = gated.get("judge_mined") or {}
    out["mined_gated"] = {  # the gated setting of the mined judge, on the test half, against SD there
        "row": g.get("row"),
        "reason": g.get("reason"),
        "disagree_upper": g.get("disagree_upper"),
        "accepted_per_call_vs_sd": g.get("accepted_per_call_vs_sd"),
        "accepted_per_call_vs_sd_interval": g.get("accepted_per_call_vs_sd_interval"),
        "goal_1_5x_sd": None if g.get("accepted_per_call_vs_sd") is None else g["accepted_per_call_vs_sd"] >= 1.5,
    }
    out["checks"] = {
        "mined_vs_sd_accepted_per_call": round(mined / sd_row, 4) if mined and sd_row else None,
        "mined_at_least_1_5x_sd": mined >= 1.5 * sd_row if mined and sd_row else None,
        "mined_vs_kl_accepted_per_call": round(mined / kl, 4) if mined and kl else None,
        "mined_at_least_kl": mined >= kl if mined is not None and kl is not None else None,
        "note": "a policy without a gated row (none within the gate) is left out; see gated.<name>.reason",
    }
    return out


def eagle_sweep(cfgs: dict, eagle: str, overrides: list[str]) -> dict:
    """The recipe's heads-eval again, drafting with the EAGLE head ``eagle`` (output_dir + ``-eagle``)."""
    from specheads.evaluate.cli import main as eval_main

    recipe = [a for a in overrides if a.startswith("recipe=")]
    extra = [a[len("eval.") :] for a in overrides if a.startswith("eval.")]
    out = Path(cfgs["eval"].output_dir + "-eagle")
    code = eval_main([*recipe, *extra, f"eagle={eagle}", f"output_dir={out}"])
    if code:
        raise SystemExit(code)
    return json.loads((out / "sweep.json").read_text())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", default="judge_quickstart")
    ap.add_argument("--out", default=str(ROOT / "bench/results/judge.json"))
    ap.add_argument(
        "--eagle",
        default=None,
        help="an exported EAGLE head: the recipe's heads-eval runs again drafting with it, and the result holds "
        "both drafters' lossy rows (drafters.draft, drafters.eagle)",
    )
    ap.add_argument(
        "--sweep",
        default=None,
        help="run nothing: report this heads-eval output directory (its judge "
        "rows decoded with the recipe's exported head) and the recipe's "
        "datagen and train outputs",
    )
    ap.add_argument(
        "--eagle-sweep",
        default=None,
        help="with --sweep: report this heads-eval output directory (the recipe's eval run again with eagle=) as "
        "drafters.eagle instead of running it",
    )
    args, overrides = ap.parse_known_args(argv)
    pipe_args = [f"recipe={args.recipe}", *overrides]
    code, ran = read_pipeline(pipe_args, args.sweep) if args.sweep else run_pipeline(pipe_args)
    if code:
        return code
    sweep, train, manifest = ran["sweep"], ran["metrics"], ran["manifest"]
    mined = (manifest.get("mining") or {}).get("method") == "swap"
    acc, judge = sweep["accuracy"], sweep["judge"]
    sd = judge["sd_reference"]

    def within(name: str) -> bool:
        return all(
            _acc(acc, name, s) is not None
            and _acc(acc, "ar", s) is not None
            and abs(_acc(acc, name, s) - _acc(acc, "ar", s)) <= 0.02
            for s in acc.get("ar", {})
        )

    rows = judge["by_delta"]
    ok = [n for n in rows if within(n)]
    pick = max(ok, key=lambda n: rows[n]["accepted_per_call"]) if ok else sorted(rows)[-1]
    table = [
        {
            "config": r["config"],
            "tokens_per_s": r["tokens_per_s"],
            "accepted_per_call": r["accepted_per_call"],
            "tokens_per_call": r["tokens_per_call"],
            "facts_accuracy": _acc(acc, r["config"], "facts"),
            "gsm8k_accuracy": _acc(acc, r["config"], "gsm8k"),
            "arc_accuracy": _acc(acc, r["config"], "arc"),
            **intervals(sweep, r),
        }
        for r in sweep["table"]
    ]
    quality = {r["config"]: (r.get("rouge_vs_target") or {}).get("rougeL") for r in sweep["table"]}
    tradeoff = [
        {
            "config": n,
            "judge": family(n),
            "delta": threshold(n),
            "accepted_per_call": rows[n]["accepted_per_call"],
            "tokens_per_s": rows[n]["tokens_per_s"],
            "gsm8k_accuracy": _acc(acc, n, "gsm8k"),
            "arc_accuracy": _acc(acc, n, "arc"),
            "rougeL_vs_target": quality.get(n),
        }
        for n in sorted(rows, key=lambda n: rows[n]["accepted_per_call"])
    ]
    png = Path(args.out).with_name(Path(args.out).stem + "_tradeoff.png")
    src = ran["sweep_dir"] / "quality.png"
    if src.is_file():
        shutil.copyfile(src, png)
    result = {
        **run_info(__file__, argv, f"fp32, batch {sweep.get('batch_size', 1)} decoding"),
        "prompts": sweep["prompts"],
        "num_prompts": sweep["num_prompts"],
        "max_new_tokens": sweep["max_new_tokens"],
        "tuple_counts": manifest["tuple_counts"],
        "positive_tokens": manifest["positive_tokens"],
        "negative_tokens": manifest["negative_tokens"],
        "auroc": train["auroc"],
        "judge_metrics": train,
        "table": table,
        "tradeoff": tradeoff,
        "tradeoff_png": str(png.relative_to(ROOT)) if png.is_relative_to(ROOT) and png.is_file() else None,
        "judge_config": pick,
        "judge_within_2_points": pick in ok,
        "sd_config": sd,
        "ratios": {
            "judge_vs_sd_accepted_per_call": rows[pick]["vs_sd_accepted_per_call"],
            "judge_vs_sd_tokens_per_s": rows[pick]["vs_sd_tokens_per_s"],
        },
        "gsm8k_accuracy": {
            k: _acc(acc, c, "gsm8k") for k, c in (("target", "ar"), ("judge", pick), ("draft", "draft"), ("sd", sd))
        },
        "arc_accuracy": {
            k: _acc(acc, c, "arc") for k, c in (("target", "ar"), ("judge", pick), ("draft", "draft"), ("sd", sd))
        },
        "facts_accuracy": {
            k: _acc(acc, c, "facts") for k, c in (("target", "ar"), ("judge", pick), ("draft", "draft"), ("sd", sd))
        },
        **eval_and_gated(
            sweep,
            names={"fsd_kl": "kl_judge", "judge": "judge_mined" if mined else "judge_arith"},
            families=("judge", "fsd_kl"),
        ),
    }
    if mined:
        result["mining"] = {
            k: manifest["mining"].get(k)
            for k in (
                "prompts",
                "mismatches_tried",
                "important",
                "unimportant",
                "budget_hits",
                "mismatches_per_minute",
                "continuation_tokens",
                "checker",
                "max_mismatches",
                "max_tokens",
            )
        }
    if "gated" in result:
        result["comparison"] = comparison(result["gated"], table, sd)
    result["drafters"] = {"draft": lossy_block(sweep)}
    if args.eagle_sweep:
        result["drafters"]["eagle"] = lossy_block(json.loads((Path(args.eagle_sweep) / "sweep.json").read_text()))
    elif args.eagle:
        result["drafters"]["eagle"] = lossy_block(eagle_sweep(ran["cfgs"], args.eagle, pipe_args))
    result["learned_vs_training_free"] = {d: b["learned_vs_training_free"] for d, b in result["drafters"].items()}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    cols = ("config", "tokens_per_s", "accepted_per_call", "facts_accuracy", "gsm8k_accuracy", "arc_accuracy")
    print(" | ".join(cols))
    for r in table:
        print(" | ".join("-" if r[c] is None else str(r[c]) for c in cols))
    print(json.dumps({k: result[k] for k in ("auroc", "judge_config", "ratios", "gsm8k_accuracy", "arc_accuracy")}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
