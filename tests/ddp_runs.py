"""Training every head family with two processes (``accelerate launch``, DDP over gloo on the CPU): tiny data
per family, the launch, a kill after the first checkpoint, the head's tensors and a record of who wrote which
file. Used by tests/test_train_ddp.py and by bench/device_check.py.

:func:`build` makes a family's data on the plain CPU, with the settings of the family's own tests (the tiny
pair of ``conftest.py``; drafter data as tests/test_eagle_pipeline.py, eagle_rounds as tests/test_eagle_stop.py,
ratio labels as tests/test_sprinter_train.py, judge tuples as tests/test_judge_datagen.py), small enough that a
launch takes seconds and sized so that 2 x ``batch_size`` divides every family's training examples: the two
processes then see the micro-batches one process sees with ``grad_accum=2``.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch
from conftest import LABEL_PROMPTS

FAMILIES = ("acceptance", "eagle", "eagle_stop", "verifier", "judge", "draft")
# The largest |2-process head - 1-process head| each family may show (tests/test_train_ddp.py measures it):
# the two runs differ only in the summation order of the gradient (an all-reduce of two micro-batch means
# against their sum in one process), a few float32 ulps a step that Adam carries on.
TOLERANCE = dict.fromkeys((*FAMILIES, "eagle_hybrid"), 1e-5)
DDP = ["--multi_gpu", "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no"]
DDP += ["--dynamo_backend", "no"]


def zero(stage: int) -> list[str]:
    """The launcher arguments of the shipped DeepSpeed ZeRO config ``stage`` with two CPU processes."""
    from importlib.resources import files

    config = files("specheads.recipes") / "accelerate" / f"deepspeed_zero{stage}.yaml"
    return ["--config_file", str(config), "--num_processes", "2", "--mixed_precision", "no"]


LAUNCHERS = {"ddp": lambda: DDP, "zero2": lambda: zero(2), "zero3": lambda: zero(3)}
# DeepSpeed's optimizer steps on its flat fp32 partitions, in another order than torch's AdamW: a looser bound
ZERO_TOLERANCE = 1e-4
WORDS = "the cat dog sat on a mat and ran to big red blue sun moon one two three four five".split()

# sitecustomize for the launched processes (PYTHONPATH): with SPECHEADS_TEST_WRITES=<file> every rename
# (the project writes each finished file by one) is logged as "<pid> <file name>"; with
# SPECHEADS_TEST_SLOW_CACHE=<rank>:<seconds> that rank's feature-cache build sleeps before each batch.
_SITECUSTOMIZE = """
import importlib.machinery, os, sys, time

if os.environ.get("SPECHEADS_TEST_WRITES"):
    _replace = os.replace

    def _logged(src, dst, *args, **kwargs):
        _replace(src, dst, *args, **kwargs)
        with open(os.environ["SPECHEADS_TEST_WRITES"], "a") as f:
            f.write(f"{os.getpid()} {os.path.basename(os.fspath(dst))}\\n")

    os.replace = _logged

if os.environ.get("SPECHEADS_TEST_SLOW_CACHE"):
    _rank, _seconds = os.environ["SPECHEADS_TEST_SLOW_CACHE"].split(":")

    class _SlowCache:
        def find_spec(self, name, path, target=None):
            if name != "specheads.train.features" or os.environ.get("RANK", "0") != _rank:
                return None
            spec = importlib.machinery.PathFinder.find_spec(name, path)
            run = spec.loader.exec_module

            def exec_module(module):
                run(module)
                init = module.FeatureCache.__init__

                def slow_init(self, root, compute, batch_size):
                    def slow(*a, **k):
                        time.sleep(float(_seconds))
                        return compute(*a, **k)

                    init(self, root, slow, batch_size)

                module.FeatureCache.__init__ = slow_init

            spec.loader.exec_module = exec_module
            return spec

    sys.meta_path.insert(0, _SlowCache())
