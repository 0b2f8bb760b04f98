"""Training the SPRINTER verifier (``head=verifier``, alias ``sprinter``; docs/algorithms/sprinter.md).

Hard labels ``q(x) <= lambda * p(x)`` taken at batch time from the stored ratios (so heads for
several ``lambda`` share one feature cache), class-weighted BCE, the best epoch by held-out AUROC.
After training: ``metrics.json`` (ROC, AUROC, TPR/FPR/accuracy at eta, alpha) and ``roc.png``, one
curve per ``verifier.roc_lambdas`` value, each from its own head trained in ``lambda-<x>/``.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch

from specheads.heads import VerifierHead
from specheads.outputs import atomic_write_json
from specheads.train import verifier_data as V
from specheads.train.config import TrainConfig
from specheads.train.draft import Draft, feature_cache, load_draft
from specheads.train.loss import weighted_soft_bce
from specheads.train.task import EVAL_EPOCH, Task, auroc_score, calibration_metrics, describe, predict, split


class VerifierTask(Task):
    """The verifier on a draft feature (``verifier.feature=previous|current|previous+embedding``), on
    ``labels=sprinter`` data."""

    labels = ("sprinter",)
    head_type = "verifier"

    def __init__(
        self,
        cfg: TrainConfig,
        manifest: dict,
        draft: Draft,
        train_examples: list,
        eval_examples: list,
        weights: tuple[float, float],
    ):
        self.cfg, self.manifest, self.draft = cfg, manifest, draft
        self.train_examples, self.eval_examples = train_examples, eval_examples
        self.weights, self.hidden = weights, draft.hidden
        self.cache = None

    @classmethod
    def check(cls, cfg: TrainConfig) -> list[str]:
        problems = []
        if cfg.verifier.feature not in V.FEATURES:
            problems.append(
                f"verifier.feature={cfg.verifier.feature!r}: choose previous, current or previous+embedding"
            )
        return problems + V.label_problems(cfg)

    @classmethod
    def setup(cls, cfg: TrainConfig, manifest: dict, acc) -> VerifierTask:
        train_examples, eval_examples = split(V.load_examples(cfg.data_dir), cfg.eval_fraction, cfg.seed)
        draft = load_draft(cfg, acc, manifest)
        weights = (
            V.class_weights(train_examples, cfg.verifier.lam)
            if cfg.class_weights == "balanced"
            else (cfg.w_acc, cfg.w_rej)
        )
        task = cls(cfg, manifest, draft, train_examples, eval_examples, weights)
        if cfg.features == "cached":  # one file for every epoch (no mixing) and every lambda
            task.cache = feature_cache(
                cfg,
                acc,
                draft,
                f"verifier:{cfg.verifier.feature}",
                0.0,
                task.features,
                1,
                train_examples,
                eval_examples,
            )
        return task

    @staticmethod
    def summary(cfg: TrainConfig, metrics: dict) -> str:
        return (
            f"verifier AUROC {metrics.get('auroc')}, TPR {metrics.get('tpr_at_eta')} / FPR "
            f"{metrics.get('fpr_at_eta')} at eta={cfg.threshold:g}"
        )

    def build_head(self) -> VerifierHead:
        torch.manual_seed(self.cfg.seed)
        return VerifierHead(V.feature_width(self.cfg.verifier.feature, self.hidden), self.cfg.depth)

    def features(self, examples: list, epoch: int) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """The verifier's input at every labelled prefix of a batch, the ratios ``q(x)/p(x)``, rows per example."""
        d = self.draft
        return V.draft_features(d.model, d.capture, examples, self.cfg.verifier.feature, d.pad, d.device)

    def ratios(self, examples: list, epoch: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Features and raw ratios of a batch (from the cache when there is one)."""
        if self.cache is not None:
            return self.cache.batch(epoch, examples, self.draft.device)
        return self.features(examples, epoch)[:2]

    def batch(self, examples: list, epoch: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, ratio = self.ratios(examples, epoch if epoch == EVAL_EPOCH else 0)  # the same every epoch
        return x, (ratio <= self.cfg.verifier.lam).float()

    def evaluate(self, head: torch.nn.Module, examples: list) -> dict:
        """AUROC, weighted loss, TPR/FPR/accuracy at eta, alpha."""
        cfg = self.cfg
        logits, ratio = self._predict(head, examples)
        roc = V.roc_metrics(torch.sigmoid(logits), ratio, cfg.verifier.lam, cfg.threshold)
        return eval_metrics(roc, logits, (ratio <= cfg.verifier.lam).float(), self.weights)

    def _predict(self, head: torch.nn.Module, examples: list) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits and raw ratios (for metrics at any lambda) of held-out examples."""
        return predict(head, examples, self.cfg.batch_size, lambda batch: self.ratios(batch, EVAL_EPOCH))

    def score(self, metrics: dict) -> float:
        return auroc_score(metrics)

    def metadata(self, metrics: dict) -> dict:
        cfg = self.cfg
        return describe(
            cfg,
            self.manifest,
            self.hidden,
            metrics,
            label="ratio",
            lam=cfg.verifier.lam,
            draft=self.manifest["draft"],
            feature={"model": "draft", "state": "post", "layer": -1, "position": cfg.verifier.feature},
        )

    def models(self) -> dict[str, tuple]:
        return {"draft": (self.draft.model.dtype, self.draft.device)}

    def head_device(self):
        return self.draft.device

    def drafter_name(self) -> str:
        return Path(self.draft.name).name

    def _lambdas(self) -> list[float]:
        return [lam for lam in self.cfg.verifier.roc_lambdas if lam != self.cfg.verifier.lam]

    def companions(self, out: Path) -> list[tuple[str, TrainConfig]]:
        """One more verifier per ``verifier.roc_lambdas`` value, on the same data, in ``lambda-<x>/``."""
        return [
            (
                f"verifier.roc_lambdas: training the lambda={lam:g} verifier",
                replace(
                    self.cfg,
                    verifier=replace(self.cfg.verifier, lam=lam, roc_lambdas=[]),
                    output_dir=str(out / f"lambda-{lam:g}"),
                ),
            )
            for lam in self._lambdas()
        ]

    def report(self, out: Path, acc, best: dict) -> dict:
        """``metrics.json`` and ``roc.png`` of the best head and the companions' (main process)."""
        from specheads.export.package import load_head

        if not acc.is_main_process:
            return {}
        cfg, curves = self.cfg, []
        for lam, folder in [(cfg.verifier.lam, out)] + [(lam, out / f"lambda-{lam:g}") for lam in self._lambdas()]:
            head = load_head(folder / "head.safetensors").module.to(self.head_device()).float()
            logits, ratio = self._predict(head, self.eval_examples)
            curves.append(V.roc_metrics(torch.sigmoid(logits), ratio, lam, cfg.threshold))
        curves.sort(key=lambda c: c["lam"])
        png = V.roc_plot(
            out / "roc.png",
            curves,
            f"SPRINTER verifier ({cfg.verifier.feature}) on {self.drafter_name()}\n"
            f"{curves[0]['tokens']} held-out tokens, eta={cfg.threshold:g}",
        )
        main = next(c for c in curves if c["lam"] == cfg.verifier.lam)
        report = {
            "auroc": main["auroc"],
            "lam": cfg.verifier.lam,
            "eta": cfg.threshold,
            "feature": cfg.verifier.feature,
            "tpr_at_eta": main["tpr_at_eta"],
            "fpr_at_eta": main["fpr_at_eta"],
            "accuracy_at_eta": main["accuracy_at_eta"],
            "alpha": main["alpha"],
            "roc_png": str(png),
            "by_lambda": {f"{c['lam']:g}": c for c in curves},
        }
        atomic_write_json(out / "metrics.json", report)
        return {k: report[k] for k in ("auroc", "tpr_at_eta", "fpr_at_eta", "alpha", "roc_png")}


def eval_metrics(roc: dict, logits: torch.Tensor, y: torch.Tensor, weights: tuple[float, float]) -> dict:
    """A verifier's evaluation (``verifier_data.roc_metrics``'s figures, the weighted loss, the calibration)."""
    return {
        "eval_auroc": roc["auroc"],
        "eval_weighted_loss": float(weighted_soft_bce(logits, y, *weights)),
        "eval_tpr_at_eta": roc["tpr_at_eta"],
        "eval_fpr_at_eta": roc["fpr_at_eta"],
        "eval_accuracy_at_eta": roc["accuracy_at_eta"],
        "eval_alpha": roc["alpha"],
        "eval_tokens": roc["tokens"],
        "eval_label_mean": roc["label_mean"],
        **calibration_metrics(logits, y),
    }
