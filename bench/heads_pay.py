"""Where a stop rule can pay: every fixed K, the training-free stop rules and the learned heads beside the
honest ceilings (the perfect rule of each lag) and the oracle, per drafter, regime and prompt set.

Each cell is one ``heads-eval`` run (its rows interleaved prompt by prompt, one process, one cost table) on
prompts no training read: GSM8K-test and MT-Bench first turns past the quickstart's, Alpaca rows past every
drafter recipe's. Rows: ``k1..k4``; the confidence stop at ``tau`` (``c<tau>``) and the cost rule with each
training-free acceptance estimate (``c-cost``: q(y); ``c-online-cost``: vLLM's online logistic on
logit(max q); ``c-entropy-cost``: AdaEDL's entropy bound); with ``--stop-head`` (EAGLE, lag 1) or
``--draft-head`` (draft model) the learned SpecDec++ head at its thresholds and ``h-cost``; with ``--lag0-head``
(EAGLE, ``eagle_position=previous``) the lag-0 head's ``h0-<h>`` and ``h0-cost``; with ``--calibrated-head``
(``eagle_stop.state=false depth=0``: q(y) calibrated on [log q, step], lag 0) its cost rule ``cq-cost``, counted
with the training-free rules (three numbers fitted on the head's data, no state). Regimes: ``greedy``, ``t1``
(temperature 1) and ``t0.7`` at batch 1, and ``greedy-b16`` / ``t1-b16``: 16 prompts decoded together, packed
(each row verifies only its own candidates), every stop rule priced at the batch; ``--n-batch`` prompts of
``--max-new-batch`` tokens per set so that the batch stays full. The cost table prices batch-1 rounds, so the
B = 16 cells have no ceiling or oracle.

    python bench/heads_pay.py --stop-head runs/quickstart-export/head.safetensors \
        --lag0-head runs/lag0-export/head.safetensors
    python bench/heads_pay.py --n 2 --max-new 32 --regimes greedy --sets gsm8k --out /tmp/p.json   # a quick look
    python bench/heads_pay.py --merge --drafters draft --draft-head greedy=A,t1=B   # add the draft's cells

Writes ``bench/results/heads_pay.json``: per cell the table (tokens/s, predicted ms/token, ceiling and share
of it per stop row), the ceilings, the oracle, and the ratios ``head_vs_best_training_free``,
``head_vs_best_fixed_k``, ``best_training_free_vs_best_fixed_k`` (measured tokens/s) and
``lossless_identical`` (greedy: every lossless row's tokens are the target alone's), the profiled
``target_t4_over_t1`` (a 4-token verification pass over a 1-token step, on this CPU: ``cpu``); a summary over
cells.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

from _common import run_info

from specheads.evaluate.cli import main as eval_main
from specheads.gains import fastest, speed_ratio

ROOT = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("SPECHEADS_SHARED", ROOT.parent / "shared"))
SETS = {  # prompts no training read: past the quickstart's eval slice and the drafter recipes' Alpaca rows
    "gsm8k": ("data/gsm8k/test.jsonl", 200),
    "mt_bench": ("data/mt_bench/question.jsonl", 40),
    "alpaca": ("data/alpaca/alpaca_5000.json", 4600),
}
GREEDY, T1 = ["sampling.do_sample=false"], ["sampling.do_sample=true", "sampling.temperature=1.0"]
BATCH = ["batch_size=16", "packed=true", "oracle=false"]  # the cost table prices batch-1 rounds: no ceiling at B = 16
REGIMES = {
    "greedy": GREEDY,
    "t1": T1,
    "t0.7": ["sampling.do_sample=true", "sampling.temperature=0.7"],
    "greedy-b16": GREEDY + BATCH,
    "t1-b16": T1 + BATCH,
}
DRAFTERS = {"eagle": "quickstart", "draft": "specdecpp_draft_quickstart"}
LOSSLESS = ("k", "h", "c")  # row prefixes of the lossless rules run here


def for_regime(value: str | None, regime: str) -> str | None:
    """A head flag's file for ``regime``: the flag itself, or from ``regime=path,...`` pairs (a B = 16 regime reads
    its batch-1 regime's head; a regime without a pair runs without that head)."""
    if not value or "=" not in value:
        return value
    pairs = dict(item.split("=", 1) for item in value.split(","))
    return pairs.get(regime.removesuffix("-b16"))


