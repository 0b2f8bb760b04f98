"""Reliability benchmark on the shared pair: SIGKILL/resume trials, 1 vs 2 processes, peak host memory.

    python bench/reliability.py                          # every part, writes bench/results/reliability.json
    python bench/reliability.py --parts rss --rss-prompts 10000
    python bench/reliability.py --parts kill,procs,train --kill-trials 10

Parts (each writes its keys into the result file, the others are kept):

``procs``: ``heads-datagen`` on the same prompts with 1 process and with 2 (``accelerate launch
--multi_gpu --num_processes 2`` on a machine without GPUs: two CPU processes, gloo): are the chunk
files byte-identical?

``kill``: the same datagen command killed with SIGKILL at random points ``--kill-trials`` times,
alternating 1 and 2 processes, each time restarted; then run to the end. Counts prompts lost
(neither labelled nor skipped) and duplicated (labelled more than once), runs ``heads-datagen
verify``, and compares the files with the uninterrupted run.

``train``: ``heads-train`` (acceptance head) on that data: uninterrupted vs SIGKILLed after its
first checkpoint and resumed (same head, bit for bit?), and 1 process with ``grad_accum=2`` vs
2 processes with ``grad_accum=1`` (the same examples per step; the largest weight difference).

``rss``: ``heads-datagen`` over ``--rss-prompts`` prompts (GSM8K-train then Alpaca; one new token
each, so the prompts' prefill dominates): peak RSS of the process, and its RSS when the first
10% and the last of the chunks were written (bounded memory: the two are about equal).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

from _common import run_info

ROOT = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("SPECHEADS_SHARED", ROOT.parent / "shared"))
ENV = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONUNBUFFERED": "1"}
# Two CPU processes, DDP over gloo: `--multi_gpu` on a machine without GPUs. (`--cpu --num_processes 2`
# starts ONE process in accelerate 1.x unless an MPI hostfile is given.)
LAUNCH2 = [
    sys.executable,
    "-m",
    "accelerate.commands.launch",
    "--multi_gpu",
    "--num_processes",
    "2",
    "--num_machines",
    "1",
    "--mixed_precision",
    "no",
    "--dynamo_backend",
    "no",
]


def _datagen_args(out: Path, n: int) -> list[str]:
    return [
        "recipe=specdecpp_draft_quickstart",
        f"prompts={SHARED}/data/gsm8k/train.jsonl",
        f"num_prompts={n}",
        "max_new_tokens=8",
        "batch_size=4",
        "chunk_size=4",
        "sampling.do_sample=true",
        f"output_dir={out}",
    ]


def _cmd(args: list[str], procs: int, module: str = "specheads.datagen.cli") -> list[str]:
    return ([sys.executable] if procs == 1 else LAUNCH2) + ["-m", module, *args]


def _run(cmd: list[str], env: dict | None = None) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env or ENV, cwd=ROOT)
    if proc.returncode:
        raise SystemExit(f"failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stderr[-3000:]}")


def _shas(out: Path) -> dict:
    from specheads import dataset
    from specheads.outputs import file_sha256

    return {p.name: file_sha256(p) for p in dataset.chunk_files(out)}


def _coverage(out: Path, n: int) -> dict:
    import pyarrow.parquet as pq

    from specheads import dataset

    seen: dict[int, int] = {}
    skipped = set()
    for path in dataset.chunk_files(out):
        for i in pq.read_table(path, columns=["prompt_index"]).column("prompt_index").to_pylist():
            seen[i] = seen.get(i, 0) + 1
        skipped |= {s["prompt_index"] for s in dataset.chunk_info(path).get("skipped", [])}
    return {"lost": len(set(range(n)) - set(seen) - skipped), "duplicated": sum(k - 1 for k in seen.values() if k > 1)}


def _chunks_done(out: Path):
    return lambda: len(list(out.glob("data/chunk-*.parquet")))


def _checkpoint_step(out: Path):
    """The step of the checkpoint ``latest`` points at (old checkpoints are pruned: count steps, not folders)."""

    def step() -> int:
        try:
            return int((out / "latest").read_text().strip().split("-")[1])
        except (OSError, IndexError, ValueError):
            return 0

    return step


def _kill_at_random(cmd: list[str], progress, rng: random.Random, unit: int = 1) -> bool:
    """Starts ``cmd`` and SIGKILLs the launcher and every process under it once ``progress()`` has grown
    by a random 1-3 ``unit`` and a random 0-0.5 s more. True if it was still running then."""
    before = progress()
    proc = subprocess.Popen(
        cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=ENV, cwd=ROOT, start_new_session=True
    )
    want, deadline = before + unit * rng.randint(1, 3), time.time() + 900
    while proc.poll() is None and progress() < want and time.time() < deadline:
        time.sleep(0.01)
    time.sleep(rng.uniform(0.0, 0.5))
    killed = proc.poll() is None
    if killed:
        _kill_tree(proc.pid)
    proc.wait()
    return killed


def _kill_tree(pid: int) -> None:
    """SIGKILL ``pid`` and its descendants (torch elastic starts its workers in sessions of their own)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
        except (OSError, IndexError, ValueError):
            continue
    todo, tree = [pid], []
    while todo:
        p = todo.pop()
        tree.append(p)
        todo += children.get(p, [])
    for p in tree:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


