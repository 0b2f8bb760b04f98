"""Stop rules replayed on the same recorded rounds: how much of a perfect estimate's gain each rule takes, free of
the sampling noise that a measured tokens/s carries at temperature 1.

A measured row at temperature 1 draws its own tokens, so two rows on the same prompts differ by the draws as much as
by their rules (a few % on 500 tokens). Here every rule decides on the same rounds instead: ``heads-datagen
labels=eagle_rounds`` decodes held-out prompts (GSM8K-test, MT-Bench, Alpaca rows no training read) with the EAGLE
head at ``--k`` candidates per round and stores, per candidate, the drafter's ``q(y)``, entropy, state and the soft
label ``min(1, p/q)`` (greedy: 1/0 agreement), the chance that it is accepted given the ones before it. A rule that
drafts ``n`` candidates in a round yields ``1 + sum_{i<=n} prod_{j<=i} label_j`` tokens in expectation and costs
``n t_d + t_t(n + 1)`` (the cost table); a rule's figure is the expected ms per token over every round. Rules:
``k1..k<k>``; the confidence threshold on ``q(y)`` (``c<tau>``); the cost rule of the engine
(:func:`~specheads.shim.costs.cost_rules.draft_more`, the same code) on ``q(y)`` (``c-cost``), on AdaEDL's
entropy bound (``c-entropy-cost``) and on each learned head given (``h-cost``; ``hs-cost`` for a head trained
with ``eagle_stop.skip=true``; ``cq-cost`` for q calibrated on [log q, step]: each at its own lag, as the engine runs
it); the perfect estimates (the labels themselves read at lag 0 and lag 1: what no head can beat) and the per-round
oracle. vLLM's online estimate needs ``max q``, which the datagen run does not store: it is not replayed.

    python bench/studies/stop_replay.py --heads \
        greedy=runs/quickstart-export/head.safetensors,t1=runs/quickstart-export-t1/head.safetensors
    python bench/studies/stop_replay.py --regimes t1 --n 4 --heads t1=... --out /tmp/r.json   # a quick look

Writes ``bench/studies/results/stop_replay.json``: per regime and set the table (expected ms/token, tokens per
round, and each rule over the best fixed K) and ``head_vs_best_training_free`` / ``head_vs_best_fixed_k``
(expected tokens per ms), the perfect estimates' and the oracle's; the head's AUROC and ``q(y)``'s on the decided
candidates.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import torch

from specheads.datagen.cli import main as datagen_main
from specheads.export import load_head
from specheads.shim.costs.cost_rules import draft_more
from specheads.shim.costs.cost_table import CostTable
from specheads.shim.policies import SpecDecPP
from specheads.shim.policies.estimates import entropy_bound
from specheads.train.eagle_stop_task import StopStore

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))  # _common, beside the benchmarks
from _common import run_info, write_result  # noqa: E402

SHARED = Path(os.environ.get("SPECHEADS_SHARED", ROOT.parent / "shared"))
SETS = {  # past heads_pay.py's prompts, which are past every training run's
    "gsm8k": ("data/gsm8k/test.jsonl", 300),
    "mt_bench": ("data/mt_bench/question.jsonl", 50),
    "alpaca": ("data/alpaca/alpaca_5000.json", 4700),
}
REGIMES = {
    "greedy": ["sampling.do_sample=false"],
    "t1": ["sampling.do_sample=true", "sampling.temperature=1.0"],
    "t0.7": ["sampling.do_sample=true", "sampling.temperature=0.7"],
}
TAUS = (0.3, 0.4, 0.5, 0.6, 0.7)


def rounds_of(store: StopStore, scores: dict[str, torch.Tensor]) -> list[list[dict]]:
    """Per prompt, its rounds: per round the candidates' label, q, entropy bound and each head's score, in order."""
    step = store.extra["step"]
    out = []
    for e in store.examples:
        prompt, cur = [], None
        for i in range(e.start, e.end):
            if int(step[i]) == 1:
                cur = {"label": [], "q": [], "bound": [], **{k: [] for k in scores}}
                prompt.append(cur)
            assert cur is not None, "a round must start at step 1"
            cur["label"].append(float(store.labels[i]))
            cur["q"].append(float(store.confidence[i]))
            cur["bound"].append(entropy_bound(float(store.extra["q_entropy"][i]), 1.0))  # AdaEDL, gamma 1
            for k, v in scores.items():
                cur[k].append(float(v[i]))
        out.append(prompt)
    return out


def head_scores(path: str, store: StopStore) -> tuple[torch.Tensor, int]:
    """The head's acceptance estimate for every stored candidate, and its lag as the engine's policy takes it."""
    loaded = load_head(path)
    cfg = loaded.metadata["head_config"]
    head = loaded.module.float().eval()
    lag = SpecDecPP(head, 0.5, 1, 2, loaded.metadata.get("feature", {}).get("position", "own")).lag
    signals, out = tuple(cfg.get("signals") or ()), []
    with torch.no_grad():
        for e in store.examples:  # the features heads-train fed it (StopStore.batch)
            x, _ = store.batch([e], "cpu", bool(cfg.get("confidence")), signals, bool(cfg.get("hidden_size")))
            out.append(torch.sigmoid(head(x).float().reshape(-1)))
    return torch.cat(out), lag


def expected(rnd: dict, n: int) -> float:
    keep, total = 1.0, 1.0
    for y in rnd["label"][:n]:
        keep *= y
        total += keep
    return total


def cost_rule(table: CostTable, rnd: dict, key: str, lag: int, k_max: int, prompt_mean: list[float]) -> int:
    """Candidates the engine's cost rule drafts in this round with estimate ``key`` read at ``lag``."""
    betas = rnd[key]
    n = 1  # k_min = 1
    while n < k_max:
        scored = n - lag
        keep, total = 1.0, 0.0
        for b in betas[:scored]:
            keep *= b
            total += keep
        if scored > 0:
            beta = betas[scored - 1]
        else:
            beta = prompt_mean[0] / prompt_mean[1] if prompt_mean[1] else 1.0
        if not draft_more(table, n, scored, keep, total, beta):
            break
        n += 1
    for b in betas[: n - lag]:
        prompt_mean[0] += b
        prompt_mean[1] += 1
    return n


