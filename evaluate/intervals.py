"""Confidence intervals for per-prompt figures: bootstrap over prompts (``scipy.stats.bootstrap``).

Accuracy is a mean of 0/1 outcomes per prompt; a configuration's accuracy drop against the target
alone is the mean of per-prompt differences **paired by prompt** (the same prompts, so prompt
difficulty cancels and the interval is far narrower than two separate ones). Speed figures are
ratios of sums (tokens / seconds, accepted / target calls), bootstrapped by resampling prompts; in a
batched sweep the prompts of one block share its measured time (each row holds a share by tokens), so
a time-based figure resamples blocks (:func:`units`), the independent timings. Every interval is a 95% percentile
bootstrap with a fixed seed: the same rows give the same bounds.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from scipy.stats import bootstrap

LEVEL = 0.95
RESAMPLES = 4000
SEED = 0
DESCRIPTION = (
    "paired bootstrap 95% (percentile, 4000 resamples, resampling prompts; batched tokens/s: resampling "
    "the blocks of prompts that were timed together)"
)


def units(rows: list[dict], keys: tuple[str, ...]) -> list[np.ndarray]:
    """Per timing unit, the sums of ``keys`` over its rows: a batched sweep's block (rows carry ``block``),
    else each row alone. Rows of two configurations in the same prompt order give the same units, in
    the same order (a ratio of sums is the same over units as over rows)."""
    sums: dict = {}
    for i, r in enumerate(rows):
        acc = sums.setdefault(("block", r["block"]) if r.get("block") is not None else ("row", i), [0.0] * len(keys))
        for k, key in enumerate(keys):
            acc[k] += r.get(key, 0) or 0
    return [np.asarray([v[k] for v in sums.values()], dtype=float) for k in range(len(keys))]


def _interval(data: tuple[np.ndarray, ...], statistic, paired: bool = False) -> tuple[float, float]:
    if len(data[0]) < 2 or all(np.all(d == d[0]) for d in data):  # nothing to resample
        value = float(statistic(*data))
        return value, value
    res = bootstrap(
        data,
        statistic,
        paired=paired,
        vectorized=True,
        confidence_level=LEVEL,
        n_resamples=RESAMPLES,
        method="percentile",
        random_state=np.random.default_rng(SEED),
    )
    return float(res.confidence_interval.low), float(res.confidence_interval.high)


def mean_interval(values: Sequence[float]) -> dict:
    """``{"value", "low", "high", "n"}``: the mean of ``values`` and its 95% bootstrap interval."""
    x = np.asarray(values, dtype=float)
    if not len(x):
        return {"value": None, "low": None, "high": None, "n": 0}
    low, high = _interval((x,), lambda v, axis=-1: np.mean(v, axis=axis))
    return {"value": float(x.mean()), "low": low, "high": high, "n": len(x)}


def paired_difference(a: Sequence[float], b: Sequence[float]) -> dict:
    """Mean of ``a[i] - b[i]`` over prompts (``a`` and ``b`` in prompt order) with its 95% interval."""
    if len(a) != len(b):
        raise ValueError(f"paired figures need the same prompts: {len(a)} != {len(b)}")
    return mean_interval(np.asarray(a, dtype=float) - np.asarray(b, dtype=float))


def ratio_interval(num: Sequence[float], den: Sequence[float]) -> dict:
    """``sum(num) / sum(den)`` (tokens/s, accepted per target call) with its 95% interval, resampling
    prompts (each prompt's numerator and denominator together)."""
    n, d = np.asarray(num, dtype=float), np.asarray(den, dtype=float)
    if not len(n) or d.sum() == 0:
        return {"value": None, "low": None, "high": None, "n": len(n)}

    def stat(x, y, axis=-1):
        with np.errstate(divide="ignore", invalid="ignore"):
            return x.sum(axis) / y.sum(axis)

    low, high = _interval((n, d), stat, paired=True)
    return {"value": float(n.sum() / d.sum()), "low": low, "high": high, "n": len(n)}


def paired_ratio(num_a, den_a, num_b, den_b) -> dict:
    """``(sum num_a / sum den_a) / (sum num_b / sum den_b)`` (a speed ratio of two configurations on the
    same prompts) with its 95% interval, resampling prompts for both together."""
    arrays = tuple(np.asarray(x, dtype=float) for x in (num_a, den_a, num_b, den_b))
    if not len(arrays[0]) or any(x.sum() == 0 for x in arrays[1:]):
        return {"value": None, "low": None, "high": None, "n": len(arrays[0])}

    def stat(na, da, nb, db, axis=-1):
        with np.errstate(divide="ignore", invalid="ignore"):
            return (na.sum(axis) / da.sum(axis)) / (nb.sum(axis) / db.sum(axis))

    low, high = _interval(arrays, stat, paired=True)
    return {"value": float(stat(*arrays)), "low": low, "high": high, "n": len(arrays[0])}


def speed_intervals(rows: list[dict]) -> dict:
    """A configuration's tokens/s and accepted tokens per target call (ratios of sums over its rows), each
    with its 95% interval resampling prompts: ``{"tokens_per_s_interval": [low, high], ...}``."""
    out = {}
    for key, num, den in (
        ("tokens_per_s_interval", "new_tokens", "wall_time"),
        ("accepted_per_call_interval", "accepted", "target_calls"),
    ):
        r = ratio_interval(
            *(
                units(rows, (num, den))
                if den == "wall_time"
                else ([x.get(num, 0) for x in rows], [x.get(den, 0) for x in rows])
            )
        )
        out[key] = None if r["value"] is None else [round(r["low"], 4), round(r["high"], 4)]
    return out
