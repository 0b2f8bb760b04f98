"""Multi-node hygiene: chunks claimed dynamically from one output directory (any number of workers, the same
bytes; a killed launch's claims do not block the next; nodes without a shared disk split the chunks), the
process-group timeout reaching ``accelerate``, device indices out of the numerics record, and a side file
durable before the chunk file that marks it done."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from conftest import DATAGEN_PROMPTS, datagen_args, train_args

from specheads import dataset
from specheads.datagen import shards
from specheads.datagen.cli import main
from specheads.outputs import file_sha256
from specheads.runtime.numerics import check_resume, differences, numerics_settings

TOTAL = 8


def _exchanges(n: int):
    """``n`` in-process :data:`shards.Exchange` functions, one per simulated rank (a thread each)."""
    barrier, slots = threading.Barrier(n, timeout=60), [None] * n

    def make(rank):
        def exchange(obj):
            slots[rank] = obj
            barrier.wait()
            got = list(slots)
            barrier.wait()  # nobody overwrites a slot before everyone has read them
            return got

        return exchange

    return [make(r) for r in range(n)]


def _label(out: Path, chunk: int) -> None:
    """A chunk whose content depends only on its index and the seed, as a labeller's does."""
    g = torch.Generator().manual_seed(shards.chunk_seed(0, chunk))
    columns = {"prompt_index": [2 * chunk, 2 * chunk + 1], "label": torch.rand(2, 3, generator=g).tolist()}
    shards.write_chunk(out, chunk, columns, {"first_prompt": 2 * chunk, "prompts": 2})