def threshold(values: list[float], tau: float, k_max: int) -> int:
    return next((i + 1 for i, v in enumerate(values[:k_max]) if v < tau), k_max)


def replay(table: CostTable, prompts: list[list[dict]], k_max: int, heads: dict[str, int]) -> dict[str, dict]:
    """Each rule's expected ms per token and tokens per round over ``prompts``."""
    rules: dict = {f"k{k}": lambda r, k=k: k for k in range(1, k_max + 1)}
    rules |= {f"c{tau}": lambda r, t=tau: threshold(r["q"], t, k_max) for tau in TAUS}
    stateful = {"c-cost": ("q", 0), "c-entropy-cost": ("bound", 0), "perfect-lag0": ("label", 0)}
    stateful |= {"perfect-lag1": ("label", 1)} | {name: (name, lag) for name, lag in heads.items()}
    out = {}
    for name in [*rules, *stateful, "oracle"]:
        cost = tokens = 0.0
        rounds = 0
        for prompt in prompts:
            mean = [0.0, 0]
            for r in prompt:
                m = min(k_max, len(r["label"]))
                if name == "oracle":
                    n = max(range(1, m + 1), key=lambda j: expected(r, j) / table.round_ms(j, 1))
                elif name in rules:
                    n = min(rules[name](r), m)
                else:
                    n = cost_rule(table, r, *stateful[name], m, mean)
                cost += table.round_ms(n, 1)
                tokens += expected(r, n)
                rounds += 1
        out[name] = {"ms_per_token": round(cost / tokens, 4), "tokens_per_round": round(tokens / rounds, 4)}
    return out


def auroc(scores: list[float], labels: list[float]) -> float | None:
    from sklearn.metrics import roc_auc_score

    hard = [y >= 0.5 for y in labels]
    return round(float(roc_auc_score(hard, scores)), 4) if 0 < sum(hard) < len(hard) else None


