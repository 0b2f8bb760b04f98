"""How much of the stop plugin's ceiling any rule on the drafter's ``q(y)`` can reach: every one-constant threshold
on ``q``, the best chosen in hindsight per cell, priced by the same cost table of vLLM's steps as the fixed Ks and
the perfect rule.

Reads ``bench/vllm_stop.py``'s work directory (the prompts, the ``k<K>`` row's greedy outputs, the cost table and
the EAGLE head) and needs no vLLM: each request's drafts and ``q`` at every position are recomputed from the
Transformers target (``specheads.vllm.stop_check.reference_rounds``, the drafts the plugin's own match at 1.0), and
each cell is replayed in lock step as vLLM ran it (batch 1: one request at a time; batch 16: every request of the
set at once, the batch shrinking as they finish). A step costs ``t_t(B, mean length + 1)`` for the verification, the
first draft pass ``t_first(B)`` and ``t_d(B)`` for every further draft step the longest round needs; its requests
gain ``accepted + 1`` tokens each. Rules (each but ``perfect`` with at least one candidate, as the plugin without its
gate):

- ``k1..kK``: every round at K;
- ``perfect``: each round keeps exactly its accepted candidates, none if it accepts none (the ceiling of
  ``bench/vllm_stop.py``);
- ``cum>=tau``: keep candidates while ``prod q`` (the rules' survival estimate) is at least ``tau``;
- ``each>=tau``: keep candidates while each one's ``q`` is at least ``tau``;
- ``c-cost``: the plugin's cost rule on ``q`` (no gate, no batch cap), a check of these prices against the measured
  row; ``c-cost-calibrated``: the same rule on ``q`` mapped to the acceptance rate of its bin (20 bins) among the
  cell's candidates the target reached, the best calibration of ``q`` in hindsight;
- ``batch-optimal-calibrated``: every row's length chosen for the step together from the calibrated ``q`` of all
  ``K`` candidates, known before drafting (more than any rule knows), while the step's expected tokens per ms grow.

``tau`` runs over a grid; each cell reports the best of each family over the best fixed K, and its share of the
perfect rule's gain. The best threshold is chosen on the very rounds it is scored on, so it is an upper bound for a
rule on ``q`` with one constant, not a rule one could deploy.

    python bench/studies/vllm_stop_qceiling.py      # writes bench/studies/results/vllm_stop_qceiling.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TAUS = [round(0.05 * i, 2) for i in range(1, 20)]
RULES = ("c-cost", "c-cost-calibrated", "batch-optimal-calibrated")


def request_rounds(eagle, target, prompt: list[int], output: list[int], k: int):
    """Per row ``t`` of prompt + output: the ``k`` candidates' ``q`` and how many of them the target accepts."""
    import torch

    from specheads.vllm.stop_check import reference_rounds

    seq = prompt + output
    toks, logits, _ = reference_rounds(eagle, target, seq, k)
    q = torch.softmax(logits, -1).amax(-1)  # [rows, k]
    del logits
    match = []
    for t in range(toks.shape[0]):
        m, want = 0, seq[t + 2 : t + 2 + k]
        while m < len(want) and int(toks[t, m]) == want[m]:
            m += 1
        match.append(m)
    return q.tolist(), match


def simulate(requests: list[dict], lengths, table, first: dict, batch: int) -> float:
    """ms per generated token when the requests run ``batch`` at a time in lock step, each round's length from
    ``lengths(q_row, match)``."""
    ms = tokens = 0.0
    queue = list(range(len(requests)))
    while queue:
        live = queue[:batch]
        pos = {i: len(requests[i]["prompt"]) for i in live}
        while live:
            b = len(live)
            rows = [(requests[i]["q"][pos[i] - 1], requests[i]["match"][pos[i] - 1]) for i in live]
            if getattr(lengths, "batch", False):  # one decision for the step's rows together
                ls = lengths(rows, b)
            else:
                ls = [lengths(q, m) for q, m in rows]
            acc = [min(n, m) for n, (_, m) in zip(ls, rows)]
            ms += table.t_target(sum(ls) / b + 1, b) + first[b] + max(0, max(ls) - 1) * table.t_draft(b)
            for i, a in zip(live, acc):
                step = min(a + 1, len(requests[i]["prompt"]) + len(requests[i]["output"]) - 1 - pos[i])
                pos[i] += a + 1
                tokens += step
            live = [i for i in live if pos[i] + 1 < len(requests[i]["prompt"]) + len(requests[i]["output"])]
        queue = queue[batch:]
    return ms / tokens


