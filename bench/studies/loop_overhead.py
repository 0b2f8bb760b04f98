"""Where a decode's wall time goes: the prompt's prefill, the target's and the drafter's forwards, and the loop.

The cost model prices the forwards a row made (its pass sizes at the profiled prices) and leaves the prompt's
prefill out (it costs every row the same), while a row's measured ms/token is its whole wall time. This
decodes held-out GSM8K-test prompts at batch 1 with the shared pair, the target alone (``ar``), the 4-layer
draft at K = 3 (``sd-k3``) and the committed EAGLE head at K = 2 (``eagle-k2``), timing every forward of the
runners (the first target pass, the prompt's prefill, apart) and reports per row: wall ms, prefill ms, the
target's and the drafter's forward ms, and the rest (the loop: policy hooks, verification, bookkeeping) per
target call; and the cost table's prediction over the measured ms/token with and without the prefill.

    python bench/studies/loop_overhead.py    # 6 prompts x 64 tokens -> bench/studies/results/loop_overhead.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from specheads.decode.api import load_eagle
from specheads.decode.policy_factory import pair_costs
from specheads.prompts import load_prompts
from specheads.shim import load_pair
from specheads.shim.costs.cost_rules import predict_ms_per_token
from specheads.shim.loop import eagle_drafter
from specheads.shim.loop import engine as engine_mod
from specheads.shim.loop.engine import Engine
from specheads.shim.policies import StandardSD, TargetOnly
from specheads.shim.runners import model_runner
from specheads.shim.runners.models import ModelSpec

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))  # _common, beside the benchmarks
from _common import run_info, write_result  # noqa: E402

SHARED = Path(os.environ.get("SPECHEADS_SHARED", ROOT.parent / "shared"))
HEAD = ROOT / "recipes/heads/eagle_smollm2.safetensors"


class Clock:
    """Times the target's forwards (``FusedRunner.forward`` on the target) and the drafters' work (their
    ``draft`` and ``commit``, forwards and drafting logic together): ``(who, seconds)`` per call."""

    def __init__(self, target):
        self.log: list[tuple[str, float]] = []
        self._wrap(model_runner.FusedRunner, "forward", lambda runner: "target" if runner.model is target else None)
        for cls in (engine_mod._SameVocabulary, eagle_drafter.EagleDrafter):
            for name in ("draft", "commit"):
                self._wrap(cls, name, lambda runner: "draft")

    def _wrap(self, cls, name: str, who) -> None:
        orig, log = getattr(cls, name), self.log

        def timed(obj, *a, **k):
            t = time.perf_counter()
            out = orig(obj, *a, **k)
            name = who(obj)
            if name is not None:  # the draft model's forwards are inside its drafter's calls
                log.append((name, time.perf_counter() - t))
            return out

        setattr(cls, name, timed)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=6)
    ap.add_argument("--offset", type=int, default=960, help="first GSM8K-test row")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--out", default=str(ROOT / "bench/studies/results/loop_overhead.json"))
    args = ap.parse_args(argv)
    pair = load_pair(
        ModelSpec(
            path=str(SHARED / "models/smollm2-135m-instruct"), gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf", device="cpu"
        ),
        ModelSpec(path=str(SHARED / "models/smollm2-draft-4l"), device="cpu"),
    )
    eagle = load_eagle(str(HEAD), pair)
    tables = {"draft": pair_costs(pair, 5), "eagle": pair_costs(pair, 5, eagle=eagle)}
    tok = pair.target.tokenizer
    prompts = load_prompts(str(SHARED / "data/gsm8k/test.jsonl"), limit=args.n, offset=args.offset)
    ids = [tok.apply_chat_template([{"role": "user", "content": p.text}], add_generation_prompt=True) for p in prompts]
    ids = [x if isinstance(x, list) else list(x["input_ids"]) for x in ids]
    eos = pair.eos_token_ids
    engines = {
        "ar": (Engine(pair.target.model, None, eos), TargetOnly(), "draft"),
        "sd-k3": (Engine(pair.target.model, pair.draft.model, eos), StandardSD(3), "draft"),
        "eagle-k2": (Engine(pair.target.model, None, eos, eagle=eagle.module), StandardSD(2), "eagle"),
    }
    clock = Clock(pair.target.model)
    rows = []
    for name, (eng, policy, table) in engines.items():
        eng.generate(ids[0], policy, 8)  # warm-up
        for i, p in enumerate(ids):
            clock.log.clear()
            t = time.perf_counter()
            res = eng.generate(p, policy, args.max_new_tokens, generator=torch.Generator().manual_seed(i))
            wall = 1000 * (time.perf_counter() - t)
            target = [ms * 1000 for who, ms in clock.log if who == "target"]
            draft = sum(ms * 1000 for who, ms in clock.log if who == "draft")
            s = res.stats
            n = max(s.new_tokens, 1)
            predicted = predict_ms_per_token(tables[table], s.draft_forwards, s.target_pass_sizes, s.new_tokens)
            outside = wall - sum(target) - draft
            rows.append(
                {
                    "row": name,
                    "prompt_tokens": len(p),
                    "new_tokens": s.new_tokens,
                    "wall_ms": round(wall, 1),
                    "prefill_ms": round(target[0], 1),
                    "target_forward_ms": round(sum(target[1:]), 1),
                    "draft_forward_ms": round(draft, 1),
                    "loop_ms": round(outside, 1),
                    "loop_ms_per_target_call": round(outside / max(len(target), 1), 3),
                    "predicted_over_measured": round(predicted / (wall / n), 4),
                    "predicted_over_measured_without_prefill": round(
                        predicted / ((wall - target[0] + tables[table].t_target(1)) / n), 4
                    ),
                    "target_ms_per_call_over_t1": round(statistics.mean(target[1:]) / tables[table].t_target(1), 4)
                    if name == "ar"
                    else None,
                }
            )
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    summary = {}
    for name in engines:
        mine = [r for r in rows if r["row"] == name]
        wall = sum(r["wall_ms"] for r in mine)
        summary[name] = {
            "prefill_share_of_wall": round(sum(r["prefill_ms"] for r in mine) / wall, 4),
            "loop_share_of_wall": round(sum(r["loop_ms"] for r in mine) / wall, 4),
            "loop_ms_per_target_call": round(statistics.median(r["loop_ms_per_target_call"] for r in mine), 3),
            "predicted_over_measured": round(statistics.median(r["predicted_over_measured"] for r in mine), 4),
            "predicted_over_measured_without_prefill": round(
                statistics.median(r["predicted_over_measured_without_prefill"] for r in mine), 4
            ),
        }
    ar = [r["target_ms_per_call_over_t1"] for r in rows if r["row"] == "ar"]
    summary["ar"]["target_ms_per_call_over_t1"] = round(statistics.median(ar), 4)
    print(json.dumps(summary, indent=1))
    result = {
        **run_info(__file__, argv, "greedy, fp32, batch 1"),
        "prompts": f"gsm8k/test.jsonl [{args.offset}:{args.offset + args.n}]",
        "cost_tables": {k: t.describe() for k, t in tables.items()},
        "table": rows,
        "ratios": summary,
    }
    write_result(args.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
