"""How far a judge's discrimination has to go before it can pass the quality gate, measured on held-out mismatches.

    python bench/studies/judge_ceiling.py       # recipe judge_margin's runs: bench/studies/results/judge_ceiling.json

Reads a finished ``bench/judge.py --recipe judge_margin`` run (no model is run; a few seconds):

* ``operating_points``: on the training run's held-out mined mismatches (the prompts ``eval_fraction`` held out;
  each labelled by what swapping it in does to the final answer: harmless or important), the share of each
  class a rule accepts. Rules: the exported judge at each delta, the margin floor alone (accept when log p(y) is
  within ``floor`` nats of the target's top token: training-free), and the judge within each floor.
  ``auroc``: the judge's score against the target's own margin (``gap``) as the only score.
* ``drafters``: per drafter's heads-eval sweep, SD's mismatches per answer (rounds that discarded a token, at
  least ``discarded / k``: each such round rejects one token and discards at most ``k``), the share of tried
  mismatches mining found important, and from them the important-accept rate at which the expected share of
  changed answers reaches the gate's 2%: ``1 - (1 - r) ** important_per_answer = 0.02``. That ignores the
  interval (the gate reads the upper bound), so the real bar is stricter. Then, for each rule, the largest
  accepted-per-call gain its held-out harmless-accept rate could give at that important-accept rate or below,
  counting ``k`` tokens for each accepted mismatch (``gain_bound``: a round accepts at most ``k``; ``gain_estimate``
  counts the mismatch and then SD's accepted per call for the rest of the round), against the gain the issue asks
  for (``0.3 x`` SD's accepted per call: ``accepted_per_call_vs_sd >= 1.3``) and a perfect judge's bound. Each rule
  is tried at every threshold on its held-out logits (finer than delta, whose sigmoid saturates at 1.0).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from omegaconf import OmegaConf

from specheads.export.package import load_head
from specheads.train.config import TrainConfig
from specheads.train.judge_data import JudgeStore
from specheads.train.task import split

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))  # _common, beside the benchmarks
from _common import run_info, write_result  # noqa: E402

FLOORS = (None, 2.0, 1.0, 0.5, 0.25, 0.1)
DELTAS = (0.0, 0.5, 0.7, 0.9, 0.97, 0.99, 0.999)
GATE_CHANGED = 0.02
GAIN_VS_SD = 0.3


def held_out(train_dir: Path, head_path: Path) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The judge's logit (it accepts when the logit's sigmoid exceeds delta), the target's margin (log p(y) minus
    its top, <= 0) and whether it is harmless, of every held-out mismatch of the training run, split as it was."""
    cfg = OmegaConf.to_object(
        OmegaConf.merge(OmegaConf.structured(TrainConfig), OmegaConf.load(train_dir / "config.yaml"))
    )
    store = JudgeStore(cfg.data_dir, tuple(cfg.judge.signals))
    _, held = split(store.examples, cfg.eval_fraction, cfg.seed)
    x, y = store.batch(0, held, "cpu")
    head = load_head(head_path).module
    with torch.no_grad():
        logit = head(x).float().view(-1)  # logits: sigmoid saturates at 1.0 in fp32 where the head is most sure
    if "gap" not in cfg.judge.signals:
        raise SystemExit(f"{train_dir}: judge.signals {cfg.judge.signals} hold no gap; the floor needs it")
    gap = x[:, x.shape[1] - len(cfg.judge.signals) + list(cfg.judge.signals).index("gap")]
    return logit, gap, y >= 0.5


def rate(accept: torch.Tensor, mask: torch.Tensor) -> float:
    return float((accept & mask).sum() / mask.sum()) if mask.any() else float("nan")