def cell_args(drafter: str, regime: str, name: str, args, out: Path) -> list[str]:
    path, offset = SETS[name]
    n, max_new = (args.n_batch, args.max_new_batch) if regime.endswith("-b16") else (args.n, args.max_new)
    head = for_regime(args.stop_head if drafter == "eagle" else args.draft_head, regime)
    lag0 = for_regime(args.lag0_head, regime) if drafter == "eagle" else None
    platt = for_regime(args.calibrated_head, regime) if drafter == "eagle" else None
    stop = {"head": lag0, "k_min": 1, "k_max": args.k_max}
    extra = []
    if lag0:
        if args.thresholds.strip("[] "):
            extra.append(
                f"{{policy: specdecpp, settings: {json.dumps(stop)}, sweep: {{h: {args.thresholds}}}, name: h0-}}"
            )
        extra.append(f"{{policy: specdecpp, settings: {json.dumps({**stop, 'stop': 'cost'})}, name: h0-cost}}")
    if platt:
        cq = {**stop, "head": platt, "stop": "cost"}
        extra.append(f"{{policy: specdecpp, settings: {json.dumps(cq)}, name: cq-cost}}")
    rows = f"rows=[{', '.join(extra)}]"
    return [
        f"recipe={DRAFTERS[drafter]}",
        f"prompts={SHARED / path}[{offset}:{offset + n}]",
        "offset=0",
        "num_prompts=null",
        f"max_new_tokens={max_new}",
        "ks=[1,2,3,4]",
        "k_min=1",
        f"k_max={args.k_max}",
        f"confidence.taus=[{args.tau}]",
        f"confidence.k_max={args.k_max}",
        "confidence.estimates=[q,online,entropy]",
        "cost_stop=true",
        "trees=[]",
        *([] if regime.endswith("-b16") else ["oracle=true"]),
        "quality=false",
        "fidelity=false",
        f"seed={args.seed}",
        f"output_dir={out}",
        "overwrite=true",
        *([f"head={head}", f"thresholds={args.thresholds}"] if head else ["head=null", "thresholds=[]"]),
        *([] if drafter == "eagle" else ["eagle=null", *draft_vocab(args)]),
        *([rows] if extra else []),
        *REGIMES[regime],
    ]


def draft_vocab(args) -> list[str]:
    """The draft's pruned output layer the draft's stop heads were trained with (heads-pipeline chains it)."""
    if not args.draft_vocab or not Path(args.draft_vocab).is_file():
        return []
    return [f"draft.vocab_file={args.draft_vocab}", f"draft.vocab_top_n={args.draft_vocab_top_n}"]


