"""``labels=judge`` (docs/algorithms/judge.md): graded answers -> correct/wrong tuples -> token labels -> target features.

Answers to each prompt come from the loaded models (``answer_models``: target and/or draft), greedy
and ``answer_samples`` sampled ones each; ``tuples=FILE`` imports annotated tuples instead. A
grader marks the answers (:func:`specheads.grading.grade`: GSM8K-style prompts by the final number
against the reference, ARC by the chosen letter); prompts without a grader give no tuples. Every
wrong answer is localised by the arithmetic checker (:mod:`arith`: the first false step); one it
cannot localise, or one with no correct answer to pair with, goes to the review file instead of
training. A wrong answer is paired with the first correct model answer, else with the data set's
reference solution. Token labels and features (the target's last hidden state before the final
norm at each labelled answer token, fp16) are computed per tuple side and written with the
chunk's tuples and review items as :class:`specheads.dataset.JudgeChunkFiles`.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from specheads.dataset import JUDGE_COLUMNS, JudgeChunkFiles, chunk_files
from specheads.export import format_prompt
from specheads.export.shim.hidden import HiddenCapture
from specheads.export.shim.models import pad_batch
from specheads.grading import grade

from . import arith, mining, shards
from .labelling import Job, Labelled, Labeller
from .tuples import IGNORE, JudgeTuple, load_tuples, token_labels

log = logging.getLogger(__name__)
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
        base = {"question": question, "wrong": a.text, "wrong_model": a.model, "setting": a.setting, "prompt_id": prompt.id}
        span = None if prompt.source == "arc" else arith.check(a.text).error_span  # a letter has no steps
        if span is None:
            review.append({**base, "reason": "no false arithmetic step found (the grader cannot localise the error)"})
        elif pair is None:
            review.append({**base, "reason": "no correct answer to pair with"})
        else:
            counts["localised"] += 1
            tuples.append(JudgeTuple(question, pair.text, a.text, span,
                                     {"correct_model": pair.model, "wrong_model": a.model,
                                      "wrong_setting": a.setting, "annotator": "arith-checker"},
                                     f"{prompt.id}-w{i}"))
    if correct and not wrong:  # keep the positives of prompts every model got right
        tuples.append(JudgeTuple(question, correct[0].text, "", None,
                                 {"correct_model": correct[0].model, "annotator": "grader"}, f"{prompt.id}-c"))
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


def _answers(cfg, pair, batch, ids, seed: int, pad: int, eos: list[int], given=None) -> list[list[Answer]]:
    """Each model's greedy and ``answer_samples`` sampled answers per prompt (``given``: the target's, vLLM's)."""
    from specheads.export.shim import batched
    from specheads.export.shim.sampling import SamplingConfig

    out = [[] for _ in batch]
    for mi, name in enumerate(cfg.answer_models):
        model = (pair.target if name == "target" else pair.draft).model
        device = model.get_input_embeddings().weight.device
        for si in range(1 + cfg.answer_samples):
            setting = "greedy" if si == 0 else f"sample-{si}"
            sampling = SamplingConfig() if si == 0 else SamplingConfig(do_sample=True, temperature=cfg.answer_temperature)
            g = torch.Generator(device=device).manual_seed(seed * 64 + mi * 16 + si) if si else None
            for i, o in enumerate(given(setting) if given and name == "target" else
                                  batched.generate(model, ids, cfg.max_new_tokens, sampling, g, eos, pad)):
                out[i].append(Answer(pair.tokenizer.decode(o, skip_special_tokens=True), name, setting))
    return out


def _tuples(job: Job, items: list, chunk: int, counts: dict) -> tuple[list[JudgeTuple], list[dict], dict]:
    """A chunk's tuples (imported, or built from the models' graded answers), review items and prompt indices."""
    cfg, lo = job.cfg, job.first_index(chunk)
    if cfg.tuples:  # imported tuples: the items are the tuples themselves
        counts["tuples"] = len(items)
        return list(items), [], {t.id: lo + i for i, t in enumerate(items)}
    tuples, review, index_of = [], [], {}
    seed = shards.chunk_seed(cfg.seed, chunk)
    for b in range(0, len(items), cfg.batch_size):
        batch = items[b: b + cfg.batch_size]
        ids = job.prompt_ids(batch)
        given = () if job.pregenerated is None else (  # engine=vllm: the target's answers from vLLM
            lambda setting, at=lo + b, n=len(batch): [job.response(f"{at + i}/{setting}")[0] for i in range(n)],)
        for i, (p, answers) in enumerate(zip(batch, _answers(cfg, job.pair, batch, ids, seed + b, job.pad, job.eos,
                                                            *given))):
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
    stats = {"prompts": counts["items"], "tuple_counts": counts, "labelled_tokens": tokens,
             "positive_tokens": pos, "negative_tokens": neg, "label_mean": pos / tokens if tokens else None,
             "tuples_file": "tuples.jsonl", "review_file": "review.jsonl"}
    if mined:
        stats["mining"] = mining.summary(counts, out)
        stats["mined_file"] = "mined.jsonl"
    return stats


