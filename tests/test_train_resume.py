"""Kill safety of ``heads-train``: mid-epoch checkpoints, a SIGKILLed run resumed by the same
command, a crash while a checkpoint is written, damaged checkpoints, stale runs."""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import sys

import pytest
from conftest import run_killed, same_heads, train_args

from specheads.train import checkpoint
from specheads.train.cli import main

# 8 training examples, batch 2, no accumulation: 4 steps an epoch, 12 in all, a checkpoint after each
EXTRA = ("grad_accum=1", "checkpoint_every=1")


@pytest.fixture(scope="module")
def reference(tiny_pair_dirs, labelled, tmp_path_factory):
    """An uninterrupted run with the settings every test here uses."""
    out = tmp_path_factory.mktemp("reference") / "run"
    assert main(train_args(tiny_pair_dirs, labelled, out, *EXTRA)) == 0
    return out


def _steps(out) -> list[int]:
    return [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines() if "loss" in json.loads(x)]


def test_mid_epoch_checkpoints(reference):
    rows = [json.loads(x) for x in (reference / "metrics.jsonl").read_text().splitlines()]
    assert _steps(reference) == list(range(1, 13)) and sum("eval_binary_kl" in r for r in rows) == 3
    assert sorted(p.name for p in reference.glob("checkpoint-*")) == ["checkpoint-11", "checkpoint-12"]
    mid = json.loads((reference / "checkpoint-11" / "state.json").read_text())
    assert {k: mid["progress"][k] for k in ("epoch", "step", "position", "done", "world")} == {
        "epoch": 2,
        "step": 11,
        "position": 3,
        "done": False,
        "world": 1,
    }
    assert set(mid["files"]) == {"state.safetensors"} and len(mid["files"]["state.safetensors"]["sha256"]) == 64
    end = json.loads((reference / "checkpoint-12" / "state.json").read_text())["progress"]
    assert end["epoch"] == 3 and end["position"] == 0 and end["done"] is True
    assert (reference / "latest").read_text() == "checkpoint-12\n"
    assert not list(reference.glob(".checkpoint-*"))


@pytest.mark.slow  # a long run: CI's slow step
def test_sigkilled_cli_resumes_mid_epoch_to_the_same_head(tiny_pair_dirs, labelled, reference, tmp_path):
    """A real ``python -m specheads.train.cli`` process, SIGKILLed right after its third (mid-epoch)
    checkpoint, then again while its third checkpoint since the resume is written (complete in its
    temporary folder, not yet renamed into place), then the same command again: the uninterrupted
    run's head, bit for bit, and its metrics.jsonl (the killed runs' rows after the checkpoint are cut)."""
    out = tmp_path / "cut"
    args = train_args(tiny_pair_dirs, labelled, out, *EXTRA)
    run_killed("specheads.train.cli", args, "latest", 3, "after")  # steps 1-3 of 12 checkpointed
    assert (out / "latest").read_text() == "checkpoint-3\n"
    assert not json.loads((out / "checkpoint-3" / "state.json").read_text())["progress"]["done"]
    run_killed("specheads.train.cli", args, "checkpoint-*", 3, "before")  # resumed at 3; 4 and 5 saved
    assert (out / "latest").read_text() == "checkpoint-5\n" and not (out / "checkpoint-6").exists()
    assert [p.name for p in out.glob(".checkpoint-6.tmp*")]
    again = subprocess.run(
        [sys.executable, "-m", "specheads.train.cli", *args], capture_output=True, text=True, timeout=300
    )
    assert again.returncode == 0, again.stderr[-2000:]
    assert "resumed from" in again.stderr and "checkpoint-5" in again.stderr
    assert not list(out.glob(".checkpoint-*"))
    same_heads(reference, out)
    assert (out / "metrics.jsonl").read_text() == (reference / "metrics.jsonl").read_text()
    assert (out / "best_metrics.json").read_text() == (reference / "best_metrics.json").read_text()


def _crash_on_save(monkeypatch, n: int, after_write: bool):
    """The ``n``-th checkpoint save raises: after writing its state.safetensors into the temporary
    folder (``after_write=False``: before the folder is renamed), or right after the save."""
    calls = {"n": 0}
    real_save, real_file = checkpoint.save, checkpoint.save_file

    def save(*args, **kwargs):
        calls["n"] += 1
        result = real_save(*args, **kwargs)
        if after_write and calls["n"] == n:
            raise KeyboardInterrupt
        return result

    def save_file(tensors, path, *args, **kwargs):
        real_file(tensors, path, *args, **kwargs)
        if not after_write and calls["n"] == n and path.endswith("state.safetensors"):
            raise KeyboardInterrupt  # the process dies in the middle of the save

    monkeypatch.setattr(checkpoint, "save", save)
    monkeypatch.setattr(checkpoint, "save_file", save_file)  # where save writes its files