def summarise_cell(sweep: dict, rows: list[dict], greedy: bool) -> dict:
    table = sweep["table"]
    fixed = fastest(table, lambda c: c.startswith("k"))
    free = fastest(table, lambda c: c.startswith("c"))
    head = fastest(table, lambda c: c.startswith("h") and not c.startswith("h0-"))
    lag0 = fastest(table, lambda c: c.startswith("h0-"))
    ar = {r["index"]: r["tokens"] for r in rows if r["config"] == "ar"}
    lossless = [r for r in rows if r["config"].startswith(LOSSLESS)]
    keep = (
        "config",
        "tokens_per_s",
        "tokens_per_call",
        "predicted_ms_per_token",
        "predicted_over_measured",
        "ceiling_vs_best_fixed_k",
        "share_of_ceiling",
    )
    t_t = (sweep.get("cost_table") or {}).get("t_target_ms") or []
    return {
        "target_t4_over_t1": round(t_t[3] / t_t[0], 4) if len(t_t) > 3 and t_t[0] else None,
        "table": [{k: r.get(k) for k in keep} for r in table],
        "ceilings": sweep.get("ceilings"),
        "oracle_predicted_tokens_per_s": (sweep.get("oracle") or {}).get("predicted_tokens_per_s"),
        "best_fixed_k": fixed and fixed["config"],
        "best_training_free": free and free["config"],
        "best_head": head and head["config"],
        "best_lag0_head": lag0 and lag0["config"],
        "best_training_free_vs_best_fixed_k": speed_ratio(free, fixed),
        "head_vs_best_fixed_k": speed_ratio(head, fixed),
        "head_vs_best_training_free": speed_ratio(head, free),
        "lag0_head_vs_best_fixed_k": speed_ratio(lag0, fixed),
        "lag0_head_vs_best_training_free": speed_ratio(lag0, free),
        "share_of_perfect_head_gain": sweep.get("ratios", {}).get("share_of_perfect_head_gain"),
        "lossless_identical": all(r["tokens"] == ar[r["index"]] for r in lossless) if greedy else None,
    }


def summary(cells: dict) -> dict:
    out: dict = {}
    for key in (
        "head_vs_best_training_free",
        "head_vs_best_fixed_k",
        "lag0_head_vs_best_training_free",
        "lag0_head_vs_best_fixed_k",
        "best_training_free_vs_best_fixed_k",
    ):
        vals = [c[key] for c in cells.values() if c.get(key) is not None]
        out[key] = {"min": min(vals), "median": statistics.median(vals)} if vals else None
    by_ceiling = {
        name: max((c["ceilings"] or {}).get(f"lag{lag}", {}).get("vs_best_fixed_k") or 0 for lag in (0, 1))
        for name, c in cells.items()
    }
    out["largest_ceiling_cell"] = max(by_ceiling, key=by_ceiling.get) if by_ceiling else None
    out["largest_ceiling"] = max(by_ceiling.values()) if by_ceiling else None
    ratios = [c["target_t4_over_t1"] for c in cells.values() if c.get("target_t4_over_t1")]
    out["target_t4_over_t1"] = ratios[0] if ratios else None  # one cost table per drafter: every cell reads it
    greedy = [c["lossless_identical"] for c in cells.values() if c["lossless_identical"] is not None]
    out["lossless_identical"] = all(greedy) if greedy else None
    return out


