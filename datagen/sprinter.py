"""SPRINTER ratio-threshold labels (ALGORITHMS.md section 2).

A labelled example is a prefix ``s[:t]`` and a draft token ``x ~ q(.|s[:t])``; it is acceptable
at threshold ``lambda`` when ``q(x) <= lambda * p(x)`` (no division: ``p(x)`` may be 0). The raw
``q(x)`` and ``p(x)`` are stored, with the ratio ``q(x)/p(x)`` (``inf`` where ``p(x) = 0``) and
``TV(p, q)`` at the prefix, so one dataset serves every ``lambda``.

Prefixes come in four categories, as the paper trains on (every prompt gets one, round robin by
its index; every chunk keeps the same number of prefixes of each category, chosen at random):

* ``prompt``: truncations of the original prompt, up to and including the whole prompt;
* ``draft``: the prompt + the draft's own continuation;
* ``target``: the prompt + the target's continuation;
* ``mixed``: the prompt + the target's continuation with each token replaced, with probability
  ``mix_prob``, by the draft's token at that position (tokens from both models).

Which distributions the label compares: the deployment's warped ``p`` and ``q`` when sampling.
Greedy drafts (the official code's setting) take ``x = argmax q`` and compare the raw (T = 1)
probabilities: the warped ones are one-hot and would make every ``lambda`` the same label.
"""

from __future__ import annotations

import torch

from specheads.export.shim import batched
from specheads.export.shim.models import pad_batch
from specheads.export.shim.sampling import SamplingConfig, probs_from_logits, sample, sample_finite, usable_logits

CATEGORIES = ("prompt", "draft", "target", "mixed")


def category_of(prompt_index: int) -> str:
    """The prefix category of a prompt (round robin over :data:`CATEGORIES`)."""
    return CATEGORIES[prompt_index % len(CATEGORIES)]


def ratio_label(q_token: torch.Tensor, p_token: torch.Tensor, lam: float) -> torch.Tensor:
    """``q(x) <= lambda * p(x)`` as a float tensor of 0/1."""
    return (q_token <= lam * p_token).float()


