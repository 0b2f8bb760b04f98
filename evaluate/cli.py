"""``heads-eval``: any set of decoding policies side by side on held-out prompts.

    heads-eval recipe=quickstart
    heads-eval recipe=quickstart head=runs/quickstart-export/head.safetensors thresholds=[0.3,0.5,0.7]
    heads-eval recipe=sprinter_quickstart
    heads-eval recipe=fsd_quickstart fsd_js=[0.05,0.1] confidence=[0.5]

One run decodes every prompt with: the target alone (``ar``), the draft alone (``draft``),
standard SD at each fixed ``K`` and SpecDec++ at each threshold ``h``, interleaved prompt by
prompt. It reports for each configuration tokens/s, tokens and accepted drafts per target call,
verification rate, discard rate and draft forwards per token; the per-forward times ``t_t``
and ``t_d`` measured by the two baselines (wall time per forward, loop overhead included); the
cost model ``T/N`` of ALGORITHMS.md section 0 at the profiled cost table
(:mod:`specheads.export.shim.costs`: ``t_d`` and ``t_t(k)`` per target pass size ``k``, cached per
machine; ``profile=``) over the pass sizes each row actually used (``predicted_ms_per_token``),
beside the measured ms/token (wall time / new tokens, prefill included) and their ratio; with
``cost_stop`` the cost-aware stop rules (rows ``h-cost``, ``c-cost``: no threshold, stop where the
expected tokens per ms of the cost table peak); and, for greedy decoding, the oracle stopping rule
(SpecDec++ Theorem 4.1) computed from the target's own output, and the same stopping rule as a
perfect SpecDec++ head would apply it (it can only judge a candidate after drafting it, never before
``k_min``): the most any head can gain on these prompts with these models, both priced with the
cost table. With ``verifier=`` it also decodes with SPRINTER at each
``eta`` and reports, for every configuration, FLOPs per token, verifier calls per token and ROUGE
against the target-only outputs and the references, and for SPRINTER the measured ``alpha`` and the
TV bound (``quality.py``) and its ratios to the best SD configuration. Training-free rows: top-K
verification (``topk=``, rows ``t<K>``), FSD per divergence (``fsd_js=`` ..., rows ``fsd-<div>-<T>``)
and draft-confidence stopping (``confidence=``, rows ``c<tau>``), summarised against SD in the
``training_free`` section (``training_free.py``). Ratios of the stop rules: ``cost_aware_vs_best_fixed_k``
(tokens/s of ``h-cost`` over the fastest fixed K; ``confidence_cost_vs_best_fixed_k`` for ``c-cost``) and
``share_of_perfect_head_gain`` (the fastest SpecDec++ row's measured gain over the fastest fixed K,
``tokens/s / best K's - 1``, divided by the perfect head's predicted gain, ``predicted tokens/s / best K's
predicted - 1``). Writes ``sweep.json`` (cost table, table, oracle, perfect head, best lossless row,
ratios, Pareto check, ``accuracy``, ``sprinter``, ``judge``, ``training_free``), ``pareto.png``,
``quality.png`` (quality against tokens/s and accepted drafts per call, every row),
``rows.jsonl`` (every prompt x configuration; a killed sweep resumes),
``metrics.jsonl`` (one line per configuration), ``metrics.json``, ``config.yaml`` and
``manifest.json``.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from transformers.utils import logging as hf_logging

from specheads.config import cli_main, to_yaml
from specheads.errors import UserError
from specheads.export.api import fit_context, format_prompt, pair_costs
from specheads.export.package import read_metadata
from specheads.export.shim.costs import PROFILES, CostTable
from specheads.export.shim.engine import GenerationStats
from specheads.export.shim.hetero import METHODS as HETERO
from specheads.export.shim.models import load_pair, same_vocabulary
from specheads.export.shim.divergence import DIVERGENCES
from specheads.export.shim.policies import SpecDecPP, fsd_problems
from specheads.outputs import MetricsWriter, atomic_write_json, prepare_output_dir, write_manifest
from specheads.prompts import load_prompt_files

from . import quality, training_free
from .config import EvalConfig
from .oracle import (below_curve, cost_per_token, draft_agreement, oracle_schedule, perfect_head_schedule,
                     predicted_ms_per_token)
from .plot import pareto_plot, quality_speed_plot
from .sweep import COST_ROWS, build_decoders, run_sweep, same_vocab_rows, total

log = logging.getLogger(__name__)
PROG = "heads-eval"
COLUMNS = ("config", "tokens", "wall_s", "tokens_per_s", "tokens_per_call", "accepted_per_call",
           "verification_rate", "discard_rate", "draft_forwards_per_token", "predicted_ms_per_token",
           "measured_ms_per_token", "predicted_over_measured")
LOSSLESS = ("k", "h", "c", "v-")  # row prefixes of the lossless rules (SD, SpecDec++, confidence stop, TLI / SLEM)


def _check(cfg: EvalConfig) -> None:
    problems = []
    if not cfg.prompts:
        problems.append("prompts is not set; pass prompts=<held-out prompt file>")
    fsd = {d: list(getattr(cfg, f"fsd_{d}")) for d in DIVERGENCES if getattr(cfg, f"fsd_{d}")}
    if not (cfg.ks or cfg.head or cfg.verifier or cfg.judge or cfg.topk or fsd or cfg.confidence or cfg.hetero):
        problems.append("nothing to sweep: set ks=[...], head=, verifier=, judge=, topk=[...], fsd_js=[...] "
                        "(or fsd_tv, fsd_kl, fsd_kl_rev), confidence=[...] and/or hetero=[tli,slem]")
    bad = [m for m in cfg.hetero if m not in HETERO]
    if bad or len(set(cfg.hetero)) != len(cfg.hetero):
        problems.append(f"hetero={list(cfg.hetero)}: each of {list(HETERO)} at most once")
    if cfg.hetero_k < 1:
        problems.append(f"hetero_k={cfg.hetero_k} must be >= 1")
    for d, ts in fsd.items():
        if not all(t >= 0 for t in ts):
            problems.append(f"fsd_{d}={ts}: every FSD threshold T must be >= 0")
    if fsd:  # the settings every FSD row shares (threshold 0 and js are valid placeholders)
        problems += fsd_problems(0.0, "js", cfg.fsd_top_k, cfg.fsd_rule, cfg.fsd_dist)
    if any(not 0 <= c <= 1 for c in cfg.confidence):
        problems.append(f"confidence={list(cfg.confidence)}: every tau must be in [0, 1]")
    if cfg.judge and not cfg.deltas:
        problems.append("judge is set but deltas is empty")
    if any(not 0 <= d <= 1 for d in cfg.deltas):
        problems.append(f"deltas={list(cfg.deltas)}: every delta must be in [0, 1]")
    if min(cfg.judge_k, cfg.topk_k, cfg.fsd_k, cfg.confidence_k_max, *cfg.topk) < 1:
        problems.append("judge_k, topk_k, fsd_k, confidence_k_max and every topk value must be >= 1")
    if cfg.verifier and not cfg.etas:
        problems.append("verifier is set but etas is empty")
    if any(not 0 <= e <= 1 for e in cfg.etas):
        problems.append(f"etas={list(cfg.etas)}: every eta must be in [0, 1]")
    if cfg.max_run is not None and cfg.max_run < 0:
        problems.append(f"max_run={cfg.max_run} must be >= 0 (or null for no cap)")
    if any(k < 1 for k in cfg.ks):
        problems.append(f"ks={list(cfg.ks)}: every K must be >= 1")
    if cfg.head and not cfg.thresholds and not cfg.cost_stop:
        problems.append("head is set but thresholds is empty (and cost_stop=false)")
    if cfg.profile not in PROFILES and not Path(cfg.profile).is_file():
        problems.append(f"profile={cfg.profile!r} is not auto, refresh or an existing cost-table JSON file")
    if any(not 0 < h < 1 for h in cfg.thresholds):
        problems.append(f"thresholds={list(cfg.thresholds)}: every h must be in (0, 1)")
    if not 1 <= cfg.k_min <= cfg.k_max:
        problems.append(f"need 1 <= k_min <= k_max, got k_min={cfg.k_min}, k_max={cfg.k_max}")
    if cfg.max_new_tokens < 1:
        problems.append(f"max_new_tokens={cfg.max_new_tokens} must be >= 1")
    if problems:
        raise UserError("; ".join(problems))


def _max_pass(cfg: EvalConfig) -> int:
    """The largest target pass the sweep's rows and the oracle use: most candidates per round + 1
    (SPRINTER's catch-up passes can be longer; the table extrapolates those)."""
    fsd = any(getattr(cfg, f"fsd_{d}") for d in DIVERGENCES)
    most = [1, *cfg.ks, cfg.k_max if cfg.head or cfg.oracle else 1, cfg.topk_k if cfg.topk else 1,
            cfg.fsd_k if fsd else 1, cfg.confidence_k_max if cfg.confidence else 1, cfg.judge_k if cfg.judge else 1,
            (cfg.max_run if cfg.max_run is not None else 20) + 1 if cfg.verifier else 1]
    return min(max(most), 63) + 1


def _r(x: float | None, digits: int = 4) -> float | None:
    return None if x is None or x != x else round(x, digits)


def _costs(tot: GenerationStats, table: CostTable | None, t_d: float, t_t: float) -> dict:
    """Predicted (cost table, the row's own pass sizes) and measured ms/token, their ratio, and
    ``model_cost_ms_per_token`` (the predicted one; the scalar model at the baselines' times without a table)."""
    predicted = predicted_ms_per_token(tot, table) if table is not None else None
    measured = 1000 * tot.wall_time / tot.new_tokens if tot.new_tokens and tot.wall_time else None
    model = predicted if table is not None else 1000 * cost_per_token(tot.draft_forwards, tot.target_calls,
                                                                       tot.new_tokens, t_d, t_t)
    return {"predicted_ms_per_token": _r(predicted), "measured_ms_per_token": _r(measured),
            "predicted_over_measured": _r(predicted / measured) if predicted is not None and measured else None,
            "model_cost_ms_per_token": _r(model)}


def _row(name: str, rows: list[dict], t_d: float, t_t: float, table: CostTable | None = None) -> dict:
    tot = total(rows)
    sd = name not in ("ar", "draft")
    return {
        "config": name, "tokens": tot.new_tokens, "wall_s": round(tot.wall_time, 3),
        "tokens_per_s": round(tot.tokens_per_s, 3),
        "tokens_per_call": round(tot.tokens_per_call, 4) if name != "draft" else None,
        "accepted_per_call": round(tot.accepted_per_call, 4) if sd else None,
        "verification_rate": round(tot.verification_rate, 4),
        "discard_rate": round(tot.discard_rate, 4),
        "draft_forwards_per_token": round(tot.draft_forwards / tot.new_tokens, 4) if tot.new_tokens else None,
        **_costs(tot, table, t_d, t_t),
    }


def _ideal(counts: GenerationStats, t_d: float, t_t: float, table: CostTable | None = None) -> dict:
    cost = _costs(counts, table, t_d, t_t)
    ms = cost["model_cost_ms_per_token"]
    return {"tokens": counts.new_tokens, "target_calls": counts.target_calls, "draft_forwards": counts.draft_forwards,
            "verification_rate": round(counts.verification_rate, 4), "discard_rate": round(counts.discard_rate, 4),
            "target_pass_sizes": dict(sorted(counts.target_pass_sizes.items())),
            "predicted_ms_per_token": cost["predicted_ms_per_token"], "model_cost_ms_per_token": ms,
            "predicted_tokens_per_s": round(1000 / ms, 3) if ms else None}


def _gain(x: float | None, base: float | None) -> float | None:
    """``x / base - 1``; None when either is missing or zero."""
    return x / base - 1 if x and base else None


def summarize(cfg: EvalConfig, grouped: dict[str, list[dict]], oracle: GenerationStats | None, head_meta: dict | None,
              perfect: GenerationStats | None = None, costs: CostTable | None = None) -> dict:
    """The sweep table, measured forward times, oracle, perfect-head bound, ratios and Pareto check;
    every cost-model figure at the cost table ``costs`` (without one, the scalar model at the baselines'
    per-forward times)."""
    ar, dr = total(grouped["ar"]), total(grouped["draft"])
    t_t = ar.wall_time / ar.target_calls if ar.target_calls else float("nan")
    t_d = dr.wall_time / dr.draft_forwards if dr.draft_forwards else float("nan")
    table = [_row(n, rows, t_d, t_t, costs) for n, rows in grouped.items()]
    by = {r["config"]: r for r in table}
    fixed = [r for r in table if r["config"].startswith("k")]
    adaptive = [r for r in table if r["config"].startswith("h") and r["config"] not in COST_ROWS.values()]
    cost_aware = by.get(COST_ROWS["specdecpp"])
    out = {"t_target_ms": round(1000 * t_t, 3), "t_draft_ms": round(1000 * t_d, 3),
           "t_draft_over_t_target": round(t_d / t_t, 4), "table": table}
    if costs is not None:
        out["cost_table"] = costs.to_dict()
    if oracle is not None:
        out["oracle"] = _ideal(oracle, t_d, t_t, costs)
    if perfect is not None:
        out["perfect_head"] = _ideal(perfect, t_d, t_t, costs)
    lossless = [r for r in table if r["config"] == "ar" or r["config"].startswith(LOSSLESS)]
    if lossless:
        best = max(lossless, key=lambda r: r["tokens_per_s"])
        ms = best["predicted_ms_per_token"]
        out["best_lossless"] = {"config": best["config"], "tokens_per_s": best["tokens_per_s"],
                                "predicted_tokens_per_s": round(1000 / ms, 3) if ms else None}
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
            flags[cost_aware["config"]] = below_curve(curve, cost_aware["verification_rate"],
                                                      cost_aware["discard_rate"])
        out["below_fixed_k_curve"] = flags
        c_k, c_h = best_k["model_cost_ms_per_token"], best_h["model_cost_ms_per_token"]
        if oracle is not None:
            c_o = out["oracle"]["model_cost_ms_per_token"]
            ratios["oracle_gain_fraction"] = (round((c_k - c_h) / (c_k - c_o), 4)
                                              if None not in (c_k, c_h, c_o) and c_k != c_o else None)
        if perfect is not None:  # the most any head could gain over the best fixed K, in the cost model
            c_p = out["perfect_head"]["model_cost_ms_per_token"]
            ratios["perfect_head_cost_gain_vs_best_fixed_k"] = round(c_k / c_p, 4) if c_k and c_p else None
            ratios["specdecpp_cost_gain_vs_best_fixed_k"] = round(c_k / c_h, 4) if c_k and c_h else None
    if fixed:
        for name, key in ((COST_ROWS["specdecpp"], "cost_aware_vs_best_fixed_k"),
                          (COST_ROWS["confidence_stop"], "confidence_cost_vs_best_fixed_k")):
            if name in by and best_k["tokens_per_s"]:
                ratios[key] = round(by[name]["tokens_per_s"] / best_k["tokens_per_s"], 4)
    rules = adaptive + ([cost_aware] if cost_aware else [])
    if rules:
        best_rule = max(rules, key=lambda r: r["tokens_per_s"])
        out["best_stop_rule"] = best_rule["config"]
        if fixed and perfect is not None:  # measured gain of the best stop rule / predicted gain of a perfect head
            k_ms, p_ms = best_k["predicted_ms_per_token"], out["perfect_head"]["predicted_ms_per_token"]
            bound = _gain(k_ms, p_ms)  # (1/p_ms) / (1/k_ms) - 1
            got = _gain(best_rule["tokens_per_s"], best_k["tokens_per_s"])
            ratios["share_of_perfect_head_gain"] = round(got / bound, 4) if bound and bound > 0 and got is not None \
                else None
    out["ratios"] = ratios
    if head_meta is not None:
        train = head_meta.get("extra", {}).get("train", {})
        out["head"] = {"path": cfg.head, "eval_binary_kl": train.get("eval_binary_kl"),
                       "eval_auroc": train.get("eval_auroc"), "label": head_meta.get("label", "soft"),
                       "default_threshold": head_meta.get("default_threshold")}
    return out


def _quality(cfg: EvalConfig, pair, prompts, grouped: dict[str, list[dict]], decoders, summary: dict) -> None:
    """Adds FLOPs, verifier calls and ROUGE to the table rows; SPRINTER's alpha, TV bound and ratios."""
    tok = pair.tokenizer
    texts = {n: [_text(pair, n, r["tokens"]) for r in rows] for n, rows in grouped.items()}
    refs = [p.reference_text for p in prompts]
    v_params = {n: sum(p.numel() for p in d.policy.head.parameters())
                for n, d in decoders.items() if n.startswith("s") and hasattr(d.policy, "head")}
    for row in summary["table"]:
        n = row["config"]
        tot = total(grouped[n])
        f = quality.flops_per_token(tot, pair.target.model, pair.draft.model, v_params.get(n, 0))
        row["gflops_per_token"] = round(f / 1e9, 5) if f is not None else None
        row["verifier_calls_per_token"] = round(tot.verifier_calls / tot.new_tokens, 4) if tot.new_tokens else None
        row["rouge_vs_target"] = quality.rouge(texts[n], texts["ar"]) if n != "ar" else None
        row["rouge_vs_reference"] = quality.rouge(texts[n], refs)
    sprinter = [r for r in summary["table"] if r["config"].startswith("s")]
    if not sprinter:
        return
    pad = tok.pad_token_id if tok.pad_token_id is not None else pair.eos_token_ids[0]
    ar = decoders["ar"]
    ids = [fit_context(format_prompt(tok, p, cfg.chat_template), cfg.max_new_tokens, ar.context)[0] for p in prompts]
    section: dict = {"verifier": cfg.verifier, "max_run": cfg.max_run, "by_eta": {}}
    for row in sprinter:
        rows = grouped[row["config"]]
        errs = quality.verifier_errors(pair.target.model, pair.draft.model, ids, [r["tokens"] for r in rows],
                                       [[tuple(d) for d in r.get("decisions", [])] for r in rows], cfg.sampling, pad)
        section["by_eta"][row["config"]] = {**errs, "tokens_per_s": row["tokens_per_s"],
                                            "target_calls_per_token": row["verification_rate"],
                                            "tokens_between_target_calls": row["tokens_per_call"],
                                            "gflops_per_token": row["gflops_per_token"],
                                            "rouge_vs_target": row["rouge_vs_target"],
                                            "rouge_vs_reference": row["rouge_vs_reference"]}
    sds = [r for r in summary["table"] if r["config"][0] in "kh"]
    main = sprinter[0]
    section["main"] = main["config"]
    section["alpha"] = section["by_eta"][main["config"]]["alpha"]
    if sds:
        sd = max(sds, key=lambda r: r["tokens_per_s"])
        section["best_sd"] = sd["config"]
        section["ratios"] = {
            "target_calls_sd_over_sprinter": round(sd["verification_rate"] / main["verification_rate"], 4)
            if main["verification_rate"] else None,
            "sprinter_vs_sd_tokens_per_s": round(main["tokens_per_s"] / sd["tokens_per_s"], 4),
            "flops_sd_over_sprinter": round(sd["gflops_per_token"] / main["gflops_per_token"], 4)
            if main["gflops_per_token"] else None}
    head = read_metadata(cfg.verifier)
    section["head"] = {"feature": head.get("feature", {}).get("position"), "lam": head.get("lam"),
                       "auroc": head.get("extra", {}).get("train", {}).get("eval_auroc"),
                       "default_eta": head.get("default_threshold")}
    summary["sprinter"] = section


def _text(pair, config: str, tokens: list[int]) -> str:
    """A row's output text: the draft-alone row is in the draft's vocabulary, every other in the target's."""
    tok = pair.draft.tokenizer if config == "draft" else pair.tokenizer
    return tok.decode(tokens, skip_special_tokens=True)


def _accuracy(cfg: EvalConfig, pair, prompts, grouped: dict[str, list[dict]], summary: dict) -> None:
    """Per configuration and prompt source with a grader (GSM8K final number, ARC letter): accuracy;
    for judge rows, the ratios to SD at the same K (else the fastest SD row)."""
    from specheads.datagen.judge import grade

    acc: dict = {}
    for name, rows in grouped.items():
        per: dict = {}
        for prompt, row in zip(prompts, rows):
            ok, _ = grade(prompt, _text(pair, name, row["tokens"]))
            if ok is None:
                continue
            d = per.setdefault(prompt.source, [0, 0])
            d[0] += int(ok)
            d[1] += 1
        acc[name] = {src: {"accuracy": round(c / n, 4), "correct": c, "prompts": n} for src, (c, n) in per.items()}
    summary["accuracy"] = acc
    judges = [r for r in summary["table"] if r["config"].startswith("j")]
    if not judges:
        return
    by = {r["config"]: r for r in summary["table"]}
    sd = by.get(f"k{cfg.judge_k}") or max((r for r in summary["table"] if r["config"].startswith("k")),
                                          key=lambda r: r["tokens_per_s"], default=None)
    section = {"head": cfg.judge, "k": cfg.judge_k, "sd_reference": sd["config"] if sd else None, "by_delta": {}}
    for r in judges:
        section["by_delta"][r["config"]] = {
            "accepted_per_call": r["accepted_per_call"], "tokens_per_s": r["tokens_per_s"],
            "accuracy": acc.get(r["config"], {}),
            "vs_sd_accepted_per_call": round(r["accepted_per_call"] / sd["accepted_per_call"], 4)
            if sd and sd["accepted_per_call"] else None,
            "vs_sd_tokens_per_s": round(r["tokens_per_s"] / sd["tokens_per_s"], 4) if sd else None}
    summary["judge"] = section


def _print(summary: dict) -> None:
    if "cost_table" in summary:
        print(CostTable.from_dict(summary["cost_table"]).describe())
    print(" | ".join(COLUMNS))
    for r in summary["table"]:
        print(" | ".join("-" if r.get(c) is None else str(r[c]) for c in COLUMNS))
    for name, key in (("oracle", "oracle"), ("perfect head", "perfect_head")):
        if key in summary:
            o = summary[key]
            print(f"{name}: {o['tokens']} tokens, verification rate {o['verification_rate']}, discard rate "
                  f"{o['discard_rate']}, predicted {o['model_cost_ms_per_token']} ms/token "
                  f"({o['predicted_tokens_per_s']} tokens/s)")
    if "best_lossless" in summary:
        b = summary["best_lossless"]
        print(f"best lossless row {b['config']}: {b['tokens_per_s']} tokens/s measured, "
              f"{b['predicted_tokens_per_s']} predicted")
    print(f"baselines: t_target {summary['t_target_ms']} ms, t_draft {summary['t_draft_ms']} ms per forward (wall); "
          f"ratios {summary['ratios']}"
          + (f"; pareto_dominates {summary['pareto_dominates']}" if "pareto_dominates" in summary else ""))
    if "gflops_per_token" in summary["table"][0]:
        print("config | gflops_per_token | verifier_calls_per_token | rougeL_vs_target | rougeL_vs_reference")
        for r in summary["table"]:
            rt, rr = r.get("rouge_vs_target"), r.get("rouge_vs_reference")
            print(f"{r['config']} | {r['gflops_per_token']} | {r['verifier_calls_per_token']} | "
                  f"{rt['rougeL'] if rt else '-'} | {rr['rougeL'] if rr else '-'}")
    if summary.get("accuracy"):
        for name, per in summary["accuracy"].items():
            if per:
                print(f"accuracy {name}: " + ", ".join(f"{src} {v['accuracy']} ({v['correct']}/{v['prompts']})"
                                                      for src, v in per.items()))
    if "sprinter" in summary:
        sp = summary["sprinter"]
        print(f"sprinter {sp['main']}: alpha {sp['alpha']}, vs {sp.get('best_sd')}: {sp.get('ratios')}")
    if "training_free" in summary:
        tf = summary["training_free"]
        print(f"training-free vs {tf['sd_reference']} (quality: {tf['quality_metric']}, SD {tf['sd_quality']}, "
              f"target {tf['target_quality']})")
        print("config | quality | tokens_per_s | accepted_per_call | vs_sd_tokens_per_s")
        for name, r in tf["rows"].items():
            print(" | ".join(str(x) for x in (name, r["quality"], r["tokens_per_s"], r["accepted_per_call"],
                                              r.get("vs_sd_tokens_per_s"))))


def run(cfg: EvalConfig) -> int:
    _check(cfg)
    hf_logging.disable_progress_bar()
    head_meta = read_metadata(cfg.head) if cfg.head else None
    prompts = load_prompt_files(cfg.prompts, limit=cfg.num_prompts, offset=cfg.offset)
    out = prepare_output_dir(cfg.output_dir, to_yaml(cfg), overwrite=cfg.overwrite)
    started = time.time()
    pair = load_pair(cfg.target, cfg.draft, same_vocab=not cfg.hetero)
    shared = same_vocabulary(pair.target.tokenizer, pair.draft.tokenizer)
    if not shared and same_vocab_rows(cfg):
        raise UserError(f"the draft's tokenizer differs from the target's: {', '.join(same_vocab_rows(cfg))} need "
                        "one vocabulary; on this pair sweep only hetero=[tli,slem] (and pass ks=[])")
    costs = pair_costs(pair, _max_pass(cfg), cfg.profile, cfg.fused_forward)
    log.info("%s", costs.describe())
    decoders = build_decoders(cfg, pair, costs)
    grouped = run_sweep(decoders, prompts, out / "rows.jsonl")
    oracle = perfect = None
    lag = next((d.policy.lag for d in decoders.values() if isinstance(d.policy, SpecDecPP)), None)
    if cfg.oracle and not shared:
        log.info("the oracle needs one vocabulary; skipped for this heterogeneous pair")
    elif cfg.oracle and not cfg.sampling.do_sample:
        oracle = GenerationStats(prompts=0)
        perfect = GenerationStats(prompts=0) if lag is not None else None
        ar = decoders["ar"]
        for prompt, row in zip(prompts, grouped["ar"]):
            ids, _ = fit_context(format_prompt(pair.tokenizer, prompt, cfg.chat_template), cfg.max_new_tokens,
                                 ar.context)
            agree = draft_agreement(pair.draft.model, ids, row["tokens"], cfg.fused_forward, ar.engine.vocab_size)
            oracle = GenerationStats.total([oracle, oracle_schedule(agree, cfg.k_max)])
            if perfect is not None:
                perfect = GenerationStats.total([perfect, perfect_head_schedule(agree, cfg.k_min, cfg.k_max, lag)])
    elif cfg.oracle:
        log.warning("the oracle is defined for greedy decoding only (sampling.do_sample=false); skipped")
    summary = summarize(cfg, grouped, oracle, head_meta, perfect, costs)
    if cfg.quality:
        _quality(cfg, pair, prompts, grouped, decoders, summary)
    if cfg.accuracy:
        _accuracy(cfg, pair, prompts, grouped, summary)
    tf = training_free.section(cfg, summary, grouped)
    if tf is not None:
        summary["training_free"] = tf
    label, points = training_free.plot_points(summary)
    if label is not None:
        summary["quality_png"] = str(quality_speed_plot(
            out / "quality.png", points, label, f"{pair.draft.name} -> {pair.target.name}, {len(prompts)} prompts"))
    if any(r["config"].startswith(("k", "h")) for r in summary["table"]):  # the fixed-K / SpecDec++ plane
        summary["pareto_png"] = str(pareto_plot(
            out / "pareto.png",
            [{"label": r["config"], **r} for r in summary["table"] if r["config"].startswith("k")],
            [{"label": r["config"], **r} for r in summary["table"] if r["config"].startswith("h")],
            summary.get("oracle"), f"{pair.draft.name} -> {pair.target.name}, {len(prompts)} prompts"))
    summary.update(prompts=cfg.prompts, num_prompts=len(prompts), sampling=cfg.sampling.to_dict(),
                   max_new_tokens=cfg.max_new_tokens)
    atomic_write_json(out / "sweep.json", summary)
    atomic_write_json(out / "metrics.json", {"ratios": summary["ratios"], **{k: summary[k] for k in (
        "t_target_ms", "t_draft_ms", "best_fixed_k", "best_threshold", "best_stop_rule", "best_lossless",
        "pareto_dominates") if k in summary},
        **({"oracle_predicted_tokens_per_s": summary["oracle"]["predicted_tokens_per_s"]}
           if "oracle" in summary else {}),
        **({"sprinter": {k: summary["sprinter"].get(k) for k in ("main", "alpha", "best_sd", "ratios")}}
           if "sprinter" in summary else {}),
        **({"training_free": {k: summary["training_free"][k] for k in ("settings", "sd_reference", "quality_metric")}}
           if "training_free" in summary else {})})
    (out / "metrics.jsonl").unlink(missing_ok=True)
    with MetricsWriter(out) as metrics:
        for r in summary["table"]:
            metrics.write(r)
    write_manifest(out, command=PROG, prompts_file=cfg.prompts, num_prompts=len(prompts),
                   target={"name": pair.target.name, "fingerprint": pair.target.fingerprint},
                   draft={"name": pair.draft.name, "fingerprint": pair.draft.fingerprint}, head=cfg.head,
                   sampling=cfg.sampling.to_dict(), seed=cfg.seed, wall_time_s=round(time.time() - started, 3))
    _print(summary)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``heads-eval``."""
    return cli_main(PROG, EvalConfig, "eval", argv, run)


if __name__ == "__main__":
    raise SystemExit(main())
