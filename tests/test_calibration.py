"""Calibration figures (specheads/runtime/calibration.py) on cases with known answers, and where they are reported."""

from __future__ import annotations

import numpy as np
import pytest

from specheads.runtime.calibration import by_position, calibration, reliability_png


def test_a_constant_overconfident_head():
    """p = 0.9 everywhere, half the labels 1: ECE 0.4, Brier 0.5 * 0.01 + 0.5 * 0.81 = 0.41, AUROC 0.5."""
    c = calibration([0.9] * 100, [1, 0] * 50)
    assert c["ece"] == pytest.approx(0.4) and c["brier"] == pytest.approx(0.41) and c["auroc"] == 0.5
    full = [b for b in c["bins"] if b["n"]]
    assert len(full) == 1 and full[0]["low"] == pytest.approx(0.9) and full[0]["mean_label"] == 0.5


def test_a_calibrated_head_has_a_small_ece_and_soft_labels_count():
    rng = np.random.default_rng(0)
    p = rng.uniform(size=20000)
    y = (rng.uniform(size=20000) < p).astype(float)
    c = calibration(p, y)
    assert c["ece"] < 0.02 and c["auroc"] > 0.8 and c["n"] == 20000
    soft = calibration([0.3, 0.7], [0.3, 0.7])  # soft labels equal to the predictions: perfect
    assert soft["ece"] == pytest.approx(0.0) and soft["brier"] == pytest.approx(0.0) and soft["auroc"] == 1.0
    assert calibration([], [])["ece"] is None
    with pytest.raises(ValueError, match="labels"):
        calibration([0.5], [1, 0])


def test_by_position_pools_the_tail_and_the_diagram_is_written(tmp_path):
    pos = [1, 1, 2, 2, 9, 12]
    out = by_position([0.9, 0.8, 0.6, 0.5, 0.2, 0.1], [1, 1, 1, 0, 0, 0], pos, most=8)
    assert list(out) == ["1", "2", "8+"] and out["8+"]["n"] == 2 and out["1"]["ece"] == pytest.approx(0.15)
    png = reliability_png(tmp_path / "r.png", {"all": calibration([0.9, 0.1], [1, 0]), **out}, "test")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