def part_procs(work: Path, n: int) -> dict:
    one, two = work / "dg-1proc", work / "dg-2proc"
    t0 = time.perf_counter()
    _run(_cmd(_datagen_args(one, n), 1))
    t1 = time.perf_counter()
    _run(_cmd(_datagen_args(two, n), 2))
    t2 = time.perf_counter()
    same = _shas(one) == _shas(two)
    print(f"datagen {n} prompts: 1 process {t1 - t0:.0f} s, 2 processes {t2 - t1:.0f} s, identical files: {same}")
    return {
        "datagen_1_vs_2_processes": {
            "prompts": n,
            "chunks": len(_shas(one)),
            "identical_files": same,
            "seconds_1_process": round(t1 - t0, 1),
            "seconds_2_processes": round(t2 - t1, 1),
        }
    }


def part_kill(work: Path, n: int, trials: int, seed: int) -> dict:
    ref, out = work / "dg-1proc", work / "dg-killed"
    if not ref.is_dir():
        _run(_cmd(_datagen_args(ref, n), 1))
    rng = random.Random(seed)
    kills, log = 0, []
    for t in range(trials):
        procs = 1 + t % 2
        killed = _kill_at_random(_cmd(_datagen_args(out, n), procs), _chunks_done(out), rng)
        kills += killed
        done = len(list(out.glob("data/chunk-*.parquet")))
        log.append({"trial": t, "processes": procs, "killed": killed, "chunks_after": done})
        print(f"trial {t}: {procs} process(es), killed={killed}, {done} chunks written")
    _run(_cmd(_datagen_args(out, n), 2))  # finish with 2 processes
    cov = _coverage(out, n)
    check = subprocess.run(
        [sys.executable, "-m", "specheads.datagen.cli", "verify", f"output_dir={out}"],
        capture_output=True,
        text=True,
        env=ENV,
        cwd=ROOT,
    )
    print(check.stdout.strip())
    return {
        "datagen_kill_trials": trials,
        "datagen_kills_landed": kills,
        "datagen_lost": cov["lost"],
        "datagen_duplicated": cov["duplicated"],
        "datagen_verify_exit": check.returncode,
        "datagen_verify_output": check.stdout.strip().splitlines()[-1],
        "datagen_killed_equals_uninterrupted": _shas(out) == _shas(ref),
        "datagen_kill_log": log,
    }


