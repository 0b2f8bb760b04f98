"""Bootstrap intervals (evaluate/intervals.py) on cases whose answer is known, and the quality-gated choice."""

from __future__ import annotations

import math

import pytest

from specheads.errors import UserError
from specheads.evaluate.intervals import mean_interval, paired_difference, paired_ratio, ratio_interval, speed_intervals
from specheads.evaluate.select import Gate, choose, gated, parse


def test_the_interval_of_a_proportion_matches_the_normal_approximation():
    """400 prompts, half right: 0.5 +- 1.96 sqrt(0.25 / 400) = [0.451, 0.549]."""
    r = mean_interval([1] * 200 + [0] * 200)
    assert r["value"] == 0.5 and r["n"] == 400
    half = 1.96 * math.sqrt(0.25 / 400)
    assert r["low"] == pytest.approx(0.5 - half, abs=0.006) and r["high"] == pytest.approx(0.5 + half, abs=0.006)
    assert mean_interval([1] * 200 + [0] * 200) == r  # seeded: the same rows give the same bounds


def test_pairing_by_prompt_resolves_a_drop_two_separate_intervals_cannot():
    """200 prompts; the target gets the first 100 right, the configuration loses 10 of them. Separately the
    two accuracy intervals (0.50 vs 0.45, each about +-0.07) overlap; paired, the drop 0.05 has a
    bound of about +-0.03 and excludes 0."""
    target = [1] * 100 + [0] * 100
    config = [0] * 10 + [1] * 90 + [0] * 100
    a, b = mean_interval(target), mean_interval(config)
    assert a["low"] < b["high"]  # unpaired: no resolution
    d = paired_difference(target, config)
    assert d["value"] == pytest.approx(0.05)
    assert 0 < d["low"] < 0.05 < d["high"] < 0.09
    same = paired_difference(target, target)
    assert (same["value"], same["low"], same["high"]) == (0.0, 0.0, 0.0)
    with pytest.raises(ValueError, match="same prompts"):
        paired_difference([1, 0], [1])


def test_ratio_intervals_resample_prompts_whole():
    tokens, seconds = [10, 20, 30, 40], [1, 2, 3, 4]  # every prompt at 10 tokens/s: no spread
    r = ratio_interval(tokens, seconds)
    assert (r["value"], r["low"], r["high"]) == (10.0, 10.0, 10.0)
    fast = paired_ratio([20, 40, 60, 80], seconds, tokens, seconds)  # twice as fast on every prompt
    assert (fast["value"], fast["low"], fast["high"]) == (2.0, 2.0, 2.0)
    mixed = ratio_interval([10, 30, 10, 30] * 10, [1] * 40)
    assert mixed["low"] < 20 < mixed["high"] and mixed["value"] == 20
    assert ratio_interval([], [])["value"] is None
    rows = [{"new_tokens": t, "wall_time": 1.0, "accepted": a, "target_calls": 2} for t, a in ((10, 1), (30, 3))] * 10
    s = speed_intervals(rows)
    assert s["tokens_per_s_interval"][0] < 20 < s["tokens_per_s_interval"][1]
    assert s["accepted_per_call_interval"][0] < 1 < s["accepted_per_call_interval"][1]
    assert speed_intervals([{"new_tokens": 0, "wall_time": 0, "accepted": 0, "target_calls": 0}]) == {
        "tokens_per_s_interval": None,
        "accepted_per_call_interval": None,
    }


# ---- quality-gated selection -------------------------------------------------------------------


def test_choose_refuses_a_faster_threshold_whose_bound_exceeds_max_drop():
    cands = {
        "j0.2": {"tokens_per_s": 30.0, "acc_drop_high": 0.011},
        "j0.5": {"tokens_per_s": 25.0, "acc_drop_high": 0.010},
        "j0.9": {"tokens_per_s": 20.0, "acc_drop_high": -0.01},
    }
    assert choose(cands, Gate(max_drop=0.01)) == "j0.5"
    assert choose(cands, Gate(max_drop=0.02)) == "j0.2"
    assert choose(cands, Gate(max_drop=-0.02)) is None


def _rows(n, tokens, seconds, accepted=0, calls=1):
    return [{"new_tokens": tokens, "wall_time": seconds, "accepted": accepted, "target_calls": calls}] * n


