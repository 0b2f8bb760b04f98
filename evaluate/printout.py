"""The summary of a ``heads-eval`` sweep (:func:`~.report.build`) as text on stdout."""

from __future__ import annotations

from specheads.evaluate.competence import describe as describe_competence
from specheads.evaluate.fidelity import describe as describe_fidelity
from specheads.evaluate.report import COLUMNS
from specheads.evaluate.select import describe as describe_gated
from specheads.gains import ceiling_lines
from specheads.shim import CostTable


def print_summary(summary: dict) -> None:
    """The cost table, the sweep table, the bounds, ratios and sections, as text on stdout."""
    if "cost_table" in summary:
        print(CostTable.from_dict(summary["cost_table"]).describe())
    print(" | ".join(COLUMNS))
    for r in summary["table"]:
        print(" | ".join("-" if r.get(c) is None else str(r[c]) for c in COLUMNS))
    for name, key in (("oracle", "oracle"), ("perfect head", "perfect_head")):
        if key in summary:
            o = summary[key]
            print(
                f"{name}: {o['tokens']} tokens, verification rate {o['verification_rate']}, discard rate "
                f"{o['discard_rate']}, predicted {o['model_cost_ms_per_token']} ms/token "
                f"({o['predicted_tokens_per_s']} tokens/s)"
            )
    if summary.get("ceilings"):  # the honest ceilings: each stop row beside the perfect rule of its own lag
        print("\n".join(ceiling_lines(summary)))
    if "best_lossless" in summary:
        b = summary["best_lossless"]
        print(
            f"best lossless row {b['config']}: {b['tokens_per_s']} tokens/s measured, "
            f"{b['predicted_tokens_per_s']} predicted"
        )
    if "deploy" in summary:
        d = summary["deploy"]
        vs = d.get("vs_best_fixed_k") or {}
        print(
            f"to deploy ({d['kind']}): {d['config']}, {d['tokens_per_s']} tokens/s {d['tokens_per_s_interval']}"
            + (f"; {vs['value']}x {vs['against']} [{vs['low']}, {vs['high']}]" if vs.get("value") else "")
            + (" (within noise of the fixed K)" if d["within_noise_of_fixed_k"] else "")
        )
    if "eagle" in summary:
        print(
            f"drafter: EAGLE head {summary['eagle']['path']} (tensors_sha256 "
            f"{str(summary['eagle']['tensors_sha256'])[:12]})"
        )
    t_d_from = "its draft step in the cost table" if "t_draft_source" in summary else "per forward (wall)"
    print(
        f"baselines: t_target {summary['t_target_ms']} ms per forward (wall), t_draft {summary['t_draft_ms']} ms "
        f"{t_d_from}; "
        f"ratios {summary['ratios']}"
        + (f"; pareto_dominates {summary['pareto_dominates']}" if "pareto_dominates" in summary else "")
    )
    if "gflops_per_token" in summary["table"][0]:
        print("config | gflops_per_token | verifier_calls_per_token | rougeL_vs_target | rougeL_vs_reference")
        for r in summary["table"]:
            rt, rr = r.get("rouge_vs_target"), r.get("rouge_vs_reference")
            print(
                f"{r['config']} | {r['gflops_per_token']} | {r['verifier_calls_per_token']} | "
                f"{rt['rougeL'] if rt else '-'} | {rr['rougeL'] if rr else '-'}"
            )
    if summary.get("accuracy"):
        for name, per in summary["accuracy"].items():
            if per:
                print(
                    f"accuracy {name}: "
                    + ", ".join(
                        f"{src} {v['accuracy']} [{v['accuracy_low']}, {v['accuracy_high']}] "
                        f"({v['correct']}/{v['prompts']})"
                        + (
                            f", drop vs target {v['acc_drop']} [{v['acc_drop_low']}, {v['acc_drop_high']}]"
                            + (" (not informative)" if v.get("acc_drop_informative") is False else "")
                            if "acc_drop" in v
                            else ""
                        )
                        for src, v in per.items()
                    )
                )
    if "competence" in summary:
        print("\n".join(describe_competence(summary["competence"])))
    if "fidelity" in summary:
        print("\n".join(describe_fidelity(summary["fidelity"])))
    if "gated" in summary:
        print("\n".join(describe_gated(summary["gated"])))
    for name, c in summary.get("calibration", {}).items():
        o = c["overall"]
        print(
            f"calibration {name}: ECE {o['ece']:.4f}, Brier {o['brier']:.4f}, AUROC {o['auroc']}, {o['n']} candidates; "
            "ECE by position " + ", ".join(f"{k}: {v['ece']:.3f}" for k, v in c["by_position"].items())
        )
    if "sprinter" in summary:
        sp = summary["sprinter"]
        print(f"sprinter {sp['main']}: alpha {sp['alpha']}, vs {sp.get('best_sd')}: {sp.get('ratios')}")
    if "training_free" in summary:
        tf = summary["training_free"]
        print(
            f"training-free vs {tf['sd_reference']} (quality: {tf['quality_metric']}, SD {tf['sd_quality']}, "
            f"target {tf['target_quality']})"
        )
        print("config | quality | tokens_per_s | accepted_per_call | vs_sd_tokens_per_s")
        for name, r in tf["rows"].items():
            print(
                " | ".join(
                    str(x)
                    for x in (
                        name,
                        r["quality"],
                        r["tokens_per_s"],
                        r["accepted_per_call"],
                        r.get("vs_sd_tokens_per_s"),
                    )
                )
            )
