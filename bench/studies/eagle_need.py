"""How much more the EAGLE head must agree with the target before lossless decoding reaches a speed bar, per set.

    python bench/studies/eagle_need.py    # from bench/results/draft_head.json: bench/studies/results/eagle_need.json

No model runs (a second). It reads a ``bench/draft_head.py`` result: per prompt set, the head's acceptance at each
draft step (the share of rounds reaching step ``j`` whose step-``j`` token the target accepts), the measured cost
table (the target's forward over ``n`` tokens, one draft step) and the measured rows. A chain of ``K`` draft steps
keeps ``1 + sum_j prod_{i<=j} a_i`` tokens per call and costs ``t_target(K + 1) + K t_draft``; against the target
alone (``t_target(1)`` a token) that predicts each fixed-K row's speed. The prediction is calibrated per set by the
measured best fixed-K row (``calibration``: measured over predicted ratio, which takes in the loop's own overhead),
and the cost-aware stop's measured gain over that row (``stop_gain``) is assumed to stay. Then every step's
acceptance is raised by the same ``lift`` until the best K reaches ``--bar`` (default 1.5x the target alone):
``lift_fixed_k`` for a fixed K alone, ``lift_with_stop`` with the stop's gain. ``step1_needed`` is the first step's
acceptance then.

With ``--old-tokens`` and ``--new-tokens`` (the training tokens of the result's ``eagle_old`` and ``eagle`` heads),
``data_multiple`` extrapolates the first step's gain between the two heads log-linearly in tokens: the multiple of
the new head's data at which the first step would reach ``step1_needed``. Two points and two different recipes:
read it as an order of magnitude.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))  # _common, beside the benchmarks
from _common import run_info, write_result  # noqa: E402


def tokens_per_call(acc: list[float], k: int) -> float:
    kept, run = 1.0, 1.0
    for a in acc[:k]:
        run *= a
        kept += run
    return kept


def best_fixed_k(acc: list[float], t_target: list[float], t_draft: float) -> tuple[float, int]:
    """The predicted best fixed-K ratio to the target alone and its K (K up to the steps measured)."""
    ks = range(1, min(len(acc), len(t_target) - 1) + 1)
    return max((t_target[0] * tokens_per_call(acc, k) / (t_target[k] + k * t_draft), k) for k in ks)


def lift_for(acc: list[float], t_target: list[float], t_draft: float, scale: float, bar: float) -> float | None:
    """The smallest lift of every step's acceptance (capped at 0.999) at which ``scale`` x the predicted best
    ratio reaches ``bar``; None when even acceptance 0.999 everywhere does not."""

    def ratio(lift: float) -> float:
        return scale * best_fixed_k([min(a + lift, 0.999) for a in acc], t_target, t_draft)[0]

    if ratio(0.0) >= bar:
        return 0.0
    if ratio(1.0) < bar:
        return None
    lo, hi = 0.0, 1.0
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if ratio(mid) >= bar else (mid, hi)
    return hi


def _all_identical(row: dict) -> bool:
    same, _, of = str(row.get("identical_to_target", "")).partition("/")
    return bool(of) and same == of


def need(name: str, data: dict, costs: dict, head: str, bar: float) -> dict:
    rows = {r["config"]: r for r in data["table"]}
    acc = [float(a) for a in data["acceptance_by_step"][head]]
    t_target, t_draft = [float(t) for t in costs["t_target_ms"]], float(costs["t_draft_ms"])
    ar = rows["ar"]["tokens_per_s"]
    fixed = {int(c.removeprefix(f"{head}_k")): r for c, r in rows.items() if c.removeprefix(f"{head}_k").isdigit()}
    if not fixed:
        raise SystemExit(f"{name}: the result has no {head}_kK rows to calibrate on")
    k_best = max(fixed, key=lambda k: fixed[k]["tokens_per_s"])
    measured_fixed = fixed[k_best]["tokens_per_s"] / ar
    predicted = t_target[0] * tokens_per_call(acc, k_best) / (t_target[k_best] + k_best * t_draft)
    lossless = [r for c, r in rows.items() if c.startswith(head) and _all_identical(r)]
    best = max(lossless, key=lambda r: r["tokens_per_s"])
    calibration, stop_gain = measured_fixed / predicted, max(best["tokens_per_s"] / fixed[k_best]["tokens_per_s"], 1.0)
    out = {
        "acceptance_by_step": acc,
        "measured_best_fixed_k": {"row": f"{head}_k{k_best}", "vs_target": round(measured_fixed, 4)},
        "measured_best_lossless": {"row": best["config"], "vs_target": round(best["tokens_per_s"] / ar, 4)},
        "predicted_at_measured_k": round(predicted, 4),
        "calibration": round(calibration, 4),
        "stop_gain": round(stop_gain, 4),
    }
    for key, scale in (("fixed_k", calibration), ("with_stop", calibration * stop_gain)):
        lift = lift_for(acc, t_target, t_draft, scale, bar)
        out[f"lift_{key}"] = None if lift is None else round(lift, 4)
        out[f"step1_needed_{key}"] = None if lift is None else round(min(acc[0] + lift, 0.999), 4)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--result", default=str(ROOT / "bench/results/draft_head.json"), help="a draft_head.py result")
    ap.add_argument("--head", default="eagle", help="the rows' name in the result (eagle)")
    ap.add_argument("--bar", type=float, default=1.5, help="lossless speed to reach, x the target alone")
    ap.add_argument("--old-tokens", type=float, default=0, help="training tokens of the result's eagle_old head")
    ap.add_argument("--new-tokens", type=float, default=0, help="training tokens of the result's eagle head")
    ap.add_argument("--out", default=str(ROOT / "bench/studies/results/eagle_need.json"))
    args = ap.parse_args(argv)
    if not Path(args.result).is_file():
        ap.error(f"--result {args.result}: no such file (run bench/draft_head.py first)")
    src = json.loads(Path(args.result).read_text())
    costs = (src.get("cost_tables") or {}).get(args.head)
    if not costs:
        ap.error(f"--result {args.result} has no cost_tables.{args.head}")
    result = {
        **run_info(__file__, argv, "no model run: a draft_head.py result's measured costs and acceptance"),
        "source": {"result": args.result, "command": src.get("command"), "cpu": src.get("cpu")},
        "bar": args.bar,
        "sets": {},
    }
    for name, data in src["sets"].items():
        row = need(name, data, costs, args.head, args.bar)
        old = data["acceptance_by_step"].get(f"{args.head}_old")
        if old and args.old_tokens > 0 and args.new_tokens > args.old_tokens:
            per_log = (row["acceptance_by_step"][0] - old[0]) / math.log(args.new_tokens / args.old_tokens)
            want = row["step1_needed_with_stop"]
            row["step1_old_head"] = old[0]
            row["data_multiple"] = (
                None
                if want is None or per_log <= 0
                else round(math.exp((want - row["acceptance_by_step"][0]) / per_log), 1)
            )
        result["sets"][name] = row
    print(f"cpu: {src.get('cpu')}; bar {args.bar}x the target alone, lossless")
    print("set | best fixed K (measured) | best lossless | step 1 now | lift: fixed K / with stop | step 1 needed")
    for name, r in result["sets"].items():
        print(
            f"{name} | {r['measured_best_fixed_k']['row']} {r['measured_best_fixed_k']['vs_target']} | "
            f"{r['measured_best_lossless']['row']} {r['measured_best_lossless']['vs_target']} | "
            f"{r['acceptance_by_step'][0]:.3f} | {r['lift_fixed_k']} / {r['lift_with_stop']} | "
            f"{r['step1_needed_with_stop']}" + (f" | data x{r['data_multiple']}" if "data_multiple" in r else "")
        )
    write_result(args.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
