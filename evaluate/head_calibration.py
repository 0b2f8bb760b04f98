"""The acceptance head's calibration while it decodes: every SpecDec++ row's verified candidates.

A SpecDec++ row records, for each candidate its head scored and the round then decided (accepted, or
the first rejected one), the position in the round, ``beta_hat`` and the outcome (the policy's trace,
``acceptance``). Pooled over prompts, that gives ECE, Brier score and AUROC overall and per draft
position (1st, 2nd, ... candidate), and a reliability diagram per position
(:mod:`specheads.runtime.calibration`). The verifier and judge heads' calibration is measured by
``heads-train`` on held-out labels: while decoding, their labels are not observed.
"""

from __future__ import annotations

from pathlib import Path

from specheads.runtime.calibration import by_position, calibration, reliability_png


def add_calibration(summary: dict, grouped: dict[str, list[dict]], out: Path, title: str) -> None:
    """Adds ``calibration`` (per SpecDec++ row: overall and by position) and ``calibration_png``."""
    section = {}
    for name, rows in grouped.items():
        seen = [o for r in rows for o in r.get("acceptance", [])]
        if not seen:
            continue
        pos, p, y = zip(*seen)
        section[name] = {"overall": calibration(p, y), "by_position": by_position(p, y, pos)}
    if not section:
        return
    summary["calibration"] = section
    name = max(section, key=lambda n: section[n]["overall"]["n"])
    curves = {"all positions": section[name]["overall"]}
    curves.update({f"candidate {k}": c for k, c in list(section[name]["by_position"].items())[:4]})
    summary["calibration_png"] = str(
        reliability_png(out / "calibration.png", curves, f"{title}: acceptance head while decoding ({name})")
    )
