"""Drafters side by side: the shared draft, a distilled draft and an EAGLE head, with the stop rules on the head.

One process, one run, every configuration interleaved prompt by prompt (rotating order), greedy, fp32,
batch 1, on three prompt sets: GSM8K-test, MT-Bench first turns, and Alpaca rows that no training run
read (``--alpaca-offset``; the drafter recipes read rows below 4,000). Rows:

* ``ar``: the target alone;
* ``shared_k{K}``, ``distilled_k{K}``, ``eagle_k{K}``: standard SD at a fixed K with each drafter (the shared
  draft's output layer pruned to the quickstart's 8,192 tokens, as every benchmark runs it);
* ``eagle_tree_{D}x{W}x{N}`` (``--trees``): greedy tree drafting on the head (``policy=tree``: EAGLE-2's dynamic
  tree of depth D, width W, N tokens verified per target pass);
* ``eagle_confidence_cost``: the cost-aware confidence stop on the head (no threshold: drafts on while one
  more candidate raises the round's expected tokens per ms of the head's own profiled cost table);
* ``eagle_specdecpp`` / ``eagle_confidence_head`` (with ``--stop-head`` / ``--confidence-head``): learned stops.

Per set and drafter, the greedy oracle (a stop that knows where the drafter's token will be wrong) is
priced by the drafter's cost table. Prints a table per set and writes ``bench/results/draft_head.json``.

    python bench/draft_head.py --eagle runs/eagle-smollm2-export/head.safetensors \\
        --distilled runs/draft-distill/draft
    python bench/draft_head.py --eagle HEAD --gsm8k-n 8 --mtbench-n 4 --alpaca-n 4 --out /tmp/d.json   # quick
    python bench/draft_head.py --distilled runs/draft-smollm2-train/draft --draft-ks 2,3

Without ``--eagle`` the run times the target alone, the shared and the distilled draft only, and writes them into
the existing result file as ``distilled_run`` (its own command, CPU and ratios), with ``distilled_draft`` (the
training run's held-out figures) and ``ratios.distilled_draft_agreement``; the EAGLE rows stay as they were.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
from _common import interleave, run_info, shared_pair

from specheads.decode.api import format_prompt, load_eagle, pair_costs
from specheads.decode.policy_factory import make_policy
from specheads.evaluate.oracle import (
    draft_agreement,
    eagle_oracle,
    oracle_schedule,
    per_position_acceptance,
    predicted_ms_per_token,
)
from specheads.evaluate.rows import parse_tree
from specheads.prompts import load_prompts
from specheads.shim import load_pair
from specheads.shim.core.stats import GenerationStats
from specheads.shim.loop.engine import Engine
from specheads.shim.policies import ConfidenceStop, EagleTree, StandardSD
from specheads.shim.runners import kernels
from specheads.shim.runners.models import ModelSpec

ROOT = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("SPECHEADS_SHARED", ROOT.parent / "shared"))
STEPS = 6  # draft steps whose acceptance is reported


def model_oracle(draft, vocab_size, prompts, outputs, k_max: int) -> GenerationStats:
    total = GenerationStats(prompts=0)
    with torch.inference_mode():
        for ids, out in zip(prompts, outputs):
            total = GenerationStats.total(
                [total, oracle_schedule(draft_agreement(draft, ids, out, True, vocab_size), k_max)]
            )
    return total


def row(name: str, tot: GenerationStats, identical: int, n: int, table) -> dict:
    pred = predicted_ms_per_token(tot, table) if table is not None and name != "ar" else None
    return {
        "config": name,
        "tokens": tot.new_tokens,
        "tokens_per_s": round(tot.tokens_per_s, 3),
        "tokens_per_call": round(tot.tokens_per_call, 3),
        "accepted_per_call": round(tot.accepted_per_call, 3) if name != "ar" else None,
        "predicted_ms_per_token": round(pred, 3) if pred else None,
        "identical_to_target": f"{identical}/{n}",
    }


def run_set(label: str, prompts, configs: dict, tables: dict, oracles: dict) -> dict:
    stats, outputs = interleave(configs, prompts, prompts[0][:32])
    ref = outputs["ar"]
    rows = []
    for name in configs:
        same = sum(a == b for a, b in zip(outputs[name], ref))
        rows.append(row(name, GenerationStats.total(stats[name]), same, len(prompts), tables.get(name.split("_")[0])))
    oracle_rows, by_step = {}, {}
    for drafter, fn in oracles.items():
        rounds: list = []
        o = fn(prompts, ref, rounds)
        ms = predicted_ms_per_token(o, tables[drafter.removesuffix("_old")])
        oracle_rows[drafter] = {
            "tokens_per_call": round(o.tokens_per_call, 3),
            "predicted_ms_per_token": round(ms, 3),
            "predicted_tokens_per_s": round(1000 / ms, 3),
        }
        if rounds:  # an EAGLE head's SD rounds at the oracle's k_max: acceptance at each draft step
            by_step[drafter] = per_position_acceptance(rounds, STEPS)
            print(f"acceptance by draft step, {drafter}: {by_step[drafter]}")
    print(f"\n== {label} ({len(prompts)} prompts) ==")
    cols = [
        "config",
        "tokens_per_s",
        "tokens_per_call",
        "accepted_per_call",
        "predicted_ms_per_token",
        "identical_to_target",
    ]
    print(" | ".join(cols))
    for r in rows:
        print(" | ".join("-" if r[c] is None else str(r[c]) for c in cols))
    for d, o in oracle_rows.items():
        print(f"oracle {d} | {o['predicted_tokens_per_s']} (predicted) | {o['tokens_per_call']}")
    lossless = [r for r in rows if r["config"] != "ar"]  # every row verifies with the target: all lossless
    identical = all(r["identical_to_target"] == f"{len(prompts)}/{len(prompts)}" for r in lossless)
    return {"table": rows, "oracle": oracle_rows, "acceptance_by_step": by_step, "greedy_identical": identical}


def ratios(sets: dict) -> dict:
    out: dict = {}
    per_set = {}
    for label, res in sets.items():
        by = {r["config"]: r for r in res["table"]}
        ar = by["ar"]["tokens_per_s"]
        eagle = [r for r in res["table"] if r["config"].startswith("eagle_")]
        fixed = [r for r in eagle if r["config"][len("eagle_k") :].isdigit() and r["config"].startswith("eagle_k")]
        best = max(eagle, key=lambda r: r["tokens_per_s"]) if eagle else None
        best_fixed = max(fixed, key=lambda r: r["tokens_per_s"]) if fixed else None
        s = {}
        if best:
            s["eagle_best_lossless"] = best["config"]
            s["eagle_best_lossless_vs_target"] = round(best["tokens_per_s"] / ar, 4)
            s["eagle_best_lossless_tokens_per_call"] = best["tokens_per_call"]
            most = max(eagle, key=lambda r: r["tokens_per_call"])  # the best chain or tree row by tokens per call
            s["eagle_tokens_per_call"], s["eagle_tokens_per_call_row"] = most["tokens_per_call"], most["config"]
        if best_fixed:
            s["eagle_best_fixed_k"] = best_fixed["config"]
            for stop in ("eagle_specdecpp", "eagle_confidence_cost", "eagle_confidence_head"):
                if stop in by:
                    s[f"{stop[len('eagle_') :]}_vs_best_fixed_k"] = round(
                        by[stop]["tokens_per_s"] / best_fixed["tokens_per_s"], 4
                    )
            o = res["oracle"].get("eagle")
            if o:  # share of the gain a perfect stop would add over the best fixed K that a stop rule realises
                gap = o["predicted_tokens_per_s"] - best_fixed["tokens_per_s"]
                for stop in ("eagle_specdecpp", "eagle_confidence_cost", "eagle_confidence_head"):
                    if stop in by and gap > 0:
                        s[f"share_of_perfect_head_gain_{stop[len('eagle_') :]}"] = round(
                            (by[stop]["tokens_per_s"] - best_fixed["tokens_per_s"]) / gap, 4
                        )
        s.update(_distilled_ratios(res["table"], ar))
        per_set[label] = s
    for key in ("eagle_best_lossless_vs_target", "eagle_tokens_per_call"):
        vals = [s[key] for s in per_set.values() if key in s]
        if vals:
            out[key] = min(vals)
    out["per_set"] = per_set
    return out


def _distilled_ratios(table: list[dict], ar: float) -> dict:
    """The distilled draft's best fixed-K row against the target alone and the shared draft's best, same run."""
    best = {}
    for drafter in ("shared", "distilled"):
        mine = [r for r in table if r["config"].startswith(f"{drafter}_k")]
        if mine:
            best[drafter] = max(mine, key=lambda r: r["tokens_per_s"])
    if "distilled" not in best:
        return {}
    d = best["distilled"]
    out = {
        "distilled_best": d["config"],
        "distilled_best_vs_target": round(d["tokens_per_s"] / ar, 4),
        "distilled_tokens_per_call": d["tokens_per_call"],
    }
    if "shared" in best:
        out["distilled_best_vs_shared_best"] = round(d["tokens_per_s"] / best["shared"]["tokens_per_s"], 4)
        out["shared_tokens_per_call"] = best["shared"]["tokens_per_call"]
    return out


def _merge_distilled(out: Path, result: dict) -> dict:
    """A run without ``--eagle`` (the distilled draft against the shared draft and the target alone) goes into the
    existing result file as ``distilled_run``: the EAGLE run's rows and ratios stay as they were measured; each run's
    ratios compare rows of that run only."""
    whole = json.loads(out.read_text()) if out.is_file() else {}
    whole["distilled_run"] = {k: v for k, v in result.items() if k not in ("distilled_draft",)}
    whole["distilled_draft"] = result["distilled_draft"]
    whole.setdefault("ratios", {})["distilled_draft_agreement"] = result["ratios"]["distilled_draft_agreement"]
    return whole


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--eagle",
        default="",
        help="exported EAGLE head (heads-export output or head.safetensors); without it, --distilled's rows only, "
        "written into --out's file as distilled_run",
    )
    ap.add_argument(
        "--distilled", default="", help="a distilled draft's Hugging Face directory (heads-train head=draft)"
    )
    ap.add_argument(
        "--distilled-vocab",
        default="",
        help="the heads-vocab ranking a distilled draft was trained pruned "
        "with (its draft/vocab.json or the run's vocab_file); top 8192",
    )
    ap.add_argument(
        "--old-eagle", default="", help="an earlier EAGLE head: its acceptance by draft step beside --eagle's (no rows)"
    )
    ap.add_argument("--stop-head", default="", help="a SpecDec++ head trained on the EAGLE head's rounds")
    ap.add_argument("--confidence-head", default="", help="a linear confidence head on the EAGLE head's state")
    ap.add_argument(
        "--stop-k-max",
        type=int,
        default=8,
        help="k_max of the learned stops (at most the eagle_k their eagle_rounds data was written with)",
    )
    ap.add_argument("--gsm8k-n", type=int, default=32)
    ap.add_argument("--mtbench-n", type=int, default=16)
    ap.add_argument(
        "--mtbench-offset",
        type=int,
        default=0,
        help="first MT-Bench question read (0-15 are writing and roleplay, 16-79 the other six categories)",
    )
    ap.add_argument("--alpaca-n", type=int, default=16)
    ap.add_argument("--alpaca-offset", type=int, default=4000)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--ks", default="2,3,4,5", help="fixed K of the EAGLE rows")
    ap.add_argument("--draft-ks", default="1,2,3", help="fixed K of the shared and distilled drafts' rows")
    ap.add_argument(
        "--trees",
        default="4x3x8",
        help="draft trees on the EAGLE head, DEPTHxWIDTHxNODES[-cost], "
        "comma-separated (rows eagle_tree_DxWxN; -cost: sized per round by the cost table; empty: none)",
    )
    ap.add_argument(
        "--training-summary",
        default="",
        help="the heads-pipeline summary.json that built --eagle (recipe eagle_smollm2): its cost goes in the result",
    )
    ap.add_argument("--oracle-k-max", type=int, default=8)
    ap.add_argument("--vocab", default=str(ROOT / "runs/specdecpp_draft_quickstart-vocab/vocab.json"))
    ap.add_argument("--out", default=str(ROOT / "bench/results/draft_head.json"))
    args = ap.parse_args(argv)
    if not args.eagle and not args.distilled:
        ap.error("give --eagle, --distilled or both")
    eagle_only = [
        f
        for f, v in (
            ("--old-eagle", args.old_eagle),
            ("--stop-head", args.stop_head),
            ("--confidence-head", args.confidence_head),
        )
        if v
    ]
    if eagle_only and not args.eagle:
        ap.error(f"{', '.join(eagle_only)}: only with --eagle (rows and oracles on the EAGLE head)")
    if args.eagle and not Path(args.eagle).exists():
        ap.error(f"--eagle {args.eagle} does not exist; train and export one (README: Drafters)")
    if args.distilled and not (Path(args.distilled).parent / "metrics.json").is_file():
        ap.error(f"--distilled {args.distilled}: no metrics.json beside it; give a heads-train head=draft run's draft/")
    torch.manual_seed(0)
    pair = shared_pair(SHARED, args.vocab, 8192)
    eagle = load_eagle(args.eagle, pair) if args.eagle else None
    mx, ks, dks = args.max_new_tokens, [int(k) for k in args.ks.split(",")], [int(k) for k in args.draft_ks.split(",")]
    trees = [parse_tree(t) for t in filter(None, args.trees.split(","))] if eagle else []
    k_top = max((ks if eagle else []) + dks + [args.oracle_k_max] + [t[2] for t in trees]) + 2
    shared = Engine(pair.target.model, pair.draft.model, pair.eos_token_ids)
    tables = {"shared": pair_costs(pair, k_top)}
    configs = {"ar": lambda ids: shared.generate_ar(ids, mx)}
    configs.update({f"shared_k{k}": (lambda ids, k=k: shared.generate(ids, StandardSD(k), mx)) for k in dks})
    oracles = {
        "shared": lambda ps, outs, _: model_oracle(pair.draft.model, shared.vocab_size, ps, outs, args.oracle_k_max)
    }
    if args.distilled:
        _distilled_rows(args, pair, dks, k_top, tables, configs, oracles)
    if eagle is not None:
        _eagle_rows(args, pair, eagle, ks, k_top, tables, configs, oracles)
    print(
        "cost tables (ms):",
        {d: (round(t.t_draft_ms, 2), [round(x, 1) for x in t.t_target_ms[:6]]) for d, t in tables.items()},
        file=sys.stderr,
    )
    tok = pair.tokenizer
    sets = {
        "gsm8k": load_prompts(str(SHARED / "data/gsm8k/test.jsonl"), limit=args.gsm8k_n),
        "mtbench": load_prompts(
            str(SHARED / "data/mt_bench/question.jsonl"), limit=args.mtbench_n, offset=args.mtbench_offset
        ),
        "alpaca": load_prompts(
            str(SHARED / "data/alpaca/alpaca_5000.json"), limit=args.alpaca_n, offset=args.alpaca_offset
        ),
    }
    results = {}
    for label, ps in sets.items():
        if ps:
            results[label] = run_set(label, [format_prompt(tok, p) for p in ps], configs, tables, oracles)
    result = {
        **run_info(__file__, argv, "fp32, batch 1, greedy"),
        "max_new_tokens": mx,
        "prompts": {
            "gsm8k": f"test[0:{args.gsm8k_n}]",
            "mtbench": f"first turns [{args.mtbench_offset}:{args.mtbench_offset + args.mtbench_n}]",
            "alpaca": f"alpaca_5000[{args.alpaca_offset}:{args.alpaca_offset + args.alpaca_n}]",
        },
        "eagle_head": {
            "path": args.eagle,
            **{k: eagle.metadata.get(k) for k in ("head_config", "ttt_steps", "draft_vocab")},
        }
        if eagle is not None
        else None,
        "cost_tables": {d: t.to_dict() for d, t in tables.items()},
        "kernels": kernels.describe(),
        "sets": results,
        "greedy_identical": all(r["greedy_identical"] for r in results.values()),
        "ratios": ratios(results),
    }
    if args.distilled:  # heads-train head=draft writes draft/ beside metrics.json (held-out before / after)
        held = json.loads((Path(args.distilled).parent / "metrics.json").read_text())
        result["distilled_draft"] = {"path": args.distilled, **held}
        result["ratios"]["distilled_draft_agreement"] = round(held["after"]["agreement"], 4)
    if args.training_summary:
        summary = json.loads(Path(args.training_summary).read_text())
        result["training_cost"] = {"summary": args.training_summary, "runs": summary.get("cost", [])}  # per part
    print(json.dumps(result["ratios"], indent=1))
    out = Path(args.out)
    if eagle is None:
        result = _merge_distilled(out, result)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


def _distilled_rows(args, pair, dks, k_top, tables, configs, oracles) -> None:
    """``distilled_k{K}`` rows and the distilled draft's oracle (the target is the shared pair's, already loaded)."""
    dpair = load_pair(
        ModelSpec(
            path=str(SHARED / "models/smollm2-135m-instruct"), gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf", device="cpu"
        ),
        ModelSpec(
            path=args.distilled,
            device="cpu",
            vocab_file=args.distilled_vocab or None,
            vocab_top_n=8192 if args.distilled_vocab else None,
        ),
    )
    mx = args.max_new_tokens
    distilled = Engine(pair.target.model, dpair.draft.model, pair.eos_token_ids)
    tables["distilled"] = pair_costs(dpair, k_top)
    configs.update({f"distilled_k{k}": (lambda ids, k=k: distilled.generate(ids, StandardSD(k), mx)) for k in dks})
    oracles["distilled"] = lambda ps, outs, _: model_oracle(
        dpair.draft.model, distilled.vocab_size, ps, outs, args.oracle_k_max
    )


def _eagle_rows(args, pair, eagle, ks, k_top, tables, configs, oracles) -> None:
    """The EAGLE head's fixed-K, tree, cost-stop and learned-stop rows, its oracle (and ``--old-eagle``'s)."""
    mx = args.max_new_tokens
    head = Engine(pair.target.model, eos_token_ids=pair.eos_token_ids, eagle=eagle.module)
    tables["eagle"] = pair_costs(pair, k_top, eagle=eagle)
    oracles["eagle"] = lambda ps, outs, rounds: eagle_oracle(head, ps, mx, args.oracle_k_max, rounds)
    if args.old_eagle:  # its rounds only (acceptance by step, the oracle), no timed rows
        old = Engine(pair.target.model, eos_token_ids=pair.eos_token_ids, eagle=load_eagle(args.old_eagle, pair).module)
        oracles["eagle_old"] = lambda ps, outs, rounds: eagle_oracle(old, ps, mx, args.oracle_k_max, rounds)
    configs.update({f"eagle_k{k}": (lambda ids, k=k: head.generate(ids, StandardSD(k), mx)) for k in ks})
    for spec in filter(None, args.trees.split(",")):
        depth, width, nodes, stop = parse_tree(spec)
        tree = EagleTree(depth, width, nodes, stop, tables["eagle"])
        configs[f"eagle_tree_{spec}"] = lambda ids, t=tree: head.generate(ids, t, mx)
    cost_stop = ConfidenceStop(k_max=max(ks) + 2, stop="cost", costs=tables["eagle"])
    configs["eagle_confidence_cost"] = lambda ids: head.generate(ids, cost_stop.fork(), mx)
    for name, path in (("eagle_specdecpp", args.stop_head), ("eagle_confidence_head", args.confidence_head)):
        if path:  # a stop head on the EAGLE head's states, priced by its cost table (stop=cost)
            stop = make_policy(
                "specdecpp",
                pair,
                head=path,
                k_min=1,
                k_max=args.stop_k_max,
                stop="cost",
                costs=tables["eagle"],
                eagle=eagle,
            )
            configs[name] = lambda ids, stop=stop: head.generate(ids, stop.fork(), mx)


if __name__ == "__main__":
    raise SystemExit(main())
