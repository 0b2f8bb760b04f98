"""What ``heads-pipeline`` prints and writes at the end: the stages' figures, the two gains the main job
shows and the table (:func:`summarize`, :func:`gains`, :func:`print_summary`)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from specheads.gains import gains, where_lines
from specheads.pipeline.parts import cost_lines

# What the summary keeps of each stage's output: the datagen manifest, the best checkpoint's metrics, the sweep.
DATAGEN_KEYS = (
    "labels",
    "prompts",
    "labelled_tokens",
    "label_mean",
    "expected_label_mean",
    "category_shares",
    "label_mean_by_lambda",
)
TRAIN_KEYS = (
    "eval_binary_kl",
    "eval_auroc",
    "eval_auroc_confidence",
    "eval_weighted_loss",
    "epoch",
    "eval_tpr_at_eta",
    "eval_fpr_at_eta",
    "eval_wrong_accepted_share",
)
EVAL_KEYS = (
    "table",
    "oracle",
    "perfect_head",
    "ceilings",
    "ratios",
    "best_fixed_k",
    "best_threshold",
    "best_stop_rule",
    "best_lossless",
    "pareto_dominates",
    "pareto_png",
    "t_target_ms",
    "t_draft_ms",
    "cost_table",
    "sprinter",
    "judge",
    "accuracy",
    "eagle",
)


def _pick(d: dict, keys: tuple[str, ...]) -> dict:
    """``d``'s values at ``keys`` (None where absent)."""
    return {k: d.get(k) for k in keys}


def summarize(cfgs: dict, times: dict) -> dict:
    """Facts from the stages' outputs: labels, head quality, the sweep's headline rows."""
    out: dict = {"stage_seconds": {k: round(v, 1) for k, v in times.items()}}
    made = cfgs.get("datagen_parts") or ([cfgs["datagen"]] if "datagen" in cfgs else [])
    runs = [c for c in made if c.labels != "prompts"]
    found = [json.loads(f.read_text()) for c in runs if (f := Path(c.output_dir) / "manifest.json").is_file()]
    if len(found) > 1:  # datagen parts: their totals (the training set)
        out["datagen"] = {
            "labels": found[0].get("labels"),
            "parts": len(found),
            "prompts": sum(m.get("prompts") or 0 for m in found),
            "labelled_tokens": sum(m.get("labelled_tokens") or 0 for m in found),
            "label_mean": None,
        }
    elif found:
        m = found[0]
        out["datagen"] = _pick(m, DATAGEN_KEYS)
    best = Path(cfgs["train"].output_dir) / "best_metrics.json" if "train" in cfgs else None
    if best and best.is_file():
        b = json.loads(best.read_text())
        out["train"] = _pick(b, TRAIN_KEYS)
    sweep = Path(cfgs["eval"].output_dir) / "sweep.json" if "eval" in cfgs else None
    if sweep and sweep.is_file():
        s = json.loads(sweep.read_text())
        out["eval"] = _pick(s, EVAL_KEYS)
        ev = cfgs["eval"]
        out["eval"]["drafter"] = (
            f"EAGLE head {ev.eagle}"
            if getattr(ev, "eagle", None)
            else f"draft {Path(ev.draft.path).name}"
            if ev.draft.path
            else None
        )
    return out


def print_summary(summary: dict, file=None) -> None:
    """The summary as printed at the end of ``heads-pipeline``: the recipe's run, each further regime's, and
    where a stop head can pay."""
    file = file or sys.stdout
    p = lambda *a: print(*a, file=file)  # noqa: E731
    p("\n== heads-pipeline summary ==" + (f" ({summary['regime']})" if summary.get("regime") else ""))
    _print_run(summary, p)
    for name, sub in (summary.get("regimes") or {}).items():
        p(f"\n== regime {name} ==")
        _print_run(sub, p)
    if summary.get("regimes"):
        p("")
        for line in where_lines(summary.get("where_heads_pay")):
            p(line)


