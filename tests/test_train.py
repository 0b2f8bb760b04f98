"""``heads-train`` on tiny datagen output: mixing, a full run, export, resume."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import same_heads, train_args
from ddp_runs import DDP, kill_after_first_checkpoint

from specheads.export import load_head, read_metadata
from specheads.train.acceptance_data import Example, mix
from specheads.train.cli import main


def test_mixing_follows_the_ratio_and_masks_by_draw():
    ex = Example(0, [1, 2] + [10] * 4000, 2, [20] * 4000, [0.5] * 4000)
    z, mask = mix(ex, 0.15, seed=3)
    drawn = [zi == 10 for zi in z[2:]]
    assert abs(sum(drawn) / 4000 - 0.15) < 0.02
    assert mask == [not d for d in drawn]
    same = Example(0, [1, 2, 7, 7], 2, [7, 7], [1.0, 1.0])  # x == y: the mask still follows the draw
    for seed in range(20):
        z, mask = mix(same, 0.5, seed)
        assert z == [1, 2, 7, 7] and len(mask) == 2
    assert mix(ex, 0.15, 3) == mix(ex, 0.15, 3)


def test_train_exports_a_loadable_head(tiny_pair_dirs, labelled, tmp_path):
    out = tmp_path / "tr"
    assert main(train_args(tiny_pair_dirs, labelled, out)) == 0
    meta = read_metadata(out / "head.safetensors")
    assert meta["head_type"] == "acceptance" and meta["hidden_size"] == 32 and meta["default_threshold"] == 0.7
    assert meta["sampling"]["do_sample"] is True
    head = load_head(out / "head.safetensors")
    assert head.module(torch.zeros(3, 32)).shape == (3,)
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert any("loss" in r for r in lines) and sum("eval_binary_kl" in r for r in lines) == 3
    assert (out / "latest").read_text().strip().startswith("checkpoint-")
    # calibration of the held-out predictions, every epoch, and the best epoch's reliability diagram
    evals = [r for r in lines if "eval_binary_kl" in r]
    assert all(
        0 <= r["eval_ece"] <= 1 and 0 <= r["eval_brier"] <= 1 and len(r["eval_calibration"]) == 10 for r in evals
    )
    assert sum(b["n"] for b in evals[-1]["eval_calibration"]) == evals[-1]["eval_tokens"]
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["reliability_png"] == str(out / "reliability.png")
    assert (out / "reliability.png").read_bytes()[:4] == b"\x89PNG"


def test_head_aliases_name_the_same_tasks_and_record_their_names(tiny_pair_dirs, labelled, tmp_path):
    from specheads.train.registry import task_type

    assert task_type("specdecpp") is task_type("acceptance") and task_type("sprinter") is task_type("verifier")
    out = tmp_path / "alias"
    assert main(train_args(tiny_pair_dirs, labelled, out, "head=specdecpp", "epochs=1")) == 0
    assert "head: acceptance" in (out / "config.yaml").read_text()
    assert read_metadata(out / "head.safetensors")["head_type"] == "acceptance"


def test_every_task_declares_the_interface_and_the_task_module_names_it():
    """Each registered task subclasses Task, so its optional hooks (loss, save, artifact) are declared, with
    defaults, and never looked up by name; train/task.py's docstring names every task and its module."""
    from specheads.train import task as task_module
    from specheads.train.registry import TASKS
    from specheads.train.task import Task

    doc = " ".join(task_module.__doc__.split())
    for name, cls in TASKS.items():
        assert Task in cls.__mro__, name  # declared: its hooks are the interface's unless it replaces them
        assert callable(cls.loss) and callable(cls.save) and cls.artifact, name
        assert f"``{name}``" in doc and f"``{cls.__module__.rsplit('.', 1)[1]}.py``" in doc, name
    assert {n for n, c in TASKS.items() if c.artifact != "head.safetensors"} == {"draft"}
    assert {n for n, c in TASKS.items() if c.loss is not Task.loss} == {"eagle", "draft"}
    assert {n for n, c in TASKS.items() if c.save is not Task.save} == {"draft"}