def headline(summ: dict) -> dict:
    """The summary's figures flat (``docs/benchmarks.md`` shows a result's ``ratios``)."""
    out = {}
    for key, value in summ.items():
        if isinstance(value, dict):
            out |= {f"{key}_{k}": round(v, 4) for k, v in value.items()}
        elif value is not None:
            out[key] = value
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--stop-head",
        default=None,
        help="the learned SpecDec++ head on the EAGLE drafter: a file, or regime=file,... (one per regime)",
    )
    ap.add_argument("--lag0-head", default=None, help="a lag-0 SpecDec++ head on the EAGLE drafter")
    ap.add_argument("--calibrated-head", default=None, help="q calibrated on [log q, step] (eagle_stop.state=false)")
    ap.add_argument("--draft-head", default=None, help="the learned SpecDec++ head on the draft model")
    ap.add_argument(
        "--draft-vocab",
        default="runs/specdecpp_draft_quickstart-vocab/vocab.json",
        help="the heads-vocab ranking the draft's head was trained with ('' : the full vocabulary)",
    )
    ap.add_argument("--draft-vocab-top-n", type=int, default=8192)
    ap.add_argument("--drafters", default="eagle", help="comma-separated of: " + ", ".join(DRAFTERS))
    ap.add_argument("--regimes", default="greedy,t1", help="comma-separated of: " + ", ".join(REGIMES))
    ap.add_argument("--sets", default=",".join(SETS), help="comma-separated of: " + ", ".join(SETS))
    ap.add_argument("--n", type=int, default=6, help="prompts per set")
    ap.add_argument("--max-new", type=int, default=96)
    ap.add_argument("--n-batch", type=int, default=32, help="prompts per set in the B = 16 regimes")
    ap.add_argument("--max-new-batch", type=int, default=48, help="new tokens per prompt in the B = 16 regimes")
    ap.add_argument("--k-max", type=int, default=8)
    ap.add_argument("--tau", type=float, default=0.5)
    ap.add_argument("--thresholds", default="[0.5,0.7]")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--work", default="runs/heads_pay")
    ap.add_argument("--out", default=str(ROOT / "bench/results/heads_pay.json"))
    ap.add_argument("--resummarise", action="store_true", help="recompute --out's summary from its cells; no decoding")
    ap.add_argument(
        "--merge",
        action="store_true",
        help="keep --out's other cells (each cell is its own side-by-side run) and add or replace the ones run now",
    )
    args = ap.parse_args(argv)
    if args.resummarise:
        result = json.loads(Path(args.out).read_text())
        result["summary"] = summary(result["cells"])
        result["ratios"] = headline(result["summary"])
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
        print(json.dumps(result["ratios"], indent=1))
        return 0
    picks = {k: [x for x in getattr(args, k).split(",") if x] for k in ("drafters", "regimes", "sets")}
    for key, allowed in (("drafters", DRAFTERS), ("regimes", REGIMES), ("sets", SETS)):
        bad = [x for x in picks[key] if x not in allowed]
        if bad:
            print(f"heads_pay.py: error: --{key} {bad}: choose from {', '.join(allowed)}", file=sys.stderr)
            return 2
    kept = json.loads(Path(args.out).read_text()) if args.merge and Path(args.out).exists() else {}
    cells = dict(kept.get("cells", {}))
    for drafter in picks["drafters"]:
        for regime in picks["regimes"]:
            for name in picks["sets"]:
                cell = f"{drafter}/{regime}/{name}"
                out = Path(args.work) / cell.replace("/", "-")
                print(f"== {cell}", flush=True)
                code = eval_main(cell_args(drafter, regime, name, args, out))
                if code:
                    print(f"heads_pay.py: error: heads-eval failed on {cell} (exit {code})", file=sys.stderr)
                    return code
                sweep = json.loads((out / "sweep.json").read_text())
                rows = [json.loads(x) for x in (out / "rows.jsonl").read_text().splitlines()]
                cells[cell] = summarise_cell(sweep, rows, regime.startswith("greedy"))
    result = {
        **run_info(
            __file__,
            argv,
            (
                f"fp32, {args.n} prompts per set x {args.max_new} new tokens at batch 1, "
                f"{args.n_batch} x {args.max_new_batch} at B = 16 (packed)"
            ),
        ),
        "cells": cells,
        "summary": summary(cells),
    }
    if kept:
        result["merged_from"] = [*kept.get("merged_from", []), kept.get("command")]
    result["ratios"] = headline(result["summary"])
    cols = ("free/K", "head/K", "head/free", "lag0/K", "lag0/free", "ceil0", "ceil1")
    print(f"\n{'cell':<24} {'best K':>7} " + " ".join(f"{c:>9}" for c in cols))
    for cell, c in cells.items():
        ce = c["ceilings"] or {}
        values = [
            c["best_training_free_vs_best_fixed_k"],
            c["head_vs_best_fixed_k"],
            c["head_vs_best_training_free"],
            c["lag0_head_vs_best_fixed_k"],
            c["lag0_head_vs_best_training_free"],
            ce.get("lag0", {}).get("vs_best_fixed_k"),
            ce.get("lag1", {}).get("vs_best_fixed_k"),
        ]
        shown = " ".join(f"{v if v is not None else '-':>9}" for v in values)
        print(f"{cell:<24} {c['best_fixed_k'] or '-':>7} {shown}")
    print(json.dumps(result["summary"]))
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"-> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
