"""Answer accuracy of a sweep's rows: per configuration and prompt source with a grader, and the
``judge`` section (each Judge row against SD at the same K)."""

from __future__ import annotations

from specheads.evaluate.intervals import mean_interval, paired_difference
from specheads.evaluate.select import gated
from specheads.evaluate.select import parse as parse_select
from specheads.grading import answer, grade


def figures(outcomes: list[tuple[int, str | None]], target: list[tuple[int, str | None]] | None) -> dict:
    """A configuration's accuracy on one prompt source with its 95% interval and, against the target
    alone on the same prompts (``target``), the accuracy drop (target minus this, paired by prompt)
    and the share of prompts where both give the same answer, each with its interval."""
    ok = [c for c, _ in outcomes]
    a = mean_interval(ok)
    out = {
        "accuracy": round(a["value"], 4),
        "accuracy_low": round(a["low"], 4),
        "accuracy_high": round(a["high"], 4),
        "correct": sum(ok),
        "prompts": len(ok),
    }
    if target is not None and len(target) == len(outcomes):
        drop = paired_difference([c for c, _ in target], ok)
        same = mean_interval([int(x is not None and x == y) for (_, x), (_, y) in zip(outcomes, target)])
        out.update(
            acc_drop=round(drop["value"], 4),
            acc_drop_low=round(drop["low"], 4),
            acc_drop_high=round(drop["high"], 4),
            agreement_with_target=round(same["value"], 4),
            agreement_low=round(same["low"], 4),
            agreement_high=round(same["high"], 4),
        )
    return out


def output_text(pair, config: str, tokens: list[int]) -> str:
    """A row's output text: the draft-alone row is in the draft's vocabulary, every other in the target's."""
    tok = pair.draft.tokenizer if config == "draft" else pair.tokenizer
    return tok.decode(tokens, skip_special_tokens=True)


def add_accuracy(cfg, pair, prompts, grouped: dict[str, list[dict]], summary: dict) -> None:
    """Per configuration and prompt source with a grader (GSM8K final number, ARC letter): accuracy, and
    against the target alone the paired accuracy drop and answer agreement (:func:`figures`); for judge
    rows, the ratios to SD at the same K (else the fastest SD row)."""
    graded = {}  # name -> source -> [(correct, answer)] in prompt order
    correct: dict[str, list[int | None]] = {}  # name -> 0/1 per prompt (None: no grader)
    for name, rows in grouped.items():
        per: dict = {}
        correct[name] = []
        for prompt, row in zip(prompts, rows):
            text = output_text(pair, name, row["tokens"])
            ok = grade(prompt, text)
            correct[name].append(None if ok is None else int(ok))
            if ok is not None:
                per.setdefault(prompt.source, []).append((int(ok), answer(prompt, text)))
        graded[name] = per
    acc = {
        name: {
            src: figures(outcomes, graded.get("ar", {}).get(src) if name != "ar" else None)
            for src, outcomes in per.items()
        }
        for name, per in graded.items()
    }
    summary["accuracy"] = acc
    max_drop = parse_select(getattr(cfg, "select", None))
    if max_drop is not None and "ar" in grouped:
        table = {r["config"]: r for r in summary["table"]}
        fastest = max(
            (r for r in summary["table"] if r["config"].startswith("k")), key=lambda r: r["tokens_per_s"], default=None
        )

        def sd(k: int | None) -> str | None:
            return f"k{k}" if f"k{k}" in table else fastest["config"] if fastest else None

        summary["gated"] = gated(
            grouped,
            correct,
            max_drop,
            {"judge": sd(cfg.judge_k), "sprinter": sd(None), "topk_verify": sd(cfg.topk_k), "fsd": sd(cfg.fsd_k)},
        )
    judges = [r for r in summary["table"] if r["config"].startswith("j")]
    if not judges:
        return
    by = {r["config"]: r for r in summary["table"]}
    sd = by.get(f"k{cfg.judge_k}") or max(
        (r for r in summary["table"] if r["config"].startswith("k")), key=lambda r: r["tokens_per_s"], default=None
    )
    section = {
        "head": cfg.judge,
        "heads": dict(getattr(cfg, "judges", {}) or {}),
        "k": cfg.judge_k,
        "sd_reference": sd["config"] if sd else None,
        "by_delta": {},
    }
    for r in judges:
        section["by_delta"][r["config"]] = {
            "accepted_per_call": r["accepted_per_call"],
            "tokens_per_s": r["tokens_per_s"],
            "accuracy": acc.get(r["config"], {}),
            "vs_sd_accepted_per_call": round(r["accepted_per_call"] / sd["accepted_per_call"], 4)
            if sd and sd["accepted_per_call"]
            else None,
            "vs_sd_tokens_per_s": round(r["tokens_per_s"] / sd["tokens_per_s"], 4) if sd else None,
        }
    summary["judge"] = section