def test_family_settings_sit_in_their_sections_and_a_flat_key_names_its_new_spelling(tmp_path, capsys):
    """Each head family's settings are a section of heads-train's schema, listed by --help; a flat key of before
    (stop_confidence=false), on the command line or in a recipe, is a one-line error naming the new spelling."""
    from specheads.train.config import MOVED

    assert main(["--help"]) == 0
    shown = capsys.readouterr().out
    assert all(f"\n  {new}: " in shown for new in MOVED.values())
    for old, new in MOVED.items():
        assert main([f"{old}=1"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"{old} is now {new}; write {new}=1" in err, err
    recipe = tmp_path / "old.yaml"
    recipe.write_text("train:\n  head: eagle_stop\n  stop_confidence: false\n  ttt_steps: 2\n")
    assert main([f"recipe={recipe}"]) == 2
    err = capsys.readouterr().err
    assert (
        err.count("\n") == 1
        and "stop_confidence is now eagle_stop.confidence; write eagle_stop.confidence=false" in err
    )
    assert "ttt_steps is now eagle.ttt_steps; write eagle.ttt_steps=2" in err


def test_resumed_training_gives_the_same_head(tiny_pair_dirs, labelled, tmp_path, monkeypatch):
    from specheads.train import checkpoint

    full, cut = tmp_path / "full", tmp_path / "cut"
    assert main(train_args(tiny_pair_dirs, labelled, full)) == 0
    save = checkpoint.save

    def killed_after_first_checkpoint(*args, **kwargs):
        save(*args, **kwargs)
        raise KeyboardInterrupt  # the process dies right after its first checkpoint

    monkeypatch.setattr(checkpoint, "save", killed_after_first_checkpoint)
    assert main(train_args(tiny_pair_dirs, labelled, cut)) == 130
    monkeypatch.setattr(checkpoint, "save", save)
    assert main(train_args(tiny_pair_dirs, labelled, cut)) == 0  # the same command resumes
    a = load_head(full / "head.safetensors").module.state_dict()
    b = load_head(cut / "head.safetensors").module.state_dict()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0)


def test_train_refuses_data_from_another_draft(tiny_pair_dirs, labelled, tmp_path, capsys):
    args = train_args(tiny_pair_dirs, labelled, tmp_path / "x") + [f"draft.path={tiny_pair_dirs[0]}"]
    assert main(args) == 2
    assert "not the draft the data was labelled with" in capsys.readouterr().err


def test_export_best_latest_and_bad_sources(tiny_pair_dirs, labelled, tmp_path, capsys):
    from specheads.export.cli import main as export

    tr = tmp_path / "tr"
    assert main(train_args(tiny_pair_dirs, labelled, tr, "patience=1")) == 0
    x = torch.randn(5, 32)
    trained = load_head(tr / "head.safetensors").module
    assert export([f"train_dir={tr}", f"output_dir={tmp_path / 'best'}", "threshold=0.4"]) == 0
    best = load_head(tmp_path / "best" / "head.safetensors")
    assert best.threshold == 0.4 and read_metadata(tr / "head.safetensors")["default_threshold"] == 0.7
    assert torch.equal(best.module(x), trained(x))
    meta = best.metadata
    assert meta["draft"] == read_metadata(tr / "head.safetensors")["draft"] and meta["hidden_size"] == 32
    manifest = json.loads((tmp_path / "best" / "manifest.json").read_text())
    assert manifest["round_trip_identical"] is True and (tmp_path / "best" / "config.yaml").is_file()
    assert export([f"train_dir={tr}", "checkpoint=latest", "dtype=bfloat16", f"output_dir={tmp_path / 'last'}"]) == 0
    last = load_head(tmp_path / "last" / "head.safetensors")
    assert last.metadata["extra"]["checkpoint"].startswith("checkpoint-")
    assert next(last.module.parameters()).dtype == torch.bfloat16
    capsys.readouterr()
    assert export([f"train_dir={tmp_path / 'nope'}", f"output_dir={tmp_path / 'e1'}"]) == 2
    assert "head.safetensors not found" in capsys.readouterr().err
    assert export([f"train_dir={tr}", "checkpoint=checkpoint-999", f"output_dir={tmp_path / 'e2'}"]) == 2
    err = capsys.readouterr().err
    assert "checkpoint 'checkpoint-999' not found" in err and "checkpoint-" in err.split("one of")[1]
    assert export([f"train_dir={tr}", "threshold=1.5", f"output_dir={tmp_path / 'e3'}"]) == 2


def test_expected_label_head_reads_the_previous_state(tiny_pair_dirs, labelled, tmp_path, capsys):
    from specheads.train.acceptance_data import draft_features, load_examples

    out = tmp_path / "exp"
    assert main(train_args(tiny_pair_dirs, labelled, out, "acceptance.label=expected", "epochs=1")) == 0
    meta = read_metadata(out / "head.safetensors")
    assert meta["feature"]["position"] == "previous" and meta["label"] == "expected"
    soft, exp = load_examples(labelled), load_examples(labelled, "expected_label")
    assert soft[0].label != exp[0].label and all(0 <= v <= 1 for v in exp[0].label)

    class Capture:  # the "draft" returns position indices as its states
        post = None

    def draft(input_ids, attention_mask, logits_to_keep):
        Capture.post = (
            torch.arange(input_ids.shape[1], dtype=torch.float32).view(1, -1, 1).expand(input_ids.shape[0], -1, 2)
        )

    ex = soft[0]
    mask = [True] * len(ex.label)
    x0, _ = draft_features(draft, Capture, [ex.input_ids], [ex.start], [mask], [ex.label], 0, "cpu")
    x1, _ = draft_features(draft, Capture, [ex.input_ids], [ex.start], [mask], [ex.label], 0, "cpu", shift=1)
    assert x0[0, 0] == ex.start and x1[0, 0] == ex.start - 1
    assert main(train_args(tiny_pair_dirs, labelled, tmp_path / "bad", "acceptance.label=tv")) == 2
    assert "acceptance.label='tv'" in capsys.readouterr().err


def test_cached_features_match_online_and_are_reused(tiny_pair_dirs, labelled, tmp_path):
    from safetensors.torch import load_file

    from specheads.train.acceptance_data import load_examples

    cache = tmp_path / "cache"
    out = tmp_path / "cached"
    assert main(train_args(tiny_pair_dirs, labelled, out, "features=cached", f"cache_dir={cache}")) == 0
    (key,) = [p for p in cache.iterdir()]
    files = sorted(p.name for p in key.iterdir())
    assert files == ["epoch-0.safetensors", "epoch-1.safetensors", "epoch-2.safetensors", "epoch-4095.safetensors"]
    t = load_file(str(key / "epoch-0.safetensors"))
    assert t["features"].dtype == torch.float16 and t["features"].shape[1] == 32
    assert t["offsets"][-1] == t["features"].shape[0] == t["labels"].shape[0]
    # the cached rows are the online features of the same mixing draw, rounded to fp16
    from specheads.shim.runners.hidden import HiddenCapture
    from specheads.shim.runners.models import ModelSpec, load_model
    from specheads.train.acceptance_data import draft_features, mix, mix_seed

    draft = load_model(ModelSpec(path=str(tiny_pair_dirs[1]), device="cpu"), "draft").model
    ex = {e.index: e for e in load_examples(labelled)}[int(t["index"][0])]
    z, m = mix(ex, 0.15, mix_seed(0, 0, ex.index))
    x, y = draft_features(draft, HiddenCapture(draft), [z], [ex.start], [m], [ex.label], 2, "cpu")
    a, b = int(t["offsets"][0]), int(t["offsets"][1])
    torch.testing.assert_close(t["features"][a:b].float(), x, atol=1e-2, rtol=1e-3)
    torch.testing.assert_close(t["labels"][a:b], y)
    stamp = {p.name: p.stat().st_mtime_ns for p in key.iterdir()}
    assert (
        main(
            train_args(tiny_pair_dirs, labelled, tmp_path / "again", "features=cached", f"cache_dir={cache}", "depth=0")
        )
        == 0
    )  # other head settings: the same files, not rebuilt
    assert {p.name: p.stat().st_mtime_ns for p in key.iterdir()} == stamp
    assert read_metadata(tmp_path / "again" / "head.safetensors")["head_config"]["depth"] == 0


def _launch(tiny_pair_dirs, labelled, out, launcher: list[str], *extra, wait=True, env=None):
    """``accelerate launch <launcher> -m specheads.train.cli ...`` on CPU: the finished process, or
    (``wait=False``) the running one, in a session of its own."""
    import os
    import subprocess
    import sys

    cmd = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        *launcher,
        "-m",
        "specheads.train.cli",
        *train_args(tiny_pair_dirs, labelled, out, *extra),
    ]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1", **(env or {})}
    if wait:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, start_new_session=True)


