"""``labels=judge`` (docs/algorithms/judge.md): graded answers -> correct/wrong tuples -> token labels -> target
features.

Answers to each prompt come from the loaded models (``answer_models``: target and/or draft), greedy
and ``answer_samples`` sampled ones each; ``judge.tuples=FILE`` imports annotated tuples instead. A
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
from pathlib import Path

import torch

from specheads.datagen import mining
from specheads.datagen.judge_features import Features, gather_features, verdicts_from
from specheads.datagen.judge_tuples import COUNTS, _tuples, summarise, tuple_rows
from specheads.datagen.labelling import Job, Labelled, Labeller
from specheads.datagen.tuples import load_tuples
from specheads.datagen.vllm_states import judge_features
from specheads.dataset import JUDGE_COLUMNS, JudgeChunkFiles
from specheads.decode.api import format_prompt
from specheads.heads.judge_head import JUDGE_SIGNALS
from specheads.shim import HiddenCapture, pad_batch

log = logging.getLogger(__name__)


@torch.inference_mode()
def target_features(model, rows: list[dict], pad: int, batch_size: int) -> Features:
    """The target's pre-final-norm states at every labelled answer token (label != IGNORE), fp16, and its
    verdict on each (:data:`~specheads.heads.judge_head.JUDGE_SIGNALS`, from the logits one position earlier).

    A row whose states hold a NaN or Inf anywhere in the sequence is left out.

    Returns features ``[M, d]``, labels ``[M]``, the number of tokens per kept row, the indices of the rows
    left out and the signals ``[M, 4]``.
    """
    device = model.get_input_embeddings().weight.device
    parts: list[Features] = []
    with HiddenCapture(model) as cap:
        for i in range(0, len(rows), batch_size):
            batch = rows[i : i + batch_size]
            ids, mask = pad_batch([r["input_ids"] for r in batch], pad, device)
            model(input_ids=ids, attention_mask=mask, logits_to_keep=1)
            pre, post = cap.pre, cap.post
            finite = (torch.isfinite(pre).all(-1) | ~mask.bool().to(pre.device)).all(-1).tolist()
            verdicts = verdicts_from(model, lambda b, post=post: post[b])
            got = gather_features(batch, lambda b, pre=pre: pre[b] if finite[b] else None, verdicts)
            parts.append((got[0], got[1], got[2], [i + b for b in got[3]], got[4]))
    d = model.config.hidden_size
    feats = [p[0] for p in parts if p[0].numel()]
    return (
        torch.cat(feats) if feats else torch.empty(0, d, dtype=torch.float16),
        torch.cat([p[1] for p in parts]) if parts else torch.empty(0),
        [c for p in parts for c in p[2]],
        [b for p in parts for b in p[3]],
        torch.cat([p[4] for p in parts]) if parts else torch.empty(0, len(JUDGE_SIGNALS)),
    )


class JudgeLabeller(Labeller):
    """``labels=judge``: per tuple side, token labels 1/0/-1 and the target's features at the labelled tokens."""

    def problems(self, cfg) -> list[str]:
        out = (
            []
            if cfg.prompts or cfg.judge.tuples
            else ["prompts is not set; pass prompts=<file> or judge.tuples=<file>"]
        )
        bad = [m for m in cfg.judge.answer_models if m not in ("target", "draft")]
        if bad or not cfg.judge.answer_models:
            out.append(f"judge.answer_models={list(cfg.judge.answer_models)}: choose from target, draft")
        if cfg.judge.answer_samples < 0 or cfg.judge.answer_temperature <= 0:
            out.append("answer_samples must be >= 0 and answer_temperature > 0")
        if cfg.judge.mining not in ("arith", "swap"):
            out.append(f"judge.mining={cfg.judge.mining!r}: choose arith or swap")
        elif cfg.judge.mining == "swap":
            out += mining.problems(cfg)
        return out

    def needs_draft(self, cfg) -> bool:
        if cfg.judge.mining == "swap":
            return not cfg.judge.mine_eagle  # the EAGLE head drafts on the target's states
        return not (cfg.judge.tuples or "draft" not in cfg.judge.answer_models)

    def check_models(self, job: Job) -> None:
        if job.cfg.judge.mining == "swap" and job.cfg.judge.mine_eagle:
            job.eagle_head(job.cfg.judge.mine_eagle)

    def target_under_vllm(self, cfg) -> str:
        return "output_layer"  # answers, swaps and states from vLLM; its verdict: the final norm and output layer

    def items(self, cfg):
        if not cfg.judge.tuples:
            return super().items(cfg)
        everything = load_tuples(cfg.judge.tuples)[cfg.offset :]
        return iter(everything[: cfg.num_prompts] if cfg.num_prompts is not None else everything)

    def label_chunk(self, job: Job, items: list, chunk: int) -> Labelled:
        cfg, pair = job.cfg, job.pair
        if cfg.judge.mining == "swap":
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
        feats, labels, per_row, bad, signals = (
            judge_features(job, rows)  # engine=vllm: the target's states from vLLM
            if job.states is not None
            else target_features(pair.target.model, rows, job.pad, cfg.batch_size)
        )
        skipped = []
        for i in bad:  # a tuple side whose target states hold NaN/Inf is counted, never written
            skipped.append(
                {
                    "prompt_index": index_of.get(rows[i]["tuple_id"], -1),
                    "tuple_id": rows[i]["tuple_id"],
                    "side": rows[i]["side"],
                    "reason": "non-finite target states",
                }
            )
            log.warning("tuple %s side %s skipped: non-finite target states", rows[i]["tuple_id"], rows[i]["side"])
        dropped = set(bad)
        rows = [r for i, r in enumerate(rows) if i not in dropped]
        offsets = torch.zeros(len(rows) + 1, dtype=torch.int64)
        if rows:
            offsets[1:] = torch.tensor(per_row, dtype=torch.int64).cumsum(0)
        if not feats.numel():
            feats = torch.empty(0, pair.target.hidden_size, dtype=torch.float16)
        JudgeChunkFiles(cfg.output_dir, chunk).write(
            feats,
            labels,
            offsets,
            [t.to_json() for t in tuples],
            [json.dumps(x, ensure_ascii=False) for x in review],
            counts,
            mined,
            signals,
        )
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
        return {
            "features": {"file": f"features/{feats.name}", "bytes": feats.stat().st_size, "sha256": file_sha256(feats)}
        }

    def summarise(self, cfg, out: Path, models: dict) -> tuple[dict, dict]:
        stats = summarise(out, mined=cfg.judge.mining == "swap")
        if cfg.judge.mining == "swap":  # the settings beside the counts
            stats["mining"] = {
                "method": "swap",
                "checker": cfg.judge.checker,
                "max_mismatches": cfg.judge.mine_max_mismatches,
                "max_tokens": cfg.judge.mine_max_tokens,
                "label_matches": cfg.judge.mine_label_matches,
                "drafter": f"eagle:{Path(cfg.judge.mine_eagle).name}" if cfg.judge.mine_eagle else "draft",
                **stats["mining"],
            }
        else:
            stats["mining"] = {"method": cfg.judge.mining}
        return stats, {
            "answer_models": list(cfg.judge.answer_models),
            "answer_samples": cfg.judge.answer_samples,
            "answer_temperature": cfg.judge.answer_temperature,
            "tuples_imported_from": cfg.judge.tuples,
            "hidden_size": models["hidden_size"],
            "feature": {"model": "target", "state": "pre", "layer": -1, "signals": list(JUDGE_SIGNALS)},
        }
