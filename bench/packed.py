"""Packed batched verification: the EAGLE head's fixed K and per-row stop rules against batched AR, B = 1..32.

Every configuration decodes the same held-out prompts (GSM8K-test and MT-Bench first turns past every other
benchmark's, greedy, fp32) with the committed EAGLE head drafting (``recipes/heads/eagle_smollm2.safetensors``)
through ``Decoder.decode_many``: B = 1 is the batch-1 engine, B > 1 the batched engine (a finished prompt's
row is taken by the next). Rows: ``ar`` (the target alone, batched), ``k1..k3`` (fixed K), ``c-cost`` (the
training-free cost rule on q(y), priced at the batch by the cost table's batched prices) and
``c-online-cost`` (vLLM's online logistic estimate), with ``--stop-head`` / ``--lag0-head`` the learned
SpecDec++ stop heads on the EAGLE head's states under the same cost rule (``h-cost``, ``h0-cost``), all packed
(each row's projections on its own tokens);
at the largest B also ``k2`` and ``c-cost`` padded to the widest row (``packed=false``), the engine before
packing. Configurations run in rotating order over ``--repeats`` passes (median), so drift hits each alike.
Greedy outputs are compared token for token with B = 1 and with the target alone.

    python bench/packed.py --stop-head runs/quickstart-export/head.safetensors \
        --lag0-head runs/lag0-export/head.safetensors   # 32 prompts x 48 tokens, B = 1, 4, 8, 16, 32
    python bench/packed.py --n 8 --sizes 1,4 --max-new-tokens 16 --out /tmp/p.json   # a quick look

Prints a table and writes ``bench/results/packed.json`` with ``ratios``: ``packed_b16_best_lossless_vs_batched_ar``
(the fastest lossless row at B = 16 over batched AR at B = 16), the same at every B
(``best_lossless_vs_ar_b<B>``), ``stop_rule_vs_best_fixed_k_b<B>`` (the faster per-row stop rule over the
fastest fixed K), ``packed_vs_padded_<row>_b<Bmax>`` and ``cpu``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

from _common import run_info, write_result

from specheads.decode.api import Decoder, load_eagle
from specheads.decode.policy_factory import make_policy, pair_costs
from specheads.machine import cpu_model
from specheads.prompts import load_prompts
from specheads.shim import load_pair
from specheads.shim.policies import StandardSD, TargetOnly
from specheads.shim.runners import kernels
from specheads.shim.runners.models import ModelSpec

ROOT = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("SPECHEADS_SHARED", ROOT.parent / "shared"))
HEAD = ROOT / "recipes/heads/eagle_smollm2.safetensors"
K_MAX = 4


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=32, help="prompts (half GSM8K-test, half MT-Bench)")
    ap.add_argument("--offset", type=int, default=900, help="first GSM8K-test row")
    ap.add_argument("--mtbench-offset", type=int, default=60, help="first MT-Bench row")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--sizes", default="1,4,8,16,32", help="batch sizes")
    ap.add_argument("--repeats", type=int, default=1, help="passes over every configuration")
    ap.add_argument("--stop-head", help="a lag-1 head=eagle_stop export (heads-pipeline recipe=quickstart writes one)")
    ap.add_argument("--lag0-head", help="a lag-0 head=eagle_stop export (eagle_position=previous)")
    ap.add_argument("--out", default=str(ROOT / "bench/results/packed.json"))
    args = ap.parse_args(argv)
    sizes = [int(b) for b in args.sizes.split(",")]
    if any(b < 1 or b > args.n for b in sizes):
        ap.error(f"--sizes {args.sizes}: each batch size must lie in 1..--n ({args.n})")
    pair = load_pair(
        ModelSpec(
            path=str(SHARED / "models/smollm2-135m-instruct"), gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf", device="cpu"
        ),
        None,
    )
    eagle = load_eagle(str(HEAD), pair)
    costs = pair_costs(pair, K_MAX + 1, eagle=eagle, batch_size=max(sizes))
    print(costs.describe(), file=sys.stderr)
    half = args.n // 2
    prompts = load_prompts(str(SHARED / "data/gsm8k/test.jsonl"), limit=half, offset=args.offset) + load_prompts(
        str(SHARED / "data/mt_bench/question.jsonl"), limit=args.n - half, offset=args.mtbench_offset
    )
    items = list(enumerate(prompts))

    def decoder(policy, packed=True):
        return Decoder(pair, policy, args.max_new_tokens, eagle=eagle, packed=packed)

    def cost_rule(estimate):
        return make_policy(
            "confidence_stop", pair, costs=costs, eagle=eagle, k_max=K_MAX, stop="cost", estimate=estimate
        )

    rows = {
        "ar": lambda packed=True: decoder(TargetOnly(), packed),
        **{f"k{k}": (lambda packed=True, k=k: decoder(StandardSD(k), packed)) for k in (1, 2, 3)},
        "c-cost": lambda packed=True: decoder(cost_rule("q"), packed),
        "c-online-cost": lambda packed=True: decoder(cost_rule("online"), packed),
    }
    for name, head in (("h-cost", args.stop_head), ("h0-cost", args.lag0_head)):
        if head:
            rows[name] = lambda packed=True, head=head: decoder(
                make_policy("specdecpp", pair, costs=costs, eagle=eagle, head=head, k_min=1, k_max=K_MAX, stop="cost"),
                packed,
            )
    top = max(sizes)
    configs = [(name, b, True) for b in sizes for name in rows]
    configs += [(name, top, False) for name in ("k2", "c-cost") if top > 1]
    decoders = {c: rows[c[0]](c[2]) for c in configs}
    for c in configs:  # warm-up (kernel choices for every row count, allocations), not timed
        dict(decoders[c].decode_many(items[: c[1]], c[1]))
    runs: dict[tuple, list] = {c: [] for c in configs}
    outputs: dict[tuple, dict] = {}
    for rep in range(args.repeats):
        order = configs[rep % len(configs) :] + configs[: rep % len(configs)]
        for c in order:
            name, b, packed = c
            start = time.perf_counter()
            res = dict(decoders[c].decode_many(items, b))
            elapsed = time.perf_counter() - start
            tokens = sum(len(r.tokens) for r in res.values())
            calls = sum(r.stats.target_calls for r in res.values())
            runs[c].append({"elapsed": elapsed, "tokens": tokens, "calls": calls})
            outputs[c] = {i: r.tokens for i, r in res.items()}
            label = name if packed else name + " padded"
            print(f"pass {rep + 1}: {label} B={b}: {tokens / elapsed:.1f} tokens/s", file=sys.stderr, flush=True)
    ar_alone = outputs[("ar", sizes[0], True)]
    table = []
    for c in configs:
        name, b, packed = c
        rs = runs[c]
        elapsed = statistics.median(r["elapsed"] for r in rs)
        tokens = rs[0]["tokens"]
        table.append(
            {
                "row": name,
                "batch_size": b,
                "packed": packed,
                "tokens": tokens,
                "elapsed_s": round(elapsed, 2),
                "tokens_per_s": round(tokens / elapsed, 2),
                "tokens_per_target_call": round(tokens / rs[0]["calls"], 3),
                "identical_to_b1": outputs[c] == outputs[(name, sizes[0], True)],
                "identical_to_target": outputs[c] == ar_alone,
            }
        )
    by = {(r["row"], r["batch_size"], r["packed"]): r for r in table}
    lossless = [n for n in rows if n != "ar"]
    ratios: dict = {"cpu": cpu_model()}
    for b in sizes:
        best = max((by[(n, b, True)] for n in lossless), key=lambda r: r["tokens_per_s"])
        ratios[f"best_lossless_vs_ar_b{b}"] = round(best["tokens_per_s"] / by[("ar", b, True)]["tokens_per_s"], 4)
        ratios[f"best_lossless_row_b{b}"] = best["row"]
        fixed = max(by[(f"k{k}", b, True)]["tokens_per_s"] for k in (1, 2, 3))
        rule = max(by[(n, b, True)]["tokens_per_s"] for n in ("c-cost", "c-online-cost"))
        ratios[f"stop_rule_vs_best_fixed_k_b{b}"] = round(rule / fixed, 4)
        heads = [by[(n, b, True)]["tokens_per_s"] for n in ("h-cost", "h0-cost") if n in rows]
        if heads:
            ratios[f"head_vs_best_training_free_b{b}"] = round(max(heads) / rule, 4)
            ratios[f"head_vs_best_fixed_k_b{b}"] = round(max(heads) / fixed, 4)
    if 16 in sizes:
        ratios["packed_b16_best_lossless_vs_batched_ar"] = ratios["best_lossless_vs_ar_b16"]
    for name in ("k2", "c-cost"):
        if (name, top, False) in by:
            ratios[f"packed_vs_padded_{name}_b{top}"] = round(
                by[(name, top, True)]["tokens_per_s"] / by[(name, top, False)]["tokens_per_s"], 4
            )
    cols = list(table[0])
    print("| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
    for r in table:
        print("| " + " | ".join(str(r[c]) for c in cols) + " |")
    print(json.dumps(ratios, indent=1))
    result = {
        **run_info(__file__, argv, "greedy, fp32, EAGLE head, batch sizes " + ", ".join(map(str, sizes))),
        "prompts": [
            f"gsm8k/test.jsonl [{args.offset}:{args.offset + half}]",
            f"mt_bench/question.jsonl [{args.mtbench_offset}:{args.mtbench_offset + args.n - half}]",
        ],
        "max_new_tokens": args.max_new_tokens,
        "repeats": args.repeats,
        "eagle": str(HEAD.relative_to(ROOT)),
        "stop_heads": {"h-cost": args.stop_head, "h0-cost": args.lag0_head},
        "cost_table": costs.to_dict(),
        "kernels": kernels.describe(),
        "table": table,
        "greedy_identical_to_target": all(r["identical_to_target"] for r in table),
        "ratios": ratios,
    }
    write_result(args.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
