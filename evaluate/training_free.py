"""The training-free rows of a sweep (FSD, top-K verification, draft-confidence stopping) and the
quality axis every configuration is plotted on.

Quality is the accuracy on the graded prompts (GSM8K final number, ARC letter) pooled over sources
when the prompt set has any, else ROUGE-L against the target-only outputs (1 for the target itself).
"""

from __future__ import annotations

from specheads.evaluate.sweep import total

FAMILIES = {
    "ar": "target alone",
    "draft": "draft alone",
    "k": "SD (fixed K)",
    "h": "SpecDec++",
    "t": "top-K verification",
    "c": "confidence stop",
    "j": "judge",
    "s": "SPRINTER",
    "v": "TLI / SLEM",
    "tree": "draft tree (EAGLE)",
}
TRAINING_FREE = ("t", "fsd", "c")


def family(config: str) -> str:
    """The plot legend's family of a sweep row name (``fsd-js-0.1`` -> ``FSD js``, ``k4`` -> ``SD (fixed K)``)."""
    if config.startswith("fsd-"):
        return "FSD " + config.split("-")[1]
    if config.startswith("tree-"):
        return FAMILIES["tree"]
    return FAMILIES.get(config, FAMILIES.get(config[0], config))


def _kind(config: str) -> str:
    return config.split("-")[0] if config.startswith(("fsd-", "tree-")) else config[0]


def quality_by_config(summary: dict) -> tuple[str | None, dict[str, float | None]]:
    """``(axis label, config -> quality)``: pooled graded accuracy, else ROUGE-L vs the target, else none.

    Args:
        summary: the sweep summary after the accuracy and quality passes (``accuracy``, ``table``).
    """
    acc = summary.get("accuracy") or {}
    if any(acc.values()):
        out = {}
        for name, per in acc.items():
            graded = sum(v["prompts"] for v in per.values())
            out[name] = round(sum(v["correct"] for v in per.values()) / graded, 4) if graded else None
        sources = sorted({src for per in acc.values() for src in per})
        return f"accuracy ({', '.join(sources)})", out
    if any(r.get("rouge_vs_target") for r in summary["table"]):
        out = {r["config"]: (r.get("rouge_vs_target") or {}).get("rougeL") for r in summary["table"]}
        out["ar"] = 1.0  # the target's outputs against themselves
        return "ROUGE-L vs target-only outputs", out
    return None, {}


def settings(cfg) -> dict:
    """The training-free settings of a sweep, as recorded in ``sweep.json``.

    Args:
        cfg: the ``EvalConfig``.
    """
    return {
        "fsd": {
            "thresholds": cfg.fsd.swept(),
            "k": cfg.fsd.k,
            "rule": cfg.fsd.rule,
            "fsd_top_k": cfg.fsd.top_k,
            "fsd_dist": cfg.fsd.dist,
            "greedy": not cfg.sampling.do_sample,
        },
        "topk": {"values": list(cfg.topk.ks), "k": cfg.topk.k},
        "confidence": {
            "taus": list(cfg.confidence.taus),
            "k_max": cfg.confidence.k_max,
            "estimates": list(cfg.confidence.estimates) if cfg.cost_stop else [],
        },
    }


def section(cfg, summary: dict, grouped: dict[str, list[dict]]) -> dict | None:
    """Each training-free row beside the SD reference (``k<fsd_k>`` if swept, else the fastest fixed K):
    quality, accuracy per source, tokens/s, accepted drafts per call, the ratios to SD and, for FSD,
    the accepted candidates the SD rule would have rejected (``fuzzy_only``). None without such rows.

    Args:
        cfg: the ``EvalConfig``.
        summary: the sweep summary (``table`` and, when computed, ``accuracy`` and ROUGE).
        grouped: the sweep's rows by configuration.
    """
    rows = [r for r in summary["table"] if _kind(r["config"]) in TRAINING_FREE]
    if not rows:
        return None
    by = {r["config"]: r for r in summary["table"]}
    fixed = [r for r in summary["table"] if r["config"].startswith("k")]
    sd = by.get(f"k{cfg.fsd.k}") or max(fixed, key=lambda r: r["tokens_per_s"], default=None)
    label, quality = quality_by_config(summary)
    acc = summary.get("accuracy") or {}
    out = {
        "settings": settings(cfg),
        "sd_reference": sd["config"] if sd else None,
        "quality_metric": label,
        "target_quality": quality.get("ar"),
        "sd_quality": quality.get(sd["config"]) if sd else None,
        "rows": {},
    }
    for r in rows:
        name = r["config"]
        entry = {
            "family": family(name),
            "quality": quality.get(name),
            "accuracy": acc.get(name, {}),
            "rouge_l_vs_target": (r.get("rouge_vs_target") or {}).get("rougeL"),
            "tokens_per_s": r["tokens_per_s"],
            "accepted_per_call": r["accepted_per_call"],
            "tokens_per_call": r["tokens_per_call"],
        }
        if name.startswith("fsd-"):
            fuzzy = round(sum(x.get("fuzzy_only", 0.0) for x in grouped[name]), 4)
            accepted = total(grouped[name]).accepted
            entry.update(fuzzy_only=fuzzy, fuzzy_only_share=round(fuzzy / accepted, 4) if accepted else None)
        if sd:
            entry["vs_sd_tokens_per_s"] = (
                round(r["tokens_per_s"] / sd["tokens_per_s"], 4) if sd["tokens_per_s"] else None
            )
            entry["vs_sd_accepted_per_call"] = (
                round(r["accepted_per_call"] / sd["accepted_per_call"], 4) if sd["accepted_per_call"] else None
            )
        out["rows"][name] = entry
    return out


def plot_points(summary: dict) -> tuple[str | None, list[dict]]:
    """``(quality label, points)`` for :func:`~.plot.quality_speed_plot`: one point per table row."""
    label, quality = quality_by_config(summary)
    return label, [
        {
            "label": r["config"],
            "family": family(r["config"]),
            "quality": quality.get(r["config"]),
            "tokens_per_s": r["tokens_per_s"],
            "accepted_per_call": r["accepted_per_call"],
        }
        for r in summary["table"]
    ]