def test_gated_chooses_on_one_half_and_reports_on_the_other():
    """400 graded prompts. j0.2: twice the target's speed, loses every 5th prompt the target gets (drop
    0.1); j0.6: 1.5x, loses nothing. With max_drop 0.01 j0.6 is chosen and reported on the odd half."""
    n = 400
    target = [1] * n
    grouped = {
        "ar": _rows(n, 10, 1.0, calls=10),
        "k4": _rows(n, 10, 0.8, accepted=6, calls=4),
        "j0.2": _rows(n, 10, 0.5, accepted=8, calls=2),
        "j0.6": _rows(n, 10, 2 / 3, accepted=7, calls=3),
    }
    correct = {"ar": target, "k4": target, "j0.2": [0 if i % 5 == 0 else 1 for i in range(n)], "j0.6": target}
    g = gated(grouped, correct, Gate(max_drop=0.01), {"judge": "k4"})
    assert (g["calibration_prompts"], g["test_prompts"]) == (200, 200)
    e = g["rows"]["judge"]
    assert e["row"] == "j0.6" and e["threshold"] == 0.6
    assert e["calibration"]["j0.2"]["acc_drop_high"] > 0.01
    assert (e["acc_drop"], e["acc_drop_upper"]) == (0.0, 0.0)
    assert e["tokens_per_s_vs_target"] == pytest.approx(1.5) and e["tokens_per_s_vs_sd"] == pytest.approx(1.2)
    assert e["accepted_per_call_vs_sd"] == pytest.approx((7 / 3) / (6 / 4))
    none = gated(grouped, {**correct, "j0.6": correct["j0.2"]}, Gate(max_drop=0.01), {"judge": None})["rows"]["judge"]
    assert none["row"] is None and "no setting" in none["reason"]


def test_every_fsd_divergence_gets_its_own_threshold_and_the_sd_reference():
    """fsd-kl-1 (fast, lossy) and fsd-kl-0.3 (lossless) against fsd-js-0.1 (lossless, slower): one choice per
    divergence, so the KL judge's gated row is not hidden behind a faster JS row, and both price against k4."""
    n = 200
    grouped = {
        "ar": _rows(n, 10, 1.0, calls=10),
        "k4": _rows(n, 10, 0.8, accepted=6, calls=4),
        "fsd-kl-1": _rows(n, 10, 0.4, accepted=9, calls=2),
        "fsd-kl-0.3": _rows(n, 10, 0.5, accepted=8, calls=2),
        "fsd-js-0.1": _rows(n, 10, 0.6, accepted=7, calls=3),
    }
    target = [1] * n
    correct = {
        "ar": target,
        "k4": target,
        "fsd-kl-1": [0 if i % 4 == 0 else 1 for i in range(n)],
        "fsd-kl-0.3": target,
        "fsd-js-0.1": target,
    }
    rows = gated(grouped, correct, Gate(max_drop=0.01), {"fsd": "k4"})["rows"]
    assert set(rows) == {"fsd_kl", "fsd_js"}
    assert (rows["fsd_kl"]["row"], rows["fsd_kl"]["threshold"]) == ("fsd-kl-0.3", 0.3)
    assert (rows["fsd_js"]["row"], rows["fsd_js"]["threshold"]) == ("fsd-js-0.1", 0.1)
    assert rows["fsd_kl"]["sd_reference"] == rows["fsd_js"]["sd_reference"] == "k4"
    assert rows["fsd_kl"]["tokens_per_s_vs_sd"] == pytest.approx(1.6)


@pytest.mark.parametrize(
    "bad",
    [
        "max_drop",
        "max_drop:x",
        "drop:0.01",
        "max_drop:1.5",
        "max_drop:-0.1",
        "max_disagree:2",
        "max_drop:0.01,max_drop:0.02",
        "max_drop:0.01;max_disagree:0.02",
    ],
)
def test_select_spelling(bad):
    assert parse("max_drop:0.01") == Gate(max_drop=0.01) and parse(None) is None
    assert parse("max_disagree:0.02") == Gate(max_disagree=0.02)
    both = parse("max_drop:0.01, max_disagree:0.02")
    assert both == Gate(0.01, 0.02) and str(both) == "max_drop:0.01,max_disagree:0.02"
    with pytest.raises(UserError, match="max_drop:X, max_disagree:Y"):
        parse(bad)