def _workers(dirs: list[Path], hold=None) -> list[tuple[int, int]]:
    """One thread per entry of ``dirs`` (rank r writes to ``dirs[r]``), each running the datagen loop over the
    chunks: share, take, write, last barrier, close. Returns every ``(rank, chunk)`` taken."""
    exchanges, took, errors = _exchanges(len(dirs)), [], []

    def work(rank):
        try:
            share = shards.share_chunks(dirs[rank], TOTAL, rank, len(dirs), exchanges[rank])
            for chunk in range(TOTAL):
                if share.take(chunk):
                    took.append((rank, chunk))
                    if hold:
                        hold(rank)
                    _label(dirs[rank], chunk)
            exchanges[rank](None)
            share.close()
        except BaseException as err:  # noqa: BLE001 - reported below, in the test's thread
            errors.append(err)

    threads = [threading.Thread(target=work, args=(r,)) for r in range(len(dirs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    return took


def _shas(out: Path) -> dict[str, str]:
    return {p.name: file_sha256(p) for p in dataset.chunk_files(out)}


@pytest.fixture(scope="module")
def one_worker(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("one")
    assert sorted(c for _, c in _workers([out])) == list(range(TOTAL))
    return out


def test_two_workers_claim_each_chunk_once_and_write_one_workers_bytes(one_worker, tmp_path):
    """Worker 0 holds its first chunk until worker 1 has taken one, so both work on one queue."""
    took_one = threading.Event()

    def hold(rank):
        if rank == 1:
            took_one.set()
        else:
            assert took_one.wait(60)

    took = _workers([tmp_path, tmp_path], hold)
    assert sorted(c for _, c in took) == list(range(TOTAL))  # every chunk taken, none twice
    assert {r for r, _ in took} == {0, 1}
    assert _shas(tmp_path) == _shas(one_worker) and len(_shas(one_worker)) == TOTAL
    assert not (tmp_path / shards.CLAIMS).exists()  # the finished run leaves no claims


def test_a_killed_launchs_claims_and_temporaries_do_not_block_a_resume(one_worker, tmp_path):
    """A launch died with chunks 0-2 done, chunk 3 claimed and half-written, chunk 5 claimed: the next
    launch (two workers) removes what it left and labels exactly the rest."""
    claims = tmp_path / shards.CLAIMS
    claims.mkdir()
    (tmp_path / "data").mkdir()
    for c in range(3):
        _label(tmp_path, c)
    for c in (3, 5):
        (claims / f"chunk-{c:06d}.claim").write_text("oldlaunch rank 1 node7 pid 99\n")
    (claims / "present-1").write_text("oldlaunch")
    (tmp_path / "data" / ".chunk-000003.parquet.99.tmp").write_bytes(b"half")
    took = _workers([tmp_path, tmp_path])
    assert sorted(c for _, c in took) == list(range(3, TOTAL))
    assert _shas(tmp_path) == _shas(one_worker)
    assert not list((tmp_path / "data").glob(".chunk-*")) and not claims.exists()


def test_nodes_without_a_shared_disk_split_the_chunks_between_them(one_worker, tmp_path):
    """Ranks 0 and 2 see one directory, rank 1 another: each filesystem gets its own half, claimed by its
    processes, and together they hold one worker's files (what ``heads-datagen merge`` then joins)."""
    a, b = tmp_path / "node-a", tmp_path / "node-b"
    took = _workers([a, b, a])
    assert sorted(c for _, c in took) == list(range(TOTAL))
    assert {c for r, c in took if r != 1} == set(range(0, TOTAL, 2))  # group (0, 2) first, then group (1,)
    assert {c for r, c in took if r == 1} == set(range(1, TOTAL, 2))
    assert {**_shas(a), **_shas(b)} == _shas(one_worker) and not set(_shas(a)) & set(_shas(b))


def test_a_static_share_is_the_rank_modulo_the_count(tmp_path):
    """``engine=vllm`` keeps the static split: its responses are generated up front, per process."""
    share = shards.share_chunks(tmp_path, TOTAL, 0, 3, lambda obj: [obj] * 3, dynamic=False)
    assert share.chunks == {0, 3, 6} and share.take(3) and not share.take(1)
    assert not list((tmp_path / shards.CLAIMS).glob("chunk-*"))  # a static share claims nothing


# -- devices in the numerics record ------------------------------------------------------------------------


def test_the_device_index_is_not_recorded_but_the_device_type_is(caplog):
    a = numerics_settings(1, {"target": torch.bfloat16}, {"target": "cuda:0", "draft": torch.device("cuda", 3)})
    b = numerics_settings(1, {"target": torch.bfloat16}, {"target": torch.device("cuda:3"), "draft": "cuda:0"})
    assert a == b and "cuda:" not in json.dumps(a["devices"])
    assert a["devices"]["target"].startswith("cuda")
    cpu = numerics_settings(1, {"target": torch.bfloat16}, {"target": "cpu", "draft": "cuda:0"})
    assert differences(a, cpu) == {"devices.target": (a["devices"]["target"], "cpu")}  # still checked
    # a footer written before (with an index) resumes without a warning on another GPU of the same kind
    old = {**a, "devices": {"target": "cuda:1", "draft": "cuda:2"}}
    if not torch.cuda.is_available():  # here the current record is the bare type
        assert check_resume(old, a, "chunk 0") == [] and not caplog.records


# -- the process-group timeout ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def drafter_run(tiny_pair_dirs, tmp_path_factory):
    """``labels=drafter`` over 4 prompts (2 chunks) with ``dist_timeout_s=77``, recording the process-group
    settings handed to accelerate and the order of every fsync and rename."""
    import accelerate

    root = tmp_path_factory.mktemp("drafter")
    prompts = root / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in DATAGEN_PROMPTS[:4]))
    state_kwargs, events = [], []
    real_state, real_fsync, real_replace = accelerate.PartialState, os.fsync, os.replace

    def state(*args, **kwargs):
        state_kwargs.append(kwargs)
        return real_state(*args, **kwargs)

    def fsync(fd):
        events.append(("fsync", os.path.realpath(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    def replace(src, dst, *args, **kwargs):
        events.append(("replace", os.path.realpath(dst)))
        return real_replace(src, dst, *args, **kwargs)

    mp = pytest.MonkeyPatch()
    mp.setattr(accelerate, "PartialState", state)
    mp.setattr(os, "fsync", fsync)
    mp.setattr(os, "replace", replace)
    try:
        out = root / "out"
        args = datagen_args(tiny_pair_dirs, prompts, out, "labels=drafter", "drafter.top_k=4", "dist_timeout_s=77")
        assert main([*args, "sampling.do_sample=false"]) == 0
    finally:
        mp.undo()
    return out, state_kwargs, events


def test_datagen_hands_the_timeout_to_the_process_group(drafter_run):
    from datetime import timedelta

    _, state_kwargs, _ = drafter_run
    assert state_kwargs and state_kwargs[0]["timeout"] == timedelta(seconds=77)


def test_train_hands_the_timeout_to_the_process_group(labelled, tiny_pair_dirs, tmp_path, monkeypatch):
    import accelerate
    from accelerate.utils import InitProcessGroupKwargs

    from specheads.train.cli import main as train

    class Stop(Exception):
        pass

    seen = []

    def recording(*args, **kwargs):
        seen.append(kwargs)
        raise Stop  # the settings are what this test checks; the training itself is tested elsewhere

    monkeypatch.setattr(accelerate, "Accelerator", recording)
    with pytest.raises(Stop):
        train(train_args(tiny_pair_dirs, labelled, tmp_path / "t", "dist_timeout_s=91"))
    (handler,) = seen[0]["kwargs_handlers"]
    assert isinstance(handler, InitProcessGroupKwargs) and handler.timeout.total_seconds() == 91
    assert train(train_args(tiny_pair_dirs, labelled, tmp_path / "t2", "dist_timeout_s=0")) == 2


def test_a_zero_timeout_is_refused_in_one_line(tiny_pair_dirs, tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "a"}) + "\n")
    assert main(datagen_args(tiny_pair_dirs, prompts, tmp_path / "o", "dist_timeout_s=0")) == 2
    assert "dist_timeout_s=0 must be > 0" in capsys.readouterr().err


# -- durability ---------------------------------------------------------------------------------------------


def test_the_states_file_is_on_disk_before_the_chunk_file_marks_it_done(drafter_run):
    """Per chunk: the states file's bytes fsynced, renamed into place, its folder fsynced, and only then the
    chunk's Parquet file renamed into place (a crash can leave a states file without its chunk, never a
    chunk without its states)."""
    out, _, events = drafter_run
    for chunk in range(2):
        states = Path(os.path.realpath(dataset.DrafterChunkFiles(out, chunk).path))
        data = os.path.realpath(dataset.chunk_path(out, chunk))
        synced = events.index(("fsync", str(states.parent / f".{states.name}.{os.getpid()}.tmp")))
        placed = events.index(("replace", str(states)))
        folder = events.index(("fsync", str(states.parent)), placed)
        assert synced < placed < folder < events.index(("replace", data))
    assert main([f"output_dir={out}", "verify"]) == 0


# -- two real processes ---------------------------------------------------------------------------------------

_STALL = """
import os, runpy, sys, time
from specheads.datagen.acceptance_labels import AcceptanceLabeller

real, mark = AcceptanceLabeller.label_chunk, sys.argv.pop()


def stalled(self, job, items, chunk):
    if os.environ.get("RANK") == "1":  # this rank hangs in its first chunk, as a stuck GPU would
        open(os.path.join(mark, "stalled"), "w").write(str(chunk))
        time.sleep(600)
    deadline = time.time() + 300  # rank 0 labels once rank 1 holds its chunk, however loaded the machine is
    while not os.path.exists(os.path.join(mark, "stalled")) and time.time() < deadline:
        time.sleep(0.1)
    return real(self, job, items, chunk)


AcceptanceLabeller.label_chunk = stalled
runpy.run_module("specheads.datagen.cli", run_name="__main__", alter_sys=True)
"""


@pytest.mark.slow  # two processes under accelerate launch, about a minute on two cores
def test_a_stalled_rank_costs_one_chunk_and_the_timeout_ends_the_launch(tiny_pair_dirs, tmp_path):
    """Rank 1 hangs in its first chunk: rank 0 labels every other chunk (not only its half), then waits at
    the last barrier until dist_timeout_s=20 ends the launch, long before gloo's default 30 minutes."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": DATAGEN_PROMPTS[i % 6] + f" {i}"}) + "\n" for i in range(16)))
    driver = tmp_path / "stall.py"
    driver.write_text(_STALL)
    out = tmp_path / "out"
    cmd = [
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
        str(driver),
        *datagen_args(tiny_pair_dirs, prompts, out, "threads=1", "dist_timeout_s=20"),
        str(tmp_path),
    ]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=400, env=env)
    assert proc.returncode != 0 and (tmp_path / "stalled").is_file(), proc.stderr[-3000:]
    stalled = int((tmp_path / "stalled").read_text())
    done = sorted(int(p.stem.split("-")[1]) for p in dataset.chunk_files(out))
    assert done == [c for c in range(8) if c != stalled], proc.stderr[-2000:]


def _patient(rank: int, port: int, out: str, mode: str, queue) -> None:
    """One of two processes of a gloo group: rank 1 writes a chunk file a second for 6 s (``slow``) or nothing
    (``hung``) before its own wait; rank 0 waits at once with a 2 s timeout. Puts (rank, what happened)."""
    import torch.distributed as dist

    from specheads.datagen import shards
    from specheads.dataset import chunk_path

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    patience = shards.Patience(Path(out), rank, 2, timeout_s=2.0, every_s=0.2)
    try:
        if rank == 1:
            for c in range(6 if mode == "slow" else 0):
                path = chunk_path(Path(out), c)
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_bytes(b"")
                time.sleep(1.0)
            if mode == "hung":
                time.sleep(6.0)
        patience.wait()
        queue.put((rank, "done"))
    except RuntimeError as err:
        queue.put((rank, str(err)))


@pytest.mark.slow  # two spawned processes, about 20 s each
@pytest.mark.parametrize("mode", ["slow", "hung"])
def test_the_last_wait_outlasts_the_timeout_while_chunks_land_and_ends_when_none_do(mode, tmp_path):
    """engine=vllm's static shares leave one process working long after another (issue 59 item 12): the last
    wait is timed by progress, not in total. A peer writing a chunk a second for 6 s outlasts a 2 s timeout;
    a peer writing nothing ends the wait after it, naming why."""
    import multiprocessing as mp
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_patient, args=(r, port, str(tmp_path), mode, queue)) for r in range(2)]
    for p in procs:
        p.start()
    got = dict(queue.get(timeout=60) for _ in range(1 if mode == "hung" else 2))
    for p in procs:
        p.join(timeout=30)
        if p.is_alive():
            p.kill()
    if mode == "slow":
        assert got == {0: "done", 1: "done"}
    else:
        assert "no chunk or response landed for 2 s" in got[0]
