"""Judge data (ALGORITHMS.md section 3): graded answers -> correct/wrong tuples -> token labels -> target features.

Answers to each prompt come from the loaded models (``answer_models``: target and/or draft), greedy
and ``answer_samples`` sampled ones each. A grader marks them: GSM8K-style prompts by the final
number against the reference (:mod:`arith`), ARC by the chosen letter; prompts without a grader
give no tuples. Every wrong answer is localised by the arithmetic checker (the first false step);
one it cannot localise, or one with no correct answer to pair with, goes to the review file
instead of training. A wrong answer is paired with the first correct model answer, else with the
data set's reference solution. Token labels and features (the target's last hidden state before the
final norm at each labelled answer token, fp16) are computed per tuple side.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from specheads.export.shim.models import HiddenCapture, pad_batch

from . import arith
from .tuples import IGNORE, JudgeTuple, token_labels

_LETTER = re.compile(r"\b([A-E])\b")


@dataclass
class Answer:
    text: str
    model: str  # "target", "draft", "dataset"
    setting: str  # "greedy" or "sample-<i>"


def grade(prompt, text: str) -> tuple[bool | None, arith.Check | None]:
    """``(correct, check)``: None when no grader fits the prompt."""
    if prompt.reference is None:
        return None, None
    if prompt.source == "arc":
        m = _LETTER.search(text)
        return (m is not None and m.group(1) == prompt.reference.strip()), None
    try:
        float(prompt.reference.replace(",", ""))
    except ValueError:
        return None, None
    c = arith.check(text, prompt.reference)
    return bool(c.final_correct), c


def build_tuples(prompt, answers: list[Answer], counts: dict) -> tuple[list[JudgeTuple], list[dict]]:
    """Tuples and review items for one prompt's graded answers; updates ``counts``."""
    question = prompt.text if prompt.text is not None else "\n".join(m["content"] for m in prompt.messages)
    graded = []
    for a in answers:
        ok, chk = grade(prompt, a.text)
        counts["answers"] += 1
        counts["ungraded" if ok is None else ("correct" if ok else "wrong")] += 1
        if ok is not None:
            graded.append((a, ok, chk))
    correct = [a for a, ok, _ in graded if ok]
    pair = correct[0] if correct else None
    if pair is None and prompt.source == "gsm8k" and prompt.reference_text:
        pair = Answer(prompt.reference_text, "dataset", "reference")
    tuples, review = [], []
    wrong = [(a, chk) for a, ok, chk in graded if not ok]
    for i, (a, chk) in enumerate(wrong):
        base = {"question": question, "wrong": a.text, "wrong_model": a.model, "setting": a.setting,
                "prompt_id": prompt.id}
        if chk is None or chk.error_span is None:
            review.append({**base, "reason": "no false arithmetic step found (the grader cannot localise the error)"})
            counts["review"] += 1
        elif pair is None:
            review.append({**base, "reason": "no correct answer to pair with"})
            counts["review"] += 1
        else:
            counts["localised"] += 1
            tuples.append(JudgeTuple(question, pair.text, a.text, chk.error_span,
                                     {"correct_model": pair.model, "wrong_model": a.model,
                                      "wrong_setting": a.setting, "annotator": "arith-checker"},
                                     f"{prompt.id}-w{i}"))
    if correct and not wrong:  # keep the positives of prompts every model got right
        tuples.append(JudgeTuple(question, correct[0].text, "", None,
                                 {"correct_model": correct[0].model, "annotator": "grader"}, f"{prompt.id}-c"))
    counts["tuples"] += len(tuples)
    return tuples, review


def tuple_rows(tokenizer, tuples: list[JudgeTuple], format_question) -> list[dict]:
    """One row per non-empty tuple side: ``input_ids`` (question + answer), ``answer_start``, ``labels``."""
    rows = []
    for t in tuples:
        q = format_question(t.question)
        for side, text, error in (("correct", t.correct, None), ("wrong", t.wrong, t.error)):
            if not text:
                continue
            ids, labels = token_labels(tokenizer, text, error)
            if not ids:
                continue
            rows.append({"tuple_id": t.id, "side": side, "input_ids": q + ids, "answer_start": len(q),
                         "labels": labels})
    return rows


@torch.inference_mode()
def target_features(model, rows: list[dict], pad: int, batch_size: int
                    ) -> tuple[torch.Tensor, torch.Tensor, list[int], list[int]]:
    """The target's pre-final-norm states at every labelled answer token (label != IGNORE), fp16.

    A row whose states hold a NaN or Inf anywhere in the sequence is left out.

    Returns features ``[M, d]``, labels ``[M]``, the number of tokens per kept row and the
    indices of the rows left out.
    """
    device = model.get_input_embeddings().weight.device
    feats, labels, counts, bad = [], [], [], []
    with HiddenCapture(model) as cap:
        for i in range(0, len(rows), batch_size):
            batch = rows[i: i + batch_size]
            ids, mask = pad_batch([r["input_ids"] for r in batch], pad, device)
            model(input_ids=ids, attention_mask=mask, logits_to_keep=1)
            finite = (torch.isfinite(cap.pre).all(-1) | ~mask.bool().to(cap.pre.device)).all(-1).tolist()
            for b, r in enumerate(batch):
                if not finite[b]:
                    bad.append(i + b)
                    continue
                keep = [j for j, v in enumerate(r["labels"]) if v != IGNORE]
                pos = torch.tensor([r["answer_start"] + j for j in keep], dtype=torch.long, device=cap.pre.device)
                feats.append(cap.pre[b].index_select(0, pos).to(torch.float16).cpu())
                labels.append(torch.tensor([r["labels"][j] for j in keep], dtype=torch.float32))
                counts.append(len(keep))
    d = model.config.hidden_size
    if not feats:
        return torch.empty(0, d, dtype=torch.float16), torch.empty(0), counts, bad
    return torch.cat(feats), torch.cat(labels), counts, bad
