"""Writing a sweep's report: sweep.json, metrics.jsonl and its plots."""

from __future__ import annotations

from pathlib import Path

from specheads.outputs import MetricsWriter, atomic_write_json

HEADLINE = (
    "t_target_ms",
    "t_draft_ms",
    "best_fixed_k",
    "best_threshold",
    "best_stop_rule",
    "best_lossless",
    "pareto_dominates",
)  # the summary keys metrics.json repeats


def write(out: Path, summary: dict) -> None:
    """``sweep.json`` (everything), ``metrics.json`` (the headline figures) and ``metrics.jsonl`` (the table)."""
    atomic_write_json(out / "sweep.json", summary)
    headline = {"ratios": summary["ratios"], **{k: summary[k] for k in HEADLINE if k in summary}}
    if "oracle" in summary:
        headline["oracle_predicted_tokens_per_s"] = summary["oracle"]["predicted_tokens_per_s"]
    if "sprinter" in summary:
        headline["sprinter"] = {k: summary["sprinter"].get(k) for k in ("main", "alpha", "best_sd", "ratios")}
    if "gated" in summary:
        headline["gated"] = {
            f: {
                k: e.get(k)
                for k in (
                    "row",
                    "threshold",
                    "acc_drop",
                    "acc_drop_upper",
                    "tokens_per_s_vs_target",
                    "tokens_per_s_vs_sd",
                    "accepted_per_call_vs_sd",
                )
            }
            for f, e in summary["gated"]["rows"].items()
        }
    if "training_free" in summary:
        headline["training_free"] = {
            k: summary["training_free"][k] for k in ("settings", "sd_reference", "quality_metric")
        }
    atomic_write_json(out / "metrics.json", headline)
    (out / "metrics.jsonl").unlink(missing_ok=True)
    with MetricsWriter(out) as metrics:
        for r in summary["table"]:
            metrics.write(r)
