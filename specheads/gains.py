"""The figures ``heads-pipeline`` states in words: the drafter's gain, the stop rules' gain over the best fixed
K, their honest ceilings (:func:`ceiling_lines`) and, over several regimes, where a stop head can pay
(:func:`where_heads_pay`)."""

from __future__ import annotations


def _row(table: list[dict], name: str | None) -> dict | None:
    return next((r for r in table if r["config"] == name), None)


def _x(a: float | None, b: float | None) -> str:
    return f"{a / b:.3f}x" if a and b else "-"


def gains(ev: dict) -> list[str]:
    """The two gains the main job shows, as lines: the drafter's (its fastest lossless row against the target
    alone) and the stop rules' (each stop-head and confidence row against the fastest fixed K)."""
    table, lines = ev["table"], []
    ar, k = _row(table, "ar"), _row(table, ev.get("best_fixed_k"))
    drafting = [r for r in table if r.get("lossless") and r["config"] != "ar"]  # lossless rows that draft
    if ar and drafting:
        best = max(drafting, key=lambda r: r["tokens_per_s"])
        lines.append(
            f"drafter gain ({ev.get('drafter') or 'drafter'}): its fastest lossless row {best['config']} "
            f"{best['tokens_per_s']} tokens/s = {_x(best['tokens_per_s'], ar['tokens_per_s'])} the target "
            f"alone ({ar['tokens_per_s']} tokens/s)"
            + (f"; best fixed K {k['config']} {_x(k['tokens_per_s'], ar['tokens_per_s'])}" if k else "")
        )
    heads = [r for r in table if r["config"].startswith("h")]
    free = [r for r in table if r["config"].startswith("c")]
    if k and (heads or free):
        line = f"stop head gain over the best fixed K ({k['config']}, {k['tokens_per_s']} tokens/s): " + (
            ", ".join(
                f"{r['config']} {r['tokens_per_s']} tokens/s = {_x(r['tokens_per_s'], k['tokens_per_s'])}"
                for r in heads
            )
            or "no stop-head row"
        )
        if free:
            line += "; training-free " + ", ".join(
                f"{r['config']} {_x(r['tokens_per_s'], k['tokens_per_s'])}" for r in free
            )
        lines.append(line)
        lines += ceiling_lines(ev)
    return lines


PAYS = 1.05  # a ceiling below this over the best fixed K leaves no stop rule room to pay (noise is a few %)


def ceiling_lines(ev: dict) -> list[str]:
    """The honest ceilings in words: what a perfect stop rule (the row's own lag) would gain over the best fixed
    K in the cost model, each stop row's share of it, and whether any rule can pay here at all."""
    ceilings = ev.get("ceilings") or {}
    if not ceilings:
        bound = (ev.get("ratios") or {}).get("perfect_head_cost_gain_vs_best_fixed_k")
        return [f"ceiling: a perfect stop head {bound:.3f}x the best fixed K (cost model)"] if bound else []
    figures = {k: v["vs_best_fixed_k"] for k, v in ceilings.items() if v.get("vs_best_fixed_k")}
    if not figures:
        return []
    line = "ceiling (a perfect stop rule over the best fixed K, cost model): " + ", ".join(
        f"{x:.3f}x at lag {k.removeprefix('lag')}" for k, x in sorted(figures.items())
    )
    shares = [
        f"{r['config']} {r['share_of_ceiling']:.2f}" for r in ev["table"] if r.get("share_of_ceiling") is not None
    ]
    if shares:
        line += "; share of its ceiling: " + ", ".join(shares)
    out = [line]
    if max(figures.values()) < PAYS:
        out.append(
            f"no stop rule can pay here: even a perfect one gains at most {max(figures.values()):.3f}x over the best "
            "fixed K (short acceptance runs; stop rules pay with longer runs, sampling or compute-bound batches)"
        )
        return out
    low = [k for k, x in sorted(figures.items()) if x < PAYS]
    for key in low:  # a lag whose perfect rule cannot pay, while another's can
        lag = key.removeprefix("lag")
        rows = [r["config"] for r in ev["table"] if r.get("ceiling_vs_best_fixed_k") == figures[key]]
        out.append(
            f"no lag-{lag} stop rule can pay here ({', '.join(rows) or 'none run'}): even a perfect one is "
            f"{figures[key]:.3f}x the best fixed K; one that scores a candidate as it is drawn (lag 0) can reach "
            f"{max(figures.values()):.3f}x"
        )
    return out


