"""One-run sweep of decoding configurations over a prompt set, interleaved prompt by prompt (or block by block).

Every configuration decodes every prompt; the order of configurations rotates from one prompt (one
block of prompts, batched) to the next so that machine noise (thermal, other load) hits all of them
alike, and the ratio of two configurations' tokens/s is a side-by-side measurement. Each finished (prompt, config) row
is appended to ``rows.jsonl`` at once: a killed sweep resumes where it stopped.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

from tqdm import tqdm

from specheads.decode import assemble
from specheads.decode.api import Decoder
from specheads.errors import UserError
from specheads.evaluate.rows import expand, shorthand_rows
from specheads.outputs import read_finished_rows
from specheads.shim import COUNTS, GenerationStats

log = logging.getLogger(__name__)
# Rows of the cost-aware stop rules (stop="cost"); the prefix keeps each with its family (h: SpecDec++, c: confidence).
COST_ROWS = {"specdecpp": "h-cost", "confidence_stop": "c-cost"}
BLOCK = 4  # a batched sweep's block of prompts per configuration, in batches: rows refill three times


def same_vocab_rows(cfg) -> list[str]:
    """The configured rows that need the target's vocabulary in the draft (all but ar, draft, tli, slem)."""
    rows = [f"ks={list(cfg.ks)}"] if cfg.ks else []
    for key, value in (
        ("head", cfg.head),
        ("sprinter.head", cfg.sprinter.head),
        ("judge.head", cfg.judge.head),
        ("judge.heads", cfg.judge.heads),
    ):
        if value:
            rows.append(f"{key}=")
    lists = {"topk.ks": cfg.topk.ks, "trees": cfg.trees, "confidence.taus": cfg.confidence.taus}
    for key, value in {**lists, **{f"fsd.{d}": ts for d, ts in cfg.fsd.swept().items()}}.items():
        if value:
            rows.append(f"{key}={list(value)}")
    return rows


class _Rows(dict):
    """The sweep's decoders by row name; a second setting under a name already taken is a user error (a
    repeated threshold), never a silent overwrite. ``specs``: each row's policy and settings as the sweep gave them
    (what ``heads-export deploy=`` packages)."""

    def __init__(self, **rows):
        super().__init__(**rows)
        self.specs: dict[str, dict] = {}

    def __setitem__(self, name, decoder):
        if name in self:
            raise UserError(f"two configurations of the sweep are both named {name!r}: remove the repeated setting")
        super().__setitem__(name, decoder)


def decoder(cfg, models: assemble.Models, policy) -> Decoder:
    """A decoder of the sweep (:func:`~specheads.decode.assemble.decoder`): ``policy`` on the loaded models with
    the sweep's budget, seed and sampling settings (drafting with their EAGLE head when they hold one)."""
    return assemble.decoder(
        models,
        policy,
        max_new_tokens=cfg.max_new_tokens,
        sampling=cfg.sampling,
        seed=cfg.seed,
        chat_template=cfg.chat_template,
        fused_forward=cfg.fused_forward,
        packed=getattr(cfg, "packed", True),
        budgets=getattr(cfg, "max_new_tokens_by_source", None),
    )


def build_decoders(cfg, models: assemble.Models) -> dict[str, Decoder]:
    """A decoder per configuration of the sweep's rows (:mod:`.rows`: the per-policy fields' rows, then
    ``cfg.rows``), all on the one set of loaded models (:func:`~specheads.decode.assemble.load`), seed and sampling
    settings, every policy built by :func:`~specheads.decode.assemble.policy`; the cost-aware rows (``h-cost``,
    ``c-cost``) only with a cost table (``models.costs``).

    With an EAGLE head (``models.eagle``) the same-vocabulary rows draft with it (the cost table is then the
    head's, and ``cfg.head`` a stop head on its states); ``ar`` is the target alone, and the ``draft`` row runs
    only when the pair has a draft model."""
    out = _Rows(ar=decoder(cfg, models, "ar"))
    if models.pair.draft is not None:
        out["draft"] = decoder(cfg, models, "draft")
    for row in [*shorthand_rows(cfg, models.costs is not None), *getattr(cfg, "rows", [])]:
        for name, policy, settings in expand(row):
            out[name] = decoder(cfg, models, assemble.policy(policy, models, sampling=cfg.sampling, **settings))
            out.specs[name] = {"policy": policy, "settings": settings}
    return out


