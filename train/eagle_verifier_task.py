"""The SPRINTER verifier for an EAGLE drafter (``head=eagle_verifier``) on ``labels=eagle_rounds`` data.

No model is loaded: the datagen run decoded with the EAGLE head and stored, per candidate ``y``, the head's
post-norm state (``eagle_rounds.position=previous``: the state that drew ``y``, SPRINTER's
``verifier.feature=previous``; ``own``: the state after consuming ``y``, ``verifier.feature=current``), the
drafter's ``q(y)`` and the target's ``p(y)`` (both from the temperature-1 softmax under greedy decoding, as
``labels=sprinter`` compares them). The label is SPRINTER's ratio threshold, ``q(y) <= lam * p(y)``, taken from
those two columns at batch time (so ``verifier.roc_lambdas`` heads share the data). The head is a
:class:`~specheads.heads.VerifierHead` on the state, class-weighted BCE, the best epoch by held-out AUROC. It
exports as ``head_type=verifier`` with ``feature.model: eagle`` and that EAGLE head's ``tensors_sha256``, so
``heads-decode policy=sprinter sprinter.head=... eagle=...`` reads it and decoding with another EAGLE head (or the
draft model) is an error.
"""

from __future__ import annotations

from pathlib import Path

import torch

from specheads.errors import UserError
from specheads.heads import VerifierHead
from specheads.train import verifier_data as V
from specheads.train.config import TrainConfig
from specheads.train.eagle_stop_task import StopStore
from specheads.train.task import Task, auroc_score, describe, predict, split
from specheads.train.verifier_task import VerifierTask, eval_metrics

#: SPRINTER's feature name for each ``eagle_rounds.position`` (the state that drew the candidate, or the one after it)
FEATURE_OF_POSITION = {"previous": "previous", "own": "current"}


class EagleVerifierTask(Task):
    """The SPRINTER verifier on an EAGLE head's stored states, from ``labels=eagle_rounds`` data."""

    labels = ("eagle_rounds",)
    head_type = "verifier"  # policy=sprinter reads it

    def __init__(self, cfg: TrainConfig, manifest: dict, store: StopStore, device):
        self.cfg, self.manifest, self.store, self.device = cfg, manifest, store, device
        self.train_examples, self.eval_examples = split(store.examples, cfg.eval_fraction, cfg.seed)
        self.hidden = int(manifest["hidden_size"])
        ratio = store.ratio[store.rows(self.train_examples)]
        share = float((ratio <= cfg.verifier.lam).float().mean())
        fixed = cfg.class_weights == "fixed"
        self.weights = (cfg.w_acc, cfg.w_rej) if fixed else V.balanced_weights(share, cfg.verifier.lam)

    @classmethod
    def check(cls, cfg: TrainConfig) -> list[str]:
        out = []
        if cfg.verifier.feature not in FEATURE_OF_POSITION.values():
            out.append(
                f"verifier.feature={cfg.verifier.feature!r}: head=eagle_verifier reads the EAGLE head's state, "
                "previous (the state that drew the candidate) or current (the state after it); the EAGLE head has no "
                "draft embedding"
            )
        return out + V.label_problems(cfg)

    @classmethod
    def setup(cls, cfg: TrainConfig, manifest: dict, acc) -> EagleVerifierTask:
        rounds = manifest.get("eagle_rounds")
        if rounds is None:
            raise UserError(
                f"{cfg.data_dir}/manifest.json has no eagle_rounds section; relabel with heads-datagen "
                "labels=eagle_rounds eagle_rounds.position=previous"
            )
        position = rounds["feature"]["position"]
        if FEATURE_OF_POSITION[position] != cfg.verifier.feature:
            want = next(p for p, f in FEATURE_OF_POSITION.items() if f == cfg.verifier.feature)
            raise UserError(
                f"{cfg.data_dir} stores eagle_rounds.position={position} states (SPRINTER's feature="
                f"{FEATURE_OF_POSITION[position]}); train with verifier.feature={FEATURE_OF_POSITION[position]} or "
                f"relabel with eagle_rounds.position={want}"
            )
        return cls(cfg, manifest, StopStore(cfg.data_dir), acc.device)

    @staticmethod
    def summary(cfg: TrainConfig, metrics: dict) -> str:
        return (
            f"verifier AUROC {metrics.get('eval_auroc')} (the drafter's confidence q(y): "
            f"{metrics.get('eval_auroc_confidence')}), TPR {metrics.get('eval_tpr_at_eta')} / FPR "
            f"{metrics.get('eval_fpr_at_eta')} at eta={cfg.threshold:g}"
        )

    def build_head(self) -> VerifierHead:
        torch.manual_seed(self.cfg.seed)
        return VerifierHead(self.hidden, self.cfg.depth)

    def ratios(self, examples: list) -> tuple[torch.Tensor, torch.Tensor]:
        """States ``[N, d]`` and raw ratios ``q(y)/p(y)`` ``[N]`` of a batch."""
        x, _ = self.store.batch(examples, self.device)
        return x, self.store.ratio[self.store.rows(examples)].to(self.device)

    def batch(self, examples: list, epoch: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, ratio = self.ratios(examples)
        return x, (ratio <= self.cfg.verifier.lam).float()

    def _predict(self, head: torch.nn.Module, examples: list) -> tuple[torch.Tensor, torch.Tensor]:
        return predict(head, examples, self.cfg.batch_size, self.ratios)

    @torch.no_grad()
    def evaluate(self, head: torch.nn.Module, examples: list) -> dict:
        """AUROC (the head's and the drafter's confidence's), weighted loss, TPR/FPR/accuracy at eta, alpha."""
        cfg = self.cfg
        logits, ratio = self._predict(head, examples)
        roc = V.roc_metrics(torch.sigmoid(logits), ratio, cfg.verifier.lam, cfg.threshold)
        conf = V.roc_metrics(self.store.confidence[self.store.rows(examples)], ratio, cfg.verifier.lam, cfg.threshold)
        out = eval_metrics(roc, logits, (ratio <= cfg.verifier.lam).float(), self.weights)
        return {"eval_auroc": out.pop("eval_auroc"), "eval_auroc_confidence": conf["auroc"], **out}

    def score(self, metrics: dict) -> float:
        return auroc_score(metrics)

    def metadata(self, metrics: dict) -> dict:
        rounds = self.manifest["eagle_rounds"]
        eagle = rounds["eagle"]
        feature = {
            **rounds["feature"],
            "position": self.cfg.verifier.feature,
            "eagle": {"file": eagle.get("file"), "tensors_sha256": eagle["tensors_sha256"]},
        }
        return describe(
            self.cfg, self.manifest, self.hidden, metrics, label="ratio", lam=self.cfg.verifier.lam, feature=feature
        )

    def models(self) -> dict[str, tuple]:
        return {}  # the states were stored by the datagen run

    def head_device(self):
        return self.device

    def drafter_name(self) -> str:
        return Path(str(self.manifest["eagle_rounds"]["eagle"].get("file") or "the EAGLE head")).name

    # the verifier.roc_lambdas companions and the report are the draft-model verifier's
    _lambdas = VerifierTask._lambdas
    companions = VerifierTask.companions
    report = VerifierTask.report
