"""SPRINTER verifier training data, features, evaluation and ROC plot (docs/algorithms/sprinter.md).

Examples come from ``heads-datagen labels=sprinter``: per prompt a context, labelled prefix
lengths ``t``, draft tokens ``x`` and their raw ``q(x)``/``p(x)``. Features and stored labels do not
depend on ``lambda``: the feature cache stores the ratio ``q(x)/p(x)`` and the label
``ratio <= lambda`` is taken at batch time, so heads for several ``lambda`` share one cache.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from specheads.errors import UserError
from specheads.shim import pad_batch

COLUMNS = ("prompt_index", "category", "input_ids", "positions", "draft_token", "q_token", "p_token")
FEATURES = ("previous", "current", "previous+embedding")


@dataclass
class VerifierExample:
    """One prompt's context with its labelled prefixes."""

    index: int
    category: str
    input_ids: list[int]
    positions: list[int]
    draft_token: list[int]
    ratio: list[float]


def load_examples(data_dir: str | Path) -> list[VerifierExample]:
    """Reads every chunk written by ``heads-datagen labels=sprinter``."""
    import pyarrow.parquet as pq

    from specheads.dataset import require_columns, shard_paths

    files = shard_paths(data_dir)  # the manifest's list; UserError for a missing/newer-schema manifest
    if not files:
        raise UserError(f"{data_dir} holds no labelled examples; run heads-datagen labels=sprinter with more prompts")
    out = []
    for path in files:
        require_columns(path, COLUMNS)
        for row in pq.read_table(path, columns=list(COLUMNS)).to_pylist():
            ratio = [q / p if p > 0 else float("inf") for q, p in zip(row["q_token"], row["p_token"])]
            out.append(
                VerifierExample(
                    row["prompt_index"], row["category"], row["input_ids"], row["positions"], row["draft_token"], ratio
                )
            )
    out.sort(key=lambda e: e.index)
    return [e for e in out if e.positions]


def feature_width(feature: str, hidden: int) -> int:
    if feature not in FEATURES:
        raise UserError(f"feature={feature!r}: choose one of {list(FEATURES)}")
    return 2 * hidden if feature == "previous+embedding" else hidden


@torch.no_grad()
def draft_features(
    draft, capture, examples: list[VerifierExample], feature: str, pad: int, device
) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """The verifier's input at every labelled prefix of a batch, the ratios, and rows per example.

    ``previous``: the draft's post-norm state at position ``t - 1`` (the one that produced
    ``q(.|s[:t])``); ``previous+embedding``: that state and ``x``'s input embedding;
    ``current``: the state after consuming ``x`` at position ``t`` (see :mod:`specheads.runtime.states`).
    """
    seqs = [e.input_ids for e in examples]
    if feature == "current":
        from specheads.runtime.states import states_after_tokens

        feats = states_after_tokens(
            draft, seqs, [e.positions for e in examples], [e.draft_token for e in examples], pad
        )
        x = torch.cat(feats).float()
    else:
        ids, attn = pad_batch(seqs, pad, device)
        draft(input_ids=ids, attention_mask=attn, logits_to_keep=1)
        states = capture.post
        rows = torch.cat([torch.full((len(e.positions),), b, dtype=torch.long) for b, e in enumerate(examples)])
        cols = torch.cat([torch.tensor(e.positions, dtype=torch.long) - 1 for e in examples])
        x = states[rows.to(states.device), cols.to(states.device)].float()
        if feature == "previous+embedding":
            tok = torch.tensor([t for e in examples for t in e.draft_token], device=device)
            x = torch.cat([x, draft.get_input_embeddings()(tok).float().to(x.device)], -1)
    ratio = torch.tensor([r for e in examples for r in e.ratio], dtype=torch.float32, device=x.device)
    return x, ratio, [len(e.positions) for e in examples]


