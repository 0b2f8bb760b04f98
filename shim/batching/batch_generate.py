"""Batched generation on the fused forward (data generation: many prompts, one target).

At batch 1 a CPU decoding step reads every weight once for a single token; a batch of ``B``
rows reads them once for ``B`` tokens, so the target's responses for a whole batch cost little
more than one. :func:`generate` left-pads the prompts into one preallocated KV cache, runs the
prompt as one block and then one token per row per step; rows that finished (EOS, or the row
budget) are dropped from the batch as they accumulate, so a long response does not keep the
short ones' rows busy.

Models the fused forward does not cover (:func:`~specheads.shim.runners.fused.supports`) use the
model's own batched ``generate``.
"""

from __future__ import annotations

import torch

from specheads.shim.core.sampling import SamplingConfig, probs_from_logits, sample_finite
from specheads.shim.runners.fused import FusedShape, decoder_layers, output_logits, rms_norm, use_fused
from specheads.shim.runners.model_facts import pad_batch


@torch.inference_mode()
def generate(
    model,
    prompts: list[list[int]],
    max_new_tokens: int,
    sampling: SamplingConfig,
    generator: torch.Generator | None,
    eos: list[int],
    pad: int,
    vocab_size: int | None = None,
    record_logits: bool = False,
):
    """Responses of ``model`` to a batch of tokenised prompts.

    Greedy, or sampling with the warped distribution (``sampling``) and ``generator``: the
    draws depend only on the batch and the generator's state. A response ends at its first EOS
    (kept) or after ``max_new_tokens`` tokens.

    Args:
        model: a causal LM in eval mode.
        prompts: token ids per row (non-empty).
        max_new_tokens: budget per row.
        sampling: the decoding settings.
        generator: RNG for sampled decoding (unused when greedy).
        eos: token ids that end a response.
        pad: padding id (only used by the fallback path).
        vocab_size: sample only from the first ``vocab_size`` logits (a model that pads its vocabulary).
        record_logits: also return, per prompt, the raw logits ``[len(response), V]`` each token was
            chosen from (the target's distributions along its own response: data generation needs
            no second target pass).

    Returns:
        one token list per prompt, in order; with ``record_logits``, ``(tokens, logits)``.
    """
    if not prompts:
        return ([], []) if record_logits else []
    if not use_fused(model):
        plain = hf_generate(model, prompts, max_new_tokens, sampling, generator, eos, pad)
        return (plain, None) if record_logits else plain
    shape = FusedShape(model)
    emb = model.get_input_embeddings()
    device, dtype = emb.weight.device, emb.weight.dtype
    b = len(prompts)
    width = max(len(p) for p in prompts)
    cap = width + max_new_tokens
    ids, real = pad_batch(prompts, pad, device, left=True)
    valid = torch.zeros(b, cap, dtype=torch.bool, device=device)  # which cache slots hold real tokens
    valid[:, :width] = real.bool()
    offset = (width - real.sum(1)).to(device)  # left padding per row
    kv = (b, shape.kv_heads, cap, shape.head_dim)
    keys = [torch.zeros(kv, dtype=dtype, device=device) for _ in shape.weights.layers]
    values = [torch.zeros(kv, dtype=dtype, device=device) for _ in shape.weights.layers]
    probe = torch.zeros(1, 1, shape.head_dim, dtype=dtype, device=device)
    cos_t, sin_t = model.model.rotary_emb(probe, torch.arange(cap, device=device).unsqueeze(0))
    cos_t, sin_t = cos_t[0].to(dtype), sin_t[0].to(dtype)  # [cap, hd]

    rows = list(range(b))  # original index of each batch row
    out: list[list[int]] = [[] for _ in prompts]
    record = None
    done: set[int] = set()  # finished rows (original indices) still in the batch
    # Prompt block: each row attends to its own real tokens, causally; pad queries see themselves
    # (their outputs are never used) so no attention row is empty.
    pos = (torch.arange(width, device=device)[None, :] - offset[:, None]).clamp_min(0)
    causal = torch.ones(width, width, dtype=torch.bool, device=device).tril()
    mask = (causal[None] & valid[:, None, :width]) | torch.eye(width, dtype=torch.bool, device=device)[None]
    x = decoder_layers(
        shape, emb(ids), cos_t[pos][:, None], sin_t[pos][:, None], keys, values, 0, width, mask[:, None], False
    )
    end = width
    for step in range(max_new_tokens):
        logits = output_logits(shape.weights, rms_norm(model.model.norm, x[:, -1]))
        if vocab_size is not None:
            logits = logits[:, :vocab_size]
        if record_logits:
            if record is None:
                record = logits.new_empty(b, max_new_tokens, logits.shape[-1])
            record[torch.tensor(rows, device=device), step] = logits
        if sampling.do_sample:
            tok = sample_finite(probs_from_logits(logits, sampling), generator)  # a NaN row must not stop the batch
        else:
            tok = logits.argmax(-1)
        for r, t in zip(rows, tok.tolist()):  # the step's one device sync
            if r not in done:
                out[r].append(t)
                if t in eos:
                    done.add(r)
        if step + 1 == max_new_tokens or len(done) == len(rows):
            break
        if done and len(done) * 4 >= len(rows):  # drop finished rows once they are a quarter of the batch
            kept = [i for i, r in enumerate(rows) if r not in done]
            keep = torch.tensor(kept, device=device)
            rows, done = [rows[i] for i in kept], set()
            keys = [k.index_select(0, keep) for k in keys]
            values = [v.index_select(0, keep) for v in values]
            valid, offset, tok = valid[keep], offset[keep], tok[keep]
        valid[:, end] = True
        pos = (end - offset)[:, None]
        x = decoder_layers(
            shape,
            emb(tok[:, None]),
            cos_t[pos][:, None],
            sin_t[pos][:, None],
            keys,
            values,
            end,
            end + 1,
            valid[:, None, None, : end + 1],
            False,
        )
        end += 1
    if record_logits:
        assert record is not None  # filled by the first step
        return out, [record[i, : len(r)] for i, r in enumerate(out)]
    return out


def hf_generate(model, prompts, max_new_tokens, sampling, generator, eos, pad) -> list[list[int]]:
    """The model's own left-padded batched ``generate`` (models the fused forward does not cover).

    ``generate`` draws from torch's global RNG: it is seeded from ``generator`` so the draws still
    follow the caller's seed."""
    ids, mask = pad_batch(prompts, pad, model.get_input_embeddings().weight.device, left=True)
    width = ids.shape[1]
    kwargs: dict[str, object] = {"do_sample": False}
    if sampling.do_sample:
        kwargs = {
            "do_sample": True,
            "temperature": sampling.temperature,
            "top_k": sampling.top_k or None,
            "top_p": sampling.top_p,
        }
        # drawn on the generator's own device: a CUDA generator cannot draw into a CPU tensor
        seed = int(torch.randint(0, 2**62, (1,), generator=generator, device=generator.device)) if generator else 0
        torch.manual_seed(seed)
    gen = model.generate(
        ids, attention_mask=mask, max_new_tokens=max_new_tokens, pad_token_id=pad, eos_token_id=eos or None, **kwargs
    )
    responses = []
    for row in gen[:, width:].tolist():
        cut = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
        responses.append(row[:cut])
    return responses
