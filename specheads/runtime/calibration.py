"""How well a head's probabilities are calibrated: ECE, Brier score, AUROC and a reliability diagram.

Shared by ``heads-train`` (every head, on its held-out examples, every epoch) and ``heads-eval``.
Labels may be soft (the acceptance head's expected label is a probability): the Brier score is
``mean((p - y)^2)``, each bin of the reliability diagram compares the mean predicted probability
with the mean label, and the expected calibration error is the bins' ``|mean label - mean p|``
weighted by their share of the examples (equal-width bins over [0, 1]). AUROC is against the
label binarised at 0.5 (None when one class is absent).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

BINS = 10


def calibration(probs, labels, bins: int = BINS) -> dict:
    """``{"ece", "brier", "auroc", "n", "bins": [{"low", "high", "n", "mean_p", "mean_label"}]}``."""
    p = np.asarray(probs, dtype=float).ravel()
    y = np.asarray(labels, dtype=float).ravel()
    if p.shape != y.shape:
        raise ValueError(f"{len(p)} probabilities for {len(y)} labels")
    if not len(p):
        return {"ece": None, "brier": None, "auroc": None, "n": 0, "bins": []}
    from sklearn.metrics import roc_auc_score

    which = np.minimum((p * bins).astype(int), bins - 1)
    table, ece = [], 0.0
    for b in range(bins):
        sel = which == b
        n = int(sel.sum())
        row = {
            "low": b / bins,
            "high": (b + 1) / bins,
            "n": n,
            "mean_p": float(p[sel].mean()) if n else None,
            "mean_label": float(y[sel].mean()) if n else None,
        }
        if n:
            ece += n / len(p) * abs(row["mean_label"] - row["mean_p"])
        table.append(row)
    hard = y >= 0.5
    auroc = float(roc_auc_score(hard, p)) if 0 < hard.sum() < len(hard) else None
    return {"ece": float(ece), "brier": float(np.mean((p - y) ** 2)), "auroc": auroc, "n": int(len(p)), "bins": table}


def by_position(probs, labels, positions, most: int = 8) -> dict[str, dict]:
    """:func:`calibration` per position (``"1"``, ``"2"``, ...; positions past ``most`` pooled as ``"{most}+"``)."""
    p, y, pos = (np.asarray(x) for x in (probs, labels, positions))
    out = {}
    for k in sorted(set(np.minimum(pos, most).tolist())):
        sel = np.minimum(pos, most) == k
        out[f"{k}+" if k == most else str(k)] = calibration(p[sel], y[sel])
    return out


def reliability_png(path: str | Path, curves: dict[str, dict], title: str) -> Path:
    """A reliability diagram: for each named :func:`calibration` result, mean label against mean predicted
    probability per bin (the diagonal is perfect calibration), with the examples per bin below."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(5.5, 6.5), sharex=True, gridspec_kw={"height_ratios": [3, 1]})
    top.plot([0, 1], [0, 1], color="grey", linestyle="--", linewidth=1, label="perfect calibration")
    width = 1 / max(len(next(iter(curves.values()))["bins"]), 1) / max(len(curves), 1)
    for i, (name, c) in enumerate(curves.items()):
        pts = [(b["mean_p"], b["mean_label"]) for b in c["bins"] if b["n"]]
        if pts:
            top.plot(*zip(*pts), marker="o", label=f"{name} (ECE {c['ece']:.3f}, Brier {c['brier']:.3f})")
        bottom.bar([b["low"] + i * width for b in c["bins"]], [b["n"] for b in c["bins"]], width=width, align="edge")
    top.set_ylabel("mean label")
    top.set_xlim(0, 1)
    top.set_ylim(0, 1)
    top.set_title(title, fontsize=9)
    top.legend(fontsize=7, loc="upper left")
    bottom.set_xlabel("predicted probability")
    bottom.set_ylabel("examples")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