def _train_args(data: Path, out: Path, n: int, *extra: str) -> list[str]:
    # n_eval = 8 + n % 8 held-out prompts leave a multiple of 8 = batch_size x 2 training examples: an
    # epoch is padded to a multiple of batch_size x processes, so 1 and 2 processes then see the same
    # examples at every step
    n_eval = 8 + n % 8
    return [
        "recipe=specdecpp_draft_quickstart",
        f"data_dir={data}",
        "epochs=3",
        "patience=10",
        "batch_size=4",
        f"eval_fraction={n_eval / n!r}",
        f"output_dir={out}",
        *extra,
    ]


def _head(path: Path):
    from safetensors.torch import load_file

    return load_file(str(path / "head.safetensors"))


def part_train(work: Path, n: int, seed: int) -> dict:
    from specheads.train.config import TrainConfig

    data = work / "dg-1proc"
    if not data.is_dir():
        _run(_cmd(_datagen_args(data, n), 1))
    mid = ["checkpoint_every=2"] if "checkpoint_every" in TrainConfig.__dataclass_fields__ else []
    full, cut = work / "tr-full", work / "tr-killed"
    _run(_cmd(_train_args(data, full, n, *mid), 1, "specheads.train.cli"))
    rng = random.Random(seed)
    kills = 0
    for _ in range(3):  # killed a random moment after 1-3 new checkpoints, up to three times
        if (cut / "head.safetensors").exists() and (cut / "manifest.json").exists():
            break
        kills += _kill_at_random(
            _cmd(_train_args(data, cut, n, *mid), 1, "specheads.train.cli"),
            _checkpoint_step(cut),
            rng,
            unit=2 if mid else 1,
        )
    _run(_cmd(_train_args(data, cut, n, *mid), 1, "specheads.train.cli"))
    a, b = _head(full), _head(cut)
    identical = a.keys() == b.keys() and all(bool((a[k] == b[k]).all()) for k in a)
    # One thread per process in both runs (accelerate launch sets OMP_NUM_THREADS=1 for each of its
    # processes): the draft's features then come from the same kernels, and the all-reduce's mean
    # (g1 + g2) / 2 equals the accumulated g1 / 2 + g2 / 2 exactly. With 2 threads in the single
    # process the features differ in the last bits, and Adam turns that into visibly different
    # weights wherever a gradient is near zero (update ~ +-lr).
    one, two = work / "tr-1proc-accum2", work / "tr-2proc"
    single = {**ENV, "OMP_NUM_THREADS": "1"}
    _run(_cmd(_train_args(data, one, n, "grad_accum=2"), 1, "specheads.train.cli"), single)
    _run(_cmd(_train_args(data, two, n, "grad_accum=1"), 2, "specheads.train.cli"), single)
    x, y = _head(one), _head(two)
    diff = max(float((x[k].float() - y[k].float()).abs().max()) for k in x)
    evals = {
        name: json.loads((d / "best_metrics.json").read_text())
        for name, d in (("1_process", one), ("2_processes", two))
    }
    print(f"train kill/resume identical: {identical} ({kills} kills); 1 vs 2 processes max |dw| = {diff:.2e}")
    return {
        "train_resume_identical": identical,
        "train_kills_landed": kills,
        "train_checkpoint_every": mid[0].split("=")[1] if mid else "epoch",
        "train_1_vs_2_processes": {
            "max_abs_weight_diff": diff,
            "identical": diff == 0.0,
            "best_eval": {
                k: {m: v.get(m) for m in ("epoch", "eval_binary_kl", "eval_auroc")} for k, v in evals.items()
            },
            "setting": "1 process grad_accum=2 vs 2 processes grad_accum=1 "
            "(accelerate launch --multi_gpu without GPUs: gloo DDP), "
            "same examples per optimizer step, OMP_NUM_THREADS=1 in both",
        },
    }