def fastest(table: list[dict], pick) -> dict | None:
    """The row of ``table`` with the most tokens/s among those whose ``config`` satisfies ``pick``."""
    return max((r for r in table if pick(r["config"])), key=lambda r: r["tokens_per_s"], default=None)


def speed_ratio(a: dict | None, b: dict | None) -> float | None:
    """Row ``a``'s tokens/s over row ``b``'s (4 places; None when either is missing)."""
    return round(a["tokens_per_s"] / b["tokens_per_s"], 4) if a and b and b["tokens_per_s"] else None


def where_heads_pay(summaries: dict[str, dict]) -> dict | None:
    """The regime with the largest stop-rule ceiling (the perfect rule of either lag over the best fixed K, cost
    model) and there the fastest learned-head row against the fastest training-free and fixed-K rows (measured).

    Args:
        summaries: ``{regime: a pipeline summary}`` (its ``eval`` section holds the sweep's table and ceilings).
    """
    ceilings = {}
    for name, summary in summaries.items():
        figures = [v.get("vs_best_fixed_k") for v in ((summary.get("eval") or {}).get("ceilings") or {}).values()]
        if any(figures):
            ceilings[name] = max(x for x in figures if x)
    if not ceilings:
        return None
    name = max(ceilings, key=lambda n: ceilings[n])
    table = summaries[name]["eval"]["table"]
    fixed, free, head = (fastest(table, lambda c, p=p: c.startswith(p)) for p in ("k", "c", "h"))
    return {
        "regime": name,
        "ceiling": ceilings[name],
        "ceilings": ceilings,
        "pays": ceilings[name] >= PAYS,
        "best_fixed_k": fixed and fixed["config"],
        "best_training_free": free and free["config"],
        "best_head": head and head["config"],
        "head_vs_best_training_free": speed_ratio(head, free),
        "head_vs_best_fixed_k": speed_ratio(head, fixed),
        "best_training_free_vs_best_fixed_k": speed_ratio(free, fixed),
        "head_share_of_ceiling": head.get("share_of_ceiling") if head else None,
    }


def where_lines(where: dict | None) -> list[str]:
    """:func:`where_heads_pay` in words: the regime, its ceiling, and which rule to use there."""
    if not where:
        return []
    every = ", ".join(f"{n} {x:.3f}x" for n, x in where["ceilings"].items())
    line = (
        f"where a stop head can pay: {where['regime']}, the regime with the largest ceiling (a perfect stop rule "
        f"over the best fixed K, cost model: {every})"
    )
    if not where["pays"]:
        return [line, f"in no regime run here can a stop rule pay: the largest ceiling is below {PAYS}x"]
    out = [line]
    head, free, k = where["best_head"], where["best_training_free"], where["best_fixed_k"]
    if head and free and k:
        out.append(
            f"there the learned head {head} runs at {where['head_vs_best_training_free']:.3f}x the best "
            f"training-free rule ({free}) and {where['head_vs_best_fixed_k']:.3f}x the best fixed K ({k}); "
            f"{free} is {where['best_training_free_vs_best_fixed_k']:.3f}x {k}"
        )
        best = max((where["head_vs_best_fixed_k"], head), (where["best_training_free_vs_best_fixed_k"], free), (1.0, k))
        out.append(f"fastest rule there: {best[1]}" + (" (the learned head pays)" if best[1] == head else ""))
    return out
