"""One-run sweep of decoding configurations over a prompt set, interleaved prompt by prompt (or block by block).

Every configuration decodes every prompt; the order of configurations rotates from one prompt (one
block of prompts, batched) to the next so that machine noise (thermal, other load) hits all of them
alike, and the ratio of two configurations' tokens/s is a side-by-side measurement. Each finished (prompt, config) row
is appended to ``rows.jsonl`` at once: a killed sweep resumes where it stopped.
"""

from __future__ import annotations

import json
import logging
import re
import time
from pathlib import Path

from tqdm import tqdm

from specheads.errors import UserError
from specheads.export.api import Decoder, make_policy
from specheads.export.shim.divergence import DIVERGENCES
from specheads.export.shim.stats import COUNTS, GenerationStats
from specheads.outputs import read_finished_rows

log = logging.getLogger(__name__)
# Rows of the cost-aware stop rules (stop="cost"); the prefix keeps each with its family (h: SpecDec++, c: confidence).
COST_ROWS = {"specdecpp": "h-cost", "confidence_stop": "c-cost"}
BLOCK = 4  # a batched sweep's block of prompts per configuration, in batches: rows refill three times


def num(x: float) -> str:
    """A setting as it appears in a row name: ``:g`` for the usual values (``0.99``, ``1``), but every
    significant digit up to 12, so that ``0.9999999`` is not written ``1`` (two settings, one name)."""
    return f"{x:.12g}"


def config_names(ks: list[int], thresholds: list[float], with_head: bool, etas: list[float] = (),
                 with_verifier: bool = False) -> list[str]:
    """Names of the sweep's configurations: baselines, fixed K, SpecDec++ thresholds, SPRINTER etas."""
    return (["ar", "draft"] + [f"k{k}" for k in ks] + ([f"h{num(h)}" for h in thresholds] if with_head else [])
            + ([f"s{num(e)}" for e in etas] if with_verifier else []))


def hetero_row(method: str, k: int) -> str:
    """Row name of a heterogeneous-vocabulary method (``v-slem-k2``)."""
    return f"v-{method}-k{k}"


def same_vocab_rows(cfg) -> list[str]:
    """The configured rows that need the target's vocabulary in the draft (all but ar, draft, tli, slem)."""
    rows = [f"ks={list(cfg.ks)}"] if cfg.ks else []
    for key in ("head", "verifier", "judge", "judges"):
        if getattr(cfg, key, None):
            rows.append(f"{key}=")
    for key in ("topk", "trees", "confidence", *(f"fsd_{d}" for d in DIVERGENCES)):
        if getattr(cfg, key, None):
            rows.append(f"{key}={list(getattr(cfg, key))}")
    return rows


def parse_tree(spec: str) -> tuple[int, int, int, str]:
    """``DEPTHxWIDTHxNODES`` (``4x3x8``) -> ``(4, 3, 8, "threshold")``; with ``-cost`` (``5x3x12-cost``) the
    tree is sized per round by the cost table (``stop="cost"``: at most that depth and size); UserError for
    anything else."""
    m = re.fullmatch(r"(\d+)x(\d+)x(\d+)(-cost)?", str(spec))
    if not m or min(map(int, m.groups()[:3])) < 1:
        raise UserError(f"trees: {spec!r} is not DEPTHxWIDTHxNODES (each >= 1), optionally with -cost (e.g. 4x3x8, "
                        "5x3x12-cost)")
    depth, width, nodes = map(int, m.groups()[:3])
    return depth, width, nodes, "cost" if m[4] else "threshold"


class _Rows(dict):
    """The sweep's decoders by row name; a second setting under a name already taken is a user error (a
    repeated threshold), never a silent overwrite."""

    def __setitem__(self, name, decoder):
        if name in self:
            raise UserError(f"two configurations of the sweep are both named {name!r}: remove the repeated setting")
        super().__setitem__(name, decoder)


def decoder(cfg, pair, policy, eagle=None) -> Decoder:
    """A decoder of the sweep: ``policy`` on the loaded pair with the sweep's budget, seed and sampling settings
    (drafting with the EAGLE head ``eagle`` when given)."""
    d = Decoder(pair, policy, cfg.max_new_tokens, 1, cfg.sampling, cfg.seed, cfg.chat_template, cfg.fused_forward,
                eagle=eagle)
    d.budgets = dict(getattr(cfg, "max_new_tokens_by_source", {}) or {})
    return d