def _row(i: int, prompt, name: str, res) -> dict:
    # the policy's own counts (FSD: fuzzy_only, judge: judge_only) and trace (SPRINTER: its decisions)
    return {
        "index": i,
        "id": prompt.id,
        "config": name,
        "tokens": res.tokens,
        **res.stats.to_dict(),
        **{k: round(v, 4) for k, v in res.stats.counters.items()},
        **res.trace,
    }


def run_sweep(
    decoders: dict[str, Decoder], prompts, rows_path: Path, warmup: bool = True, batch_size: int = 1
) -> dict[str, list[dict]]:
    """Decodes every prompt with every configuration; returns rows grouped by configuration.

    ``batch_size=1``: configurations interleaved prompt by prompt. ``batch_size=B``: blocks of
    ``BLOCK * B`` prompts, every configuration decoding the block ``B`` at a time in rotating order;
    a row's ``wall_time`` is then its share (by tokens) of its configuration's time on the block, so
    that a configuration's tokens/s is its throughput, and ``latency_s`` its own time in the batch.
    """
    names = list(decoders)
    sizes = {n: batch_size if batch_size > 1 and d.batch_problem() is None else 1 for n, d in decoders.items()}
    if batch_size > 1 and any(b == 1 for b in sizes.values()):
        log.info(
            "rows %s run at batch 1 (%s)",
            [n for n, b in sizes.items() if b == 1],
            next(decoders[n].batch_problem() for n, b in sizes.items() if b == 1),
        )
    done = {(r["index"], r["config"]): r for r in read_finished_rows(rows_path)}
    todo = sum((i, n) not in done for i, _ in enumerate(prompts) for n in names)
    if done:
        log.info("resuming: %d of %d runs already done", len(done), len(done) + todo)
    if warmup and todo and prompts:  # first-call costs (allocations, kernel selection) stay out of the timings
        for name in names:
            keep = decoders[name].max_new_tokens
            decoders[name].max_new_tokens = min(keep, 4)
            try:
                dict(decoders[name].decode_many(list(enumerate(prompts[: sizes[name]])), sizes[name]))
            finally:
                decoders[name].max_new_tokens = keep
    block = 1 if batch_size == 1 else BLOCK * batch_size
    with open(rows_path, "a", encoding="utf-8") as fh, tqdm(total=todo, desc="heads-eval", unit="run") as bar:
        for b, first in enumerate(range(0, len(prompts), block)):
            items = list(enumerate(prompts))[first : first + block]
            for name in names[b % len(names) :] + names[: b % len(names)]:
                mine = [(i, p) for i, p in items if (i, name) not in done]
                if not mine:
                    continue
                start = time.perf_counter()
                results = dict(decoders[name].decode_many(mine, sizes[name], names=[f"prompt {p.id}" for _, p in mine]))
                elapsed = time.perf_counter() - start
                rows = {i: _row(i, p, name, results[i]) for i, p in mine}
                if sizes[name] > 1:
                    tokens = sum(len(r["tokens"]) for r in rows.values()) or 1
                    for r in rows.values():
                        r["latency_s"] = r["wall_time"]
                        r["wall_time"] = elapsed * max(len(r["tokens"]), 0) / tokens
                        r["block"] = b  # the timing unit its intervals resample
                for i, _ in mine:
                    fh.write(json.dumps(rows[i]) + "\n")
                    done[(i, name)] = rows[i]
                fh.flush()
                bar.update(len(mine))
    return {n: [done[(i, n)] for i in range(len(prompts))] for n in names}


def total(rows: list[dict]) -> GenerationStats:
    """Summed stats of a configuration's rows."""
    return GenerationStats.total(
        [
            GenerationStats(**{k: r.get(k, 0) for k in COUNTS}, target_pass_sizes=r.get("target_pass_sizes") or {})
            for r in rows
        ]
    )