def test_crash_while_writing_a_checkpoint_keeps_the_previous_one(
    tiny_pair_dirs, labelled, reference, tmp_path, monkeypatch
):
    out = tmp_path / "crash"
    args = train_args(tiny_pair_dirs, labelled, out, *EXTRA)
    _crash_on_save(monkeypatch, 3, after_write=False)
    assert main(args) == 130
    monkeypatch.undo()
    assert (out / "latest").read_text() == "checkpoint-2\n"
    assert [p.name for p in out.glob(".checkpoint-3.tmp*")] and not (out / "checkpoint-3").exists()
    ckpt = checkpoint.find(out, world=1)
    assert ckpt.path.name == "checkpoint-2" and ckpt.progress["position"] == 2
    assert _steps(out) == [1, 2, 3]
    assert main(args) == 0  # resumes from checkpoint-2, removes the half-written folder
    assert not list(out.glob(".checkpoint-*"))
    same_heads(reference, out)
    assert (out / "metrics.jsonl").read_text() == (reference / "metrics.jsonl").read_text()


def test_damaged_checkpoints_fall_back_or_end_in_one_line(
    tiny_pair_dirs, labelled, reference, tmp_path, monkeypatch, capsys, caplog
):
    out, broken = tmp_path / "damaged", tmp_path / "broken"
    for folder in (out, broken):  # two runs that stop right after their third checkpoint
        _crash_on_save(monkeypatch, 3, after_write=True)
        assert main(train_args(tiny_pair_dirs, labelled, folder, *EXTRA)) == 130
        monkeypatch.undo()
        assert sorted(p.name for p in folder.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-3"]
    args = train_args(tiny_pair_dirs, labelled, out, *EXTRA)

    state = out / "checkpoint-3" / "state.safetensors"  # truncated: the previous checkpoint is taken
    state.write_bytes(state.read_bytes()[:-100])
    with pytest.raises(checkpoint.Damaged, match="truncated"):
        checkpoint.read(out / "checkpoint-3")
    caplog.clear()
    caplog.set_level(logging.INFO)
    assert main(args) == 0
    assert any("trying an older checkpoint" in r.message for r in caplog.records)
    assert any("resumed from" in r.getMessage() and "checkpoint-2" in r.getMessage() for r in caplog.records)
    same_heads(reference, out)
    assert (out / "metrics.jsonl").read_text() == (reference / "metrics.jsonl").read_text()

    data = bytearray((broken / "checkpoint-3" / "state.safetensors").read_bytes())  # same size, a flipped bit
    data[-1] ^= 1
    (broken / "checkpoint-3" / "state.safetensors").write_bytes(bytes(data))
    (broken / "checkpoint-2" / "state.json").write_text('{"step": 2, "progr')  # cut JSON
    capsys.readouterr()
    assert main(train_args(tiny_pair_dirs, labelled, broken, *EXTRA)) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert "no checkpoint in" in err and "SHA-256" in err and "delete its checkpoint-*" in err


def test_overwriting_another_run_does_not_resume_its_checkpoints(tiny_pair_dirs, labelled, reference, tmp_path):
    out = tmp_path / "other"
    shutil.copytree(reference, out)
    args = train_args(tiny_pair_dirs, labelled, out, *EXTRA)
    assert main([*args, "epochs=1"]) == 2  # another run's folder: refused
    assert main([*args, "epochs=1", "overwrite=true"]) == 0
    assert _steps(out) == [1, 2, 3, 4]
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-3", "checkpoint-4"]


def test_checkpoint_every_must_not_be_negative(tiny_pair_dirs, labelled, tmp_path, capsys):
    assert main(train_args(tiny_pair_dirs, labelled, tmp_path / "x", "checkpoint_every=-1")) == 2
    assert "checkpoint_every=-1 must be >= 0" in capsys.readouterr().err


def test_manifest_and_checkpoints_record_numerics_and_a_resume_under_others_warns(
    tiny_pair_dirs, labelled, reference, tmp_path, monkeypatch, caplog
):
    import torch

    numerics = json.loads((reference / "manifest.json").read_text())["numerics"]
    assert numerics["processes"] == 1 and numerics["threads"] == torch.get_num_threads()
    assert numerics["dtypes"] == {"head": "float32", "autocast": "no", "draft": "float32"}
    assert numerics["devices"] == {"head": "cpu", "draft": "cpu"} and numerics["torch"] == torch.__version__
    assert "kernel_path" in numerics
    assert json.loads((reference / "checkpoint-12" / "state.json").read_text())["progress"]["numerics"] == numerics

    out = tmp_path / "threads"
    args = train_args(tiny_pair_dirs, labelled, out, *EXTRA, "threads=1")
    _crash_on_save(monkeypatch, 3, after_write=True)
    assert main(args) == 130
    monkeypatch.undo()
    state = out / "checkpoint-3" / "state.json"  # as if written by a process with 3 threads
    meta = json.loads(state.read_text())
    assert meta["progress"]["numerics"]["threads"] == 1
    meta["progress"]["numerics"]["threads"] = 3
    state.write_text(json.dumps(meta))
    caplog.clear()
    caplog.set_level(logging.WARNING)
    assert main(args) == 0
    (message,) = [r.getMessage() for r in caplog.records if r.name == "specheads.runtime.numerics"]
    assert "threads=3 now 1" in message and "checkpoint-3" in message and "not be byte-identical" in message
    assert json.loads((out / "manifest.json").read_text())["numerics"]["threads"] == 1


def test_threads_must_be_positive(tiny_pair_dirs, labelled, tmp_path, capsys):
    assert main(train_args(tiny_pair_dirs, labelled, tmp_path / "x", "threads=0")) == 2
    assert "threads=0 must be >= 1" in capsys.readouterr().err
