"""What a deeper EAGLE head costs on this machine, and how much more it must agree with the target to pay for it.

    python bench/studies/eagle_layers.py   # heads of 1, 2 and 3 decoder layers: bench/studies/results/eagle_layers.json

One run, side by side: the shared target's forward over ``n`` tokens and one draft step of a head of each depth
(``decoder_layers``; the shared target's shape, its layers 2, 15 and 27, an 8,192-row output layer), timed by the
decoding runners' cost profile (``specheads.shim.costs.cost_profile.measure``: medians, every size
interleaved), in rounds that rotate the depths so that drifts hit each alike. The cost does not depend on the
weights, so the heads are untrained.

Then, per prompt set of a ``bench/draft_head.py`` result (``--result``): with the set's measured per-step acceptance
(one-layer head), the chain model of ``bench/studies/eagle_need.py`` predicts the best fixed-K speed against the target
alone with each depth's draft step (``predicted_vs_target``) and the uniform lift in per-step acceptance a deeper
head needs to match the one-layer head's predicted speed (``break_even_lift``). A deeper head pays only where it
agrees more than that.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import torch
from eagle_need import best_fixed_k, lift_for

from specheads.heads import EagleConfig, EagleHead
from specheads.shim.costs.cost_profile import measure
from specheads.shim.runners import kernels

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))  # _common, beside the benchmarks
from _common import run_info, shared_pair, write_result  # noqa: E402

SHARED = Path(os.environ.get("SPECHEADS_SHARED", str(ROOT.parent / "shared")))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", default="1,2,3", help="decoder layers of the heads to time")
    ap.add_argument("--rounds", type=int, default=3, help="rounds over the depths (each a full cost profile)")
    ap.add_argument("--max-pass", type=int, default=8, help="target passes timed: 1 .. this many tokens")
    ap.add_argument("--result", default=str(ROOT / "bench/results/draft_head.json"), help="a draft_head.py result")
    ap.add_argument("--out", default=str(ROOT / "bench/studies/results/eagle_layers.json"))
    args = ap.parse_args(argv)
    depths = [int(x) for x in args.layers.split(",") if x.strip()]
    if not depths or min(depths) < 1 or 1 not in depths:
        ap.error(f"--layers {args.layers}: depths >= 1, the one-layer head among them (the baseline)")
    if args.rounds < 1 or args.max_pass < 2:
        ap.error("--rounds >= 1 and --max-pass >= 2")
    if not Path(args.result).is_file():
        ap.error(f"--result {args.result}: no such file (run bench/draft_head.py first)")
    pair = shared_pair(SHARED, "", 0)
    target = pair.target.model
    n = target.config.num_hidden_layers
    heads = {}
    for depth in depths:
        torch.manual_seed(0)
        config = EagleConfig.for_target(target.config, [2, n // 2, n - 3], 8192, num_layers=depth)
        heads[depth] = EagleHead(config).eval()
    draft_ms: dict[int, list[float]] = {d: [] for d in depths}
    target_ms: list[list[float]] = []
    for r in range(args.rounds):
        for depth in depths[r % len(depths) :] + depths[: r % len(depths)]:
            t_d, t_t = measure(target, heads[depth], args.max_pass, seed=r)
            draft_ms[depth].append(t_d)
            target_ms.append(t_t)
    t_target = [statistics.median(col) for col in zip(*target_ms)]
    t_draft = {d: statistics.median(v) for d, v in draft_ms.items()}
    src = json.loads(Path(args.result).read_text())
    sets = {}
    for name, data in src["sets"].items():
        acc = [float(a) for a in data["acceptance_by_step"]["eagle"]]
        base, _ = best_fixed_k(acc, t_target, t_draft[1])
        row = {}
        for depth in depths:
            ratio, k = best_fixed_k(acc, t_target, t_draft[depth])
            lift = 0.0 if depth == 1 else lift_for(acc, t_target, t_draft[depth], 1.0, base)
            row[str(depth)] = {
                "predicted_vs_target": round(ratio, 4),
                "best_k": k,
                "break_even_lift": None if lift is None else round(lift, 4),
            }
        sets[name] = row
    result = {
        **run_info(__file__, argv, "fp32, batch 1, untrained heads (cost only)"),
        "kernels": kernels.describe(),
        "acceptance_from": {"result": args.result, "cpu": src.get("cpu")},
        "t_target_ms": [round(t, 3) for t in t_target],
        "t_draft_ms": {str(d): round(t, 3) for d, t in t_draft.items()},
        "t_draft_ms_rounds": {str(d): [round(t, 3) for t in v] for d, v in draft_ms.items()},
        "draft_step_vs_target_token": {str(d): round(t / t_target[0], 4) for d, t in t_draft.items()},
        "sets": sets,
    }
    print(
        f"cpu: {result['cpu']}; target forward over 1 / {args.max_pass} tokens: "
        f"{t_target[0]:.2f} / {t_target[-1]:.2f} ms"
    )
    print(
        "decoder layers | draft step ms | x a target token | "
        + " | ".join(f"{s}: ratio, break-even lift" for s in sets)
    )
    for depth in depths:
        cells = [
            f"{sets[s][str(depth)]['predicted_vs_target']}, {sets[s][str(depth)]['break_even_lift']}" for s in sets
        ]
        print(f"{depth} | {t_draft[depth]:.3f} | {t_draft[depth] / t_target[0]:.3f} | " + " | ".join(cells))
    write_result(args.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