def operating_points(logit, gap, harmless) -> list[dict]:
    """The table: the judge at each delta, each floor alone and the judge within each floor."""
    good, bad = harmless, ~harmless
    p = torch.sigmoid(logit)
    rows = []
    for floor in FLOORS:
        within = torch.ones_like(good) if floor is None else gap >= -floor
        for d in DELTAS if floor is not None else DELTAS[1:]:
            alone = floor is not None and d == 0.0  # the floor without the judge: training-free
            accept = within if alone else within & (p > d)
            rule = "judge" if floor is None else ("floor" if alone else "judge+floor")
            rows.append({"rule": rule, "floor": floor, "delta": d} | _shares(accept, good, bad))
    return rows


def roc_points(logit, gap, harmless) -> list[dict]:
    """Every operating point of each rule: the judge (and the judge within each floor) at every threshold on its
    logit at one of its held-out scores (finer than delta, which saturates), and each floor alone."""
    good, bad = harmless, ~harmless
    rows = []
    for floor in FLOORS:
        within = torch.ones_like(good) if floor is None else gap >= -floor
        if floor is not None:
            rows.append({"rule": "floor", "floor": floor, "delta": 0.0} | _shares(within, good, bad))
        for z in torch.unique(logit[within]).tolist():
            rule = "judge" if floor is None else "judge+floor"
            accept = within & (logit >= z)
            rows.append({"rule": rule, "floor": floor, "logit": round(z, 3)} | _shares(accept, good, bad))
    return rows


def _shares(accept, good, bad) -> dict:
    return {"harmless_accepted": round(rate(accept, good), 4), "important_accepted": round(rate(accept, bad), 4)}


def auroc(score: torch.Tensor, harmless: torch.Tensor) -> float:
    from sklearn.metrics import roc_auc_score

    return round(float(roc_auc_score(harmless.numpy(), score.numpy())), 4)


def sd_row(sweep_dir: Path, k: int) -> dict:
    """SD at ``k``'s totals from a heads-eval run's rows.jsonl (every prompt of the sweep)."""
    rows = [json.loads(line) for line in (sweep_dir / "rows.jsonl").read_text().splitlines() if line.strip()]
    mine = [r for r in rows if r["config"] == f"k{k}"]
    if not mine:
        raise SystemExit(f"{sweep_dir}: no row k{k}; run heads-eval with ks including {k}")
    tot = {key: sum(r[key] for r in mine) for key in ("prompts", "target_calls", "accepted", "discarded", "rounds")}
    answers = tot["prompts"]
    return {
        "config": f"k{k}",
        "prompts": answers,
        "accepted_per_call": round(tot["accepted"] / tot["target_calls"], 4),
        "calls_per_answer": round(tot["target_calls"] / answers, 3),
        "mismatches_per_answer_low": round(tot["discarded"] / k / answers, 3),
        "mismatches_per_answer_high": round(min(tot["rounds"], tot["discarded"]) / answers, 3),
    }


