"""The FSD acceptance head's label: one stored ``Div < T`` decision of a ``labels=fsd`` run.

``heads-train acceptance.label=fsd acceptance.fsd_label=js@0.3`` trains the SpecDec++ acceptance head (same module,
same loss, same loop) to predict whether fuzzy speculative decoding with that divergence and
threshold accepts the drafted token (FSD paper, section 7.1). The decision is a function of
``p_i`` and ``q_i`` alone, so the head reads the state that produced ``q_i``: the draft's state at
position ``i-1`` of the target's own sequence ``c, x`` (no token mixing, every position carries a
loss), as for ``acceptance.label=expected``. The label is hard (0/1): the weighted soft BCE is then the
weighted BCE (``w_acc = w_rej`` gives the plain BCE).

The divergence and threshold must be among those the datagen run stored (its manifest's
``fsd`` block); the exported head records them with the distributions they were computed on.
"""

from __future__ import annotations

import math

from specheads.errors import UserError
from specheads.shim import DIVERGENCES


def parse_label(text: str) -> tuple[str, float]:
    """``"js@0.3"`` -> ``("js", 0.3)``.

    Raises:
        UserError: when the text is not ``<divergence>@<threshold>`` with a known divergence and a
            finite threshold >= 0.
    """
    name, sep, value = text.partition("@")
    if not text or not sep:
        raise UserError(
            f"acceptance.fsd_label={text!r}: write <divergence>@<threshold>, e.g. acceptance.fsd_label=js@0.3"
        )
    if name not in DIVERGENCES:
        raise UserError(
            f"acceptance.fsd_label={text!r}: unknown divergence {name!r}; choose one of {list(DIVERGENCES)}"
        )
    try:
        threshold = float(value)
    except ValueError:
        raise UserError(f"acceptance.fsd_label={text!r}: threshold {value!r} is not a number") from None
    if not math.isfinite(threshold) or threshold < 0:
        raise UserError(f"acceptance.fsd_label={text!r}: the threshold must be finite and >= 0")
    return name, threshold


def label_column(text: str, manifest: dict, data_dir: str) -> str:
    """The Parquet column holding the decisions ``text`` selects in a ``labels=fsd`` run.

    Args:
        text: ``acceptance.fsd_label``.
        manifest: the datagen run's manifest.
        data_dir: its directory (for the messages).

    Raises:
        UserError: when the run holds other labels, or not this divergence and threshold.
    """
    info = manifest.get("fsd")
    if manifest.get("labels") != "fsd" or not info:
        raise UserError(
            f"acceptance.label=fsd needs labels=fsd data but {data_dir} holds labels={manifest.get('labels')!r}; "
            "run heads-datagen labels=fsd"
        )
    name, threshold = parse_label(text)
    for d in info["divergences"]:
        for t in info["thresholds"]:
            if d == name and float(t) == threshold:
                return info["label_columns"][f"{d}@{t:g}"]
    stored = [f"{d}@{t:g}" for d in info["divergences"] for t in info["thresholds"]]
    raise UserError(
        f"acceptance.fsd_label={text!r} is not in {data_dir}: it stores {stored}; pick one of those or rerun "
        "heads-datagen with that divergence and threshold in fsd.divergences / fsd.thresholds"
    )


def head_metadata(text: str, manifest: dict) -> dict:
    """The ``fsd`` block of the exported head: what its probability predicts."""
    name, threshold = parse_label(text)
    info = manifest["fsd"]
    return {
        "predicts": "FSD acceptance: P(Div(p_i, q_i) < T)",
        "divergence": name,
        "threshold": threshold,
        "dist": info["dist"],
        "top_k": info["top_k"],
        "rule": info.get("rule"),
        "label_mean": info["label_mean"][name].get(f"{threshold:g}"),
    }
