"""Judge head training data: the target features ``heads-datagen labels=judge`` stored, per tuple.

The datagen run already holds the target's pre-norm states (fp16) at every labelled answer token,
so training needs neither model: an example is one tuple (both its sides), its tokens' features
and labels (1 correct, 0 the wrong answer's first mistake). The labels are held; the features are read
from the side files a batch at a time (``side_rows.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from specheads.dataset import JudgeChunkFiles, shard_paths
from specheads.errors import UserError
from specheads.heads.judge_head import JUDGE_SIGNALS
from specheads.train.side_rows import SideRows, read_small


@dataclass
class JudgeExample:
    """One tuple: where its features are (``store`` rows ``start:end``)."""

    index: int
    tuple_id: str
    start: int
    end: int


class JudgeStore:
    """Every chunk's labels in memory, its features read per batch, and the examples over them."""

    def __init__(self, data_dir: str | Path, signals: tuple[str, ...] = ()):
        """``data_dir``: one ``labels=judge`` output_dir, or several comma-separated (mixed: the examples of
        the ``k``-th get ids ``k:<tuple id>``); ``signals``: of the target's verdicts the data stores
        (:data:`~specheads.heads.judge_head.JUDGE_SIGNALS`), those each example's features end with."""
        import pyarrow.parquet as pq

        dirs = [Path(d.strip()) for d in str(data_dir).split(",") if d.strip()]
        files = []
        for k, d in enumerate(dirs):
            found = shard_paths(d)  # the manifest's list
            if not found:
                raise UserError(f"no chunk-*.parquet under {d / 'data'}; run heads-datagen labels=judge first")
            files += [(f"{k}:" if len(dirs) > 1 else "", d, p) for p in found]
        labels, verdicts, self.examples = [], [], []
        self.features = SideRows("features")
        pick = [JUDGE_SIGNALS.index(n) for n in signals]
        base = 0
        spans: dict[str, list[int]] = {}
        order: list[str] = []
        for prefix, root, path in files:
            chunk = int(path.stem.split("-")[1])
            side = JudgeChunkFiles(root, chunk)
            if not side.features_path.is_file():
                raise UserError(
                    f"{side.features_path} is missing; re-run heads-datagen labels=judge to finish the chunk"
                )
            t, shapes = read_small(side.features_path, ("labels", "offsets"))
            if pick:
                if "signals" not in shapes:
                    raise UserError(
                        f"{side.features_path} holds no signals (written before the judge read the target's "
                        "verdict); re-run heads-datagen labels=judge into a new output_dir, or drop judge.signals"
                    )
                verdicts.append(read_small(side.features_path, ("signals",))[0]["signals"][:, pick])
            ids = [prefix + t for t in pq.read_table(path, columns=["tuple_id"]).column("tuple_id").to_pylist()]
            off = t["offsets"].tolist()
            if len(off) != len(ids) + 1:
                raise UserError(
                    f"{side.features_path} does not match {path} ({len(off) - 1} rows against "
                    f"{len(ids)}); re-run heads-datagen labels=judge"
                )
            for i, tid in enumerate(ids):  # a tuple's rows are adjacent within its chunk
                if tid not in spans:
                    spans[tid] = [base + off[i], base + off[i + 1]]
                    order.append(tid)
                else:
                    spans[tid][1] = base + off[i + 1]
            self.features.add(side.features_path, int(off[-1]))
            labels.append(t["labels"])
            base += int(off[-1])
        self.labels = torch.cat(labels) if labels else torch.empty(0)
        self.signals = torch.cat(verdicts) if verdicts else None
        self.examples = [
            JudgeExample(i, tid, *spans[tid]) for i, tid in enumerate(order) if spans[tid][1] > spans[tid][0]
        ]
        if not self.examples:
            raise UserError(f"{data_dir} holds no labelled answer tokens")

    def batch(self, epoch: int, examples: list[JudgeExample], device) -> tuple[torch.Tensor, torch.Tensor]:
        idx = torch.cat([torch.arange(e.start, e.end) for e in examples])
        x = self.features.take([(e.start, e.end) for e in examples]).float()
        if self.signals is not None:
            x = torch.cat([x, self.signals[idx]], dim=-1)
        return x.to(device), self.labels[idx].to(device)


def judge_metrics(scores: torch.Tensor, labels: torch.Tensor, delta: float) -> dict:
    """AUROC; at ``delta`` (accept when score > delta): precision and recall of the negative class
    and the share of wrong tokens accepted."""
    from sklearn.metrics import roc_auc_score

    y = labels.cpu().numpy() >= 0.5
    s = scores.float().cpu().numpy()
    accept = s > delta
    neg, pred_neg = ~y, ~accept
    out = {
        "auroc": float(roc_auc_score(y, s)) if 0 < y.sum() < len(y) else None,
        "tokens": int(len(y)),
        "negative_tokens": int(neg.sum()),
    }
    out["negative_precision"] = float((pred_neg & neg).sum() / pred_neg.sum()) if pred_neg.sum() else None
    out["negative_recall"] = float((pred_neg & neg).sum() / neg.sum()) if neg.sum() else None
    out["wrong_accepted_share"] = float((accept & neg).sum() / neg.sum()) if neg.sum() else None
    out["correct_accepted_share"] = float((accept & y).sum() / y.sum()) if y.sum() else None
    return out
