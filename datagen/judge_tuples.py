"""Judge labels' tuples: graded answers to correct/wrong tuples, their rows, and the summary beside the chunks."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from specheads.datagen import arith, mining, shards
from specheads.datagen.labelling import Job
from specheads.datagen.tuples import JudgeTuple, token_labels
from specheads.dataset import JudgeChunkFiles, chunk_files
from specheads.grading import grade
from specheads.shim import SamplingConfig

COUNTS = ("items", "answers", "correct", "wrong", "ungraded", "localised", "review", "tuples", "too_long")


@dataclass
class Answer:
    text: str
    model: str  # "target", "draft", "dataset"
    setting: str  # "greedy" or "sample-<i>"


def build_tuples(prompt, answers: list[Answer], counts: dict) -> tuple[list[JudgeTuple], list[dict]]:
    """Tuples and review items for one prompt's graded answers; updates ``counts``."""
    question = prompt.text if prompt.text is not None else "\n".join(m["content"] for m in prompt.messages)
    graded = []
    for a in answers:
        ok = grade(prompt, a.text)
        counts["answers"] += 1
        counts["ungraded" if ok is None else ("correct" if ok else "wrong")] += 1
        if ok is not None:
            graded.append((a, ok))
    correct = [a for a, ok in graded if ok]
    pair = correct[0] if correct else None
    if pair is None and prompt.source == "gsm8k" and prompt.reference_text:
        pair = Answer(prompt.reference_text, "dataset", "reference")
    tuples, review = [], []
    wrong = [a for a, ok in graded if not ok]
    for i, a in enumerate(wrong):
        base = {
            "question": question,
            "wrong": a.text,
            "wrong_model": a.model,
            "setting": a.setting,
            "prompt_id": prompt.id,
        }
        span = None if prompt.source == "arc" else arith.check(a.text).error_span  # a letter has no steps
        if span is None:
            review.append({**base, "reason": "no false arithmetic step found (the grader cannot localise the error)"})
        elif pair is None:
            review.append({**base, "reason": "no correct answer to pair with"})
        else:
            counts["localised"] += 1
            tuples.append(
                JudgeTuple(
                    question,
                    pair.text,
                    a.text,
                    span,
                    {
                        "correct_model": pair.model,
                        "wrong_model": a.model,
                        "wrong_setting": a.setting,
                        "annotator": "arith-checker",
                    },
                    f"{prompt.id}-w{i}",
                )
            )
    if correct and not wrong:  # keep the positives of prompts every model got right
        tuples.append(
            JudgeTuple(
                question,
                correct[0].text,
                "",
                None,
                {"correct_model": correct[0].model, "annotator": "grader"},
                f"{prompt.id}-c",
            )
        )
    counts["tuples"] += len(tuples)
    counts["review"] += len(review)
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
            rows.append(
                {"tuple_id": t.id, "side": side, "input_ids": q + ids, "answer_start": len(q), "labels": labels}
            )
    return rows


def answer_settings(cfg) -> list[tuple[int, str, SamplingConfig]]:
    """Each answer a model gives a prompt: ``(index, name, sampling)``, the greedy one (``greedy``) and
    ``judge.answer_samples`` sampled at ``judge.answer_temperature`` (``sample-1`` ...)."""
    sampled = SamplingConfig(do_sample=True, temperature=cfg.judge.answer_temperature)
    return [(0, "greedy", SamplingConfig())] + [
        (si, f"sample-{si}", sampled) for si in range(1, 1 + cfg.judge.answer_samples)
    ]