def cum(tau: float, k: int):
    def f(q, match):
        s, n = 1.0, 0
        for j in range(k):
            s *= q[j]
            if n >= 1 and s < tau:
                break
            n += 1
        return n

    return f


def each(tau: float, k: int):
    def f(q, match):
        n = 0
        for j in range(k):
            if n >= 1 and q[j] < tau:
                break
            n += 1
        return n

    return f


def cost(table, b: int, k: int, calibrate=None):
    """The cost rule of ``c-cost`` (``specheads.shim.costs.cost_rules.draft_more``, no gate, at least one
    candidate) at batch ``b`` on ``q``, or on ``calibrate(q)``."""
    from specheads.shim.costs.cost_rules import draft_more

    def f(q, match):
        keep, total, n = 1.0, 0.0, 0
        for j in range(k):
            n += 1
            beta = calibrate(q[j]) if calibrate else q[j]
            keep *= beta
            total += keep
            if n >= k or not draft_more(table, n, n, keep, total, beta, b):
                break
        return n

    return f


def batch_optimal(table, first: dict, k: int, calibrate):
    """Every row's length chosen for the step together, knowing each row's calibrated survival ``S_i(j)`` of all
    ``k`` candidates before any is drawn (more than a rule can know): candidates added best first while the step's
    expected tokens per ms grow (at least one per row)."""

    def f(rows, b):
        ls, gains = [1] * b, []
        tokens = 0.0
        for i, (q, _) in enumerate(rows):
            s = 1.0
            for j in range(k):
                s *= calibrate(q[j])
                if j == 0:
                    tokens += 1 + s
                else:
                    gains.append((s, i, j + 1))
        gains.sort(reverse=True)

        def step_ms(lengths):
            return table.t_target(sum(lengths) / b + 1, b) + first[b] + (max(lengths) - 1) * table.t_draft(b)

        best, best_ls, cur = tokens / step_ms(ls), list(ls), list(ls)
        for g, i, j in gains:
            if cur[i] != j - 1:  # a row's candidates in order (S_i decreases along the row)
                continue
            cur[i] = j
            tokens += g
            rate = tokens / step_ms(cur)
            if rate > best:
                best, best_ls = rate, list(cur)
        return best_ls

    f.batch = True
    return f