@pytest.mark.slow  # a long run: CI's slow step
def test_two_process_ddp_training(tiny_pair_dirs, labelled, tmp_path, capsys):
    """``accelerate launch`` with 2 processes (DDP over gloo on CPU) trains the head one process
    trains with the same global batch (2 x batch_size x grad_accum): the two runs differ only in
    the summation order of the gradient (all-reduce of two partial means vs one sum), which keeps
    them within 1e-6. The checkpoints record the process count: a one-process rerun is refused."""
    out = tmp_path / "ddp"
    proc = _launch(tiny_pair_dirs, labelled, out, DDP, "epochs=2", "grad_accum=1", "checkpoint_every=1")
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert sum("eval_binary_kl" in r for r in rows) == 2  # one writer: the main process
    assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3, 4]
    assert (out / "checkpoint-3").is_dir()  # mid-epoch (2 steps an epoch)
    state = json.loads((out / "checkpoint-3" / "state.json").read_text())["progress"]
    assert state["world"] == 2 and state["position"] == 1 and state["epoch"] == 1

    one = tmp_path / "one"  # 1 process, twice the accumulation: the same 4 micro-batches a step
    assert main(train_args(tiny_pair_dirs, labelled, one, "epochs=2", "grad_accum=2")) == 0
    same_heads(out, one, atol=1e-6)

    capsys.readouterr()
    assert main(train_args(tiny_pair_dirs, labelled, out, "epochs=2", "grad_accum=1", "checkpoint_every=1")) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "2 processes, this one has 1" in err and "--num_processes 2" in err


