"""The report of a ``heads-eval`` sweep: the table, ratios, sections and files built from the decoded rows.

:func:`build` turns the rows of every configuration into the summary written to ``sweep.json``:
one table row per configuration (tokens/s, tokens and accepted drafts per call, verification and
discard rates, draft forwards per token, predicted and measured ms/token), the baselines' per-forward
times, the oracle and perfect-head bounds, the ratios and the Pareto check (:func:`summarize`), FLOPs,
verifier calls and ROUGE per row with the ``sprinter`` section (:func:`add_quality`), accuracy per
prompt source with the ``judge`` section (:func:`~.accuracy.add_accuracy`), the ``training_free`` section and
the plots. :func:`write` writes ``sweep.json``, ``metrics.json`` and ``metrics.jsonl``;
:func:`~.printout.print_summary` prints it.
"""

from __future__ import annotations

import json
from pathlib import Path

from specheads.evaluate import training_free
from specheads.evaluate.accuracy import add_accuracy
from specheads.evaluate.head_calibration import add_calibration
from specheads.evaluate.intervals import speed_intervals
from specheads.evaluate.oracle import below_curve, cost_figures, ideal_figures
from specheads.evaluate.plot import pareto_plot, quality_speed_plot
from specheads.evaluate.quality_report import add_quality
from specheads.evaluate.sweep import COST_ROWS, total
from specheads.shim import CostTable, GenerationStats

COLUMNS = (
    "config",
    "tokens",
    "wall_s",
    "tokens_per_s",
    "tokens_per_call",
    "accepted_per_call",
    "verification_rate",
    "discard_rate",
    "draft_forwards_per_token",
    "predicted_ms_per_token",
    "measured_ms_per_token",
    "predicted_over_measured",
)


def _row(name: str, rows: list[dict], t_d: float, t_t: float, table: CostTable | None = None) -> dict:
    tot = total(rows)
    sd = name not in ("ar", "draft")
    return {
        "config": name,
        "tokens": tot.new_tokens,
        "wall_s": round(tot.wall_time, 3),
        "tokens_per_s": round(tot.tokens_per_s, 3),
        "tokens_per_call": round(tot.tokens_per_call, 4) if name != "draft" else None,
        "accepted_per_call": round(tot.accepted_per_call, 4) if sd else None,
        "verification_rate": round(tot.verification_rate, 4),
        "discard_rate": round(tot.discard_rate, 4),
        "draft_forwards_per_token": round(tot.draft_forwards / tot.new_tokens, 4) if tot.new_tokens else None,
        **cost_figures(tot, table, t_d, t_t),
    }


def _r(x: float, digits: int) -> float | None:
    """``x`` rounded; None for NaN (no such forward timed: no draft row)."""
    return None if x != x else round(x, digits)


def eagle_section(path: str, metadata: dict) -> dict:
    """What the summary and the manifest record of the EAGLE head the rows drafted with."""
    cfg = metadata.get("head_config", {})
    return {
        "path": path,
        "tensors_sha256": metadata.get("tensors_sha256"),
        "layers": cfg.get("layers"),
        "draft_vocab_size": cfg.get("draft_vocab_size"),
        "ttt_steps": metadata.get("ttt_steps"),
    }


def drafter_name(pair, eagle: dict | None = None) -> str:
    """The drafter in plot titles: the EAGLE head's file, else the draft model's name."""
    return f"EAGLE {eagle['path']}" if eagle else pair.draft.name if pair.draft is not None else "no drafter"


def _fastest(rows: list[dict], key: str) -> float | None:
    """The smallest ``key`` (a cost in ms per token) of ``rows``; None when no row has one."""
    return min((r[key] for r in rows if r[key]), default=None)


def _gain(x: float | None, base: float | None) -> float | None:
    """``x / base - 1``; None when either is missing or zero."""
    return x / base - 1 if x and base else None


