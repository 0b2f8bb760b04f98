"""Quality-gated thresholds (``heads-eval select=max_drop:X``): for each lossy policy, the fastest setting
whose accuracy drop against the target alone is at most ``X`` at the upper end of its 95% interval.

The prompts are split in two disjoint halves by index (even: calibration, odd: test), so that prompt
sources mix alike in both. The choice is made on the calibration half only; the chosen row is then
reported on the test half (its drop with interval, its speed against the target alone and against SD,
paired by prompt), which is the figure to trust: a choice judged on the prompts it was made on is
biased towards looking good.
"""

from __future__ import annotations

import re

from specheads.errors import UserError
from specheads.evaluate.intervals import paired_difference, paired_ratio, units

# Row names of the lossy policies a threshold trades speed for quality in, and the family each belongs to:
# FSD is one family per divergence (``fsd_kl`` is the training-free KL judge) and each named judge
# (``judges=``, rows ``j-<name>-<delta>``) one of its own, so each gets its own gated threshold.
ROW = re.compile(
    r"^(?:(?P<judge>j)|j-(?P<named>\w+)-|(?P<sprinter>s)|(?P<topk_verify>t)|fsd-(?P<fsd>kl_rev|kl|js|tv)-)"
    r"(?P<threshold>\d[\d.e+-]*)$"
)


def family(row: str) -> str | None:
    """The gated family of a row name (``j0.9`` judge, ``j-mined-0.9`` judge_mined, ``fsd-kl-1`` fsd_kl, ``s0.5``
    sprinter, ``t2`` topk_verify), None for a row no threshold makes lossy."""
    m = ROW.match(row)
    if m is None:
        return None
    if m["named"]:
        return f"judge_{m['named']}"
    if m["fsd"]:
        return f"fsd_{m['fsd']}"
    return next(k for k in ("judge", "sprinter", "topk_verify") if m[k])


def threshold(row: str) -> float:
    return float(ROW.match(row)["threshold"])


def parse(select: str | None) -> float | None:
    """``"max_drop:0.01"`` -> 0.01; None -> None; anything else is a UserError."""
    if select is None:
        return None
    key, _, value = select.partition(":")
    try:
        drop = float(value)
    except ValueError:
        drop = -1.0
    if key != "max_drop" or not 0 <= drop < 1:
        raise UserError(f"select={select!r}: expected max_drop:X with 0 <= X < 1 (an accuracy drop, 0.01 = 1 point)")
    return drop


def _speed(rows: list[dict], idx: list[int]) -> float:
    time = sum(rows[i]["wall_time"] for i in idx)
    return sum(rows[i]["new_tokens"] for i in idx) / time if time else 0.0


def choose(candidates: dict[str, dict], max_drop: float) -> str | None:
    """The fastest candidate (``{"tokens_per_s", "acc_drop_high"}`` each) whose drop's upper bound is at
    most ``max_drop``; None when no candidate's is."""
    ok = [n for n, c in candidates.items() if c["acc_drop_high"] is not None and c["acc_drop_high"] <= max_drop]
    return max(ok, key=lambda n: candidates[n]["tokens_per_s"]) if ok else None


def gated(
    grouped: dict[str, list[dict]],
    correct: dict[str, list[int | None]],
    max_drop: float,
    sd_reference: dict[str, str | None],
) -> dict:
    """The ``gated`` section: per lossy family present, the chosen row (or why none) with its test figures.

    Args:
        grouped: each configuration's rows in prompt order (``new_tokens``, ``wall_time``, ``accepted``,
            ``target_calls``).
        correct: each configuration's 0/1 per prompt (None where no grader fits).
        max_drop: the largest accepted upper bound of the drop.
        sd_reference: per family (``fsd`` for every FSD divergence, ``judge`` for every judge), the SD row its
            speed is compared with.
    """
    graded = [i for i, c in enumerate(correct["ar"]) if c is not None]
    calib, test = graded[0::2], graded[1::2]
    out = {"max_drop": max_drop, "calibration_prompts": len(calib), "test_prompts": len(test), "rows": {}}
    ar = grouped["ar"]
    families: dict[str, list[str]] = {}
    for n in grouped:
        if family(n):
            families.setdefault(family(n), []).append(n)
    for fam, names in families.items():
        candidates = {}
        for n in names:
            drop = paired_difference([correct["ar"][i] for i in calib], [correct[n][i] for i in calib])
            candidates[n] = {
                "tokens_per_s": round(_speed(grouped[n], calib), 3),
                "acc_drop": drop["value"],
                "acc_drop_high": drop["high"],
            }
        pick = choose(candidates, max_drop)
        entry: dict = {"calibration": candidates, "row": pick}
        if pick is None:
            entry["reason"] = (
                f"no setting's accuracy drop is at most {max_drop} at the upper bound on the calibration half"
            )
            out["rows"][fam] = entry
            continue
        rows = grouped[pick]
        drop = paired_difference([correct["ar"][i] for i in test], [correct[pick][i] for i in test])

        def ratio(num: str, den: str, ref: list[dict]) -> dict:
            if den == "wall_time":  # a batched row's time is its block's share: resample blocks
                return paired_ratio(
                    *units([rows[i] for i in test], (num, den)), *units([ref[i] for i in test], (num, den))
                )
            return paired_ratio(
                [rows[i][num] for i in test],
                [rows[i][den] for i in test],
                [ref[i][num] for i in test],
                [ref[i][den] for i in test],
            )

        vs_target = ratio("new_tokens", "wall_time", ar)
        entry.update(
            threshold=threshold(pick),
            acc_drop=drop["value"],
            acc_drop_low=drop["low"],
            acc_drop_upper=drop["high"],
            tokens_per_s_vs_target=vs_target["value"],
            tokens_per_s_vs_target_interval=[vs_target["low"], vs_target["high"]],
        )
        sd = sd_reference.get(fam.split("_")[0] if fam.startswith(("fsd", "judge")) else fam)
        if sd is not None:
            by_time, by_call = (
                ratio("new_tokens", "wall_time", grouped[sd]),
                ratio("accepted", "target_calls", grouped[sd]),
            )
            entry.update(
                sd_reference=sd,
                tokens_per_s_vs_sd=by_time["value"],
                tokens_per_s_vs_sd_interval=[by_time["low"], by_time["high"]],
                accepted_per_call_vs_sd=by_call["value"],
                accepted_per_call_vs_sd_interval=[by_call["low"], by_call["high"]],
            )
        out["rows"][fam] = entry
    return out


def describe(g: dict) -> list[str]:
    """The ``gated`` section as text lines."""
    lines = [
        f"quality-gated (accuracy drop <= {g['max_drop']} at the upper bound; chosen on {g['calibration_prompts']} "
        f"prompts, reported on {g['test_prompts']} others):"
    ]
    for fam, e in g["rows"].items():
        if e["row"] is None:
            lines.append(f"  {fam}: none ({e['reason']})")
            continue
        lines.append(
            f"  {fam}: {e['row']} drop {e['acc_drop']:.4f} [{e['acc_drop_low']:.4f}, "
            f"{e['acc_drop_upper']:.4f}], tokens/s vs target {e['tokens_per_s_vs_target']:.3f}"
            + (f", vs {e['sd_reference']} {e['tokens_per_s_vs_sd']:.3f}" if "sd_reference" in e else "")
        )
    return lines