def _answers(cfg, pair, batch, ids, seed: int, pad: int, eos: list[int], given=None) -> list[list[Answer]]:
    """Each model's greedy and ``answer_samples`` sampled answers per prompt (``given``: the target's, vLLM's)."""
    from specheads.shim import batch_generate

    out = [[] for _ in batch]
    for mi, name in enumerate(cfg.judge.answer_models):
        loaded = pair.target if name == "target" else pair.draft
        model, device = loaded.model, loaded.device  # engine=vllm: a target without weights, its spec's device
        for si, setting, sampling in answer_settings(cfg):
            g = torch.Generator(device=device).manual_seed(seed * 64 + mi * 16 + si) if si else None
            for i, o in enumerate(
                given(setting)
                if given and name == "target"
                else batch_generate(model, ids, cfg.max_new_tokens, sampling, g, eos, pad)
            ):
                out[i].append(Answer(pair.tokenizer.decode(o, skip_special_tokens=True), name, setting))
    return out


def _tuples(job: Job, items: list, chunk: int, counts: dict) -> tuple[list[JudgeTuple], list[dict], dict]:
    """A chunk's tuples (imported, or built from the models' graded answers), review items and prompt indices."""
    cfg, lo = job.cfg, job.first_index(chunk)
    if cfg.judge.tuples:  # imported tuples: the items are the tuples themselves
        counts["tuples"] = len(items)
        return list(items), [], {t.id: lo + i for i, t in enumerate(items)}
    tuples, review, index_of = [], [], {}
    seed = shards.chunk_seed(cfg.seed, chunk)
    for b in range(0, len(items), cfg.batch_size):
        batch = items[b : b + cfg.batch_size]
        ids = job.prompt_ids(batch)
        given = (
            ()
            if job.pregenerated is None
            else (  # engine=vllm: the target's answers from vLLM
                lambda setting, at=lo + b, n=len(batch): [job.response(f"{at + i}/{setting}")[0] for i in range(n)],
            )
        )
        for i, (p, answers) in enumerate(
            zip(batch, _answers(cfg, job.pair, batch, ids, seed + b, job.pad, job.eos, *given))
        ):
            t, r = build_tuples(p, answers, counts)
            tuples += t
            review += r
            index_of.update({x.id: lo + b + i for x in t})
    return tuples, review, index_of


def summarise(out: Path, mined: bool = False) -> dict:
    """Tuple counts (summed over chunks), token label counts, and the merged tuple and review files
    (written chunk by chunk: memory does not grow with the run); with ``mined``, the ``mined.jsonl`` records
    and the mining counts too."""
    import tempfile

    counts = {k: 0 for k in COUNTS}
    pos = neg = 0
    handles = {}
    for name in ("tuples.jsonl", "review.jsonl") + (("mined.jsonl",) if mined else ()):
        fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=out)
        handles[name] = (os.fdopen(fd, "w", encoding="utf-8"), tmp)
    try:
        for path in chunk_files(out):
            files = JudgeChunkFiles(out, int(path.stem.split("-")[1]))
            for k, v in files.counts().items():
                counts[k] = counts.get(k, 0) + v
            labels = files.labels()
            pos += int((labels == 1).sum())
            neg += int((labels == 0).sum())
            handles["tuples.jsonl"][0].writelines(x + "\n" for x in files.tuples())
            handles["review.jsonl"][0].writelines(x + "\n" for x in files.review())
            if mined:
                handles["mined.jsonl"][0].writelines(x + "\n" for x in files.mined())
        for name, (fh, tmp) in handles.items():
            fh.flush()
            os.fsync(fh.fileno())
            fh.close()
            os.replace(tmp, out / name)
    finally:
        for fh, tmp in handles.values():
            fh.close()
            Path(tmp).unlink(missing_ok=True)
    tokens = pos + neg
    stats = {
        "prompts": counts["items"],
        "tuple_counts": counts,
        "labelled_tokens": tokens,
        "positive_tokens": pos,
        "negative_tokens": neg,
        "label_mean": pos / tokens if tokens else None,
        "tuples_file": "tuples.jsonl",
        "review_file": "review.jsonl",
    }
    if mined:
        stats["mining"] = mining.summary(counts, out)
        stats["mined_file"] = "mined.jsonl"
    return stats