def summarize(
    cfg,
    grouped: dict[str, list[dict]],
    oracle: GenerationStats | None,
    head_meta: dict | None,
    perfect: GenerationStats | None = None,
    costs: CostTable | None = None,
    ceilings: tuple[dict[int, GenerationStats], dict[str, int]] | None = None,
    lossless: dict[str, bool] | None = None,
) -> dict:
    """The sweep table, measured forward times, oracle, perfect-head bound, ratios and Pareto check;
    every cost-model figure at the cost table ``costs`` (without one, the scalar model at the baselines'
    per-forward times). ``ceilings``: the perfect head at each lag and each stop row's lag
    (:func:`add_ceilings`). ``lossless``: per row, whether its policy is (``Policy.lossless``; default: the
    target alone only), recorded in each table row and read for ``best_lossless``."""
    ar = total(grouped["ar"])
    t_t = ar.wall_time / ar.target_calls if ar.target_calls else float("nan")
    t_d, t_draft_source = float("nan"), None
    if getattr(cfg, "eagle", None):  # the rows draft with the EAGLE head: its profiled step, not a draft row's
        if costs is not None:
            t_d, t_draft_source = costs.t_draft_ms / 1000, "cost table: the EAGLE head's draft step"
    elif "draft" in grouped:
        dr = total(grouped["draft"])
        t_d = dr.wall_time / dr.draft_forwards if dr.draft_forwards else float("nan")
    table = [_row(n, rows, t_d, t_t, costs) for n, rows in grouped.items()]
    for r in table:
        r["lossless"] = bool((lossless or {}).get(r["config"], r["config"] == "ar"))
    by = {r["config"]: r for r in table}
    fixed = [r for r in table if r["config"].startswith("k")]
    adaptive = [r for r in table if r["config"].startswith("h") and r["config"] not in COST_ROWS.values()]
    cost_aware = by.get(COST_ROWS["specdecpp"])
    out = {
        "t_target_ms": _r(1000 * t_t, 3),
        "t_draft_ms": _r(1000 * t_d, 3),
        "t_draft_over_t_target": _r(t_d / t_t, 4),
        "table": table,
    }
    if t_draft_source:
        out["t_draft_source"] = t_draft_source
    if costs is not None:
        out["cost_table"] = costs.to_dict()
    if oracle is not None:
        out["oracle"] = ideal_figures(oracle, t_d, t_t, costs)
    if perfect is not None:
        out["perfect_head"] = ideal_figures(perfect, t_d, t_t, costs)
    exact = [r for r in table if r["lossless"]]
    if exact:
        best = max(exact, key=lambda r: r["tokens_per_s"])
        ms = best["predicted_ms_per_token"]
        out["best_lossless"] = {
            "config": best["config"],
            "tokens_per_s": best["tokens_per_s"],
            "predicted_tokens_per_s": round(1000 / ms, 3) if ms else None,
        }
    ratios: dict = {}
    if fixed:
        best_k = max(fixed, key=lambda r: r["tokens_per_s"])
        out["best_fixed_k"] = best_k["config"]
        ratios["best_fixed_k_vs_ar"] = round(best_k["tokens_per_s"] / by["ar"]["tokens_per_s"], 4)
    if adaptive:
        best_h = max(adaptive, key=lambda r: r["tokens_per_s"])
        out["best_threshold"] = best_h["config"]
        ratios["specdecpp_vs_ar"] = round(best_h["tokens_per_s"] / by["ar"]["tokens_per_s"], 4)
    if fixed and adaptive:
        ratios["specdecpp_vs_best_fixed_k"] = round(best_h["tokens_per_s"] / best_k["tokens_per_s"], 4)
        curve = [(r["verification_rate"], r["discard_rate"]) for r in fixed]
        flags = {r["config"]: below_curve(curve, r["verification_rate"], r["discard_rate"]) for r in adaptive}
        out["pareto_dominates"] = all(f is not False for f in flags.values()) and any(flags.values())  # fixed h
        if cost_aware:
            flags[cost_aware["config"]] = below_curve(
                curve, cost_aware["verification_rate"], cost_aware["discard_rate"]
            )
        out["below_fixed_k_curve"] = flags
        c_k, c_h = best_k["model_cost_ms_per_token"], best_h["model_cost_ms_per_token"]
        if oracle is not None:
            c_o = out["oracle"]["model_cost_ms_per_token"]
            ratios["oracle_gain_fraction"] = (
                round((c_k - c_h) / (c_k - c_o), 4) if None not in (c_k, c_h, c_o) and c_k != c_o else None
            )
        if perfect is not None:  # the most any head could gain over the best fixed K, both in the cost model
            c_p = out["perfect_head"]["model_cost_ms_per_token"]
            c_best = _fastest(fixed, "model_cost_ms_per_token")
            ratios["perfect_head_cost_gain_vs_best_fixed_k"] = round(c_best / c_p, 4) if c_best and c_p else None
            ratios["specdecpp_cost_gain_vs_best_fixed_k"] = round(c_k / c_h, 4) if c_k and c_h else None
    if fixed:
        for name, key in (
            (COST_ROWS["specdecpp"], "cost_aware_vs_best_fixed_k"),
            (COST_ROWS["confidence_stop"], "confidence_cost_vs_best_fixed_k"),
        ):
            if name in by and best_k["tokens_per_s"]:
                ratios[key] = round(by[name]["tokens_per_s"] / best_k["tokens_per_s"], 4)
    rules = adaptive + ([cost_aware] if cost_aware else [])
    if rules:
        best_rule = max(rules, key=lambda r: r["tokens_per_s"])
        out["best_stop_rule"] = best_rule["config"]
        if fixed and perfect is not None:  # the best stop rule's predicted gain / the perfect head's, both predicted
            k_ms = _fastest(fixed, "predicted_ms_per_token")
            p_ms, r_ms = out["perfect_head"]["predicted_ms_per_token"], best_rule["predicted_ms_per_token"]
            bound = _gain(k_ms, p_ms)  # (1/p_ms) / (1/k_ms) - 1
            got = _gain(k_ms, r_ms) if bound is not None else None
            ratios["share_of_perfect_head_gain"] = (
                round(got / bound, 4) if bound and bound > 0 and got is not None else None
            )
    out["ratios"] = ratios
    if ceilings is not None and fixed:
        add_ceilings(out, ceilings, fixed, t_d, t_t, costs)
    if head_meta is not None:
        train = head_meta.get("extra", {}).get("train", {})
        out["head"] = {
            "path": cfg.head,
            "eval_binary_kl": train.get("eval_binary_kl"),
            "eval_auroc": train.get("eval_auroc"),
            "label": head_meta.get("label", "soft"),
            "default_threshold": head_meta.get("default_threshold"),
        }
    return out


