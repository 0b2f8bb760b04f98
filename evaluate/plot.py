"""The Pareto plot: verification rate against discard rate, fixed K vs SpecDec++ vs the oracle."""

from __future__ import annotations

from pathlib import Path


def pareto_plot(path: str | Path, fixed: list[dict], adaptive: list[dict], oracle: dict | None, title: str) -> Path:
    """Draws the curves to a PNG. Rows carry ``label``, ``verification_rate`` and ``discard_rate``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.8), dpi=120)
    for rows, style, name in ((fixed, "o-", "fixed K"), (adaptive, "s-", "SpecDec++ (threshold h)")):
        if not rows:
            continue
        rows = sorted(rows, key=lambda r: r["verification_rate"])
        ax.plot([r["verification_rate"] for r in rows], [r["discard_rate"] for r in rows], style, label=name)
        for r in rows:
            ax.annotate(r["label"], (r["verification_rate"], r["discard_rate"]), textcoords="offset points",
                        xytext=(4, 4), fontsize=8)
    if oracle is not None:
        ax.plot([oracle["verification_rate"]], [oracle["discard_rate"]], "*", markersize=14, label="greedy oracle")
    ax.set_xlabel("verification rate (target calls per token)")
    ax.set_ylabel("discard rate (discarded drafts per token)")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path)
    plt.close(fig)
    return path
