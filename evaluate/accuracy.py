"""Answer accuracy of a sweep's rows: per configuration and prompt source with a grader, and the
``judge`` section (each Judge row against SD at the same K)."""

from __future__ import annotations

from specheads.grading import grade


def output_text(pair, config: str, tokens: list[int]) -> str:
    """A row's output text: the draft-alone row is in the draft's vocabulary, every other in the target's."""
    tok = pair.draft.tokenizer if config == "draft" else pair.tokenizer
    return tok.decode(tokens, skip_special_tokens=True)


def add_accuracy(cfg, pair, prompts, grouped: dict[str, list[dict]], summary: dict) -> None:
    """Per configuration and prompt source with a grader (GSM8K final number, ARC letter): accuracy;
    for judge rows, the ratios to SD at the same K (else the fastest SD row)."""
    acc: dict = {}
    for name, rows in grouped.items():
        per: dict = {}
        for prompt, row in zip(prompts, rows):
            ok = grade(prompt, output_text(pair, name, row["tokens"]))
            if ok is None:
                continue
            d = per.setdefault(prompt.source, [0, 0])
            d[0] += int(ok)
            d[1] += 1
        acc[name] = {src: {"accuracy": round(c / n, 4), "correct": c, "prompts": n} for src, (c, n) in per.items()}
    summary["accuracy"] = acc
    judges = [r for r in summary["table"] if r["config"].startswith("j")]
    if not judges:
        return
    by = {r["config"]: r for r in summary["table"]}
    sd = by.get(f"k{cfg.judge_k}") or max((r for r in summary["table"] if r["config"].startswith("k")),
                                          key=lambda r: r["tokens_per_s"], default=None)
    section = {"head": cfg.judge, "k": cfg.judge_k, "sd_reference": sd["config"] if sd else None, "by_delta": {}}
    for r in judges:
        section["by_delta"][r["config"]] = {
            "accepted_per_call": r["accepted_per_call"], "tokens_per_s": r["tokens_per_s"],
            "accuracy": acc.get(r["config"], {}),
            "vs_sd_accepted_per_call": round(r["accepted_per_call"] / sd["accepted_per_call"], 4)
            if sd and sd["accepted_per_call"] else None,
            "vs_sd_tokens_per_s": round(r["tokens_per_s"] / sd["tokens_per_s"], 4) if sd else None}
    summary["judge"] = section
