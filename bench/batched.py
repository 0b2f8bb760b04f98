"""Batched decoding on the shared pair: prompts per hour at B = 1, 4, 8, 16 for AR and SD, one run.

Every configuration decodes the same held-out prompts (GSM8K-test and MT-Bench first turns, greedy,
fp32, the draft pruned as recipe ``specdecpp_draft_quickstart`` prunes it) through ``Decoder.decode_many``:
B = 1 is the batch-1 engine, B > 1 the batched engine (a finished prompt's row is taken by the next). The
configurations run one after another in rotating order over ``--repeats`` passes, each figure the
median over passes, so that drift hits every batch size alike. Aggregate tokens/s is all new tokens
over the wall clock of the whole set; per-row latency is a prompt's own wall time from joining to
finishing. Outputs at every B are compared token for token with B = 1.

    python bench/batched.py                       # 32 prompts x 64 tokens, 2 passes
    python bench/batched.py --n 16 --repeats 1 --out /tmp/b.json

Prints a table and writes ``bench/results/batched.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

from _common import run_info, shared_pair

from specheads.decode.api import Decoder
from specheads.prompts import load_prompts
from specheads.shim.policies import StandardSD, TargetOnly
from specheads.shim.runners import kernels

ROOT = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("SPECHEADS_SHARED", ROOT.parent / "shared"))
SIZES = (1, 4, 8, 16)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=32, help="prompts (half GSM8K-test, half MT-Bench)")
    ap.add_argument("--offset", type=int, default=700, help="first GSM8K-test row")
    ap.add_argument("--mtbench-offset", type=int, default=56, help="first MT-Bench row")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--k", type=int, default=3, help="SD candidates per round")
    ap.add_argument("--repeats", type=int, default=2, help="passes over every configuration")
    ap.add_argument("--vocab", default=str(ROOT / "runs/specdecpp_draft_quickstart-vocab/vocab.json"))
    ap.add_argument("--draft-top-n", type=int, default=8192)
    ap.add_argument("--out", default=str(ROOT / "bench/results/batched.json"))
    args = ap.parse_args(argv)
    pair = shared_pair(SHARED, args.vocab, args.draft_top_n)
    half = args.n // 2
    prompts = load_prompts(str(SHARED / "data/gsm8k/test.jsonl"), limit=half, offset=args.offset) + load_prompts(
        str(SHARED / "data/mt_bench/question.jsonl"), limit=args.n - half, offset=args.mtbench_offset
    )
    items = list(enumerate(prompts))
    decoders = {
        "ar": Decoder(pair, TargetOnly(), args.max_new_tokens),
        "sd": Decoder(pair, StandardSD(args.k), args.max_new_tokens),
    }
    configs = [(p, b) for b in SIZES for p in decoders]
    for p, b in configs:  # warm-up (kernel choice for every row count, allocations), not timed
        dict(decoders[p].decode_many(items[:b], b))
    runs: dict[tuple, list] = {c: [] for c in configs}
    outputs: dict[tuple, dict] = {}
    for rep in range(args.repeats):
        order = configs[rep % len(configs) :] + configs[: rep % len(configs)]
        for p, b in order:
            start = time.perf_counter()
            res = dict(decoders[p].decode_many(items, b))
            elapsed = time.perf_counter() - start
            tokens = sum(len(r.tokens) for r in res.values())
            runs[(p, b)].append(
                {
                    "elapsed": elapsed,
                    "tokens": tokens,
                    "latency": statistics.mean(r.stats.wall_time for r in res.values()),
                    "calls": sum(r.stats.target_calls for r in res.values()),
                }
            )
            outputs[(p, b)] = {i: r.tokens for i, r in res.items()}
            print(f"pass {rep + 1}: {p} B={b}: {tokens / elapsed:.1f} tokens/s", file=sys.stderr, flush=True)
    table = []
    for p, b in configs:
        rs = runs[(p, b)]
        elapsed = statistics.median(r["elapsed"] for r in rs)
        tokens = rs[0]["tokens"]
        table.append(
            {
                "policy": p,
                "batch_size": b,
                "prompts": len(items),
                "tokens": tokens,
                "elapsed_s": round(elapsed, 2),
                "tokens_per_s": round(tokens / elapsed, 2),
                "prompts_per_hour": round(3600 * len(items) / elapsed, 1),
                "row_latency_s": round(statistics.median(r["latency"] for r in rs), 3),
                "row_ms_per_token": round(1000 * statistics.median(r["latency"] for r in rs) * len(items) / tokens, 2),
                "tokens_per_target_call": round(tokens / rs[0]["calls"], 3),
                "identical_to_b1": outputs[(p, b)] == outputs[(p, 1)],
            }
        )
    by = {(r["policy"], r["batch_size"]): r for r in table}
    ratios = {}
    for p in decoders:
        for b in SIZES[1:]:
            ratios[f"{p}_b{b}_vs_b1_tokens_per_s"] = round(by[(p, b)]["tokens_per_s"] / by[(p, 1)]["tokens_per_s"], 3)
    ratios["b8_vs_b1_tokens_per_s"] = ratios["sd_b8_vs_b1_tokens_per_s"]
    ratios["b16_vs_b1_tokens_per_s"] = ratios["sd_b16_vs_b1_tokens_per_s"]
    ratios["sd_vs_ar_at_b1"] = round(by[("sd", 1)]["tokens_per_s"] / by[("ar", 1)]["tokens_per_s"], 3)
    ratios["sd_vs_ar_at_b8"] = round(by[("sd", 8)]["tokens_per_s"] / by[("ar", 8)]["tokens_per_s"], 3)
    cols = list(table[0])
    print(" | ".join(cols))
    for r in table:
        print(" | ".join(str(r[c]) for c in cols))
    print(json.dumps(ratios))
    result = {
        **run_info(__file__, argv, "greedy, fp32, batch sizes " + ", ".join(map(str, SIZES))),
        "prompts": [
            f"gsm8k/test.jsonl [{args.offset}:{args.offset + half}]",
            f"mt_bench/question.jsonl [{args.mtbench_offset}:{args.mtbench_offset + args.n - half}]",
        ],
        "max_new_tokens": args.max_new_tokens,
        "k": args.k,
        "repeats": args.repeats,
        "draft": f"output layer pruned to {args.draft_top_n} tokens ({args.vocab})",
        "target_fingerprint": pair.target.fingerprint,
        "draft_fingerprint": pair.draft.fingerprint,
        "kernels": kernels.describe(),
        "table": table,
        "greedy_identical_to_b1": all(r["identical_to_b1"] for r in table),
        "ratios": ratios,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
