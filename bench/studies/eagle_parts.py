"""The EAGLE head's held-out acceptance per data part: which of the training data's sources the new head learned.

``heads-pipeline recipe=eagle_smollm2`` trains on several datagen parts (the target's self-written prompts,
Alpaca, GSM8K-train twice, ARC-train). Training holds out a seeded share of the sequences (``eval_fraction``,
``seed``: the same split as the training run's when both match it); this script cuts those held-out sequences
by part and measures each head on them, unrolled ``--steps`` draft steps on its own states exactly as training
evaluates: ``acc_by_step``, the greedy agreement with the target's top-1 at each draft step of the unroll
(step j drafts on the head's own states of steps 1..j-1), and ``accept_length``, the mean run of leading
matching steps: the tokens a greedy round at K = ``--steps`` keeps beside the target's own.
Every head reads the same rows (the old head trained on Alpaca rows 0-3839: its Alpaca row is not held out).

    python bench/studies/eagle_parts.py --heads new=runs/eagle-smollm2-export/head.safetensors,old=OLD.safetensors

Prints a table and writes ``bench/studies/results/eagle_parts.json``.
"""

from __future__ import annotations

import argparse
import bisect
import json
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from specheads.config import load_config
from specheads.train.config import TrainConfig
from specheads.train.eagle_task import EagleTask
from specheads.train.trainer import data_manifest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))  # _common, beside the benchmarks
from _common import run_info  # noqa: E402

PARTS = "self=runs/eagle-smollm2-data-selfanswers,alpaca=runs/eagle-smollm2-data-alpaca,gsm8k=runs/eagle-smollm2-data-gsm8k,gsm8k2=runs/eagle-smollm2-data-gsm8k2,arc=runs/eagle-smollm2-data-arc"  # noqa: E501


def pairs(spec: str) -> dict[str, str]:
    out = {}
    for item in filter(None, spec.split(",")):
        name, _, path = item.partition("=")
        if not path:
            raise SystemExit(f"error: {item!r} is not NAME=PATH")
        out[name] = path
    return out


def task_for(head: str, parts: dict[str, str], args) -> EagleTask:
    argv = [
        "recipe=eagle_smollm2",
        f"data_dir={','.join(parts.values())}",
        f"eagle.init_head={head}",
        f"eagle.ttt_steps={args.steps}",
        f"eval_fraction={args.eval_fraction}",
        f"seed={args.seed}",
        f"batch_size={args.batch_size}",
        "target.device=cpu",
    ]
    cfg = load_config(TrainConfig, "train", argv)
    return EagleTask.setup(cfg, data_manifest(cfg), SimpleNamespace(device=torch.device("cpu")))


def part_rows(task: EagleTask, parts: dict[str, str], cap: int) -> dict[str, list[int]]:
    """The held-out sequence indices of each part (at most ``cap`` each, the first by index)."""
    starts, first = [], 0
    for d in parts.values():  # DrafterData indexes the runs' sequences in order, chunk by chunk
        starts.append(first)
        first += sum(len(c.offsets) - 1 for c in task.data.chunks if str(c.parquet).startswith(str(Path(d)) + "/"))
    out: dict[str, list[int]] = {name: [] for name in parts}
    names = list(parts)
    for i in sorted(task.eval_examples):
        rows = out[names[bisect.bisect_right(starts, i) - 1]]
        if len(rows) < cap:
            rows.append(i)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--heads", required=True, help="NAME=head.safetensors,... (exported or trained EAGLE heads)")
    ap.add_argument("--parts", default=PARTS, help="NAME=datagen output_dir,... in the training run's order")
    ap.add_argument("--steps", type=int, default=6, help="draft steps unrolled")
    ap.add_argument("--eval-fraction", type=float, default=0.02, help="the training run's eval_fraction")
    ap.add_argument("--seed", type=int, default=0, help="the training run's seed")
    ap.add_argument("--max-rows", type=int, default=400, help="held-out sequences per part at most")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--out", default=str(ROOT / "bench/studies/results/eagle_parts.json"))
    args = ap.parse_args(argv)
    heads, parts = pairs(args.heads), pairs(args.parts)
    for path in [*heads.values(), *parts.values()]:
        if not Path(path).exists():
            ap.error(f"{path} does not exist (README: Drafters, heads-pipeline recipe=eagle_smollm2)")
    torch.manual_seed(0)
    table: dict[str, dict] = {}
    for name, path in heads.items():
        t0 = time.perf_counter()
        task = task_for(path, parts, args)
        head = task.build_head().eval()
        rows = part_rows(task, parts, args.max_rows)
        for part, idx in rows.items():
            got = task.evaluate(head, idx) if idx else {}
            table.setdefault(part, {"sequences": len(idx)})[name] = {
                "accept_length": round(got.get("eval_accept_length", 0.0), 4),
                "acc_by_step": [round(got.get(f"eval_acc_step{j}", 0.0), 4) for j in range(1, args.steps + 1)],
            }
        print(f"{name}: {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    names = list(heads)
    head = " ".join(f"{n + ' run':>10} {n + ' step1..' + str(args.steps):>36}" for n in names)
    print(f"{'part':8} {'rows':>5} {head}")
    for part, row in table.items():
        cells = [
            f"{row[n]['accept_length']:>10.3f} {' '.join(f'{a:.2f}' for a in row[n]['acc_by_step']):>36}" for n in names
        ]
        print(f"{part:8} {row['sequences']:>5} " + " ".join(cells))
    result = {
        **run_info(__file__, argv, "fp32, the training run's held-out sequences, teacher-forced target states"),
        "heads": heads,
        "parts": parts,
        "steps": args.steps,
        "eval_fraction": args.eval_fraction,
        "seed": args.seed,
        "by_part": table,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