def add_ceilings(
    out: dict, ceilings: tuple[dict[int, GenerationStats], dict[str, int]], fixed: list[dict], t_d, t_t, costs
) -> None:
    """The honest ceiling of each stop row, in the cost model: the perfect head with the row's own lag (and
    ``k_max``), its predicted speed over the best fixed K's predicted speed (``ceilings``: ``lag<L>`` ->
    ``vs_best_fixed_k``), and on each stop row of the table ``ceiling_vs_best_fixed_k`` and
    ``share_of_ceiling`` (the row's predicted gain over the best fixed K, over the ceiling's gain; None where
    the ceiling is no gain: no stop rule can pay there)."""
    perfects, row_lags = ceilings
    k_ms = _fastest(fixed, "predicted_ms_per_token")
    if not k_ms:
        return
    out["ceilings"] = {}
    for lag, stats in sorted(perfects.items()):
        p_ms = ideal_figures(stats, t_d, t_t, costs)["predicted_ms_per_token"]
        out["ceilings"][f"lag{lag}"] = {"vs_best_fixed_k": round(k_ms / p_ms, 4) if p_ms else None}
    for r in out["table"]:
        lag = row_lags.get(r["config"])
        ceiling = out["ceilings"].get(f"lag{lag}", {}).get("vs_best_fixed_k") if lag is not None else None
        if ceiling is None:
            continue
        got = k_ms / r["predicted_ms_per_token"] - 1 if r["predicted_ms_per_token"] else None
        r["ceiling_vs_best_fixed_k"] = ceiling
        r["share_of_ceiling"] = round(got / (ceiling - 1), 4) if got is not None and ceiling > 1 else None


def row_kind(name: str) -> str:
    """The family of a sweep row by its name: ``learned`` (``h...``), ``training_free`` (``c...``) or ``fixed_k``."""
    return "learned" if name.startswith("h") else "training_free" if name.startswith("c") else "fixed_k"


def deploy(summary: dict, grouped: dict[str, list[dict]], specs: dict | None = None, regime: dict | None = None):
    """The rule to deploy in this regime: the fastest lossless row that speculates (a fixed K, a training-free stop
    rule or a learned head), with its tokens/s interval and its paired speed ratio (with interval) against the best
    fixed K and the best training-free stop row; ``kind`` says which family it is, and ``within_noise_of_fixed_k``
    whether the interval of its ratio to the best fixed K holds 1 (then the fixed K is as good a choice). With
    ``specs`` (each row's ``{policy, settings}``) the choice names its policy and settings, and ``regime`` (the
    sweep's engine, batch, sampling, budget, EAGLE head) where it was measured: what ``heads-export deploy=``
    packages. None when no lossless row speculates."""
    from specheads.evaluate.intervals import paired_ratio, units

    rows = [r for r in summary["table"] if r["lossless"] and r["config"] not in ("ar", "draft")]
    if not rows:
        return None
    best = max(rows, key=lambda r: r["tokens_per_s"])

    def ratio(a: str, b: str) -> dict:
        na, da = units(grouped[a], ("new_tokens", "wall_time"))
        nb, db = units(grouped[b], ("new_tokens", "wall_time"))
        if len(na) != len(nb):  # rows not paired prompt by prompt (a batched sweep's blocks): no ratio
            return {"value": None, "low": None, "high": None, "against": b}
        r = paired_ratio(na, da, nb, db)
        return {k: (None if r[k] is None else round(r[k], 4)) for k in ("value", "low", "high")} | {"against": b}

    out = {
        "config": best["config"],
        "kind": row_kind(best["config"]),
        "tokens_per_s": best["tokens_per_s"],
        "tokens_per_s_interval": best.get("tokens_per_s_interval"),
    }
    for family, key in (("fixed_k", "vs_best_fixed_k"), ("training_free", "vs_best_training_free")):
        others = [r for r in rows if row_kind(r["config"]) == family]
        if others and row_kind(best["config"]) != family:
            out[key] = ratio(best["config"], max(others, key=lambda r: r["tokens_per_s"])["config"])
    vs = out.get("vs_best_fixed_k")
    out["within_noise_of_fixed_k"] = bool(vs and vs.get("low") is not None and vs["low"] <= 1.0)
    if specs and best["config"] in specs:
        out |= json.loads(json.dumps(specs[best["config"]], default=str))  # policy, settings: plain JSON
    if regime is not None:
        out["regime"] = regime
    return out


