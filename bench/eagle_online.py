"""An EAGLE head trained on states stored (offline), made while it trains (online) or made once and cached (hybrid), on
the shared target: the loss curves side by side, the disk each takes, peak memory and speed; the same with the states
streamed from vLLM at tensor parallelism 3; and the plans of the Llama-3.1 recipes.

    python bench/eagle_online.py                                  # the Transformers target in the training process
    python bench/eagle_online.py --vllm-python ../vllm-venv/bin/python   # and vLLM (TP 3) streaming the states

1. ``heads-datagen recipe=eagle_smollm2`` (``engine=specheads``) on ``--n`` GSM8K-train prompts twice: with the states
   (``offline`` data) and with ``drafter.store_states=false`` (``ids`` data: ids and top-k only); ``disk_ratio`` is
   their sizes' ratio, and the two must hold the same ids and top-k.
2. ``heads-train`` (the recipe's train section, ``--epochs`` epochs at 3 test-time steps), one process each:
   ``offline`` on the offline data, ``online`` and ``hybrid`` on the ids data; per mode its wall seconds, training
   tokens a second (sequence positions x epochs over the wall), peak RSS, and ``loss_rel_diff_max``: the largest
   ``|loss - offline loss| / offline loss`` over the optimizer steps (the bar: 1e-3).
3. ``--vllm-python``: datagen ``engine=vllm`` with the states, then ``offline`` on them and ``online`` with
   ``eagle.engine=vllm vllm.tensor_parallel=3`` (``VLLM_CPU_OMP_THREADS_BIND=0|1|0``: the shared target's 9 heads
   refuse 2).
4. ``plan``: ``heads-train plan=true`` of ``eagle_llama31_8b``, ``eagle_llama31_70b`` and the 405B shape on one node of
   8x80 GB (and 8x141 GB) for ``--conversations`` three-turn conversations: disk offline against online, the fullest
   GPU, what fits or is refused.
5. ``speculators_round_trip``: the figures of ``bench/results/speculators_round_trip.json`` (its own command).

Steps already done in ``--work`` are read back (rerun with ``--fresh`` to measure again). Writes
``bench/results/eagle_online.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
SHARED = Path(os.environ.get("SPECHEADS_SHARED", ROOT.parent / "shared"))
TOLERANCE = 1e-3


def _train(args, data: Path, out: Path, *extra: str, env: dict | None = None) -> dict:
    """One ``heads-train`` process (the recipe's train section): wall seconds, peak RSS, its loss rows, manifest."""
    done = out / "bench.json"
    if done.is_file():
        return json.loads(done.read_text())
    shutil.rmtree(out, ignore_errors=True)
    cmd = ["recipe=eagle_smollm2", f"data_dir={data}", f"output_dir={out}", f"epochs={args.epochs}", "patience=9"]
    cmd += ["eagle.ttt_steps=3", "batch_size=4", "eval_fraction=0.1", "checkpoint_every=0", "threads=2", *extra]
    code = f"import sys; from specheads.train.cli import main; sys.exit(main({cmd!r}))"
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-c", code], env={**os.environ, **(env or {})})
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    if os.waitstatus_to_exitcode(status):
        raise SystemExit(f"heads-train {' '.join(cmd)} failed")
    manifest = json.loads((out / "manifest.json").read_text())
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    positions = manifest["train_data"]["tokens"] * args.epochs
    got = {
        "wall_s": round(wall, 2),
        "tokens_per_s": round(positions / wall, 1),
        "peak_rss_mb": round(usage.ru_maxrss / 1024, 1),
        "states": manifest["states"],
        "losses": [r["loss"] for r in rows if "loss" in r],
        "accept_length": [r["eval_accept_length"] for r in rows if "eval_accept_length" in r],
    }
    done.write_text(json.dumps(got))
    return got


def _compare(base: dict, other: dict) -> float:
    if len(base["losses"]) != len(other["losses"]):
        raise SystemExit("the runs took other numbers of steps")
    return max(abs(a - b) / abs(a) for a, b in zip(base["losses"], other["losses"]))


def _datagen(args, out: Path, *extra: str) -> dict:
    from _common import run_datagen

    if (out / "manifest.json").is_file():
        return json.loads((out / "manifest.json").read_text())
    shutil.rmtree(out, ignore_errors=True)
    common = [f"prompts={args.prompts}", f"num_prompts={args.n}", f"offset={args.offset}", "chunk_size=16"]
    common += ["batch_size=8", f"max_new_tokens={args.max_new}"]
    return run_datagen("eagle_smollm2", [*common, *extra], out)[1]


def _disk(out: Path) -> int:
    return sum(p.stat().st_size for p in out.rglob("*") if p.is_file() and p.suffix in (".parquet", ".safetensors"))


def _same_labels(a: Path, b: Path) -> bool:
    from _common import rows

    from specheads.dataset import DrafterChunkFiles

    if [r["input_ids"] for r in rows(a)] != [r["input_ids"] for r in rows(b)]:
        return False
    chunks = sorted(p.stem.split("-")[1] for p in (a / "data").glob("chunk-*.parquet"))
    import torch

    for c in chunks:
        x, y = DrafterChunkFiles(a, int(c)).load(), DrafterChunkFiles(b, int(c)).load()
        if not all(torch.equal(x[k], y[k]) for k in ("top_ids", "top_logp", "offsets")):
            return False
    return True


def _plans(conversations: int, work: Path) -> dict:
    from specheads.plan import plan_figures

    path = work / "conversations.jsonl"
    path.write_text("".join('{"messages": [{"role": "user", "content": "q"}]}\n' for _ in range(conversations)))
    os.environ["CONVERSATIONS"] = str(path)
    l405 = ["target.path=meta-llama/Llama-3.1-405B-Instruct", "vllm.tensor_parallel=8"]
    out = {}
    for name, recipe, extra in [
        ("llama31_8b", "eagle_llama31_8b", []),
        ("llama31_70b", "eagle_llama31_70b", []),
        ("llama31_70b_141gb", "eagle_llama31_70b", ["gpu_memory_gb=141"]),
        ("llama31_405b", "eagle_llama31_70b", l405),
        ("llama31_405b_141gb", "eagle_llama31_70b", [*l405, "gpu_memory_gb=141"]),
        ("llama31_8b_offline_on_2tb", "eagle_llama31_8b", ["eagle.states=offline", "disk_gb=2000"]),
    ]:
        p = plan_figures("heads-train", recipe, extra)
        out[name] = {
            "overrides": extra,
            "processes": p["processes"],
            "fullest_gpu_gb": p["per_process_gb"]["fullest_gpu"],
            "usable_per_gpu_gb": p["per_process_gb"]["usable_per_gpu"],
            "eagle": p["eagle"],
            "fits": p["fits"],
            "refusal": p["refusal"],
        }
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", default=str(SHARED / "data/gsm8k/train.jsonl"))
    ap.add_argument("--offset", type=int, default=6000)
    ap.add_argument("--n", type=int, default=48)
    ap.add_argument("--max-new", type=int, default=64)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--conversations", type=int, default=300_000, help="plan: conversations (three turns each)")
    ap.add_argument("--vllm-python", default=None)
    ap.add_argument("--work", default=str(ROOT / "runs/eagle_online"))
    ap.add_argument("--fresh", action="store_true")
    ap.add_argument("--out", default=str(ROOT / "bench/results/eagle_online.json"))
    args = ap.parse_args(argv)
    from _common import run_info, write_result

    work = Path(args.work)
    if args.fresh:
        shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True, exist_ok=True)
    stored, ids = work / "data-stored", work / "data-ids"
    m_stored = _datagen(args, stored, "engine=specheads")
    _datagen(args, ids, "engine=specheads", "drafter.store_states=false")
    data = {
        "prompts": m_stored["prompts"],
        "response_tokens": m_stored["labelled_tokens"],
        "disk_offline_bytes": _disk(stored),
        "disk_online_bytes": _disk(ids),
        "same_ids_and_top_k": _same_labels(stored, ids),
    }
    data["disk_ratio"] = round(data["disk_offline_bytes"] / data["disk_online_bytes"], 2)
    modes = {
        "offline": _train(args, stored, work / "train-offline", "eagle.states=offline"),
        "online": _train(args, ids, work / "train-online", "eagle.states=online"),
        "hybrid": _train(args, ids, work / "train-hybrid", "eagle.states=hybrid"),
    }
    for name in ("online", "hybrid"):
        modes[name]["loss_rel_diff_max"] = _compare(modes["offline"], modes[name])
    result = {
        **run_info(__file__, argv, f"{args.n} GSM8K-train prompts from row {args.offset}, {args.max_new} new tokens"),
        "tolerance": TOLERANCE,
        "data": data,
        "modes": modes,
    }
    if args.vllm_python:
        vdata = work / "data-vllm"
        _datagen(args, vdata, "engine=vllm", f"vllm.python={args.vllm_python}")
        tp3 = ["eagle.states=online", "eagle.engine=vllm", f"vllm.python={args.vllm_python}", "vllm.tensor_parallel=3"]
        v = {
            "offline": _train(args, vdata, work / "train-vllm-offline", "eagle.states=offline"),
            "online_tp3": _train(
                args, vdata, work / "train-vllm-online-tp3", *tp3, env={"VLLM_CPU_OMP_THREADS_BIND": "0|1|0"}
            ),
        }
        v["online_tp3"]["loss_rel_diff_max"] = _compare(v["offline"], v["online_tp3"])
        result["vllm_tp3"] = v
    runs = [(k, m) for k, m in modes.items()] + [(f"vllm {k}", m) for k, m in result.get("vllm_tp3", {}).items()]
    result["table"] = [
        {
            "run": name,
            "mode": m["states"]["mode"],
            "engine": m["states"].get("engine"),
            "wall_s": m["wall_s"],
            "tokens_per_s": m["tokens_per_s"],
            "peak_rss_mb": m["peak_rss_mb"],
            "made_tokens": m["states"].get("made_tokens", 0),
            "loss_rel_diff_max": m.get("loss_rel_diff_max", 0.0),
            "final_accept_length": m["accept_length"][-1],
        }
        for name, m in runs
    ]
    diffs = [r["loss_rel_diff_max"] for r in result["table"]]
    result["loss_rel_diff_max"] = max(diffs)
    result["within_tolerance"] = max(diffs) <= TOLERANCE
    result["disk_ratio"] = data["disk_ratio"]
    result["plan"] = {
        "conversations": args.conversations,
        "cluster": "1 node x 8 GPUs",
        **_plans(args.conversations, work),
    }
    trip = ROOT / "bench/results/speculators_round_trip.json"
    if trip.is_file():
        t = json.loads(trip.read_text())
        result["speculators_round_trip"] = {
            "command": t.get("command"),
            **{k: v for k, v in t.items() if k not in ("command", "machine", "cpu")},
        }
    write_result(args.out, result)
    print(f"{'run':<16} {'wall s':>8} {'tok/s':>8} {'RSS MB':>8} {'loss rel diff':>14}")
    for r in result["table"]:
        print(
            f"{r['run']:<16} {r['wall_s']:>8.1f} {r['tokens_per_s']:>8.1f} {r['peak_rss_mb']:>8.0f} "
            f"{r['loss_rel_diff_max']:>14.2e}"
        )
    print(f"disk offline/online: {data['disk_ratio']}x ({data['disk_offline_bytes']} / {data['disk_online_bytes']})")
    for name, p in result["plan"].items():
        if isinstance(p, dict):
            print(f"plan {name}: {'fits' if p['fits'] else 'refused'}; disk GB {p['eagle']['disk_gb']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