def drafter_bound(sd: dict, important_share: float, points: list[dict], held: dict, k: int) -> dict:
    """The gate's important-accept rate for this drafter and, per rule, the most accepted-per-call gain a rule
    within it could give (see the module docstring)."""
    mism = sd["mismatches_per_answer_low"]  # fewer mismatches: a looser bar, favouring the judge
    imp = important_share * mism
    r_max = 1 - (1 - GATE_CHANGED) ** (1 / imp) if imp > 0 else 1.0
    need = GAIN_VS_SD * sd["accepted_per_call"]
    harmless_per_call = (1 - important_share) * mism / sd["calls_per_answer"]
    best: dict[str, dict] = {}
    for row in points:
        if row["important_accepted"] > r_max:
            continue
        gain = row["harmless_accepted"] * harmless_per_call * k
        if gain > best.get(row["rule"], {}).get("gain_bound", -1):
            # estimate: the accepted mismatch, then the rest of the round goes on as SD's rounds do
            likely = row["harmless_accepted"] * harmless_per_call * (1 + sd["accepted_per_call"])
            best[row["rule"]] = {**row, "gain_bound": round(gain, 4), "gain_estimate": round(likely, 4)}
    return {
        "sd": sd,
        "important_per_answer": round(imp, 3),
        "important_accept_rate_max": round(r_max, 5),
        "held_out_resolution": round(1 / (held["mismatches"] - held["harmless"] + 1), 5),
        "gain_needed": round(need, 4),
        "perfect_judge_bound": round(harmless_per_call * k, 4),  # every harmless mismatch, no important one
        "best_within": best,
        "reachable": {rule: b["gain_bound"] >= need for rule, b in best.items()},
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--train", default="runs/judge_margin-train", help="the judge's heads-train run")
    ap.add_argument("--head", default="runs/judge_margin-export/head.safetensors", help="its exported head")
    ap.add_argument("--datagen", default="runs/judge_margin-datagen", help="the mining run (its manifest's counts)")
    ap.add_argument(
        "--sweeps",
        default="draft=runs/judge_margin-eval,eagle=runs/judge_margin-eval-eagle",
        help="NAME=heads-eval dir, comma-separated: the drafters' sweeps",
    )
    ap.add_argument("--k", type=int, default=4, help="SD's and the judge rows' draft length in the sweeps")
    ap.add_argument("--out", default=str(ROOT / "bench/studies/results/judge_ceiling.json"))
    args = ap.parse_args(argv)
    for path in (Path(args.train) / "config.yaml", Path(args.head), Path(args.datagen) / "manifest.json"):
        if not path.is_file():
            ap.error(f"{path} is missing: run python bench/judge.py --recipe judge_margin first")
    p, gap, harmless = held_out(Path(args.train), Path(args.head))
    counts = json.loads((Path(args.datagen) / "manifest.json").read_text())
    mined = counts.get("tuple_counts") or {}
    tried = mined.get("mismatches_tried")
    if not tried:
        ap.error(f"{args.datagen}/manifest.json holds no mismatches_tried: not a mining=swap run")
    important_share = mined["important"] / tried  # undetermined mismatches count as harmless: favours the judge
    points, roc = operating_points(p, gap, harmless), roc_points(p, gap, harmless)
    result = {
        **run_info(__file__, argv, "no model run: held-out mined mismatches and heads-eval rows"),
        "train_dir": args.train,
        "head": args.head,
        "held_out": {"mismatches": int(len(harmless)), "harmless": int(harmless.sum())},
        "auroc": {"judge": auroc(p, harmless), "gap_alone": auroc(gap, harmless)},
        "important_share_of_tried": round(important_share, 4),
        "gate_changed": GATE_CHANGED,
        "gain_vs_sd_needed": GAIN_VS_SD,
        "operating_points": points,
        "drafters": {},
    }
    for item in filter(None, args.sweeps.split(",")):
        name, _, path = item.partition("=")
        if not (Path(path) / "rows.jsonl").is_file():
            print(f"skipping {name}: {path}/rows.jsonl is missing")
            continue
        sd = sd_row(Path(path), args.k)
        result["drafters"][name] = drafter_bound(sd, important_share, roc, result["held_out"], args.k)
    print(f"held-out mismatches {len(harmless)} ({int(harmless.sum())} harmless); AUROC {result['auroc']}")
    print("rule | floor | delta | harmless accepted | important accepted")
    for r in points:
        print(f"{r['rule']} | {r['floor']} | {r['delta']} | {r['harmless_accepted']} | {r['important_accepted']}")
    for name, d in result["drafters"].items():
        print(
            f"{name}: important mismatches/answer {d['important_per_answer']}, gate's important-accept rate "
            f"<= {d['important_accept_rate_max']} (held-out resolution {d['held_out_resolution']}); gain needed "
            f"{d['gain_needed']}/call; bound per rule: "
            + ", ".join(f"{k} {b['gain_bound']}" for k, b in d["best_within"].items())
        )
    write_result(args.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