def _print_run(summary: dict, p) -> None:
    p("stage seconds: " + ", ".join(f"{k} {v}" for k, v in summary["stage_seconds"].items()))
    if len(summary.get("cost") or []) > 2:  # several datagen parts or training stages: what each cost
        for line in cost_lines(summary["cost"]):
            p(line)
    if "datagen" in summary:
        d = summary["datagen"]
        p(
            f"datagen: {d['prompts']} prompts, {d['labelled_tokens']} labelled tokens"
            + (f" in {d['parts']} parts" if d.get("parts") else f", mean label {d['label_mean']}")
            + (f" (labels={d['labels']})" if d.get("labels") else "")
        )
    if "train" in summary:
        t = summary["train"]
        if t.get("eval_wrong_accepted_share") is not None:
            p(
                f"judge: eval AUROC {t['eval_auroc']}, wrong tokens accepted at delta {t['eval_wrong_accepted_share']} "
                f"(epoch {t['epoch']})"
            )
        elif t.get("eval_binary_kl") is not None:
            p(
                f"head: eval binary KL {t['eval_binary_kl']}, AUROC {t['eval_auroc']} (epoch {t['epoch']})"
                + (
                    f"; AUROC of the drafter's own q(y): {t['eval_auroc_confidence']}"
                    if t.get("eval_auroc_confidence") is not None
                    else ""
                )
            )
        else:
            p(
                f"verifier: eval AUROC {t['eval_auroc']}, TPR {t['eval_tpr_at_eta']} / FPR {t['eval_fpr_at_eta']} "
                f"at eta (epoch {t['epoch']})"
            )
    ev = summary.get("eval")
    if ev:
        cols = (
            "config",
            "tokens_per_s",
            "tokens_per_call",
            "verification_rate",
            "discard_rate",
            "predicted_ms_per_token",
            "measured_ms_per_token",
        )
        p(" | ".join(cols))
        for r in ev["table"]:  # predicted: the cost table at the row's own target pass sizes
            p(" | ".join("-" if r.get(c) is None else str(r.get(c)) for c in cols))
        if ev.get("oracle"):
            o = ev["oracle"]
            p(
                f"oracle | {o.get('predicted_tokens_per_s', '-')} (predicted) | - | {o['verification_rate']} | 0.0 | "
                f"{o['model_cost_ms_per_token']} | -"
            )
        if ev.get("perfect_head"):
            o = ev["perfect_head"]
            p(
                f"perfect head | {o.get('predicted_tokens_per_s', '-')} (predicted) | - | {o['verification_rate']} | "
                f"{o['discard_rate']} | {o['model_cost_ms_per_token']} | -"
            )
        if ev.get("oracle") and ev.get("best_lossless"):
            b = ev["best_lossless"]
            p(
                f"oracle predicted {ev['oracle'].get('predicted_tokens_per_s')} tokens/s vs best lossless row "
                f"{b['config']}: {b['tokens_per_s']} tokens/s measured ({b['predicted_tokens_per_s']} predicted)"
            )
        p(
            f"best fixed K: {ev.get('best_fixed_k')}, best SpecDec++ threshold: {ev.get('best_threshold')}, "
            f"best stop rule: {ev.get('best_stop_rule')}, ratios: {ev.get('ratios')}, "
            f"pareto_dominates: {ev.get('pareto_dominates')}"
        )
        for line in gains(ev):
            p(line)
        p(f"Pareto plot: {ev.get('pareto_png')}")
        if ev.get("judge"):
            p(
                f"judge vs {ev['judge']['sd_reference']}: "
                + ", ".join(
                    f"{n}: accepted/call x{v['vs_sd_accepted_per_call']}, tokens/s x{v['vs_sd_tokens_per_s']}"
                    for n, v in ev["judge"]["by_delta"].items()
                )
            )
        sp = ev.get("sprinter")
        if sp:
            p(f"SPRINTER {sp['main']}: alpha {sp['alpha']}; vs best SD {sp.get('best_sd')}: {sp.get('ratios')}")
