"""``labels=sprinter``: SPRINTER ratio-threshold labels (docs/algorithms/sprinter.md).

A labelled example is a prefix ``s[:t]`` and a draft token ``x ~ q(.|s[:t])``; it is acceptable
at threshold ``lambda`` when ``q(x) <= lambda * p(x)`` (:mod:`specheads.runtime.ratio`, which also says
which distributions are compared). The raw ``q(x)`` and ``p(x)`` are stored, with the ratio
``q(x)/p(x)`` (``inf`` where ``p(x) = 0``) and ``TV(p, q)`` at the prefix, so one dataset serves
every ``lambda`` (columns: :data:`specheads.dataset.SPRINTER_COLUMNS`).

Prefixes come in four categories, as the paper trains on (every prompt gets one, round robin by
its index; every chunk keeps the same number of prefixes of each category, chosen at random):

* ``prompt``: truncations of the original prompt, up to and including the whole prompt;
* ``draft``: the prompt + the draft's own continuation;
* ``target``: the prompt + the target's continuation;
* ``mixed``: the prompt + the target's continuation with each token replaced, with probability
  ``mix_prob``, by the draft's token at that position (tokens from both models).
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

import torch

from specheads.datagen import shards
from specheads.datagen.labelling import Job, Labelled, Labeller, skip_record
from specheads.datagen.vllm_states import target_logits as vllm_target_logits
from specheads.dataset import SPRINTER_COLUMNS, chunk_files
from specheads.runtime.ratio import label_distributions
from specheads.runtime.states import logits_at
from specheads.shim import SamplingConfig, batch_generate, probs_from_logits, sample_finite, uniform, usable_logits

CATEGORIES = ("prompt", "draft", "target", "mixed")


def category_of(prompt_index: int) -> str:
    """The prefix category of a prompt (round robin over :data:`CATEGORIES`)."""
    return CATEGORIES[prompt_index % len(CATEGORIES)]


def build_contexts(
    target,
    draft,
    prompts: list[list[int]],
    categories: list[str],
    max_new_tokens: int,
    sampling: SamplingConfig,
    seed: int,
    pad: int,
    eos: list[int],
    mix_prob: float,
    generator: torch.Generator | None,
    given: dict[int, list[int]] | None = None,
) -> list[tuple[list[int], list[int]]]:
    """Per prompt, the context sequence ``s`` and its candidate prefix lengths ``t``.

    ``prompt``: ``s`` is the prompt and ``t`` its last ``max_new_tokens`` lengths (the whole
    prompt included). The other categories append a continuation ``c`` (``max_new_tokens`` at
    most, ended by EOS) and take ``t = len(prompt) + i`` for each ``i < len(c)``. ``given``: the
    target's continuations by row (``engine=vllm``), instead of generating them.
    """
    device = target.get_input_embeddings().weight.device
    want = {c: [i for i, cat in enumerate(categories) if cat == c] for c in CATEGORIES}
    conts: dict[int, list[int]] = {}
    by_target = want["target"] + want["mixed"]
    if given is not None:
        conts.update({i: given[i] for i in by_target})
    elif by_target:
        g = torch.Generator(device=device).manual_seed(seed) if sampling.do_sample else None
        out = batch_generate(target, [prompts[i] for i in by_target], max_new_tokens, sampling, g, eos, pad)
        conts.update(zip(by_target, out))
    if want["draft"]:
        d_dev = draft.get_input_embeddings().weight.device
        g = torch.Generator(device=d_dev).manual_seed(seed + 1) if sampling.do_sample else None
        out = batch_generate(draft, [prompts[i] for i in want["draft"]], max_new_tokens, sampling, g, eos, pad)
        conts.update(zip(want["draft"], out))
    mixed = [i for i in want["mixed"] if conts[i]]
    if mixed:  # the draft's token at each position of the target's continuation, swapped in at random
        seqs = [prompts[i] + conts[i] for i in mixed]
        pos = [list(range(len(prompts[i]), len(prompts[i]) + len(conts[i]))) for i in mixed]
        for i, q_logits in zip(mixed, logits_at(draft, seqs, pos, pad)):
            if sampling.do_sample:
                y = sample_finite(probs_from_logits(q_logits, sampling), generator).tolist()
            else:
                y = q_logits.argmax(-1).tolist()
            swap = (uniform(len(y), torch.device("cpu"), generator) < mix_prob).tolist()
            conts[i] = [yi if s else xi for xi, yi, s in zip(conts[i], y, swap)]
    contexts = []
    for i, (ids, cat) in enumerate(zip(prompts, categories)):
        if cat == "prompt":
            contexts.append((list(ids), list(range(max(1, len(ids) - max_new_tokens + 1), len(ids) + 1))))
        else:
            c = conts[i]
            contexts.append((list(ids) + c, list(range(len(ids), len(ids) + len(c)))))
    return contexts


def balance(
    contexts: list[tuple[list[int], list[int]]], categories: list[str], generator: torch.Generator
) -> list[list[int]]:
    """Keeps the same number of prefixes of each category present (a seeded random choice).

    Returns the kept prefix lengths per row, in increasing order.
    """
    pool: dict[str, list[tuple[int, int]]] = {}
    for row, ((_, positions), cat) in enumerate(zip(contexts, categories)):
        pool.setdefault(cat, []).extend((row, t) for t in positions)
    n = min(len(v) for v in pool.values()) if pool else 0
    kept: list[list[int]] = [[] for _ in contexts]
    for cat in sorted(pool):
        items = pool[cat]
        order = torch.randperm(len(items), generator=generator)[:n].tolist()
        for j in sorted(order):
            row, t = items[j]
            kept[row].append(t)
    return [sorted(k) for k in kept]


def label_prompts(
    target,
    draft,
    prompts: list[list[int]],
    indices: list[int],
    max_new_tokens: int,
    sampling: SamplingConfig,
    seed: int,
    pad: int,
    eos: list[int],
    mix_prob: float,
    generator: torch.Generator,
    given: dict[int, list[int]] | None = None,
    target_logits=None,
) -> list[dict]:
    """Labels one group of prompts: contexts, balanced prefixes, draws and ratios.

    Returns one dict per prompt with ``category``, ``input_ids`` (the context ``s``),
    ``positions`` (kept prefix lengths) and the columns of :func:`label_distributions` as lists.
    ``target_logits(seqs, positions)``: the target's logits as :func:`logits_at` gives them, from elsewhere
    (``engine=vllm``: vLLM's states); None: a pass of ``target``.
    """
    categories = [category_of(i) for i in indices]
    contexts = build_contexts(
        target, draft, prompts, categories, max_new_tokens, sampling, seed, pad, eos, mix_prob, generator, given
    )
    kept = balance(contexts, categories, torch.Generator().manual_seed(seed))
    rows = [{"category": c, "input_ids": s, "positions": k} for c, (s, _), k in zip(categories, contexts, kept)]
    live = [r for r in rows if r["positions"]]
    for r in rows:
        for key in ("draft_token", "q_token", "p_token", "ratio", "tv"):
            r[key] = []
    if not live:
        return rows
    seqs, pos = [r["input_ids"] for r in live], [r["positions"] for r in live]
    p_logits = torch.cat(logits_at(target, seqs, pos, pad) if target_logits is None else target_logits(seqs, pos))
    q_logits = torch.cat(logits_at(draft, seqs, pos, pad)).to(p_logits.device)
    sizes = [len(p) for p in pos]
    finite = (torch.isfinite(p_logits).all(-1) & usable_logits(q_logits)).cpu()  # a pruned draft's -inf is fine
    ok = [bool(f.all()) for f in finite.split(sizes)]
    if not all(ok):  # a prompt with NaN/Inf logits is left out (the caller counts it)
        for r, good in zip(live, ok):
            r["nonfinite"] = not good
        keep = finite.new_tensor(ok).repeat_interleave(torch.tensor(sizes)).to(p_logits.device)
        p_logits, q_logits = p_logits[keep], q_logits[keep]
        live = [r for r, good in zip(live, ok) if good]
        if not live:
            return rows
    vocab = min(p_logits.shape[-1], q_logits.shape[-1])
    out = label_distributions(p_logits[:, :vocab], q_logits[:, :vocab], sampling, generator)
    sizes = [len(r["positions"]) for r in live]
    for key, val in out.items():
        for r, part in zip(live, val.cpu().split(sizes)):
            r[key] = part.tolist()
    return rows


def summarise(out: Path, lambdas: list[float]) -> dict:
    """Prefix counts and shares per category, and the label mean at each lambda."""
    import pyarrow.parquet as pq

    prompts = tokens = 0
    per_cat = {c: 0 for c in CATEGORIES}
    prompts_per_cat = {c: 0 for c in CATEGORIES}
    accept = {lam: 0 for lam in lambdas}
    for path in chunk_files(out):
        table = pq.read_table(path, columns=["category", "q_token", "p_token"])
        for cat, qs, ps in zip(*(table.column(c).to_pylist() for c in ("category", "q_token", "p_token"))):
            prompts += 1
            prompts_per_cat[cat] += 1
            per_cat[cat] += len(qs)
            tokens += len(qs)
            for lam in lambdas:
                accept[lam] += sum(q <= lam * p for q, p in zip(qs, ps))
    return {
        "prompts": prompts,
        "labelled_tokens": tokens,
        "prefixes_per_category": per_cat,
        "category_shares": {c: (n / tokens if tokens else None) for c, n in per_cat.items()},
        "prompts_per_category": prompts_per_cat,
        "label_mean_by_lambda": {f"{lam:g}": (accept[lam] / tokens if tokens else None) for lam in lambdas},
        "label_mean": accept[lambdas[0]] / tokens if tokens and lambdas else None,
    }


class SprinterLabeller(Labeller):
    """``labels=sprinter``: draft tokens at prefixes of four categories, with ``q(x)``, ``p(x)``, ratio and TV."""

    def target_under_vllm(self, cfg) -> str:
        return "output_layer"  # p: vLLM's last-layer states through the target's final norm and output layer

    def problems(self, cfg) -> list[str]:
        out = super().problems(cfg)
        if cfg.chunk_size % len(CATEGORIES):
            out.append(
                f"chunk_size={cfg.chunk_size}: labels=sprinter needs a multiple of {len(CATEGORIES)} "
                "(every chunk holds the four prefix categories equally)"
            )
        if any(lam <= 0 for lam in cfg.sprinter.lambdas):
            out.append(f"sprinter.lambdas={list(cfg.sprinter.lambdas)}: every lambda must be > 0")
        if not 0 <= cfg.sprinter.mix_prob <= 1:
            out.append(f"sprinter.mix_prob={cfg.sprinter.mix_prob} must be in [0, 1]")
        return out

    def label_chunk(self, job: Job, items: list, chunk: int) -> Labelled:
        cfg, pair = job.cfg, job.pair
        seed = shards.chunk_seed(cfg.seed, chunk)
        gen = torch.Generator(device=pair.target.output_device).manual_seed(seed)  # where p and q meet
        cols: dict[str, list] = {k: [] for k in SPRINTER_COLUMNS}
        labelled, skipped = 0, []
        # Batches hold whole groups of four consecutive prompts (one per category) so that each
        # batch, and with it the chunk, is balanced over the categories.
        step = max(len(CATEGORIES), cfg.batch_size - cfg.batch_size % len(CATEGORIES))
        for b in range(0, len(items), step):
            batch = items[b : b + step]
            indices = [job.first_index(chunk) + b + i for i in range(len(batch))]
            given = (
                None
                if job.pregenerated is None
                else {  # engine=vllm: the target's continuations
                    i: job.response(str(x))[0] for i, x in enumerate(indices) if category_of(x) in ("target", "mixed")
                }
            )
            rows = label_prompts(
                pair.target.model,
                pair.draft.model,
                job.prompt_ids(batch),
                indices,
                cfg.max_new_tokens,
                cfg.sampling,
                seed + b,
                job.pad,
                job.eos,
                cfg.sprinter.mix_prob,
                gen,
                given,
                None if job.states is None else partial(vllm_target_logits, job),  # engine=vllm: vLLM's states
            )
            for p, index, row in zip(batch, indices, rows):
                if row.get("nonfinite"):
                    skipped.append(skip_record(p, index, "non-finite logits"))
                    continue
                cols["prompt_id"].append(p.id)
                cols["prompt_index"].append(index)
                for key in SPRINTER_COLUMNS[2:]:
                    cols[key].append(row[key])
                labelled += len(row["positions"])
        return Labelled(cols, labelled, skipped)

    def summarise(self, cfg, out: Path, models: dict) -> tuple[dict, dict]:
        return summarise(out, list(cfg.sprinter.lambdas)), {
            "lambdas": list(cfg.sprinter.lambdas),
            "mix_prob": cfg.sprinter.mix_prob,
        }
