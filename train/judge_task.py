"""Training the Judge head (``head=judge``) on the target features ``heads-datagen labels=judge`` stored.

No model is loaded: the datagen run kept the target's pre-norm states at every labelled answer
token. Class-weighted BCE (negatives, the first mistake of each wrong answer, are rare), the best
epoch by held-out AUROC; ``metrics.json`` holds that epoch's metrics at ``delta`` (``threshold``).
"""

from __future__ import annotations

from pathlib import Path

import torch

from specheads.errors import UserError
from specheads.heads import JudgeHead
from specheads.heads.judge_head import JUDGE_SIGNALS
from specheads.outputs import atomic_write_json
from specheads.train import judge_data as J
from specheads.train.config import TrainConfig
from specheads.train.loss import weighted_soft_bce
from specheads.train.task import EVAL_EPOCH, Task, auroc_score, calibration_metrics, describe, predict, split


class JudgeTask(Task):
    """The judge head on the target's stored states, from ``labels=judge`` data."""

    labels = ("judge",)
    head_type = "judge"

    def __init__(
        self,
        cfg: TrainConfig,
        manifest: dict,
        store: J.JudgeStore,
        train_examples: list,
        eval_examples: list,
        weights: tuple[float, float],
        device,
    ):
        self.cfg, self.manifest, self.store, self.device = cfg, manifest, store, device
        self.train_examples, self.eval_examples = train_examples, eval_examples
        self.weights, self.hidden = weights, int(manifest["hidden_size"])

    @classmethod
    def check(cls, cfg: TrainConfig) -> list[str]:
        bad = [s for s in cfg.judge.signals if s not in JUDGE_SIGNALS]
        if bad or len(set(cfg.judge.signals)) < len(cfg.judge.signals):
            return [f"judge.signals={list(cfg.judge.signals)}: choose each at most once from {list(JUDGE_SIGNALS)}"]
        return []

    @classmethod
    def setup(cls, cfg: TrainConfig, manifest: dict, acc) -> JudgeTask:
        store = J.JudgeStore(cfg.data_dir, tuple(cfg.judge.signals))
        train_examples, eval_examples = split(store.examples, cfg.eval_fraction, cfg.seed)
        weights = (cfg.w_acc, cfg.w_rej)
        if cfg.class_weights == "balanced":
            labels = torch.cat([store.labels[e.start : e.end] for e in train_examples])
            share = float((labels >= 0.5).float().mean())
            if share in (0.0, 1.0):
                raise UserError(
                    f"every training token of {cfg.data_dir} has label {int(share)}: nothing to learn; "
                    "generate or import more tuples"
                )
            weights = (0.5 / share, 0.5 / (1 - share))
        return cls(cfg, manifest, store, train_examples, eval_examples, weights, acc.device)

    @staticmethod
    def summary(cfg: TrainConfig, metrics: dict) -> str:
        return (
            f"judge AUROC {metrics.get('eval_auroc')}, wrong tokens accepted at delta={cfg.threshold:g}: "
            f"{metrics.get('eval_wrong_accepted_share')}"
        )

    def build_head(self) -> JudgeHead:
        torch.manual_seed(self.cfg.seed)
        return JudgeHead(self.hidden, self.cfg.depth, tuple(self.cfg.judge.signals))

    def batch(self, examples: list, epoch: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.store.batch(epoch, examples, self.device)

    def evaluate(self, head: torch.nn.Module, examples: list) -> dict:
        """AUROC, weighted loss; at delta: precision and recall of the negative class, accepted shares."""
        logits, labels = predict(head, examples, self.cfg.batch_size, lambda batch: self.batch(batch, EVAL_EPOCH))
        m = J.judge_metrics(torch.sigmoid(logits), labels, self.cfg.threshold)
        w_pos, w_neg = self.weights
        return {
            "eval_auroc": m["auroc"],
            "eval_weighted_loss": float(weighted_soft_bce(logits, labels, w_pos, w_neg)),
            "eval_negative_precision": m["negative_precision"],
            "eval_negative_recall": m["negative_recall"],
            "eval_wrong_accepted_share": m["wrong_accepted_share"],
            "eval_correct_accepted_share": m["correct_accepted_share"],
            "eval_tokens": m["tokens"],
            "eval_negative_tokens": m["negative_tokens"],
            **calibration_metrics(logits, labels),
        }

    def score(self, metrics: dict) -> float:
        return auroc_score(metrics)

    def metadata(self, metrics: dict) -> dict:
        return describe(
            self.cfg,
            self.manifest,
            self.hidden,
            metrics,
            label="judge",
            draft=self.manifest.get("draft"),
            feature={"model": "target", "state": "pre", "layer": -1, "position": "own"}
            | ({"signals": list(self.cfg.judge.signals)} if self.cfg.judge.signals else {}),
        )

    def models(self) -> dict[str, tuple]:
        return {}  # the features were stored by the datagen run

    def companions(self, out: Path) -> list[tuple[str, TrainConfig]]:
        return []

    def report(self, out: Path, acc, best: dict) -> dict:
        """``metrics.json``: the best epoch's held-out metrics (without ``eval_``), ``delta`` and its epoch."""
        if acc.is_main_process:
            atomic_write_json(
                out / "metrics.json",
                {k[len("eval_") :]: v for k, v in best.items() if k.startswith("eval_")}
                | {"delta": self.cfg.threshold, "epoch": best.get("epoch")},
            )
        return {}