def build_decoders(cfg, pair, costs=None, eagle=None) -> dict[str, Decoder]:
    """A decoder per configuration, all on the one loaded pair, seed and sampling settings; with a cost
    table (``costs``) and ``cfg.cost_stop``, the cost-aware stop rules too (rows ``h-cost``, ``c-cost``).

    ``eagle`` (a loaded EAGLE head, ``load_eagle``): the same-vocabulary rows draft with it (the cost table is
    then the head's, ``pair_costs(..., eagle=)``, and ``cfg.head`` a stop head on its states); ``ar`` is the
    target alone, and the ``draft`` row runs only when the pair has a draft model."""
    def dec(policy, own_drafter: bool = True):
        return decoder(cfg, pair, policy, eagle if own_drafter else None)

    out = _Rows(ar=dec("ar", False))
    if pair.draft is not None:
        out["draft"] = dec("draft", False)
    for k in cfg.ks:
        out[f"k{k}"] = dec(make_policy("sd", pair, k=k))
    if cfg.head:
        for h in cfg.thresholds:
            out[f"h{num(h)}"] = dec(make_policy("specdecpp", pair, head=cfg.head, threshold=h, k_min=cfg.k_min,
                                             k_max=cfg.k_max, sampling=cfg.sampling, eagle=eagle))
        if costs is not None and cfg.cost_stop:
            out[COST_ROWS["specdecpp"]] = dec(make_policy("specdecpp", pair, head=cfg.head, k_min=cfg.k_min,
                                                          k_max=cfg.k_max, sampling=cfg.sampling, stop="cost",
                                                          costs=costs, eagle=eagle))
    for spec in getattr(cfg, "trees", []):
        depth, width, nodes, stop = parse_tree(spec)
        if stop == "cost" and costs is None:
            raise UserError(f"trees: {spec} needs the cost table")
        out[f"tree-{spec}"] = dec(make_policy("tree", pair, k=depth, tree_width=width, tree_nodes=nodes, stop=stop,
                                              costs=costs))
    for top_k in getattr(cfg, "topk", []):
        out[f"t{top_k}"] = dec(make_policy("topk_verify", pair, k=cfg.topk_k, top_k=top_k))
    for div in DIVERGENCES:
        for t in getattr(cfg, f"fsd_{div}", []):
            out[f"fsd-{div}-{num(t)}"] = dec(make_policy("fsd", pair, k=cfg.fsd_k, threshold=t, divergence=div,
                                                      fsd_top_k=cfg.fsd_top_k, fsd_rule=cfg.fsd_rule,
                                                      fsd_dist=cfg.fsd_dist))
    for tau in getattr(cfg, "confidence", []):
        out[f"c{num(tau)}"] = dec(make_policy("confidence_stop", pair, threshold=tau, k_max=cfg.confidence_k_max))
    if getattr(cfg, "confidence", None) and costs is not None and cfg.cost_stop:
        out[COST_ROWS["confidence_stop"]] = dec(make_policy("confidence_stop", pair, k_max=cfg.confidence_k_max,
                                                            stop="cost", costs=costs))
    judges = ({"": cfg.judge} if getattr(cfg, "judge", None) else {}) | dict(getattr(cfg, "judges", {}) or {})
    for name, head in judges.items():
        for delta in (getattr(cfg, "judge_deltas", {}) or {}).get(name, cfg.deltas):
            out[f"j-{name}-{num(delta)}" if name else f"j{num(delta)}"] = dec(make_policy(
                "judge", pair, k=cfg.judge_k, head=head, threshold=delta, sampling=cfg.sampling))
    for method in getattr(cfg, "hetero", []):
        out[hetero_row(method, cfg.hetero_k)] = dec(make_policy(method, pair, k=cfg.hetero_k))
    if getattr(cfg, "verifier", None):
        for eta in cfg.etas:
            out[f"s{num(eta)}"] = dec(make_policy("sprinter", pair, head=cfg.verifier, threshold=eta,
                                               sampling=cfg.sampling, max_run=cfg.max_run))
    return out


def _row(i: int, prompt, name: str, res) -> dict:
    # the policy's own counts (FSD: fuzzy_only, judge: judge_only) and trace (SPRINTER: its decisions)
    return {"index": i, "id": prompt.id, "config": name, "tokens": res.tokens, **res.stats.to_dict(),
            **{k: round(v, 4) for k, v in res.stats.counters.items()}, **res.trace}


def run_sweep(decoders: dict[str, Decoder], prompts, rows_path: Path, warmup: bool = True,
              batch_size: int = 1) -> dict[str, list[dict]]:
    """Decodes every prompt with every configuration; returns rows grouped by configuration.

    ``batch_size=1``: configurations interleaved prompt by prompt. ``batch_size=B``: blocks of
    ``BLOCK * B`` prompts, every configuration decoding the block ``B`` at a time in rotating order;
    a row's ``wall_time`` is then its share (by tokens) of its configuration's time on the block, so
    that a configuration's tokens/s is its throughput, and ``latency_s`` its own time in the batch.
    """
    names = list(decoders)
    sizes = {n: batch_size if batch_size > 1 and d.batch_problem() is None else 1 for n, d in decoders.items()}
    if batch_size > 1 and any(b == 1 for b in sizes.values()):
        log.info("rows %s run at batch 1 (%s)", [n for n, b in sizes.items() if b == 1],
                 next(decoders[n].batch_problem() for n, b in sizes.items() if b == 1))
    done = {(r["index"], r["config"]): r for r in read_finished_rows(rows_path)}
    todo = sum((i, n) not in done for i, _ in enumerate(prompts) for n in names)
    if done:
        log.info("resuming: %d of %d runs already done", len(done), len(done) + todo)
    if warmup and todo and prompts:  # first-call costs (allocations, kernel selection) stay out of the timings
        for name in names:
            keep = decoders[name].max_new_tokens
            decoders[name].max_new_tokens = min(keep, 4)
            try:
                dict(decoders[name].decode_many(list(enumerate(prompts[:sizes[name]])), sizes[name]))
            finally:
                decoders[name].max_new_tokens = keep
    block = 1 if batch_size == 1 else BLOCK * batch_size
    with open(rows_path, "a", encoding="utf-8") as fh, tqdm(total=todo, desc="heads-eval", unit="run") as bar:
        for b, first in enumerate(range(0, len(prompts), block)):
            items = list(enumerate(prompts))[first: first + block]
            for name in names[b % len(names):] + names[: b % len(names)]:
                mine = [(i, p) for i, p in items if (i, name) not in done]
                if not mine:
                    continue
                start = time.perf_counter()
                results = dict(decoders[name].decode_many(mine, sizes[name],
                                                          names=[f"prompt {p.id}" for _, p in mine]))
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
    return GenerationStats.total([GenerationStats(**{k: r.get(k, 0) for k in COUNTS},
                                                  target_pass_sizes=r.get("target_pass_sizes") or {}) for r in rows])
