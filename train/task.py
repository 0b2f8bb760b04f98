"""What a head family brings to a training run, and the pieces the families share.

The loop (``trainer.py``) is the same for every head; a :class:`Task` is the rest: which examples it
reads, the features and labels of a batch, a fresh head, the held-out metrics, the score that
selects the best epoch, the metadata the exported head carries, and the reports written after the
last epoch. Three hooks have defaults a family may replace: ``loss`` (the weighted BCE with the task's
class weights), ``save`` (the best epoch's ``head.safetensors``) and ``artifact`` (the name of what
``save`` writes). ``registry.py`` names the tasks by ``head=``: ``acceptance`` (SpecDec++'s stop head,
``acceptance_task.py``), ``verifier`` (SPRINTER's, ``verifier_task.py``), ``judge`` (``judge_task.py``),
``eagle`` (the EAGLE-3-style draft head, its own loss: ``eagle_task.py``), ``draft`` (a distilled
standalone draft model, its own loss and ``save``: a model directory, ``distill_task.py``), ``eagle_stop``
(the stop head on an EAGLE head's states, ``eagle_stop_task.py``) and ``eagle_verifier`` (the verifier on
them, ``eagle_verifier_task.py``).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import ClassVar, Protocol

import torch

from specheads.errors import UserError
from specheads.export import save_head
from specheads.train.config import TrainConfig
from specheads.train.loss import weighted_soft_bce

EVAL_EPOCH = 0xFFF  # the held-out set's "epoch": its fixed mixing draw, its file in the feature cache


class Task(Protocol):
    """One head family's side of a training run, built by :meth:`setup` before the first epoch.

    A family subclasses it and implements every method without a body here; ``loss``, ``save`` and
    ``artifact`` it keeps or replaces."""

    labels: ClassVar[tuple[str, ...]]  # the heads-datagen labels= it trains on; errors name the first
    head_type: ClassVar[str]  # its key in specheads.heads.HEADS, written into the exported file
    artifact: ClassVar[str] = "head.safetensors"  # what save writes in the output directory
    train_examples: list
    eval_examples: list
    weights: tuple[float, float]  # (w_pos, w_neg) of the weighted BCE
    hidden: int  # the hidden size of the model it reads (ZeRO-3 bucket sizes)

    @classmethod
    def check(cls, cfg: TrainConfig) -> list[str]:
        """The problems of its own settings, as one-line messages."""

    @classmethod
    def setup(cls, cfg: TrainConfig, manifest: dict, acc) -> Task:
        """Reads the examples, splits them, loads what computes the features (collective)."""

    @staticmethod
    def summary(cfg: TrainConfig, metrics: dict) -> str:
        """The final metrics in one log line."""

    def build_head(self) -> torch.nn.Module:
        """A fresh head, its initial weights drawn from the run's seed."""

    def batch(self, examples: list, epoch: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Features ``[M, d]`` and labels ``[M]`` of a batch of examples."""

    def loss(self, head: torch.nn.Module, x, y) -> torch.Tensor:
        """A batch's training loss: the weighted soft BCE of the head's logits with :attr:`weights` (a draft
        head brings its own, against the target's distributions)."""
        return weighted_soft_bce(head(x.to(param_dtype(head))).float(), y, *self.weights)

    def evaluate(self, head: torch.nn.Module, examples: list) -> dict:
        """Held-out metrics (``eval_*``)."""

    def score(self, metrics: dict) -> float:
        """Selects the best epoch: lower is better."""

    def metadata(self, metrics: dict) -> dict:
        """What the exported head records besides ``head_config`` (see :mod:`specheads.export.package`)."""

    def save(self, out: Path, head: torch.nn.Module, metrics: dict) -> None:
        """Writes the best epoch's head as ``out /`` :attr:`artifact`: ``head.safetensors`` with its
        ``head_config`` and :meth:`metadata` (main process, full weights)."""
        save_head(out / self.artifact, head, self.head_type, {"head_config": head.config(), **self.metadata(metrics)})

    def models(self) -> dict[str, tuple]:
        """The frozen models it runs, ``role -> (dtype, device)`` (the run's numerics)."""

    def companions(self, out: Path) -> list[tuple[str, TrainConfig]]:
        """Further runs on the same data that its report compares, with a note for the log."""

    def report(self, out: Path, acc, best: dict) -> dict:
        """Writes its report files after training (and the companions'); returns fields for the manifest."""


def split(examples: list, eval_fraction: float, seed: int) -> tuple[list, list]:
    """A seeded split by prompt (every prompt's tokens on one side)."""
    order = list(range(len(examples)))
    random.Random(seed).shuffle(order)
    n_eval = max(1, round(len(examples) * eval_fraction)) if eval_fraction > 0 else 0
    if n_eval >= len(examples):
        raise UserError(f"eval_fraction={eval_fraction} leaves no training prompts out of {len(examples)}")
    held = set(order[:n_eval])
    return [e for i, e in enumerate(examples) if i not in held], [e for i, e in enumerate(examples) if i in held]


def param_dtype(module: torch.nn.Module) -> torch.dtype:
    """The dtype of a head's weights (bf16 inside a DeepSpeed bf16 engine, else fp32)."""
    return next(module.parameters()).dtype


@torch.no_grad()
def predict(
    head: torch.nn.Module, examples: list, batch_size: int, inputs: Callable[[list], tuple[torch.Tensor, torch.Tensor]]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The head's logits (fp32) over ``examples``, and the targets ``inputs`` gives with the features."""
    logits, targets = [], []
    for i in range(0, len(examples), batch_size):
        x, y = inputs(examples[i : i + batch_size])
        logits.append(head(x.to(param_dtype(head))).float())
        targets.append(y)
    return torch.cat(logits), torch.cat(targets)


def calibration_metrics(logits: torch.Tensor, labels: torch.Tensor) -> dict:
    """The held-out calibration of a head (:func:`specheads.runtime.calibration.calibration`): ``eval_ece``,
    ``eval_brier`` and the reliability bins ``eval_calibration`` that ``reliability.png`` draws."""
    from specheads.runtime.calibration import calibration

    c = calibration(torch.sigmoid(logits.float()).cpu().numpy(), labels.float().cpu().numpy())
    return {"eval_ece": c["ece"], "eval_brier": c["brier"], "eval_calibration": c["bins"]}


def auroc_score(metrics: dict) -> float:
    """Minus the held-out AUROC (0.5 where it is undefined: one class only)."""
    return -(metrics["eval_auroc"] if metrics["eval_auroc"] is not None else 0.5)


def describe(cfg: TrainConfig, manifest: dict, hidden: int, metrics: dict, **fields) -> dict:
    """The exported metadata every head carries, and the family's ``fields`` (feature, label, draft ...)."""
    return {
        "hidden_size": hidden,
        "target": manifest["target"],
        "sampling": manifest["sampling"],
        "default_threshold": cfg.threshold,
        "extra": {"train": metrics, "datagen_seed": manifest.get("seed")},
        **fields,
    }
