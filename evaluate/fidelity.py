"""Fidelity to the target: how far each row's outputs moved from the target alone's, prompt by prompt.

Accuracy only tells where the target is competent (:mod:`.competence`); fidelity tells everywhere. For every
row but the target alone and the draft alone, paired by prompt with the target's output, each with its 95%
bootstrap interval (:mod:`.intervals`):

* ``agreement``: per graded source, the share of prompts whose answer (:func:`specheads.grading.answer`: the
  ARC letter, the final number, the fact) is the target's; two outputs without an answer agree;
* ``exact_match``: the share of prompts whose whole output is the target's, token for token;
* ``rouge_l``: ROUGE-L F-measure (``rouge-score``) of the output against the target's;
* ``logprob_gap``: the target's mean log-probability per token of the row's output minus that of its own
  output, teacher-forced on the prompt (:func:`mean_logprobs`, batched). 0 where the outputs are equal,
  negative where the row wrote what the target finds less likely; it needs no grader.
"""

from __future__ import annotations

import copy
import inspect

import torch

from specheads.evaluate.intervals import mean_interval
from specheads.shim import output_device

BATCH_TOKENS = 4096  # tokens per teacher-forced forward


@torch.no_grad()
def mean_logprobs(model, items: list[tuple[list[int], list[int]]], pad: int, batch_tokens: int = BATCH_TOKENS):
    """For each ``(prompt_ids, output_ids)``, the model's mean log-probability per output token, teacher-forced
    (None for an empty output).

    The outputs of one prompt share its forward: the prompt runs once, its key/value cache is repeated for
    the prompt's outputs, which then run together (right-padded, at most ``batch_tokens`` tokens a forward;
    a causal model's padding after a sequence cannot change it). The vocabulary projection runs on the
    output positions only where the model exposes its decoder body (``model.model``)."""
    out: list[float | None] = [None] * len(items)
    device = next(model.parameters()).device
    out_device = output_device(model)  # the logits': a split target's output layer sits on its last GPU
    body = getattr(model, "model", None)
    head = model.get_output_embeddings() if body is not None else None
    cache_kw = "cache" if "cache" in inspect.signature((body or model).forward).parameters else "past_key_values"
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, (p, o) in enumerate(items):
        if o:
            groups.setdefault(tuple(p), []).append(i)
    for prompt, members in groups.items():
        prefix = torch.tensor([list(prompt[:-1])], device=device)
        cache = None
        if prefix.shape[1]:
            first = (body or model)(input_ids=prefix, use_cache=True)
            cache = getattr(first, "cache", None) or first.past_key_values
        width = max(len(items[i][1]) for i in members)
        step = max(1, batch_tokens // width)
        for start in range(0, len(members), step):
            part = members[start : start + step]
            ids = torch.full((len(part), width), pad, dtype=torch.long, device=device)
            for row, i in enumerate(part):
                seq = [prompt[-1], *items[i][1][:-1]]
                ids[row, : len(seq)] = torch.tensor(seq)
            past = None
            if cache is not None:
                past = copy.deepcopy(cache) if start + step < len(members) else cache
                past.batch_repeat_interleave(len(part))
            positions = torch.arange(len(prompt) - 1, len(prompt) - 1 + width, device=device)[None].expand(
                len(part), -1
            )
            kwargs = {"input_ids": ids, "position_ids": positions, cache_kw: past, "use_cache": past is not None}
            if head is not None:
                states = body(**kwargs).last_hidden_state
            else:
                logits_all = model(**kwargs).logits
            for row, i in enumerate(part):
                o = items[i][1]
                logits = head(states[row, : len(o)]) if head is not None else logits_all[row, : len(o)]
                index = torch.tensor(o, device=out_device)[:, None]
                lp = torch.log_softmax(logits.float(), dim=-1).gather(-1, index)
                out[i] = float(lp.mean())
    return out


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 4)


def _interval(values: list[float]) -> dict:
    m = mean_interval(values)
    return {"value": _round(m["value"]), "low": _round(m["low"]), "high": _round(m["high"]), "prompts": m["n"]}


def _rouge_l(candidates: list[str], references: list[str]) -> list[float]:
    from rouge_score import rouge_scorer

    scorer = rouge_scorer.RougeScorer(["rougeL"], use_stemmer=True)
    return [scorer.score(r, c)["rougeL"].fmeasure if (r or c) else 1.0 for c, r in zip(candidates, references)]


def fidelity(
    names: list[str],
    grouped: dict[str, list[dict]],
    texts: dict[str, list[str]],
    same: dict[str, list[int | None]],
    sources: list[str],
    logprob=None,
) -> dict:
    """The ``fidelity`` section: per row in ``names``, its figures against the target alone (``ar``).

    Args:
        names: the rows to report.
        grouped: each configuration's rows in prompt order (``tokens``).
        texts: each configuration's output texts in prompt order.
        same: each configuration's 1 / 0 per prompt where its answer is / is not the target's (None: ungraded).
        sources: each prompt's source.
        logprob: ``callable(prompt_index, tokens) -> mean log-probability or None`` (the target's, teacher-forced);
            None leaves the log-probability gap out.
    """
    ar = grouped["ar"]
    out = {}
    for n in names:
        rows = grouped[n]
        entry: dict = {"agreement": {}}
        for src in dict.fromkeys(s for s, v in zip(sources, same[n]) if v is not None):
            entry["agreement"][src] = _interval([v for s, v in zip(sources, same[n]) if s == src and v is not None])
        entry["exact_match"] = _interval([int(r["tokens"] == a["tokens"]) for r, a in zip(rows, ar)])
        entry["rouge_l"] = _interval(_rouge_l(texts[n], texts["ar"]))
        if logprob is not None:
            entry["logprob_gap"] = _interval([g for g in prompt_gaps(rows, ar, logprob) if g is not None])
        out[n] = entry
    return out


def prompt_gaps(rows: list[dict], ar: list[dict], logprob) -> list[float | None]:
    """Per prompt, the target's mean log-probability per token of the row's output minus that of its own
    (0 where the two are equal; None where either was not scored)."""
    gaps: list[float | None] = []
    for i, (r, a) in enumerate(zip(rows, ar)):
        if r["tokens"] == a["tokens"]:
            gaps.append(0.0)
            continue
        mine, target = logprob(i, r["tokens"]), logprob(i, a["tokens"])
        gaps.append(mine - target if mine is not None and target is not None else None)
    return gaps


def describe(block: dict) -> list[str]:
    """The ``fidelity`` section as text lines."""
    lines = []
    for n, e in block.items():
        agree = ", ".join(f"{s} {v['value']} [{v['low']}, {v['high']}]" for s, v in e["agreement"].items())
        gap = e.get("logprob_gap")
        lines.append(
            f"fidelity {n}: answers as target's {agree or '-'}; exact match {e['exact_match']['value']}, "
            f"ROUGE-L {e['rouge_l']['value']}"
            + (f", log-prob gap {gap['value']} [{gap['low']}, {gap['high']}]" if gap else "")
        )
    return lines