@pytest.mark.slow
def test_two_process_ddp_training_killed_mid_epoch_resumes_to_the_same_head(tiny_pair_dirs, labelled, tmp_path):
    """2-process DDP, SIGKILLed (launcher and workers) after its first mid-epoch checkpoint, rerun
    with the same command: the head of an uninterrupted 2-process run, bit for bit."""
    extra = ("epochs=2", "grad_accum=1", "checkpoint_every=1")
    full = _launch(tiny_pair_dirs, labelled, tmp_path / "full", DDP, *extra)
    assert full.returncode == 0, full.stderr[-2000:]
    kill_after_first_checkpoint(
        _launch(tiny_pair_dirs, labelled, tmp_path / "cut", DDP, *extra, wait=False), tmp_path / "cut"
    )
    again = _launch(tiny_pair_dirs, labelled, tmp_path / "cut", DDP, *extra)
    assert again.returncode == 0, again.stderr[-2000:]
    assert "resumed from" in again.stderr
    same_heads(tmp_path / "full", tmp_path / "cut")
    assert (tmp_path / "full" / "metrics.jsonl").read_text() == (tmp_path / "cut" / "metrics.jsonl").read_text()


def _deepspeed_ok() -> bool:
    import importlib.util

    return importlib.util.find_spec("deepspeed") is not None


def _deepspeed_resumes(tiny_pair_dirs, labelled, tmp_path, name: str) -> None:
    """The shipped launcher config ``name`` on one CPU process (accelerate runs DeepSpeed
    multi-process only on accelerators): the DeepSpeed path (engine-owned accumulation and loss
    scaling, per-rank optimizer partitions in the checkpoint) trains the same head as the plain
    loop, and a run SIGKILLed after its first (mid-epoch) checkpoint resumes to the head of an
    uninterrupted run, bit for bit, with the same metrics.jsonl."""
    from importlib.resources import files

    config = files("specheads.recipes") / "accelerate" / f"{name}.yaml"
    launcher = ["--config_file", str(config), "--num_processes", "1", "--mixed_precision", "no"]
    env = {"DS_ACCELERATOR": "cpu"}
    extra = ("epochs=3", "checkpoint_every=1")
    full = _launch(tiny_pair_dirs, labelled, tmp_path / "full", launcher, *extra, env=env)
    assert full.returncode == 0, full.stderr[-3000:]
    ckpt = sorted((tmp_path / "full").glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))[-1]
    step = ckpt.name.split("-")[1]
    assert sorted(p.name for p in ckpt.iterdir() if p.name.startswith(".zero")) == [f".zero-{step}-rank0.safetensors"]
    from safetensors import safe_open

    with safe_open(str(ckpt / "state.safetensors"), framework="pt") as f:  # full weights, also under ZeRO-3
        assert f.get_slice("model.blocks.0.linear.weight").get_shape() == [32, 32]
    assert main(train_args(tiny_pair_dirs, labelled, tmp_path / "plain", *extra)) == 0
    same_heads(tmp_path / "full", tmp_path / "plain", atol=1e-3)  # same math, other summation order
    assert main(train_args(tiny_pair_dirs, labelled, tmp_path / "full", *extra)) == 2  # resumed without DeepSpeed
    kill_after_first_checkpoint(
        _launch(tiny_pair_dirs, labelled, tmp_path / "cut", launcher, *extra, wait=False, env=env), tmp_path / "cut"
    )
    again = _launch(tiny_pair_dirs, labelled, tmp_path / "cut", launcher, *extra, env=env)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resumed from" in again.stderr
    same_heads(tmp_path / "full", tmp_path / "cut")
    assert (tmp_path / "full" / "metrics.jsonl").read_text() == (tmp_path / "cut" / "metrics.jsonl").read_text()