def class_weights(examples: list[VerifierExample], lam: float) -> tuple[float, float]:
    """``(w_pos, w_neg) = (1/(2 s), 1/(2 (1 - s)))`` with ``s`` the share of label 1 at ``lam``."""
    labels = [r <= lam for e in examples for r in e.ratio]
    return balanced_weights(sum(labels) / max(1, len(labels)), lam)


def balanced_weights(s: float, lam: float) -> tuple[float, float]:
    """``(w_pos, w_neg)`` for a share ``s`` of label 1 at ``lam``; UserError when one class is missing."""
    if s in (0.0, 1.0):
        raise UserError(
            f"every training label at lam={lam} is {int(s)}: nothing to learn; label more prompts or pick another "
            "verifier.lam"
        )
    return 0.5 / s, 0.5 / (1 - s)


def label_problems(cfg) -> list[str]:
    """The class-weight and ``lam`` settings every verifier task checks."""
    out = []
    if cfg.class_weights not in ("balanced", "fixed"):
        out.append(f"class_weights={cfg.class_weights!r}: choose balanced or fixed")
    if cfg.verifier.lam <= 0 or any(lam <= 0 for lam in cfg.verifier.roc_lambdas):
        out.append("verifier.lam and every verifier.roc_lambdas value must be > 0")
    return out


def roc_metrics(scores: torch.Tensor, ratio: torch.Tensor, lam: float, eta: float, points: int = 201) -> dict:
    """AUROC, TPR/FPR/accuracy at ``eta`` and a thinned ROC curve against labels ``ratio <= lam``.

    Also ``alpha``: the share of truly unacceptable tokens (``q(x) > p(x)``, the ``lambda = 1``
    ground truth of docs/algorithms/sprinter.md) that the verifier approves at ``eta``.
    """
    from sklearn.metrics import roc_auc_score, roc_curve

    s = scores.float().cpu().numpy()
    y = (ratio <= lam).cpu().numpy()
    approve = s >= eta
    out: dict = {"lam": lam, "eta": eta, "tokens": int(len(y)), "label_mean": float(y.mean()) if len(y) else None}
    if 0 < y.sum() < len(y):
        fpr, tpr, _ = roc_curve(y, s)
        keep = sorted(set(torch.linspace(0, len(fpr) - 1, min(points, len(fpr))).round().long().tolist()))
        out["auroc"] = float(roc_auc_score(y, s))
        out["roc"] = {"fpr": [round(float(fpr[i]), 5) for i in keep], "tpr": [round(float(tpr[i]), 5) for i in keep]}
    else:
        out["auroc"] = None
    pos, neg = y.sum(), len(y) - y.sum()
    out["tpr_at_eta"] = float((approve & y).sum() / pos) if pos else None
    out["fpr_at_eta"] = float((approve & ~y).sum() / neg) if neg else None
    out["accuracy_at_eta"] = float((approve == y).mean()) if len(y) else None
    out["approval_rate_at_eta"] = float(approve.mean()) if len(y) else None
    bad = (ratio > 1.0).cpu().numpy()
    out["alpha"] = float((approve & bad).sum() / bad.sum()) if bad.sum() else None
    return out


def roc_plot(path: Path, curves: list[dict], title: str) -> Path:
    """One ROC curve per trained ``lambda`` (with the operating point at ``eta``) in one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 5))
    for c in curves:
        if c.get("roc") is None:
            continue
        ax.plot(c["roc"]["fpr"], c["roc"]["tpr"], label=f"lambda={c['lam']:g} (AUROC {c['auroc']:.3f})")
        if c.get("fpr_at_eta") is not None and c.get("tpr_at_eta") is not None:
            ax.scatter([c["fpr_at_eta"]], [c["tpr_at_eta"]], s=18)
    ax.plot([0, 1], [0, 1], color="grey", linestyle=":", linewidth=1)
    ax.set_xlabel("false-positive rate")
    ax.set_ylabel("true-positive rate")
    ax.set_title(title, fontsize=9)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
