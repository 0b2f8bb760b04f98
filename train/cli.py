"""``heads-train``: fit a head on ``heads-datagen`` output.

    heads-train recipe=quickstart
    heads-train recipe=fsd_head_quickstart acceptance.fsd_label=js@0.4   # an FSD acceptance head (label=fsd)
    heads-train recipe=sprinter_quickstart                      # head=verifier (alias sprinter)
    heads-train head=draft data_dir=runs/drafter distill.init=truncate:4 lr=1e-3   # a distilled draft model
    accelerate launch --multi_gpu --num_processes 2 -m specheads.train.cli recipe=quickstart

Writes ``head.safetensors`` (the best epoch's head with its metadata, ready for
``heads-decode policy=specdecpp specdecpp.head=...`` or ``policy=sprinter``), ``best_metrics.json``,
``metrics.jsonl`` (each epoch's held-out figures, calibration included: ``eval_ece``, ``eval_brier``,
the reliability bins), ``reliability.png`` (the best epoch's reliability diagram), for the verifier also
``metrics.json`` (ROC, AUROC, TPR/FPR at eta, alpha) and
``roc.png`` (one curve per ``verifier.roc_lambdas`` value, each from its own head in ``lambda-<x>/``); head=draft
writes ``draft/`` instead of the head file (a Hugging Face model directory with ``specheads.json``) and
``metrics.json`` (held-out agreement and expected acceptance before and after training),
``checkpoint-<step>/`` + ``latest`` (at epoch ends and, with ``checkpoint_every=N``, every N
optimizer steps; resume by running the same command again, with as many processes),
``config.yaml`` and ``manifest.json`` (with the run's ``numerics``: threads per process, process
count, dtypes, devices, torch version, kernel path; a resume under other settings warns).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from transformers.utils import logging as hf_logging

from specheads.config import cli_main, to_yaml
from specheads.errors import UserError
from specheads.outputs import prepare_output_dir, write_manifest
from specheads.plan import run_plan
from specheads.runtime.numerics import use_threads
from specheads.train import tracking
from specheads.train.config import TrainConfig
from specheads.train.fsd_data import parse_label
from specheads.train.registry import canonical, task_type
from specheads.train.task import Task
from specheads.train.trainer import overwrites_another_run, train

log = logging.getLogger(__name__)
PROG = "heads-train"


def _check(cfg: TrainConfig) -> type[Task]:
    """Every problem of the settings, raised at once; the task ``head=`` names."""
    problems, kind = [], None
    try:
        kind = task_type(cfg.head)
        problems += kind.check(cfg)
    except UserError as err:
        problems.append(str(err))
    if not cfg.data_dir:
        problems.append("data_dir is not set; pass data_dir=<heads-datagen output_dir>")
    if cfg.acceptance.label not in ("soft", "expected", "fsd"):
        problems.append(f"acceptance.label={cfg.acceptance.label!r}: choose soft, expected or fsd")
    if cfg.acceptance.label == "fsd":
        if canonical(cfg.head) != "acceptance":
            problems.append(f"acceptance.label=fsd trains head=acceptance, not head={cfg.head}")
        try:
            parse_label(cfg.acceptance.fsd_label)
        except UserError as err:
            problems.append(str(err))
    if cfg.features not in ("online", "cached"):
        problems.append(f"features={cfg.features!r}: choose online or cached")
    if cfg.depth < 0:
        problems.append(f"depth={cfg.depth} must be >= 0")
    if not 0 <= cfg.acceptance.mix_ratio < 1:
        problems.append(f"acceptance.mix_ratio={cfg.acceptance.mix_ratio} must be in [0, 1)")
    if not 0 <= cfg.eval_fraction < 1:
        problems.append(f"eval_fraction={cfg.eval_fraction} must be in [0, 1)")
    for key in ("epochs", "batch_size", "grad_accum", "patience"):
        if getattr(cfg, key) < 1:
            problems.append(f"{key}={getattr(cfg, key)} must be >= 1")
    if cfg.max_steps is not None and cfg.max_steps < 1:
        problems.append(f"max_steps={cfg.max_steps} must be >= 1 (or null: no limit)")
    if cfg.threads is not None and cfg.threads < 1:
        problems.append(f"threads={cfg.threads} must be >= 1 (or null: torch's default)")
    if cfg.dist_timeout_s <= 0:
        problems.append(f"dist_timeout_s={cfg.dist_timeout_s} must be > 0")
    if cfg.checkpoint_every < 0:
        problems.append(f"checkpoint_every={cfg.checkpoint_every} must be >= 0 (0 = at epoch ends only)")
    if cfg.lr <= 0 or cfg.w_acc <= 0 or cfg.w_rej <= 0:
        problems.append("lr, w_acc and w_rej must be > 0")
    if not 0 < cfg.threshold < 1:
        problems.append(f"threshold={cfg.threshold} must be in (0, 1)")
    problems += tracking.problems(cfg)
    if problems:
        raise UserError("; ".join(problems))
    return kind


def run(cfg: TrainConfig) -> int:
    """Validates, prepares the output directory (resuming the same run), trains."""
    if cfg.plan:  # before any check against files or any model: the plan reads shapes only
        return run_plan("train", cfg)
    kind = _check(cfg)
    cfg.head = canonical(cfg.head)  # an alias is recorded under the task's own name
    hf_logging.disable_progress_bar()
    fresh = overwrites_another_run(cfg)  # train() then removes that run's checkpoints
    # Under ``accelerate launch`` only the main process (global rank 0) writes the run's files; the others
    # would race it, and the last writer's manifest would lack the main process's report fields.
    main_process = os.environ.get("RANK", "0") == "0"
    if main_process:
        out = prepare_output_dir(cfg.output_dir, to_yaml(cfg), overwrite=cfg.overwrite)
    else:
        (out := Path(cfg.output_dir)).mkdir(parents=True, exist_ok=True)
    with use_threads(cfg.threads):  # before any model work: the thread count changes the last bits
        metrics = train(cfg, kind, Path(out), fresh=fresh)
    artifact = kind.artifact  # head=draft: a model directory
    if main_process:
        write_manifest(out, command=PROG, data_dir=cfg.data_dir, head=artifact, **metrics)
    log.info("%s -> %s", kind.summary(cfg, metrics), Path(out) / artifact)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``heads-train``."""
    return cli_main(PROG, TrainConfig, "train", argv, run)


if __name__ == "__main__":
    raise SystemExit(main())