class JudgeLabeller(Labeller):
    """``labels=judge``: per tuple side, token labels 1/0/-1 and the target's features at the labelled tokens."""

    def problems(self, cfg) -> list[str]:
        out = [] if cfg.prompts or cfg.tuples else ["prompts is not set; pass prompts=<file> or tuples=<file>"]
        bad = [m for m in cfg.answer_models if m not in ("target", "draft")]
        if bad or not cfg.answer_models:
            out.append(f"answer_models={list(cfg.answer_models)}: choose from target, draft")
        if cfg.answer_samples < 0 or cfg.answer_temperature <= 0:
            out.append("answer_samples must be >= 0 and answer_temperature > 0")
        if cfg.mining not in ("arith", "swap"):
            out.append(f"mining={cfg.mining!r}: choose arith or swap")
        elif cfg.mining == "swap":
            out += mining.problems(cfg)
        return out

    def needs_draft(self, cfg) -> bool:
        return cfg.mining == "swap" or not (cfg.tuples or "draft" not in cfg.answer_models)

    def items(self, cfg):
        if not cfg.tuples:
            return super().items(cfg)
        everything = load_tuples(cfg.tuples)[cfg.offset:]
        return iter(everything[: cfg.num_prompts] if cfg.num_prompts is not None else everything)

    def label_chunk(self, job: Job, items: list, chunk: int) -> Labelled:
        cfg, pair = job.cfg, job.pair
        if cfg.mining == "swap":
            tuples, review = [], []
            found, mined, index_of, counts = mining.chunk_rows(job, items, chunk)
        else:
            counts, mined = {k: 0 for k in COUNTS}, None
            counts["items"] = len(items)
            tuples, review, index_of = _tuples(job, items, chunk, counts)
            found = tuple_rows(pair.tokenizer, tuples, lambda q: format_prompt(pair.tokenizer, q, cfg.chat_template))
        rows = []
        counts["too_long"] = 0
        for r in found:
            if job.limit and len(r["input_ids"]) > job.limit:
                counts["too_long"] += 1
                continue
            rows.append(r)
        feats, labels, per_row, bad = target_features(pair.target.model, rows, job.pad, cfg.batch_size)
        skipped = []
        for i in bad:  # a tuple side whose target states hold NaN/Inf is counted, never written
            skipped.append({"prompt_index": index_of.get(rows[i]["tuple_id"], -1), "tuple_id": rows[i]["tuple_id"],
                            "side": rows[i]["side"], "reason": "non-finite target states"})
            log.warning("tuple %s side %s skipped: non-finite target states", rows[i]["tuple_id"], rows[i]["side"])
        dropped = set(bad)
        rows = [r for i, r in enumerate(rows) if i not in dropped]
        offsets = torch.zeros(len(rows) + 1, dtype=torch.int64)
        if rows:
            offsets[1:] = torch.tensor(per_row, dtype=torch.int64).cumsum(0)
        JudgeChunkFiles(cfg.output_dir, chunk).write(feats, labels, offsets, [t.to_json() for t in tuples],
                                                     [json.dumps(x, ensure_ascii=False) for x in review], counts,
                                                     mined)
        cols = {k: [] for k in JUDGE_COLUMNS}
        for r in rows:
            cols["tuple_id"].append(r["tuple_id"])
            cols["prompt_index"].append(index_of.get(r["tuple_id"], -1))
            for key in ("side", "input_ids", "answer_start", "labels"):
                cols[key].append(r[key])
        return Labelled(cols, int(labels.numel()), skipped)

    def side_files(self, out: Path, chunk: int) -> tuple[Path, ...]:
        return JudgeChunkFiles(out, chunk).paths

    def shard_entry(self, out: Path, chunk: int) -> dict:
        from specheads.outputs import file_sha256

        feats = JudgeChunkFiles(out, chunk).features_path
        return {"features": {"file": f"features/{feats.name}", "bytes": feats.stat().st_size,
                             "sha256": file_sha256(feats)}}

    def summarise(self, cfg, out: Path, models: dict) -> tuple[dict, dict]:
        stats = summarise(out, mined=cfg.mining == "swap")
        if cfg.mining == "swap":  # the settings beside the counts
            stats["mining"] = {"method": "swap", "checker": cfg.checker, "max_mismatches": cfg.mine_max_mismatches,
                               "max_tokens": cfg.mine_max_tokens, "label_matches": cfg.mine_label_matches,
                               **stats["mining"]}
        else:
            stats["mining"] = {"method": cfg.mining}
        return stats, {"answer_models": list(cfg.answer_models), "answer_samples": cfg.answer_samples,
                       "answer_temperature": cfg.answer_temperature, "tuples_imported_from": cfg.tuples,
                       "hidden_size": models["hidden_size"], "feature": {"model": "target", "state": "pre", "layer": -1}}