def _answers_study(n=2000):
    """Two sources of n/2 prompts each: ``facts`` (the target right on all) and ``arc`` (the target right on none,
    as at chance). j0.2 (2x the target's speed) keeps every fact but changes half the ARC answers to other wrong
    ones: no accuracy lost anywhere. j0.6 (1.5x) changes the answer of one ARC prompt in 200."""
    sources = ["facts" if i < n // 2 else "arc" for i in range(n)]
    grouped = {
        "ar": _rows(n, 10, 1.0, calls=10),
        "k4": _rows(n, 10, 0.8, accepted=6, calls=4),
        "j0.2": _rows(n, 10, 0.5, accepted=8, calls=2),
        "j0.6": _rows(n, 10, 2 / 3, accepted=7, calls=3),
    }
    correct = {k: [int(s == "facts") for s in sources] for k in grouped}
    same = {
        "ar": [1] * n,
        "k4": [1] * n,
        "j0.2": [0 if s == "arc" and i % 4 < 2 else 1 for i, s in enumerate(sources)],
        "j0.6": [0 if s == "arc" and i % 400 in (3, 4) else 1 for i, s in enumerate(sources)],
    }
    return grouped, correct, same, sources


def test_max_disagree_refuses_a_setting_that_changes_answers_where_the_target_is_competent():
    """The accuracy gate cannot see j0.2 change half of ARC's answers (all wrong either way); the agreement gate
    does once ARC counts as competent, and picks j0.6. Where ARC is not competent its changed answers are
    reported (disagree_by_source) but never gated: the target's answers there are near chance."""
    grouped, correct, same, sources = _answers_study()
    by_drop = gated(grouped, correct, Gate(max_drop=0.01), {"judge": "k4"}, same, sources, ["facts"])
    assert by_drop["rows"]["judge"]["row"] == "j0.2"
    g = gated(grouped, correct, Gate(max_disagree=0.02), {"judge": "k4"}, same, sources, ["facts", "arc"])
    e = g["rows"]["judge"]
    assert e["row"] == "j0.6" and e["within_gate_on_test"] and e["disagree_upper"] <= 0.02
    worst = e["calibration"]["j0.2"]["disagree_by_source"]
    assert worst["arc"]["value"] == pytest.approx(0.5, abs=0.05) and worst["facts"]["value"] == 0.0
    assert set(e["disagree_by_source"]) == {"facts", "arc"} and g["select"] == "max_disagree:0.02"
    facts_only = gated(grouped, correct, Gate(max_disagree=0.02), {"judge": "k4"}, same, sources, ["facts"])
    f = facts_only["rows"]["judge"]
    assert f["row"] == "j0.2" and f["disagree_by_source"]["arc"]["value"] > 0.2  # reported, not gated
    assert "leave out arc" in facts_only["note"]
    # both gates: each bound must hold
    both = gated(grouped, correct, Gate(0.01, 0.02), {"judge": "k4"}, same, sources, ["facts", "arc"])
    assert both["rows"]["judge"]["row"] == "j0.6"
    strict = gated(grouped, correct, Gate(max_disagree=0.0), {"judge": "k4"}, same, sources, ["facts", "arc"])
    assert strict["rows"]["judge"]["row"] is None and "max_disagree:0.0" in strict["rows"]["judge"]["reason"]


def test_max_gap_bounds_the_targets_log_probability_on_every_source():
    """The log-probability gap needs no grader and no competence: j0.2 writes what the target finds less likely
    on ARC (gap -0.5 nats per token there), so max_gap:0.1 refuses it on every source and picks j0.6."""
    grouped, correct, same, sources = _answers_study()
    gaps = {n: [0.0] * len(sources) for n in grouped}
    gaps["j0.2"] = [-0.5 if s == "arc" else 0.0 for s in sources]
    g = gated(grouped, correct, Gate(max_gap=0.1), {"judge": "k4"}, same, sources, ["facts"], gaps)
    e = g["rows"]["judge"]
    assert e["row"] == "j0.6" and e["gap_lower"] == 0.0 and g["max_gap"] == 0.1
    assert e["calibration"]["j0.2"]["gap_by_source"]["arc"]["value"] == pytest.approx(-0.5)
    assert (
        gated(grouped, correct, Gate(max_gap=0.6), {"judge": "k4"}, same, sources, ["facts"], gaps)["rows"]["judge"][
            "row"
        ]
        == "j0.2"
    )


def test_max_drop_counts_only_the_sources_where_the_target_is_competent():
    """j0.2 now loses every ARC prompt the target got right on ARC, where the target is not competent: the drop
    over the competent source (facts) is 0, so max_drop picks it, and the gate says which source it left out.
    With no competent source max_drop has nothing to measure and chooses nothing."""
    grouped, correct, same, sources = _answers_study()
    correct["ar"] = [1] * len(sources)  # the target right everywhere, j0.2 wrong on every ARC prompt
    correct["k4"] = correct["j0.6"] = list(correct["ar"])
    g = gated(grouped, correct, Gate(max_drop=0.01), {"judge": "k4"}, same, sources, ["facts"])
    assert g["rows"]["judge"]["row"] == "j0.2" and g["rows"]["judge"]["acc_drop_upper"] == 0.0
    assert "leave out arc" in g["note"] and g["competent_sources"] == ["facts"]
    everywhere = gated(grouped, correct, Gate(max_drop=0.01), {"judge": "k4"}, same, sources, ["facts", "arc"])
    assert everywhere["rows"]["judge"]["row"] == "j0.6"
    none = gated(grouped, correct, Gate(max_drop=0.01), {"judge": "k4"}, same, sources, [])
    assert none["rows"]["judge"]["row"] is None and "no competent source" in none["rows"]["judge"]["reason"]


def test_batched_time_resamples_blocks_not_prompts():
    """A batched row's time is its block's share: the rows of one block have one rate, so resampling rows
    would see as many identical rates as rows. The blocks are the units: their sums, in order."""
    from specheads.evaluate.intervals import speed_intervals, units

    rows = [
        {"new_tokens": 10, "wall_time": 1.0, "block": 0},
        {"new_tokens": 30, "wall_time": 3.0, "block": 0},
        {"new_tokens": 20, "wall_time": 1.0, "block": 1},
        {"new_tokens": 20, "wall_time": 1.0, "block": 1},
        {"new_tokens": 5, "wall_time": 1.0},
    ]
    toks, secs = units(rows, ("new_tokens", "wall_time"))
    assert toks.tolist() == [40, 40, 5] and secs.tolist() == [4.0, 2.0, 1.0]
    low, high = speed_intervals(rows[:4])["tokens_per_s_interval"]
    assert low == pytest.approx(10.0) and high == pytest.approx(20.0)  # two blocks: 10 and 20 tokens/s


@pytest.mark.parametrize(
    "row, fam, thr",
    [
        ("j0.99", "judge", 0.99),
        ("j-mined-1e-06", "judge_mined", 1e-06),
        ("j-arith_v2-0.5", "judge_arith_v2", 0.5),
        ("fsd-kl-1", "fsd_kl", 1.0),
        ("fsd-kl_rev-0.3", "fsd_kl_rev", 0.3),
        ("s0.5", "sprinter", 0.5),
        ("t2", "topk_verify", 2.0),
        ("k4", None, None),
        ("ar", None, None),
        ("h0.5", None, None),
        ("v-slem-k2", None, None),
        ("c0.3", None, None),
    ],
)
def test_row_families(row, fam, thr):
    from specheads.evaluate.select import family, threshold

    assert family(row) == fam
    if fam:
        assert threshold(row) == thr


def test_the_policys_lossless_flag_decides_what_is_gated_not_the_row_name():
    """With each row's Policy.lossless known, a lossless row is never gated (even named like a judge row) and a
    lossy row of a policy the reports do not know is gated under the name before its setting."""
    grouped, correct, same, sources = _answers_study()
    grouped["margin-0.2"], grouped["margin-0.6"] = grouped.pop("j0.2"), grouped.pop("j0.6")
    for d in (correct, same):
        d["margin-0.2"], d["margin-0.6"] = d.pop("j0.2"), d.pop("j0.6")
    lossless = {"ar": True, "k4": True, "margin-0.2": False, "margin-0.6": False}
    g = gated(grouped, correct, Gate(max_disagree=0.02), {}, same, sources, ["facts", "arc"], lossless=lossless)
    assert set(g["rows"]) == {"margin"} and g["rows"]["margin"]["row"] == "margin-0.6"
    assert g["rows"]["margin"]["threshold"] == 0.6
    assert gated(grouped, correct, Gate(max_disagree=0.02), {}, same, sources, ["facts"])["rows"] == {}  # by name
    grouped["j0.5"] = grouped["k4"]
    correct["j0.5"], same["j0.5"] = correct["k4"], same["k4"]
    exact = gated(
        grouped, correct, Gate(max_disagree=0.02), {}, same, sources, ["facts"], lossless=lossless | {"j0.5": True}
    )
    assert "judge" not in exact["rows"]