@pytest.mark.slow
@pytest.mark.skipif(not _deepspeed_ok(), reason="needs the deepspeed extra (pip install -e '.[deepspeed]')")
def test_deepspeed_zero2_training_resumes_to_the_same_head(tiny_pair_dirs, labelled, tmp_path):
    _deepspeed_resumes(tiny_pair_dirs, labelled, tmp_path, "deepspeed_zero2")


@pytest.mark.slow
@pytest.mark.skipif(not _deepspeed_ok(), reason="needs the deepspeed extra (pip install -e '.[deepspeed]')")
def test_deepspeed_zero3_training_resumes_to_the_same_head(tiny_pair_dirs, labelled, tmp_path):
    """ZeRO-3 partitions the head's h x h weights (persistence threshold 10 h): evaluation, export
    and checkpoints gather them, and the checkpoint holds the stage-3 optimizer partition."""
    _deepspeed_resumes(tiny_pair_dirs, labelled, tmp_path, "deepspeed_zero3")


@pytest.mark.parametrize(
    "processes, device, want",
    [(8, "cuda:0", "cuda:3"), (8, "cuda", "cuda:3"), (8, "auto", "cuda:3"), (8, "cpu", "cpu"), (1, "cuda:1", "cuda:1")],
)
def test_each_process_loads_the_draft_on_its_own_device(processes, device, want, caplog, monkeypatch):
    """Under accelerate launch (here rank 3 of 8, faked) a recipe's draft.device=cuda:0 would put every rank's
    draft on GPU 0: the draft goes to the process's own device, with a warning; cpu, and any device named for
    one process, are kept."""
    from types import SimpleNamespace

    from accelerate.utils import DistributedType

    from specheads.train import draft as draft_module
    from specheads.train.config import TrainConfig

    class Loaded(Exception):
        pass

    def load_model(spec, role):
        raise Loaded(spec.device)

    monkeypatch.setattr(draft_module, "load_model", load_model)
    device_of_rank = torch.device("cuda", 3 if processes > 1 else 0)
    acc = SimpleNamespace(num_processes=processes, device=device_of_rank, distributed_type=DistributedType.MULTI_GPU)
    cfg = TrainConfig()
    cfg.draft.device = device
    with pytest.raises(Loaded) as loaded:
        draft_module.load_draft(cfg, acc, {})
    assert loaded.value.args == (want,)
    assert ("its own device cuda:3" in caplog.text) == (device.startswith("cuda") and processes > 1)


def test_expected_label_features_come_from_the_targets_own_prefix():
    """1 - TV(p_i, q_i) belongs to the state that produced q_i in datagen: the draft on c, x_<i
    (no token mixing, a loss at every position); the soft label's inputs are mixed."""
    from types import SimpleNamespace

    from specheads.train.acceptance_task import AcceptanceTask
    from specheads.train.config import AcceptanceSettings
    from specheads.train.draft import Draft

    class Capture:
        post = None

    def draft(input_ids, attention_mask, logits_to_keep):  # states = the consumed token ids
        Capture.post = input_ids.float().unsqueeze(-1)

    ex = Example(0, [1, 2, 10, 11, 12, 13], 2, [20, 21, 22, 23], [0.0, 1.0, 0.0, 1.0])
    stub = Draft(draft, Capture, pad=0, device="cpu", hidden=1, name="stub", fingerprint="")
    task = AcceptanceTask(
        SimpleNamespace(acceptance=AcceptanceSettings("expected", mix_ratio=0.15), seed=0, w_acc=1.0, w_rej=6.0),
        {},
        stub,
        [ex],
        [],
    )
    x, y, rows = task.features([ex], epoch=0)
    assert x[:, 0].tolist() == [2, 10, 11, 12] and y.tolist() == ex.label and rows == [4]
    task.cfg = SimpleNamespace(acceptance=AcceptanceSettings("soft", mix_ratio=0.0), seed=0)
    x, y, rows = task.features([ex], epoch=0)
    assert x[:, 0].tolist() == [20, 21, 22, 23]  # r = 0: every position holds the draft's token


@pytest.mark.parametrize("bad", ["max_steps=0", "max_steps=-1", "epochs=0", "grad_accum=0", "batch_size=-1"])
def test_zero_or_negative_counts_are_refused(tmp_path, capsys, bad):
    """Checked before any data or model is read: one line, exit code 2, no output folder."""
    out = tmp_path / "o"
    assert main([f"data_dir={tmp_path / 'data'}", f"output_dir={out}", bad]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"{bad} must be >= 1" in err and not out.exists()