"""


def pair(root: Path) -> tuple[Path, Path]:
    """The tiny pair of ``conftest.tiny_pair`` (a 2-layer target and a noisy copy as its draft) as two
    directories."""
    from conftest import make_tokenizer, perturbed_copy, tiny_llama

    tok = make_tokenizer()
    target = tiny_llama(len(tok), seed=0)
    dirs = (root / "target", root / "draft")
    for path, model in zip(dirs, (target, perturbed_copy(target, scale=0.3))):
        model.save_pretrained(path)
        tok.save_pretrained(path)
    return dirs


def _datagen(pair_dirs, out: Path, prompts: list[str] | None, *extra: str) -> Path:
    from conftest import datagen_args

    from specheads.datagen.cli import main

    file = out.parent / f"{out.name}.jsonl"
    file.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts or []))
    assert main(datagen_args(pair_dirs, file, out, *extra)) == 0, f"heads-datagen {' '.join(extra)}"
    return out


def tiny_eagle_head(target_dir: Path, path: Path, layers: tuple[int, ...] = (1,)) -> Path:
    """An EAGLE head for the tiny target reading ``layers``, started from the target (tests/test_eagle_stop.py),
    written to ``path``."""
    from specheads.export import save_head
    from specheads.heads import EagleHead
    from specheads.shim import ModelSpec, load_pair
    from specheads.train.eagle_data import init_from_target

    target = load_pair(ModelSpec(path=str(target_dir), device="cpu"), None).target
    vocab = target.model.config.vocab_size
    head = EagleHead(
        hidden_size=32,
        layers=list(layers),
        draft_vocab_size=vocab,
        vocab_size=vocab,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        intermediate_size=64,
        rms_norm_eps=target.model.config.rms_norm_eps,
        rope_theta=10000.0,
    )
    init_from_target(head, target.model, list(range(vocab)), 0)
    feature = {"model": "target", "state": "aux", "layers": list(layers)}
    meta = {"head_config": head.config(), "hidden_size": 32, "feature": feature}
    meta["target"] = {"name": target.name, "fingerprint": target.fingerprint}
    save_head(path, head, "eagle", meta)
    return path


def build(family: str, root: Path, pair_dirs) -> Path:
    """The family's training data in ``root``, built once (a finished folder is reused)."""
    out = root / f"data-{family}"
    if (out / "manifest.json").is_file():
        return out
    target = [f"target.path={pair_dirs[0]}", "target.gguf_file=null", "target.device=cpu"]
    drafter = ["labels=drafter", "sampling.do_sample=false", "max_new_tokens=8", "drafter.top_k=5"]
    if family == "acceptance":
        return _datagen(pair_dirs, out, LABEL_PROMPTS, "max_new_tokens=10")
    if family in ("eagle", "draft"):
        return _datagen(pair_dirs, out, LABEL_PROMPTS, *drafter)
    if family == "eagle_hybrid":  # ids and top-k only: the states are made while it trains, and cached
        return _datagen(pair_dirs, out, LABEL_PROMPTS, *drafter, "drafter.store_states=false")
    if family == "eagle_stop":
        head = tiny_eagle_head(pair_dirs[0], root / "eagle.safetensors")
        rounds = ["draft.path=''", "labels=eagle_rounds", f"eagle_rounds.head={head}", "eagle_rounds.k=4"]
        return _datagen(
            pair_dirs, out, LABEL_PROMPTS, *target, *rounds, "max_new_tokens=14", "sampling.do_sample=false"
        )
    if family == "verifier":
        from conftest import SPRINTER_PROMPTS

        ratio = ["batch_size=4", "chunk_size=4", "labels=sprinter", "sampling.do_sample=false", "max_new_tokens=10"]
        return _datagen(pair_dirs, out, SPRINTER_PROMPTS * 2, *ratio)
    if family == "judge":
        rng, rows = random.Random(0), []
        for _ in range(16):
            correct, wrong = (" ".join(rng.choice(WORDS) for _ in range(6)) for _ in range(2))
            start = wrong.index(" ", 3) + 1
            question = " ".join(rng.choice(WORDS) for _ in range(4))
            rows.append({"question": question, "correct": correct, "wrong": wrong, "error": [start, start + 2]})
        tuples = root / "tuples.jsonl"
        tuples.write_text("".join(json.dumps(r) + "\n" for r in rows))
        judge = ["labels=judge", "chat_template=false", f"judge.tuples={tuples}", "prompts=''", "chunk_size=4"]
        return _datagen(pair_dirs, out, None, "max_new_tokens=8", *judge)
    raise ValueError(f"family={family!r}: choose one of {', '.join(FAMILIES)}")