def build(
    cfg,
    pair,
    prompts,
    grouped: dict[str, list[dict]],
    decoders,
    oracle: GenerationStats | None,
    perfect: GenerationStats | None,
    head_meta: dict | None,
    costs: CostTable | None,
    out: Path,
    eagle: dict | None = None,
    ceilings: tuple[dict[int, GenerationStats], dict[str, int]] | None = None,
) -> dict:
    """The whole summary of a sweep (``sweep.json``), with its plots drawn into ``out``; ``eagle``: the EAGLE
    head the rows drafted with (:func:`eagle_section`), recorded as ``eagle``."""
    lossless = {n: d.policy.lossless for n, d in (decoders or {}).items()}
    summary = summarize(cfg, grouped, oracle, head_meta, perfect, costs, ceilings, lossless)
    if eagle is not None:
        summary["eagle"] = eagle
    for r in summary["table"]:
        r.update(speed_intervals(grouped[r["config"]]))
    regime = {
        "engine": getattr(cfg, "engine", "specheads"),
        "batch_size": getattr(cfg, "batch_size", 1),
        "sampling": cfg.sampling.to_dict(),
        "max_new_tokens": cfg.max_new_tokens,
        "eagle": getattr(cfg, "eagle", None),
        "prompts": cfg.prompts,
    }
    choice = deploy(summary, grouped, getattr(decoders, "specs", None), regime)
    if choice is not None:
        summary["deploy"] = choice
    if getattr(cfg, "batch_size", 1) > 1:  # the cost table prices batch-1 forwards: no prediction for a batch
        for r in summary["table"]:
            r["predicted_ms_per_token"] = r["predicted_over_measured"] = None
            r.pop("ceiling_vs_best_fixed_k", None), r.pop("share_of_ceiling", None)
        summary.pop("ceilings", None)
        if "best_lossless" in summary:
            summary["best_lossless"]["predicted_tokens_per_s"] = None
        summary["cost_model"] = "batch 1 only: the predicted columns and the oracle's price are not this batch's"
    if cfg.quality:
        add_quality(cfg, pair, prompts, grouped, decoders, summary)
    if cfg.accuracy:
        add_accuracy(cfg, pair, prompts, grouped, summary, decoders)
    add_calibration(summary, grouped, out, f"{drafter_name(pair, eagle)} -> {pair.target.name}")
    tf = training_free.section(cfg, summary, grouped)
    if tf is not None:
        summary["training_free"] = tf
    title = f"{drafter_name(pair, eagle)} -> {pair.target.name}, {len(prompts)} prompts"
    label, points = training_free.plot_points(summary)
    if label is not None:
        summary["quality_png"] = str(quality_speed_plot(out / "quality.png", points, label, title))
    if any(r["config"].startswith(("k", "h")) for r in summary["table"]):  # the fixed-K / SpecDec++ plane
        summary["pareto_png"] = str(
            pareto_plot(
                out / "pareto.png",
                [{"label": r["config"], **r} for r in summary["table"] if r["config"].startswith("k")],
                [{"label": r["config"], **r} for r in summary["table"] if r["config"].startswith("h")],
                summary.get("oracle"),
                title,
            )
        )
    summary.update(
        prompts=cfg.prompts,
        num_prompts=len(prompts),
        sampling=cfg.sampling.to_dict(),
        max_new_tokens=cfg.max_new_tokens,
        batch_size=cfg.batch_size,
    )
    return summary
