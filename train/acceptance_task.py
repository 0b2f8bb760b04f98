"""Training the SpecDec++ acceptance head (``head=acceptance``, alias ``specdecpp``).

Three labels (``acceptance.label=``): ``soft``, ``min(1, p/q)`` of the drawn token, on the draft's state at
that token with token mixing (weighted soft BCE; docs/algorithms/specdecpp.md); ``expected``,
``1 - TV(p, q)``, and ``fsd``, the stored FSD decision ``Div(p, q) < T`` of ``labels=fsd`` data
(``fsd.py``), both functions of ``(p_i, q_i)`` alone and so on the state that produced ``q_i``,
without mixing. The best epoch has the lowest held-out binary KL.
"""

from __future__ import annotations

from pathlib import Path

import torch

from specheads.heads import AcceptanceHead
from specheads.train import fsd_data as F
from specheads.train.acceptance_data import draft_features, load_examples, mix, mix_seed
from specheads.train.config import TrainConfig
from specheads.train.draft import Draft, feature_cache, load_draft
from specheads.train.loss import binary_kl, weighted_soft_bce
from specheads.train.task import EVAL_EPOCH, Task, calibration_metrics, describe, predict, split


class AcceptanceTask(Task):
    """The acceptance head on the draft's states, from ``labels=acceptance`` (or ``labels=fsd``) data."""

    labels = ("acceptance", "fsd")  # fsd data holds the acceptance columns too
    head_type = "acceptance"

    def __init__(self, cfg: TrainConfig, manifest: dict, draft: Draft, train_examples: list, eval_examples: list):
        self.cfg, self.manifest, self.draft = cfg, manifest, draft
        self.train_examples, self.eval_examples = train_examples, eval_examples
        self.weights, self.hidden = (cfg.w_acc, cfg.w_rej), draft.hidden
        self.cache = None

    @classmethod
    def check(cls, cfg: TrainConfig) -> list[str]:
        return []  # acceptance.label and fsd_label are checked with the common settings (cli.py)

    @classmethod
    def setup(cls, cfg: TrainConfig, manifest: dict, acc) -> AcceptanceTask:
        if cfg.acceptance.label == "fsd":
            column = F.label_column(cfg.acceptance.fsd_label, manifest, cfg.data_dir)
        else:
            column = "expected_label" if cfg.acceptance.label == "expected" else "label"
        train_examples, eval_examples = split(load_examples(cfg.data_dir, column), cfg.eval_fraction, cfg.seed)
        task = cls(cfg, manifest, load_draft(cfg, acc, manifest), train_examples, eval_examples)
        if cfg.features == "cached":
            if (
                cfg.acceptance.label == "fsd"
            ):  # no mixing: one epoch's file; the labels differ per divergence and threshold
                name, threshold = F.parse_label(cfg.acceptance.fsd_label)
                label, ratio, epochs = f"fsd:{name}@{threshold!r}", 0.0, 1
            else:
                label, ratio, epochs = cfg.acceptance.label, cfg.acceptance.mix_ratio, cfg.epochs
            task.cache = feature_cache(
                cfg, acc, task.draft, label, ratio, task.features, epochs, train_examples, eval_examples
            )
        return task

    @staticmethod
    def summary(cfg: TrainConfig, metrics: dict) -> str:
        return f"eval binary KL {metrics.get('eval_binary_kl', float('nan')):.4f}, AUROC {metrics.get('eval_auroc')}"

    def build_head(self) -> AcceptanceHead:
        torch.manual_seed(self.cfg.seed)
        return AcceptanceHead(self.hidden, self.cfg.depth)

    def features(self, examples: list, epoch: int) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """The draft's features and labels of a batch, computed now, and the rows of each example.

        ``label=soft``: the mixed sequence's states at the response tokens (epoch ``epoch``'s mixing
        draw). ``expected``, ``fsd``: the draft on the target's own prefix, every position, the
        state one position earlier (the one that produced ``q_i``).
        """
        cfg = self.cfg
        seqs, starts, masks, labels = [], [], [], []
        expected = cfg.acceptance.label in ("expected", "fsd")  # labels that are functions of (p_i, q_i) alone
        for ex in examples:
            if expected:
                z, m = ex.input_ids, [True] * len(ex.label)
            else:
                z, m = mix(ex, cfg.acceptance.mix_ratio, mix_seed(cfg.seed, epoch, ex.index))
            seqs.append(z)
            starts.append(ex.start)
            masks.append(m)
            labels.append(ex.label)
        d = self.draft
        x, y = draft_features(
            d.model, d.capture, seqs, starts, masks, labels, d.pad, d.device, shift=1 if expected else 0
        )
        return x, y, [sum(m) for m in masks]

    def batch(self, examples: list, epoch: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.cfg.acceptance.label == "fsd" and epoch != EVAL_EPOCH:
            epoch = 0  # FSD features do not change between epochs (no mixing)
        if self.cache is not None:
            return self.cache.batch(epoch, examples, self.draft.device)
        return self.features(examples, epoch)[:2]

    @torch.no_grad()
    def evaluate(self, head: torch.nn.Module, examples: list) -> dict:
        """Unweighted binary KL, weighted loss and AUROC against the binarised label."""
        from sklearn.metrics import roc_auc_score

        cfg = self.cfg
        x, y = predict(head, examples, cfg.batch_size, lambda batch: self.batch(batch, EVAL_EPOCH))
        hard = (y >= 0.5).cpu().numpy()
        auroc = float(roc_auc_score(hard, x.cpu().numpy())) if 0 < hard.sum() < len(hard) else None
        return {
            "eval_binary_kl": float(binary_kl(y, x)),
            "eval_weighted_loss": float(weighted_soft_bce(x, y, cfg.w_acc, cfg.w_rej)),
            "eval_auroc": auroc,
            "eval_tokens": int(y.numel()),
            "eval_label_mean": float(y.mean()),
            **calibration_metrics(x, y),
        }

    def score(self, metrics: dict) -> float:
        return metrics["eval_binary_kl"]

    def metadata(self, metrics: dict) -> dict:
        cfg = self.cfg
        position = "previous" if cfg.acceptance.label in ("expected", "fsd") else "own"
        meta = describe(
            cfg,
            self.manifest,
            self.hidden,
            metrics,
            label=cfg.acceptance.label,
            draft=self.manifest["draft"],
            feature={"model": "draft", "state": "post", "layer": -1, "position": position},
        )
        if cfg.acceptance.label == "fsd":
            meta["fsd"] = F.head_metadata(cfg.acceptance.fsd_label, self.manifest)
        return meta

    def models(self) -> dict[str, tuple]:
        return {"draft": (self.draft.model.dtype, self.draft.device)}

    def companions(self, out: Path) -> list[tuple[str, TrainConfig]]:
        return []

    def report(self, out: Path, acc, best: dict) -> dict:
        return {}