def train_args(family: str, pair_dirs, data: Path, out: Path, *extra: str) -> list[str]:
    """``heads-train head=<family>`` on ``build``'s data: 2 epochs of batch 2 at one accumulation step, a
    checkpoint every optimizer step (so the first is mid-epoch), one thread per process."""
    head = "eagle" if family == "eagle_hybrid" else family
    common = [f"data_dir={data}", f"output_dir={out}", f"head={head}", "batch_size=2", "grad_accum=1"]
    common += ["epochs=2", "lr=1e-2", "patience=2", "checkpoint_every=1", "threads=1", "eval_fraction=0.2"]
    draft = [f"draft.path={pair_dirs[1]}", "draft.gguf_file=null", "draft.device=cpu"]
    target = [f"target.path={pair_dirs[0]}", "target.gguf_file=null", "target.device=cpu"]
    own = {
        "acceptance": [*draft, "depth=1"],
        "eagle": [*target, "lr=3e-3", "eagle.ttt_steps=2", "vocab_top_n=20"],
        "eagle_hybrid": [*target, "lr=3e-3", "eagle.ttt_steps=2", "vocab_top_n=20", "eagle.states=hybrid"],
        "eagle_stop": ["draft.path=''", "depth=1"],
        "verifier": [*draft, "depth=0", "eval_fraction=0.25", "threshold=0.5"],
        "judge": ["draft.path=unused", "depth=0", "eval_fraction=0.25", "threshold=0.5"],
        "draft": [*target, "distill.init=truncate:1", "lr=3e-3"],
    }[family]
    return [*common, *own, *extra]