def calibration(reqs: list[dict], k: int, bins: int = 20):
    """``q`` -> the share of candidates in its bin that the target accepted, of those whose earlier candidates it
    accepted (fitted on the very rounds it is scored on: the best calibration of ``q`` in hindsight)."""
    hit, seen = [0] * bins, [0] * bins
    for r in reqs:
        for qs, m in zip(r["q"], r["match"]):
            for j in range(min(k, m + 1)):
                i = min(int(qs[j] * bins), bins - 1)
                seen[i] += 1
                hit[i] += m > j
    rate = [(h + 0.5) / (n + 1) for h, n in zip(hit, seen)]
    return lambda q: rate[min(int(q * bins), bins - 1)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", default=str(ROOT / "runs/vllm_stop"))
    ap.add_argument("--out", default=str(ROOT / "bench/studies/results/vllm_stop_qceiling.json"))
    args = ap.parse_args(argv)
    import torch
    from transformers import AutoModelForCausalLM

    from specheads.export import speculators
    from specheads.machine import cpu_model
    from specheads.shim import load_table

    work = Path(args.work)
    run = json.loads((work / "runs-eagle3.json").read_text())
    prompts = json.loads((work / "prompts.json").read_text())
    costs = work / "costs-k6.table.json"
    table = load_table(costs)
    k = max(int(n[1:]) for n in next(iter(run["records"].values())) if n[0] == "k" and n[1:].isdigit())
    samples = json.loads(costs.read_text())["samples"]
    first_by = {int(key.split()[1]): statistics.median(v) for key, v in samples.items() if key.startswith("t_first")}
    sizes = sorted(first_by)

    def first_at(b: int) -> float:  # linear between the measured batch sizes
        lo = max([s for s in sizes if s <= b] or sizes[:1])
        hi = min([s for s in sizes if s >= b] or sizes[-1:])
        return first_by[lo] if hi == lo else first_by[lo] + (first_by[hi] - first_by[lo]) * (b - lo) / (hi - lo)

    torch.set_grad_enabled(False)
    eagle = speculators.read(work / "eagle3").module.float().eval()
    target = AutoModelForCausalLM.from_pretrained(work / "target_hf", dtype=torch.float32).eval()
    cache: dict = {}
    cells = {}
    for cell, rows in run["records"].items():
        name, batch = cell.split("/")
        b = int(batch[1:])
        reqs = []
        for rec in rows[f"k{k}"]:
            key = (name, rec["prompt"])
            if key not in cache:
                cache[key] = request_rounds(eagle, target, prompts[name][rec["prompt"]], rec["output"], k)
            q, match = cache[key]
            reqs.append({"prompt": prompts[name][rec["prompt"]], "output": rec["output"], "q": q, "match": match})
        first = {n: first_at(n) for n in range(1, b + 1)}
        priced = {f"k{n}": simulate(reqs, lambda q, m, n=n: n, table, first, b) for n in range(1, k + 1)}
        priced["perfect"] = simulate(reqs, lambda q, m: min(m, k), table, first, b)
        priced["c-cost"] = simulate(reqs, cost(table, b, k), table, first, b)
        cal = calibration(reqs, k)
        priced["c-cost-calibrated"] = simulate(reqs, cost(table, b, k, cal), table, first, b)
        priced["batch-optimal-calibrated"] = simulate(reqs, batch_optimal(table, first, k, cal), table, first, b)
        families = {"cum": cum, "each": each}
        grid = {f: {tau: simulate(reqs, make(tau, k), table, first, b) for tau in TAUS} for f, make in families.items()}
        best_k = min((n for n in priced if n.startswith("k")), key=priced.get)
        gain = priced[best_k] / priced["perfect"] - 1
        out = {
            "requests": len(reqs),
            "best_fixed_k": best_k,
            "ms_per_token": {n: round(v, 4) for n, v in priced.items()},
            "perfect_vs_best_fixed_k": round(priced[best_k] / priced["perfect"], 4),
        }
        for n in RULES:
            vs = priced[best_k] / priced[n]
            out[n] = {
                "vs_best_fixed_k": round(vs, 4),
                "share_of_ceiling": round((vs - 1) / gain, 3) if gain > 0 else None,
            }
        for f, by_tau in grid.items():
            tau = min(by_tau, key=by_tau.get)
            vs = priced[best_k] / by_tau[tau]
            out[f"best_{f}"] = {
                "tau": tau,
                "vs_best_fixed_k": round(vs, 4),
                "share_of_ceiling": round((vs - 1) / gain, 3) if gain > 0 else None,
            }
        cells[cell] = out
        print(
            f"{cell:14s} best {best_k} perfect x{out['perfect_vs_best_fixed_k']:.3f}  "
            + "  ".join(f"{f}>= {out[f'best_{f}']['tau']}: x{out[f'best_{f}']['vs_best_fixed_k']:.3f}" for f in grid)
            + "".join(f"  {n}: x{out[n]['vs_best_fixed_k']:.3f}" for n in RULES),
            flush=True,
        )
    largest = max(cells, key=lambda c: cells[c]["perfect_vs_best_fixed_k"])
    result = {
        "command": "python bench/studies/vllm_stop_qceiling.py",
        "cpu": cpu_model(),
        "machine": f"{platform.machine()}, torch {torch.__version__}; prices: {costs.name} of bench/vllm_stop.py",
        "taus": TAUS,
        "cells": cells,
        "largest_ceiling_cell": largest,
        "best_q_rule_there": max(
            (
                *(cells[largest][f"best_{f}"] | {"family": f} for f in ("cum", "each")),
                *(cells[largest][n] | {"family": n} for n in RULES[1:]),
            ),
            key=lambda x: x["vs_best_fixed_k"],
        ),
    }
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