def summarise(rows: dict[str, dict], heads: dict[str, int]) -> dict:
    speed = {k: 1.0 / v["ms_per_token"] for k, v in rows.items()}
    fixed = max((k for k in speed if k[0] == "k"), key=speed.get)
    free = max((k for k in speed if k[0] == "c"), key=speed.get)
    out = {"best_fixed_k": fixed, "best_training_free": free}
    out["best_training_free_vs_best_fixed_k"] = round(speed[free] / speed[fixed], 4)
    for name in ("perfect-lag0", "perfect-lag1", "oracle", *heads):
        out[f"{name}_vs_best_fixed_k"] = round(speed[name] / speed[fixed], 4)
    for name in heads:
        out[f"{name}_vs_best_training_free"] = round(speed[name] / speed[free], 4)
        ceiling = speed[f"perfect-lag{heads[name]}"]  # the perfect rule with the head's own lag
        out[f"{name}_share_of_perfect_gain"] = (
            round((speed[name] - speed[fixed]) / (ceiling - speed[fixed]), 4) if ceiling > speed[fixed] else None
        )
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--heads", default="", help="regime=head.safetensors,... (lag-1 heads on the datagen's states)")
    ap.add_argument(
        "--calibrated", default="", help="regime=head.safetensors,...: q calibrated (eagle_stop.state=false)"
    )
    ap.add_argument(
        "--skip-heads", default="", help="regime=head.safetensors,...: heads trained with eagle_stop.skip=true"
    )
    ap.add_argument("--regimes", default="greedy,t1", help="comma-separated of: " + ", ".join(REGIMES))
    ap.add_argument("--sets", default=",".join(SETS), help="comma-separated of: " + ", ".join(SETS))
    ap.add_argument("--n", type=int, default=16, help="prompts per set")
    ap.add_argument("--max-new", type=int, default=128)
    ap.add_argument("--k", type=int, default=6, help="candidates per recorded round (the rules' k_max)")
    ap.add_argument("--costs", default=str(ROOT / "runs/quickstart-eval/sweep.json"), help="a sweep.json or cost table")
    ap.add_argument("--work", default="runs/stop_replay")
    ap.add_argument("--out", default=str(ROOT / "bench/studies/results/stop_replay.json"))
    args = ap.parse_args(argv)
    pairs = {
        flag: dict(x.split("=", 1) for x in getattr(args, flag).split(",") if x)
        for flag in ("heads", "calibrated", "skip_heads")
    }
    regimes, sets = args.regimes.split(","), args.sets.split(",")
    bad = [r for r in regimes if r not in REGIMES] + [s for s in sets if s not in SETS]
    if bad:
        print(f"stop_replay.py: error: unknown {bad}", file=sys.stderr)
        return 2
    raw = json.loads(Path(args.costs).read_text())
    table = CostTable.from_dict(raw.get("cost_table", raw))
    cells = {}
    for regime in regimes:
        for name in sets:
            path, offset = SETS[name]
            data = Path(args.work) / f"{regime}-{name}"
            code = datagen_main(
                [
                    "recipe=quickstart",
                    f"prompts={SHARED / path}",
                    f"offset={offset}",
                    f"num_prompts={args.n}",
                    f"max_new_tokens={args.max_new}",
                    f"eagle_rounds.k={args.k}",
                    f"output_dir={data}",
                    *REGIMES[regime],
                ]
            )
            if code:
                return code
            store = StopStore(data, signals=True)
            scores, lags = {}, {}
            for label, flag in (("h-cost", "heads"), ("cq-cost", "calibrated"), ("hs-cost", "skip_heads")):
                if pairs[flag].get(regime):
                    scores[label], lags[label] = head_scores(pairs[flag][regime], store)
            prompts = rounds_of(store, scores)
            rows = replay(table, prompts, args.k, lags)
            decided = store.decided(store.examples)
            cell = {"rounds": sum(len(p) for p in prompts), "table": rows, **summarise(rows, lags)}
            labels = store.labels[decided].tolist()
            cell["auroc_decided"] = {"q": auroc(store.confidence[decided].tolist(), labels)}
            for label, s in scores.items():
                cell["auroc_decided"][label] = auroc(s[decided].tolist(), labels)
            cells[f"{regime}/{name}"] = cell
            print(f"== {regime}/{name}: {json.dumps({k: v for k, v in cell.items() if k != 'table'})}", flush=True)
    ratios: dict = {}
    for label, key in (("h-cost", "head"), ("hs-cost", "skip_head")):
        got = [c[f"{label}_vs_best_training_free"] for c in cells.values() if f"{label}_vs_best_training_free" in c]
        if got:
            ratios[f"{key}_vs_best_training_free_min"] = min(got)
            ratios[f"{key}_vs_best_training_free_median"] = round(statistics.median(got), 4)
    for lag in (0, 1):  # the lag-matched ceiling over the best training-free rule (lag 0, free): a head's bound
        got = [
            round(c[f"perfect-lag{lag}_vs_best_fixed_k"] / c["best_training_free_vs_best_fixed_k"], 4)
            for c in cells.values()
        ]
        ratios[f"perfect_lag{lag}_vs_best_training_free_max"] = max(got)
        ratios[f"perfect_lag{lag}_vs_best_training_free_median"] = round(statistics.median(got), 4)
    result = {
        **run_info(__file__, argv, f"expected figures over recorded rounds, {args.n} prompts per set"),
        "cost_table": args.costs,
        "cells": cells,
        "ratios": ratios,
    }
    cols = ("best_training_free_vs_best_fixed_k", "h-cost_vs_best_fixed_k", "h-cost_vs_best_training_free")
    cols += ("hs-cost_vs_best_training_free", "cq-cost_vs_best_training_free")
    cols += ("perfect-lag0_vs_best_fixed_k", "perfect-lag1_vs_best_fixed_k")
    LABELS = ("free/K", "head/K", "head/free", "skip/free", "cq/free", "perf0/K", "perf1/K")  # noqa: N806
    print(f"\n{'cell':<16} {'best K':>6} {'free':>14} " + " ".join(f"{c:>9}" for c in LABELS))
    for key, c in cells.items():
        shown = " ".join(f"{c.get(col, '-'):>9}" for col in cols)
        print(f"{key:<16} {c['best_fixed_k']:>6} {c['best_training_free']:>14} {shown}")
    write_result(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
