"""The head training run: setup, epochs, evaluation, early stopping, checkpoints, export; the data's manifest,
the epoch's batches and whether an output directory holds another run.

One loop serves every head; the run's task (``task.py``, the one ``head=`` names in ``registry.py``)
says which examples, which features and labels, how to build, evaluate, select and describe the
head, and what to report after training. Its ``loss`` is the weighted BCE with the task's class
weights unless the task brings its own (the EAGLE draft head, ``eagle_task.py``, and the distilled
draft, ``distill_task.py``: against the target's distributions); the best epoch's head is what the
task's ``save`` writes: ``head.safetensors``, or for the standalone draft a model directory ``draft/``.

Data parallel under ``accelerate launch`` (DDP, DeepSpeed ZeRO 1-3, ``zero.py``): every process
draws the same seeded epoch permutation and takes every ``world``-th micro-batch of it, so the
examples a step sees do not depend on timing. Checkpoints (``checkpoint.py``) are written at epoch
ends and, with ``checkpoint_every``, every that many optimizer steps; a rerun of the same command
(same number of processes) continues at the saved data position with the saved optimizer,
scheduler and RNG state, and ends with the head an uninterrupted run ends with, bit for bit (under
the same numerics settings, which checkpoints record: a resume under others warns, see
``specheads.runtime.numerics``). Its ``metrics.jsonl`` is first cut back to the rows written up to that
checkpoint, so no step appears twice.
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import shutil
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from specheads.config import to_yaml
from specheads.dataset import MIXED_DATA_LABELS
from specheads.errors import UserError
from specheads.outputs import MetricsWriter, atomic_write_json, holds_other_run, prepare_output_dir
from specheads.runtime.numerics import check_resume, numerics_settings
from specheads.train import checkpoint, tracking, zero
from specheads.train.config import TrainConfig
from specheads.train.task import Task, param_dtype

log = logging.getLogger(__name__)


def train(cfg: TrainConfig, kind: type[Task], out: Path, fresh: bool = False) -> dict:
    """Runs the whole training of the task ``kind`` (the one ``cfg.head`` names); returns the final metrics
    and the run's ``numerics``. Resumes from the newest checkpoint in ``out``, if any, unless ``fresh``
    (``out`` held another run, overwritten: its state is removed)."""
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs

    cuda = torch.cuda.is_available()
    deepspeed = os.environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() == "true"  # set by accelerate launch
    # Under DeepSpeed the engine owns accumulation (and scales the loss); elsewhere this loop does. DeepSpeed
    # without a GPU: accelerate finds no backend for the CPU (state.py, _prepare_backend) and each process
    # would take itself for the only one while DeepSpeed's gloo group holds them all; naming gloo fixes that.
    group = {"backend": "gloo"} if deepspeed and not cuda else {}
    acc = Accelerator(
        cpu=not cuda and not deepspeed,
        gradient_accumulation_steps=cfg.grad_accum if deepspeed else 1,
        mixed_precision="bf16" if cfg.bf16 and cuda and torch.cuda.is_bf16_supported() else "no",
        kwargs_handlers=[InitProcessGroupKwargs(timeout=timedelta(seconds=cfg.dist_timeout_s), **group)],
        log_with=list(cfg.report_to) or None,
        project_dir=str(out),
    )
    manifest = data_manifest(cfg)
    held = manifest.get("labels", "acceptance")
    if held not in kind.labels:
        raise UserError(
            f"{cfg.data_dir} holds labels={held!r} data; head={cfg.head} needs heads-datagen labels={kind.labels[0]}"
        )
    if _any_rank(acc, fresh):
        if acc.is_main_process:
            checkpoint.clear(out)
            for name in (kind.artifact, "head.safetensors", "best_metrics.json"):
                shutil.rmtree(out / name) if (out / name).is_dir() else (out / name).unlink(missing_ok=True)
        acc.wait_for_everyone()
    task = kind.setup(cfg, manifest, acc)
    best, numerics = _fit(cfg, out, acc, task)
    for note, sub in task.companions(out):
        fresh = overwrites_another_run(sub)
        if acc.is_main_process:
            prepare_output_dir(sub.output_dir, to_yaml(sub), overwrite=sub.overwrite)
        acc.wait_for_everyone()
        log.info("%s in %s", note, sub.output_dir)
        train(sub, kind, Path(sub.output_dir), fresh=fresh)
    best.update(task.report(out, acc, best))
    if acc.is_main_process and best.get("eval_calibration"):
        from specheads.runtime.calibration import reliability_png

        curve = {"ece": best["eval_ece"], "brier": best["eval_brier"], "bins": best["eval_calibration"]}
        best["reliability_png"] = str(
            reliability_png(
                out / "reliability.png",
                {f"{task.head_type} head, epoch {best.get('epoch')}": curve},
                f"{cfg.head} head: held-out calibration ({best.get('eval_tokens')} examples)",
            )
        )
    best["numerics"] = numerics
    return best


@dataclass
class _Run:
    """What the steps of a run share: the settings, the prepared head and optimizer, the progress."""

    cfg: TrainConfig
    out: Path
    acc: Any
    task: Task
    head: torch.nn.Module  # as prepared (a DDP or DeepSpeed wrapper)
    raw: torch.nn.Module  # the head itself
    opt: Any
    sched: Any
    total: int  # optimizer steps of the whole run
    ds: bool  # DeepSpeed
    zero3: bool
    # position: the next micro-batch of this process's share of the epoch (at an optimizer step)
    progress: dict = field(default_factory=dict)

    @property
    def world(self) -> int:
        return self.acc.num_processes


def _fit(cfg: TrainConfig, out: Path, acc, task: Task) -> tuple[dict, dict]:
    """Epochs, evaluation, early stopping, checkpoints and the best head's export; returns the best
    epoch's metrics and the run's numerics."""
    run = _prepare(cfg, out, acc, task)
    final = {}
    with (
        MetricsWriter(out) if acc.is_main_process else _Null() as rows,
        tqdm(
            total=run.total,
            initial=run.progress["step"],
            unit="step",
            desc="heads-train",
            disable=not acc.is_main_process,
        ) as bar,
    ):
        metrics = tracking.Tracked(rows, acc, cfg, out)
        while not run.progress["done"] and run.progress["epoch"] < cfg.epochs:
            _train_epoch(run, metrics, bar)
            final = _end_epoch(run, metrics)
        metrics.close()
    best = json.loads((out / "best_metrics.json").read_text()) if (out / "best_metrics.json").exists() else final
    return best, run.progress["numerics"]


def _prepare(cfg: TrainConfig, out: Path, acc, task: Task) -> _Run:
    """A fresh head, its optimizer and schedule, resumed from the newest checkpoint in ``out`` if any,
    prepared by accelerate; the run's numerics in ``progress``."""
    from transformers import get_cosine_schedule_with_warmup

    head = task.build_head()
    opt = torch.optim.AdamW(head.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    world = acc.num_processes
    micro = len(_epoch_batches(len(task.train_examples), cfg.batch_size, world, cfg.seed, 0)) // world
    steps_per_epoch = math.ceil(micro / cfg.grad_accum)
    total = min(steps_per_epoch * cfg.epochs, cfg.max_steps or 1 << 62)
    sched = get_cosine_schedule_with_warmup(opt, math.ceil(cfg.warmup_ratio * total), total)
    ds = zero.enabled(acc)
    zero3 = ds and zero.configure(acc, cfg.batch_size, cfg.grad_accum, task.hidden)
    progress = {"epoch": 0, "step": 0, "position": 0, "best": None, "bad_epochs": 0, "done": False, "world": world}
    ckpt = checkpoint.find(out, world, acc.process_index, zero=ds, any_rank=lambda bad: _any_rank(acc, bad))
    if ckpt is not None:  # under DeepSpeed the optimizer state is per-rank partitions, loaded after prepare
        progress.update(checkpoint.restore(ckpt, head, None if ds else opt, sched))
        log.info(
            "resumed from %s (epoch %d, step %d, micro-batch %d)",
            ckpt.path,
            progress["epoch"],
            progress["step"],
            progress["position"],
        )
        if acc.is_main_process:
            _cut_metrics(out, progress.get("metrics_bytes"))
    head, opt = acc.prepare(head, opt)
    raw = acc.unwrap_model(head)
    if ds and ckpt is not None:
        zero.load_partition(ckpt, opt, acc.process_index, world)
    progress["numerics"] = _numerics(acc, task, param_dtype(raw))  # what the next checkpoints record
    if ckpt is not None and acc.is_main_process:
        check_resume(ckpt.progress.get("numerics"), progress["numerics"], str(ckpt.path))
    return _Run(cfg, out, acc, task, head, raw, opt, sched, total, ds, zero3, progress)


def _numerics(acc, task: Task, dtype: torch.dtype) -> dict:
    """The run's numerics settings: the head's dtype and device and those of the frozen models the task runs."""
    dtypes, devices = {"head": dtype, "autocast": acc.mixed_precision}, {"head": acc.device}
    for role, (model_dtype, device) in task.models().items():
        dtypes[role], devices[role] = model_dtype, device
    return numerics_settings(acc.num_processes, dtypes, devices)


def _train_epoch(run: _Run, metrics, bar) -> None:
    """This process's share of the epoch's micro-batches from the saved position, an optimizer step every
    ``grad_accum`` of them (and at the epoch's end); stops at the run's last step."""
    cfg, acc, task, progress = run.cfg, run.acc, run.task, run.progress
    epoch, train_ex = progress["epoch"], task.train_examples
    batches = _epoch_batches(len(train_ex), cfg.batch_size, run.world, cfg.seed, epoch)[acc.process_index :: run.world]
    run.head.train()
    for i in range(progress["position"], len(batches)):
        x, y = task.batch([train_ex[j] for j in batches[i]], epoch)
        loss = _loss(run, x, y)
        last = (i + 1) % cfg.grad_accum == 0 or i + 1 == len(batches)
        if run.ds:  # where DeepSpeed's accumulation boundary is
            acc.gradient_state._set_sync_gradients(last)
        if not last:
            with acc.no_sync(run.head):
                acc.backward(loss)
            continue
        acc.backward(loss)
        run.opt.step()
        run.sched.step()
        run.opt.zero_grad()
        progress["step"] += 1
        progress["position"] = i + 1
        bar.update()
        metrics.write(
            step=progress["step"],
            epoch=epoch,
            loss=float(loss.detach()) * (1 if run.ds else cfg.grad_accum),
            lr=run.sched.get_last_lr()[0],
        )
        if progress["step"] >= run.total:
            break
        if cfg.checkpoint_every and progress["step"] % cfg.checkpoint_every == 0 and i + 1 < len(batches):
            _save_checkpoint(run, metrics)  # mid-epoch (the epoch's last step is checkpointed after its eval)


def _loss(run: _Run, x, y) -> torch.Tensor:
    """A micro-batch's loss (the task's: by default the weighted BCE with its class weights), scaled for the
    accumulation this loop does."""
    with run.acc.autocast():  # a DeepSpeed bf16 engine holds bf16 weights: the task feeds it its dtype
        loss = run.task.loss(run.head, x, y)
    return loss if run.ds else loss / run.cfg.grad_accum  # DeepSpeed divides by its accumulation steps itself


def _end_epoch(run: _Run, metrics) -> dict:
    """The epoch's held-out metrics, the best head's export when they improve, early stopping and the
    epoch-end checkpoint; returns the metrics."""
    cfg, progress = run.cfg, run.progress
    run.head.eval()
    final = {"epoch": progress["epoch"], "step": progress["step"], **run.task.evaluate(run.raw, run.task.eval_examples)}
    metrics.write(final)
    score = run.task.score(final)
    improved = progress["best"] is None or score < progress["best"]
    if improved:
        progress["best"], progress["bad_epochs"] = score, 0
    else:
        progress["bad_epochs"] += 1
    with zero.full_weights(run.raw, run.zero3):
        if improved and run.acc.is_main_process:
            _export(run, final)
    progress["epoch"] += 1
    progress["position"] = 0
    progress["done"] = progress["bad_epochs"] >= cfg.patience or progress["step"] >= run.total
    _save_checkpoint(run, metrics)
    return final


def _export(run: _Run, final: dict) -> None:
    """The best epoch's head (what the task's ``save`` writes, ``head.safetensors`` unless it says otherwise)
    and its metrics."""
    run.task.save(run.out, run.raw, final)
    atomic_write_json(run.out / "best_metrics.json", final)


def _save_checkpoint(run: _Run, metrics) -> None:
    """A checkpoint at the current step (collective: under DeepSpeed every rank writes its optimizer partition,
    which the main process files in)."""
    acc, progress, step = run.acc, run.progress, run.progress["step"]
    parts = []
    if run.ds:
        zero.save_partition(run.out, step, run.opt, acc.process_index, run.world)
        parts = [checkpoint.zero_partition_path(run.out, step, r) for r in range(run.world)]
        acc.wait_for_everyone()
    with zero.full_weights(run.raw, run.zero3):
        if acc.is_main_process:
            progress["metrics_bytes"] = metrics.path.stat().st_size  # what a resumed run keeps
            checkpoint.save(
                run.out, step, run.raw, None if run.ds else run.opt, run.sched, dict(progress), extra_files=parts
            )
    acc.wait_for_everyone()


def _epoch_batches(n: int, batch: int, world: int, seed: int, epoch: int) -> list[list[int]]:
    """The epoch's micro-batches of example indices, padded so every process gets as many."""
    order = list(range(n))
    random.Random(seed * 1000 + epoch).shuffle(order)
    per_round = batch * world
    if len(order) % per_round:
        order += order[: per_round - len(order) % per_round]
    return [order[i : i + batch] for i in range(0, len(order), batch)]


def overwrites_another_run(cfg: TrainConfig) -> bool:
    """``overwrite=true`` into an output_dir that holds a run with another config (call it before
    ``prepare_output_dir`` rewrites config.yaml): that run's checkpoints must not be resumed."""
    return cfg.overwrite and holds_other_run(cfg.output_dir, to_yaml(cfg))


def data_manifest(cfg: TrainConfig) -> dict:
    """The manifest of ``data_dir``; for several comma-separated judge data sets (tuples mixed from several
    sources: arithmetic-localised, swap-mined, imported), the first one's, after checking that every one is
    judge data of the same target (fingerprint and hidden size)."""
    dirs = [d.strip() for d in cfg.data_dir.split(",") if d.strip()]
    if not dirs:
        raise UserError(f"data_dir={cfg.data_dir!r} names no directory; pass data_dir=<heads-datagen output_dir>")
    manifests = []
    for d in dirs:
        path = Path(d) / "manifest.json"
        if not path.is_file():
            raise UserError(f"{path} not found; data_dir must be a finished heads-datagen output_dir")
        manifests.append(json.loads(path.read_text()))
    if len(dirs) > 1:
        want = MIXED_DATA_LABELS.get(cfg.head)
        if want is None or any(m.get("labels") != want for m in manifests):
            raise UserError(
                f"data_dir={cfg.data_dir}: several data sets are mixed only for head=judge (labels=judge) "
                "and head=eagle or draft (labels=drafter)"
            )
        first = manifests[0]
        for d, m in zip(dirs[1:], manifests[1:]):
            if (m.get("target") or {}).get("fingerprint") != (first.get("target") or {}).get("fingerprint") or m.get(
                "hidden_size"
            ) != first.get("hidden_size"):
                raise UserError(
                    f"{d} was labelled on another target than {dirs[0]} (fingerprint or hidden size "
                    "differ); mix only data sets of one target"
                )
        return {**first, "data_dirs": dirs}
    return manifests[0]


def _any_rank(acc, bad: bool) -> bool:
    """Whether any process says ``bad`` (every process must call it)."""
    if acc.num_processes == 1:
        return bad
    flag = torch.tensor([1.0 if bad else 0.0], device=acc.device)
    return bool(acc.reduce(flag, reduction="sum").item() > 0)


def _cut_metrics(out: Path, size: int | None) -> None:
    """Drops the rows a killed run wrote after the checkpoint it resumes from (the rerun writes them again)."""
    path = out / "metrics.jsonl"
    if size is not None and path.is_file() and path.stat().st_size > size:
        with open(path, "r+b") as f:
            f.truncate(size)
        log.info("metrics.jsonl cut back to the checkpoint's rows (%d bytes)", size)


class _Null:
    path = None

    def write(self, *a, **k):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass
