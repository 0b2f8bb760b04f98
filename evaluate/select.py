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
from dataclasses import dataclass

from specheads.errors import UserError
from specheads.evaluate.intervals import mean_interval, paired_difference, paired_ratio, units

# Row names of the lossy policies a threshold trades speed for quality in, and the family each belongs to:
# FSD is one family per divergence (``fsd_kl`` is the training-free KL judge) and each named judge
# (``judge.heads=``, rows ``j-<name>-<delta>``) one of its own, so each gets its own gated threshold.
ROW = re.compile(
    r"^(?:(?P<judge>j)|j-(?P<named>\w+)-|(?P<sprinter>s)|(?P<topk_verify>t)|fsd-(?P<fsd>kl_rev|kl|js|tv)(?P<rule>-or)?-"
    r"|r-(?P<relaxed>\w+)-)(?P<threshold>\d[\d.e+-]*)$"
)


GENERIC = re.compile(r"^(?P<family>.*?[A-Za-z_])-?(?P<threshold>\d[\d.e+-]*)$")


def family(row: str, lossy: bool = False) -> str | None:
    """The gated family of a row name (``j0.9`` judge, ``j-mined-0.9`` judge_mined, ``fsd-kl-1`` fsd_kl (``fsd-kl-or-1``
    fsd_kl_or: rows of ``fsd_rule=or`` named ``fsd-kl-or-`` in ``rows=``), ``s0.5``
    sprinter, ``t2`` topk_verify, ``r-top3-0.5`` relaxed_top3: relaxed acceptance, rows named ``r-<name>-`` in
    ``rows=``), None for a row no threshold makes lossy. ``lossy`` (the row's policy is not lossless,
    ``Policy.lossless``): a row of another policy (``rows=`` of a registered one) is gated too, its family the
    name before its setting (``margin-0.3``: ``margin``)."""
    m = ROW.match(row)
    if m is None:
        g = GENERIC.match(row) if lossy else None
        return g["family"].rstrip("-_") if g else None
    if m["named"]:
        return f"judge_{m['named']}"
    if m["relaxed"]:
        return f"relaxed_{m['relaxed']}"
    if m["fsd"]:
        return f"fsd_{m['fsd']}" + ("_or" if m["rule"] else "")
    return next(k for k in ("judge", "sprinter", "topk_verify") if m[k])


def threshold(row: str) -> float:
    return float((ROW.match(row) or GENERIC.match(row))["threshold"])


@dataclass(frozen=True)
class Gate:
    """What ``select=`` asks of a setting, each bound at the bad end of its 95% interval: the accuracy drop and
    the share of answers changed, both on the sources where the target is competent (a source where it is near
    chance says nothing about quality: reported, never gated), and the target's log-probability gap per token
    (nats) on every source, which needs no grader."""

    max_drop: float | None = None
    max_disagree: float | None = None
    max_gap: float | None = None

    def __str__(self) -> str:
        return ",".join(f"{k}:{getattr(self, k)}" for k in GATES if getattr(self, k) is not None)


GATES = ("max_drop", "max_disagree", "max_gap")


def parse(select: str | None) -> Gate | None:
    """``"max_drop:0.01"``, ``"max_disagree:0.02"``, ``"max_gap:0.1"`` or several comma-separated -> a
    :class:`Gate`; None -> None; anything else is a UserError."""
    if select is None:
        return None
    bounds: dict[str, float] = {}
    for term in str(select).split(","):
        key, _, value = term.strip().partition(":")
        try:
            bound = float(value)
        except ValueError:
            bound = -1.0
        if key not in GATES or key in bounds or not 0 <= bound < (100 if key == "max_gap" else 1):
            raise UserError(
                f"select={select!r}: expected max_drop:X, max_disagree:Y and/or max_gap:Z comma-separated, each "
                "once, with 0 <= X, Y < 1 (0.01 = 1 point of accuracy; 0.02 = 2% of answers changed) and Z >= 0 "
                "(nats per token the target's log-probability of the output may fall)"
            )
        bounds[key] = bound
    return Gate(**bounds)


def _speed(rows: list[dict], idx: list[int]) -> float:
    time = sum(rows[i]["wall_time"] for i in idx)
    return sum(rows[i]["new_tokens"] for i in idx) / time if time else 0.0


def choose(candidates: dict[str, dict], gate: Gate) -> str | None:
    """The fastest candidate (``{"tokens_per_s", "acc_drop_high", "disagree_upper"}`` each) within every bound of
    ``gate``; None when no candidate is."""

    def within(c: dict) -> bool:
        for key, bound in (("acc_drop_high", gate.max_drop), ("disagree_upper", gate.max_disagree)):
            if bound is not None and (c.get(key) is None or c[key] > bound):
                return False
        return gate.max_gap is None or (c.get("gap_lower") is not None and c["gap_lower"] >= -gate.max_gap)

    ok = [n for n, c in candidates.items() if within(c)]
    return max(ok, key=lambda n: candidates[n]["tokens_per_s"]) if ok else None


def _interval_row(values: list) -> dict:
    d = mean_interval(values)
    return {"value": d["value"], "low": d["low"], "high": d["high"], "prompts": d["n"]}


def _figures(idx: list[int], name: str, correct, same, sources, competent: list[str], gaps=None) -> dict:
    """On the prompts ``idx``: the accuracy drop against the target over the competent sources' prompts; per
    graded source the share of answers that differ from the target's (``disagree_upper``: the largest upper
    bound over the competent sources); per source the log-probability gap (``gap_lower``: the lowest lower
    bound over every source), each with its interval."""
    drop_idx = [i for i in idx if sources[i] in competent]
    drop = paired_difference([correct["ar"][i] for i in drop_idx], [correct[name][i] for i in drop_idx])
    by_source = {
        src: _interval_row([1 - same[name][i] for i in idx if sources[i] == src])
        for src in dict.fromkeys(sources[i] for i in idx)
    }
    highs = [d["high"] for s, d in by_source.items() if d["high"] is not None and s in competent]
    out = {
        "acc_drop": drop["value"],
        "acc_drop_low": drop["low"],
        "acc_drop_high": drop["high"],
        "disagree_by_source": by_source,
        "disagree_upper": max(highs) if highs else None,
    }
    if gaps is not None:
        mine, here = gaps.get(name) or [], set(idx)
        gap = {}
        for src in dict.fromkeys(sources):
            vals = [mine[i] for i in range(len(mine)) if i in here and sources[i] == src and mine[i] is not None]
            if vals:
                gap[src] = _interval_row(vals)
        lows = [g["low"] for g in gap.values() if g["low"] is not None]
        out.update(gap_by_source=gap, gap_lower=min(lows) if lows else None)
    return out


def gated(
    grouped: dict[str, list[dict]],
    correct: dict[str, list[int | None]],
    gate: Gate,
    sd_reference: dict[str, str | None],
    same: dict[str, list[int | None]] | None = None,
    sources: list[str] | None = None,
    competent: list[str] | None = None,
    gaps: dict[str, list[float | None]] | None = None,
    lossless: dict[str, bool] | None = None,
) -> dict:
    """The ``gated`` section: per lossy family present, the chosen row (or why none) with its test figures.

    Args:
        grouped: each configuration's rows in prompt order (``new_tokens``, ``wall_time``, ``accepted``,
            ``target_calls``).
        correct: each configuration's 0/1 per prompt (None where no grader fits).
        gate: the bounds.
        sd_reference: per family (``fsd`` for every FSD divergence, ``judge`` for every judge), the SD row its
            speed is compared with.
        same: each configuration's 1 where its answer is the target alone's, 0 where not, per prompt (None
            where no grader fits); needed for max_disagree.
        sources: each prompt's source (default: one source for all).
        competent: the sources where the target alone is clearly above chance (default: every source): the
            accuracy drop and the answers changed count only their prompts.
        gaps: each configuration's log-probability gap to the target's output per prompt (``fidelity``); needed
            for max_gap.
        lossless: each configuration's ``Policy.lossless``: lossless rows are never gated, and a lossy row whose
            name the reports do not know is gated under the name before its setting (default: by name only).
    """
    graded = [i for i, c in enumerate(correct["ar"]) if c is not None]
    sources = sources or ["graded"] * len(correct["ar"])
    same = same or {n: [None if c is None else 1 for c in v] for n, v in correct.items()}
    competent = sorted({sources[i] for i in graded}) if competent is None else list(competent)
    calib, test = graded[0::2], graded[1::2]
    out: dict = {
        "select": str(gate),
        "max_drop": gate.max_drop,
        "max_disagree": gate.max_disagree,
        "max_gap": gate.max_gap,
        "competent_sources": competent,
        "calibration_prompts": len(calib),
        "test_prompts": len(test),
        "rows": {},
    }
    ignored = sorted({sources[i] for i in graded} - set(competent))
    if (gate.max_drop is not None or gate.max_disagree is not None) and ignored:
        out["note"] = (
            f"max_drop and max_disagree leave out {', '.join(ignored)}: the target alone is not clearly above "
            "chance there (section competence); reported, not gated"
            + ("; no graded source is left for them" if not competent else "")
        )
    ar = grouped["ar"]
    families: dict[str, list[str]] = {}
    for n in grouped:
        lossy = lossless is not None and not lossless.get(n, True)
        if lossless is not None and lossless.get(n, False):
            continue  # a lossless policy's row: nothing to gate
        if fam := family(n, lossy):
            families.setdefault(fam, []).append(n)
    for fam, names in families.items():
        candidates = {}
        for n in names:
            f = _figures(calib, n, correct, same, sources, competent, gaps)
            candidates[n] = {"tokens_per_s": round(_speed(grouped[n], calib), 3), **f}
        pick = choose(candidates, gate)
        entry: dict = {"calibration": candidates, "row": pick}
        if pick is None:
            entry["reason"] = f"no setting is within {gate} at the upper bound on the calibration half" + (
                " (max_drop and max_disagree have no competent source to measure on)"
                if (gate.max_drop is not None or gate.max_disagree is not None) and not competent
                else ""
            )
            out["rows"][fam] = entry
            continue
        rows = grouped[pick]
        f = _figures(test, pick, correct, same, sources, competent, gaps)

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
            acc_drop=f["acc_drop"],
            acc_drop_low=f["acc_drop_low"],
            acc_drop_upper=f["acc_drop_high"],
            disagree_by_source=f["disagree_by_source"],
            disagree_upper=f["disagree_upper"],
            **({"gap_by_source": f["gap_by_source"], "gap_lower": f["gap_lower"]} if "gap_lower" in f else {}),
            within_gate_on_test=choose({pick: {"tokens_per_s": 0, **f}}, gate) == pick,
            tokens_per_s_vs_target=vs_target["value"],
            tokens_per_s_vs_target_interval=[vs_target["low"], vs_target["high"]],
        )
        sd = sd_reference.get(fam.split("_")[0] if fam.startswith(("fsd", "judge", "relaxed")) else fam)
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


def _bound(x) -> str:
    return "-" if x is None else f"{x:.4f}"


def describe(g: dict) -> list[str]:
    """The ``gated`` section as text lines."""
    lines = [
        f"quality-gated ({g['select']} at the upper bound; chosen on "
        f"{g['calibration_prompts']} prompts, reported on {g['test_prompts']} others):"
    ]
    if g.get("note"):
        lines.append(f"  {g['note']}")
    for fam, e in g["rows"].items():
        if e["row"] is None:
            lines.append(f"  {fam}: none ({e['reason']})")
            continue
        lines.append(
            f"  {fam}: {e['row']} drop {_bound(e['acc_drop'])} [{_bound(e['acc_drop_low'])}, "
            f"{_bound(e['acc_drop_upper'])}], disagreement upper {_bound(e.get('disagree_upper'))}, "
            + (f"log-prob gap lower {_bound(e['gap_lower'])}, " if "gap_lower" in e else "")
            + f"tokens/s vs target {e['tokens_per_s_vs_target']:.3f}"
            + (f", vs {e['sd_reference']} {e['tokens_per_s_vs_sd']:.3f}" if "sd_reference" in e else "")
        )
    return lines
