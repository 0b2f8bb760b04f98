"""What ``heads-pipeline`` prints and writes at the end: the stages' figures, the two gains the main job
shows and the table (:func:`summarize`, :func:`gains`, :func:`print_summary`)."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def summarize(cfgs: dict, times: dict) -> dict:
    """Facts from the stages' outputs: labels, head quality, the sweep's headline rows."""
    out: dict = {"stage_seconds": {k: round(v, 1) for k, v in times.items()}}
    dg = Path(cfgs["datagen"].output_dir) / "manifest.json"
    if dg.is_file():
        m = json.loads(dg.read_text())
        out["datagen"] = {
            k: m.get(k)
            for k in (
                "labels",
                "prompts",
                "labelled_tokens",
                "label_mean",
                "expected_label_mean",
                "category_shares",
                "label_mean_by_lambda",
            )
        }
    best = Path(cfgs["train"].output_dir) / "best_metrics.json"
    if best.is_file():
        b = json.loads(best.read_text())
        out["train"] = {
            k: b.get(k)
            for k in (
                "eval_binary_kl",
                "eval_auroc",
                "eval_auroc_confidence",
                "eval_weighted_loss",
                "epoch",
                "eval_tpr_at_eta",
                "eval_fpr_at_eta",
                "eval_wrong_accepted_share",
            )
        }
    sweep = Path(cfgs["eval"].output_dir) / "sweep.json"
    if sweep.is_file():
        s = json.loads(sweep.read_text())
        out["eval"] = {
            k: s.get(k)
            for k in (
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
        }
        ev = cfgs["eval"]
        out["eval"]["drafter"] = (
            f"EAGLE head {ev.eagle}"
            if getattr(ev, "eagle", None)
            else f"draft {Path(ev.draft.path).name}"
            if ev.draft.path
            else None
        )
    return out


def _row(table: list[dict], name: str | None) -> dict | None:
    return next((r for r in table if r["config"] == name), None)


def _x(a: float | None, b: float | None) -> str:
    return f"{a / b:.3f}x" if a and b else "-"


LOSSLESS_DRAFTING = (
    "k",
    "h",
    "c",
    "v-",
    "tree-",
)  # rows that draft, lossless: SD, SpecDec++, confidence, TLI/SLEM, trees


def gains(ev: dict) -> list[str]:
    """The two gains the main job shows, as lines: the drafter's (its fastest lossless row against the target
    alone) and the stop rules' (each stop-head and confidence row against the fastest fixed K)."""
    table, lines = ev["table"], []
    ar, k = _row(table, "ar"), _row(table, ev.get("best_fixed_k"))
    drafting = [r for r in table if r["config"].startswith(LOSSLESS_DRAFTING)]
    if ar and drafting:
        best = max(drafting, key=lambda r: r["tokens_per_s"])
        lines.append(
            f"drafter gain ({ev.get('drafter') or 'drafter'}): its fastest lossless row {best['config']} "
            f"{best['tokens_per_s']} tokens/s = {_x(best['tokens_per_s'], ar['tokens_per_s'])} the target "
            f"alone ({ar['tokens_per_s']} tokens/s)"
            + (f"; best fixed K {k['config']} {_x(k['tokens_per_s'], ar['tokens_per_s'])}" if k else "")
        )
    heads = [r for r in table if r["config"].startswith("h")]
    free = [r for r in table if r["config"].startswith("c")]
    if k and (heads or free):
        line = f"stop head gain over the best fixed K ({k['config']}, {k['tokens_per_s']} tokens/s): " + (
            ", ".join(
                f"{r['config']} {r['tokens_per_s']} tokens/s = {_x(r['tokens_per_s'], k['tokens_per_s'])}"
                for r in heads
            )
            or "no stop-head row"
        )
        if free:
            line += "; training-free " + ", ".join(
                f"{r['config']} {_x(r['tokens_per_s'], k['tokens_per_s'])}" for r in free
            )
        lines.append(line)
        lines += ceiling_lines(ev)
    return lines


PAYS = 1.05  # a ceiling below this over the best fixed K leaves no stop rule room to pay (noise is a few %)


def ceiling_lines(ev: dict) -> list[str]:
    """The honest ceilings in words: what a perfect stop rule (the row's own lag) would gain over the best fixed
    K in the cost model, each stop row's share of it, and whether any rule can pay here at all."""
    ceilings = ev.get("ceilings") or {}
    if not ceilings:
        bound = (ev.get("ratios") or {}).get("perfect_head_cost_gain_vs_best_fixed_k")
        return [f"ceiling: a perfect stop head {bound:.3f}x the best fixed K (cost model)"] if bound else []
    figures = {k: v["vs_best_fixed_k"] for k, v in ceilings.items() if v.get("vs_best_fixed_k")}
    if not figures:
        return []
    line = "ceiling (a perfect stop rule over the best fixed K, cost model): " + ", ".join(
        f"{x:.3f}x at lag {k.removeprefix('lag')}" for k, x in sorted(figures.items())
    )
    shares = [
        f"{r['config']} {r['share_of_ceiling']:.2f}" for r in ev["table"] if r.get("share_of_ceiling") is not None
    ]
    if shares:
        line += "; share of its ceiling: " + ", ".join(shares)
    out = [line]
    if max(figures.values()) < PAYS:
        out.append(
            f"no stop rule can pay here: even a perfect one gains at most {max(figures.values()):.3f}x over the best "
            "fixed K (short acceptance runs; stop rules pay with longer runs, sampling or compute-bound batches)"
        )
        return out
    low = [k for k, x in sorted(figures.items()) if x < PAYS]
    for key in low:  # a lag whose perfect rule cannot pay, while another's can
        lag = key.removeprefix("lag")
        rows = [r["config"] for r in ev["table"] if r.get("ceiling_vs_best_fixed_k") == figures[key]]
        out.append(
            f"no lag-{lag} stop rule can pay here ({', '.join(rows) or 'none run'}): even a perfect one is "
            f"{figures[key]:.3f}x the best fixed K; one that scores a candidate as it is drawn (lag 0) can reach "
            f"{max(figures.values()):.3f}x"
        )
    return out


def print_summary(summary: dict, file=None) -> None:
    file = file or sys.stdout
    p = lambda *a: print(*a, file=file)  # noqa: E731
    p("\n== heads-pipeline summary ==")
    p("stage seconds: " + ", ".join(f"{k} {v}" for k, v in summary["stage_seconds"].items()))
    if "datagen" in summary:
        d = summary["datagen"]
        p(
            f"datagen: {d['prompts']} prompts, {d['labelled_tokens']} labelled tokens, mean label {d['label_mean']}"
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
