"""Answer accuracy of a sweep's rows: per configuration and prompt source with a grader, and the
``judge`` section (each Judge row against SD at the same K)."""

from __future__ import annotations

from specheads.errors import UserError
from specheads.evaluate.competence import MARGIN, competence
from specheads.evaluate.fidelity import fidelity, mean_logprobs, prompt_gaps
from specheads.evaluate.intervals import mean_interval, paired_difference
from specheads.evaluate.select import gated
from specheads.evaluate.select import parse as parse_select
from specheads.grading import answer, grade


def figures(outcomes: list[tuple[int, str | None]], target: list[tuple[int, str | None]] | None) -> dict:
    """A configuration's accuracy on one prompt source with its 95% interval and, against the target
    alone on the same prompts (``target``), the accuracy drop (target minus this, paired by prompt)
    and the share of prompts where both give the same answer (or neither gives one), each with its interval."""
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
        same = mean_interval([int(x == y) for (_, x), (_, y) in zip(outcomes, target)])  # no answer in both: same
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


def prompt_ids(cfg, pair, prompts, decoders) -> list[list[int]]:
    """Each prompt's token ids as the sweep decoded it: chat-formatted, cut to the target-alone row's context."""
    from specheads.decode.api import fit_context, format_prompt

    context = decoders["ar"].context if decoders and "ar" in decoders else None
    return [
        fit_context(format_prompt(pair.tokenizer, p, cfg.chat_template), cfg.max_new_tokens, context)[0]
        for p in prompts
    ]


def _logprob(cfg, pair, prompts, grouped, names, decoders):
    """The target's teacher-forced mean log-probability per token, for every output of ``names`` that differs
    from the target alone's and for the target's own there, in batched forwards: ``f(prompt_index, tokens)``."""
    ids = prompt_ids(cfg, pair, prompts, decoders)
    ar = grouped["ar"]
    wanted = {}
    for n in names:
        for i, (r, a) in enumerate(zip(grouped[n], ar)):
            if r["tokens"] != a["tokens"]:
                wanted[(i, tuple(r["tokens"]))] = None
                wanted[(i, tuple(a["tokens"]))] = None
    keys = list(wanted)
    tok = pair.tokenizer
    pad = tok.pad_token_id if tok.pad_token_id is not None else pair.eos_token_ids[0]
    values = mean_logprobs(pair.target.model, [(ids[i], list(t)) for i, t in keys], pad)
    table = dict(zip(keys, values))
    return lambda i, tokens: table.get((i, tuple(tokens)))


def add_accuracy(cfg, pair, prompts, grouped: dict[str, list[dict]], summary: dict, decoders=None) -> None:
    """Per configuration and prompt source with a grader (GSM8K final number, ARC letter, fact): accuracy, and
    against the target alone the paired accuracy drop and answer agreement (:func:`figures`); the target's
    ``competence`` per source; each row's ``fidelity`` to the target's outputs; the ``gated`` section when
    ``select=`` asks; for judge rows, the ratios to SD at the same K (else the fastest SD row)."""
    graded = {}  # name -> source -> [(correct, answer)] in prompt order
    correct: dict[str, list[int | None]] = {}  # name -> 0/1 per prompt (None: no grader)
    answers: dict[str, list[str | None]] = {}
    texts: dict[str, list[str]] = {}
    for name, rows in grouped.items():
        per: dict = {}
        correct[name], answers[name], texts[name] = [], [], []
        for prompt, row in zip(prompts, rows):
            text = output_text(pair, name, row["tokens"])
            ok = grade(prompt, text)
            texts[name].append(text)
            correct[name].append(None if ok is None else int(ok))
            answers[name].append(None if ok is None else answer(prompt, text))
            if ok is not None:
                per.setdefault(prompt.source, []).append((int(ok), answers[name][-1]))
        graded[name] = per
    acc = {
        name: {
            src: figures(outcomes, graded.get("ar", {}).get(src) if name != "ar" else None)
            for src, outcomes in per.items()
        }
        for name, per in graded.items()
    }
    summary["accuracy"] = acc
    if "ar" not in grouped:
        return
    sources = [p.source for p in prompts]
    # 1 where a row's answer is the target alone's (two outputs without an answer agree), per graded prompt
    same = {
        n: [None if c is None else int(x == y) for c, x, y in zip(correct[n], answers[n], answers["ar"])]
        for n in grouped
    }
    block = competence(prompts, correct["ar"], getattr(cfg, "competence_margin", MARGIN))
    if block:
        summary["competence"] = block
        for name, per in acc.items():
            for src, fig in per.items():
                if "acc_drop" in fig and not block[src]["informative"]:
                    fig["acc_drop_informative"] = False
    names = [n for n in grouped if n not in ("ar", "draft")]
    logprob = None
    if names:
        logprob = _logprob(cfg, pair, prompts, grouped, names, decoders) if getattr(cfg, "fidelity", True) else None
        summary["fidelity"] = fidelity(names, grouped, texts, same, sources, logprob)
    gate = parse_select(getattr(cfg, "select", None))
    if gate is not None and gate.max_gap is not None and logprob is None:
        raise UserError(f"select={cfg.select}: max_gap needs the target's log-probabilities; set fidelity=true")
    if gate is not None:
        table = {r["config"]: r for r in summary["table"]}
        fastest = max(
            (r for r in summary["table"] if r["config"].startswith("k")), key=lambda r: r["tokens_per_s"], default=None
        )

        def sd(k: int | None) -> str | None:
            return f"k{k}" if f"k{k}" in table else fastest["config"] if fastest else None

        summary["gated"] = gated(
            grouped,
            correct,
            gate,
            {
                "judge": sd(cfg.judge.k),
                "sprinter": sd(None),
                "topk_verify": sd(cfg.topk.k),
                "fsd": sd(cfg.fsd.k),
                "relaxed": sd(None),
            },
            same=same,
            sources=sources,
            competent=[s for s, c in block.items() if c["informative"]],
            gaps={n: prompt_gaps(grouped[n], grouped["ar"], logprob) for n in names} if logprob else None,
            lossless={n: d.policy.lossless for n, d in decoders.items()} if decoders else None,
        )
    judges = [r for r in summary["table"] if r["config"].startswith("j")]
    if not judges:
        return
    by = {r["config"]: r for r in summary["table"]}
    sd = by.get(f"k{cfg.judge.k}") or max(
        (r for r in summary["table"] if r["config"].startswith("k")), key=lambda r: r["tokens_per_s"], default=None
    )
    section = {
        "head": cfg.judge.head,
        "heads": dict(cfg.judge.heads),
        "k": cfg.judge.k,
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