def _env(extra: dict | None) -> dict:
    """The environment of a launch: no GPU, one thread, and the logging shim on PYTHONPATH."""
    shim = Path(os.environ.get("TMPDIR", "/tmp")) / f"specheads-shim-{os.getpid()}"
    shim.mkdir(exist_ok=True)
    (shim / "sitecustomize.py").write_text(_SITECUSTOMIZE)
    path = os.pathsep.join(p for p in (str(shim), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1", "PYTHONPATH": path, **(extra or {})}


def launch(args: list[str], launcher: list[str] = DDP, wait: bool = True, env: dict | None = None):
    """``accelerate launch <launcher> -m specheads.train.cli <args>`` on the CPU: the finished process, or
    (``wait=False``) the running one, in a session of its own."""
    cmd = [sys.executable, "-m", "accelerate.commands.launch", *launcher, "-m", "specheads.train.cli", *args]
    if wait:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=_env(env))
    return subprocess.Popen(
        cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=_env(env), start_new_session=True
    )


def kill_tree(pid: int) -> list[int]:
    """SIGKILLs ``pid`` and every process below it. The launcher's workers run in sessions of their own
    (torch elastic starts them with ``start_new_session``), so killing the launcher's process group
    alone would leave them training."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = open(f"/proc/{entry}/stat").read()
            except OSError:
                continue
            children.setdefault(int(stat.rsplit(")", 1)[1].split()[1]), []).append(int(entry))
    tree, todo = [], [pid]
    while todo:
        tree.append(todo.pop())
        todo += children.get(tree[-1], [])
    for p in tree:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return tree


def kill_after_first_checkpoint(proc, out: Path) -> None:
    """Waits for ``out/latest`` (the first checkpoint), then SIGKILLs the whole run; the run must not
    have finished by then, and the checkpoint must be mid-run."""
    deadline = time.time() + 300
    while not (out / "latest").exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.005)
    alive = proc.poll() is None
    kill_tree(proc.pid)
    proc.wait()
    assert alive, "the run ended before its first checkpoint"
    latest = out / (out / "latest").read_text().strip() / "state.json"
    assert json.loads(latest.read_text())["progress"]["done"] is False  # killed mid-run


def head_tensors(out: Path) -> dict[str, torch.Tensor]:
    """The trained head's tensors: ``head.safetensors``, or head=draft's model directory ``draft/``."""
    from safetensors.torch import load_file

    path = out / "head.safetensors"
    return load_file(str(path if path.is_file() else out / "draft" / "model.safetensors"))


def max_abs_diff(a: Path, b: Path) -> float:
    """The largest absolute difference between the heads of two training output folders (same tensors)."""
    x, y = head_tensors(a), head_tensors(b)
    assert x.keys() == y.keys(), sorted(x.keys() ^ y.keys())
    return max(float((x[k].double() - y[k].double()).abs().max()) if x[k].numel() else 0.0 for k in x)


def writers(log: Path, name: str) -> int:
    """How many processes renamed a file onto ``name`` (the ``SPECHEADS_TEST_WRITES`` log of a launch)."""
    lines = log.read_text().splitlines() if log.is_file() else []
    return len({pid for pid, file in (line.split(" ", 1) for line in lines) if file == name})


def check_family(family: str, root: Path, pair_dirs, launcher: str = "ddp") -> dict:
    """A family's two-process run (``launcher``: ``ddp``, ``zero2`` or ``zero3``) against its one-process run
    with the same global batch, and a two-process run SIGKILLed after its first (mid-epoch) checkpoint and
    rerun: ``max_abs_diff_ws2_vs_ws1``, ``tolerance``, ``manifests`` (the processes that wrote
    ``manifest.json``), ``resumed_after_kill_identical`` (bit for bit, also ``metrics.jsonl``), and what failed
    (``errors``), if anything."""
    from specheads.train.cli import main

    data, base = build(family, root, pair_dirs), root / f"{family}-{launcher}"
    errors = []
    log = base / "writes.log"
    base.mkdir(parents=True, exist_ok=True)
    how = LAUNCHERS[launcher]()
    env = {"DS_ACCELERATOR": "cpu"} if launcher != "ddp" else {}
    writes = {**env, "SPECHEADS_TEST_WRITES": str(log)}
    full = launch(train_args(family, pair_dirs, data, base / "ws2"), how, env=writes)
    if full.returncode:
        return {"errors": [f"2-process run: exit {full.returncode}: {full.stderr[-3000:]}"]}
    if main(train_args(family, pair_dirs, data, base / "ws1", "grad_accum=2")) != 0:
        return {"errors": ["1-process run failed"]}
    cut = base / "cut"
    try:
        kill_after_first_checkpoint(launch(train_args(family, pair_dirs, data, cut), how, wait=False, env=env), cut)
    except AssertionError as err:
        errors.append(f"kill: {err}")
    again = launch(train_args(family, pair_dirs, data, cut), how, env=env)
    if again.returncode or "resumed from" not in again.stderr:
        errors.append(f"rerun after the kill: exit {again.returncode}, no 'resumed from': {again.stderr[-3000:]}")
    identical = not again.returncode and max_abs_diff(base / "ws2", cut) == 0.0
    identical = identical and (base / "ws2" / "metrics.jsonl").read_bytes() == (cut / "metrics.jsonl").read_bytes()
    return {
        "max_abs_diff_ws2_vs_ws1": max_abs_diff(base / "ws2", base / "ws1"),
        "tolerance": TOLERANCE[family] if launcher == "ddp" else ZERO_TOLERANCE,
        "manifests": writers(log, "manifest.json"),
        "resumed_after_kill_identical": identical,
        "errors": errors,
    }


def cache_outlasts_the_timeout(root: Path, pair_dirs, seconds: float = 2.0, timeout_s: int = 4) -> dict:
    """``features=cached`` with two processes whose main process builds its feature files slowly (``seconds``
    before each batch, past ``dist_timeout_s=timeout_s`` in all): the run ends, with the same head as the
    same run built at full speed. Returns ``rc``, ``slowed_s`` (how much longer the slowed run took),
    ``same_head`` and the launch's last error lines (``error``)."""
    data = build("acceptance", root, pair_dirs)
    base = root / "cache-timeout"
    args = ["features=cached", f"dist_timeout_s={timeout_s}"]
    start = time.time()
    fast = launch(train_args("acceptance", pair_dirs, data, base / "fast", *args, f"cache_dir={base / 'c1'}"))
    fast_s = time.time() - start
    slow_env = {"SPECHEADS_TEST_SLOW_CACHE": f"0:{seconds}"}
    start = time.time()
    slow = launch(
        train_args("acceptance", pair_dirs, data, base / "slow", *args, f"cache_dir={base / 'c2'}"), env=slow_env
    )
    got = {"rc": slow.returncode, "slowed_s": round(time.time() - start - fast_s, 1), "error": slow.stderr[-1500:]}
    if fast.returncode or slow.returncode:
        return {**got, "same_head": False, "error": (fast.stderr if fast.returncode else slow.stderr)[-1500:]}
    return {**got, "same_head": max_abs_diff(base / "fast", base / "slow") == 0.0, "error": None}