def label_distributions(p_logits: torch.Tensor, q_logits: torch.Tensor, sampling: SamplingConfig,
                        generator: torch.Generator | None, x: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Draws ``x`` from the draft (or takes the given ``x``) and measures it against the target, at every row.

    Args:
        p_logits, q_logits: ``[N, V]`` target and draft logits at the same prefixes.
        sampling: the deployment settings (see the module docstring for greedy).
        generator: RNG for the draws.
        x: ``[N]`` tokens to measure instead of drawing them (e.g. the ones a decoder drew).

    Returns:
        ``draft_token`` ``[N]``, ``q_token``/``p_token`` ``[N]`` (the probability of ``x`` under
        each model), ``ratio`` ``[N]`` (``q/p``, ``inf`` where ``p = 0``) and ``tv`` ``[N]``.
    """
    if sampling.do_sample:
        p, q = probs_from_logits(p_logits, sampling), probs_from_logits(q_logits, sampling)
        x = sample(q, generator) if x is None else x
    else:
        p, q = p_logits.float().softmax(-1), q_logits.float().softmax(-1)
        x = q_logits.argmax(-1) if x is None else x
    qx = q.gather(-1, x[:, None]).squeeze(-1)
    px = p.gather(-1, x[:, None]).squeeze(-1)
    ratio = torch.where(px > 0, qx / px.clamp_min(1e-38), torch.full_like(qx, float("inf")))
    tv = 0.5 * (p - q).abs().sum(-1)
    return {"draft_token": x, "q_token": qx, "p_token": px, "ratio": ratio, "tv": tv}


@torch.inference_mode()
def logits_at(model, seqs: list[list[int]], positions: list[list[int]], pad: int) -> list[torch.Tensor]:
    """Per row, the model's next-token logits ``[len(positions[b]), V]`` after each prefix ``seqs[b][:t]``.

    One right-padded forward; the output layer runs only at the requested positions when the
    model exposes its body (``model.model``), else the full logits are sliced.
    """
    device = model.get_input_embeddings().weight.device
    ids, mask = pad_batch(seqs, pad, device)
    rows = torch.cat([torch.full((len(p),), b, dtype=torch.long) for b, p in enumerate(positions)]).to(device)
    cols = torch.cat([torch.tensor(p, dtype=torch.long) - 1 for p in positions]).to(device)
    body = getattr(model, "model", None)
    if body is not None and callable(body):
        hid = body(input_ids=ids, attention_mask=mask).last_hidden_state
        logits = model.get_output_embeddings()(hid[rows, cols])
    else:
        logits = model(input_ids=ids, attention_mask=mask).logits[rows, cols]
    return list(logits.split([len(p) for p in positions]))


def build_contexts(target, draft, prompts: list[list[int]], categories: list[str], max_new_tokens: int,
                   sampling: SamplingConfig, seed: int, pad: int, eos: list[int], mix_prob: float,
                   generator: torch.Generator | None) -> list[tuple[list[int], list[int]]]:
    """Per prompt, the context sequence ``s`` and its candidate prefix lengths ``t``.

    ``prompt``: ``s`` is the prompt and ``t`` its last ``max_new_tokens`` lengths (the whole
    prompt included). The other categories append a continuation ``c`` (``max_new_tokens`` at
    most, ended by EOS) and take ``t = len(prompt) + i`` for each ``i < len(c)``.
    """
    device = target.get_input_embeddings().weight.device
    want = {c: [i for i, cat in enumerate(categories) if cat == c] for c in CATEGORIES}
    conts: dict[int, list[int]] = {}
    by_target = want["target"] + want["mixed"]
    if by_target:
        g = torch.Generator(device=device).manual_seed(seed) if sampling.do_sample else None
        out = batched.generate(target, [prompts[i] for i in by_target], max_new_tokens, sampling, g, eos, pad)
        conts.update(zip(by_target, out))
    if want["draft"]:
        d_dev = draft.get_input_embeddings().weight.device
        g = torch.Generator(device=d_dev).manual_seed(seed + 1) if sampling.do_sample else None
        out = batched.generate(draft, [prompts[i] for i in want["draft"]], max_new_tokens, sampling, g, eos, pad)
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
            swap = (torch.rand(len(y), generator=generator, device=generator.device if generator else None)
                    < mix_prob).tolist()
            conts[i] = [yi if s else xi for xi, yi, s in zip(conts[i], y, swap)]
    contexts = []
    for i, (ids, cat) in enumerate(zip(prompts, categories)):
        if cat == "prompt":
            contexts.append((list(ids), list(range(max(1, len(ids) - max_new_tokens + 1), len(ids) + 1))))
        else:
            c = conts[i]
            contexts.append((list(ids) + c, list(range(len(ids), len(ids) + len(c)))))
    return contexts


def balance(contexts: list[tuple[list[int], list[int]]], categories: list[str],
            generator: torch.Generator) -> list[list[int]]:
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


def label_chunk(target, draft, prompts: list[list[int]], indices: list[int], max_new_tokens: int,
                sampling: SamplingConfig, seed: int, pad: int, eos: list[int], mix_prob: float,
                generator: torch.Generator) -> list[dict]:
    """Labels one group of prompts: contexts, balanced prefixes, draws and ratios.

    Returns one dict per prompt with ``category``, ``input_ids`` (the context ``s``),
    ``positions`` (kept prefix lengths) and the columns of :func:`label_distributions` as lists.
    """
    categories = [category_of(i) for i in indices]
    contexts = build_contexts(target, draft, prompts, categories, max_new_tokens, sampling, seed, pad, eos,
                              mix_prob, generator)
    kept = balance(contexts, categories, torch.Generator().manual_seed(seed))
    rows = [{"category": c, "input_ids": s, "positions": k} for c, (s, _), k in zip(categories, contexts, kept)]
    live = [r for r in rows if r["positions"]]
    for r in rows:
        for key in ("draft_token", "q_token", "p_token", "ratio", "tv"):
            r[key] = []
    if not live:
        return rows
    seqs, pos = [r["input_ids"] for r in live], [r["positions"] for r in live]
    p_logits = torch.cat(logits_at(target, seqs, pos, pad))
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