def _rss_kb(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def part_rss(work: Path, n: int) -> dict:
    out = work / f"rss-{n}"
    gsm = min(n, 7473)
    prompts = f"{SHARED}/data/gsm8k/train.jsonl" + (f",{SHARED}/data/alpaca/alpaca_5000.json" if n > gsm else "")
    per_file = gsm if n <= gsm else n // 2
    if per_file * (2 if n > gsm else 1) != n:
        raise SystemExit("--rss-prompts: use up to 7473, or an even number up to 10000")
    args = [
        "recipe=specdecpp_draft_quickstart",
        f"prompts={prompts}",
        f"num_prompts={per_file}",
        "max_new_tokens=1",
        "batch_size=32",
        "chunk_size=64",
        f"output_dir={out}",
    ]
    cmd = _cmd(args, 1)
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=ENV, cwd=ROOT)
    total = -(-n // 64)
    samples = []  # (chunks written, rss kB)
    while True:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            break
        samples.append((len(list(out.glob("data/chunk-*.parquet"))), _rss_kb(proc.pid)))
        time.sleep(1.0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode:
        raise SystemExit(f"datagen failed ({proc.returncode}): {' '.join(cmd)}")
    peak_kb = usage.ru_maxrss  # kB on Linux: the child's own high-water mark
    early = max((r for c, r in samples if c <= max(1, total // 10)), default=0)
    late = max((r for c, r in samples if c >= total - 1), default=0)
    manifest = json.loads((out / "manifest.json").read_text())
    print(
        f"{n} prompts: peak RSS {peak_kb / 1024:.0f} MiB; RSS up to 10% of chunks {early / 1024:.0f} MiB, "
        f"at the end {late / 1024:.0f} MiB; {time.perf_counter() - t0:.0f} s"
    )
    return {
        "peak_rss_10k_prompts" if n == 10000 else f"peak_rss_{n}_prompts": {
            "prompts": manifest["prompts_read"],
            "peak_rss_mib": round(peak_kb / 1024, 1),
            "rss_first_10pct_chunks_mib": round(early / 1024, 1),
            "rss_last_chunks_mib": round(late / 1024, 1),
            "chunks": manifest["chunks"],
            "seconds": round(time.perf_counter() - t0, 1),
            "command": f"python bench/reliability.py --parts rss --rss-prompts {n}",
            "setting": f"heads-datagen recipe=specdecpp_draft_quickstart, "
            f"{'GSM8K-train + Alpaca' if n > gsm else 'GSM8K-train'} prompts, "
            "max_new_tokens=1, batch_size=32, chunk_size=64, 1 process, fp32 on CPU",
        }
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", default="procs,kill,train,rss")
    ap.add_argument("--prompts", type=int, default=96, help="prompts of the procs/kill/train runs")
    ap.add_argument("--kill-trials", type=int, default=8)
    ap.add_argument("--rss-prompts", type=int, default=10000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--work", default="/tmp/specheads-reliability")
    ap.add_argument("--out", default=str(ROOT / "bench/results/reliability.json"))
    args = ap.parse_args(argv)
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    work = Path(args.work)
    import shutil

    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    out = Path(args.out)
    result = {}
    for part in parts:
        t0 = time.perf_counter()
        if part == "procs":
            got = part_procs(work, args.prompts)
        elif part == "kill":
            got = part_kill(work, args.prompts, args.kill_trials, args.seed)
        elif part == "train":
            got = part_train(work, args.prompts, args.seed)
        elif part == "rss":
            got = part_rss(work, args.rss_prompts)
        else:
            raise SystemExit(f"unknown part {part!r}: choose from procs, kill, train, rss")
        # re-read at write time: parts run as separate invocations keep each other's keys
        result = json.loads(out.read_text()) if out.is_file() else {}
        result.update(got)
        result.setdefault("runs", {})[part] = {
            **run_info(__file__, argv, "subprocesses on CPU"),
            "seconds": round(time.perf_counter() - t0, 1),
        }
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k not in ("runs", "datagen_kill_log")}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
