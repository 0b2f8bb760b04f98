"""Plots: the Pareto plot (verification rate against discard rate, fixed K vs SpecDec++ vs the oracle)
and quality against speed for any set of configurations."""

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
            ax.annotate(
                r["label"],
                (r["verification_rate"], r["discard_rate"]),
                textcoords="offset points",
                xytext=(4, 4),
                fontsize=8,
            )
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


def quality_speed_plot(path: str | Path, points: list[dict], quality_label: str, title: str) -> Path:
    """Quality against tokens/s (left) and against accepted drafts per target call (right), one line per
    family of configurations (points in sweep order, e.g. FSD by growing threshold).

    Args:
        path: PNG to write.
        points: rows with ``label``, ``family``, ``quality``, ``tokens_per_s`` and ``accepted_per_call``
            (None where undefined: such points are left out of that panel).
        quality_label: the y axis, e.g. ``accuracy (gsm8k)`` or ``ROUGE-L vs target-only outputs``.
        title: the figure's title.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    families: dict[str, list[dict]] = {}
    for p in points:
        if p["quality"] is not None:
            families.setdefault(p["family"], []).append(p)
    colors = plt.get_cmap("tab20")  # one color per family in both panels
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.8), dpi=120, sharey=True)
    for ax, x, xlabel in (
        (axes[0], "tokens_per_s", "tokens/s (wall, this run)"),
        (axes[1], "accepted_per_call", "accepted draft tokens per target call"),
    ):
        for i, (name, rows) in enumerate(families.items()):
            rows = [r for r in rows if r[x] is not None]
            if not rows:
                continue
            style = "o-" if len(rows) > 1 else "o"
            ax.plot([r[x] for r in rows], [r["quality"] for r in rows], style, color=colors(i % 20), label=name)
            for r in rows:
                ax.annotate(r["label"], (r[x], r["quality"]), textcoords="offset points", xytext=(4, 4), fontsize=7)
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel(quality_label)
    axes[0].legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path)
    plt.close(fig)
    return path
