"""A model's states and logits at chosen positions of sequences, one forward per batch (shared by the stages).

:func:`sequence_states`: the residual stream entering chosen layers at every position (the drafter's states, in
datagen and in an EAGLE head's online training). :func:`logits_at`: the next-token logits after chosen prefixes
(SPRINTER labels in datagen, the measured ``alpha`` in evaluate). :func:`states_after_tokens`: the final hidden
states of tokens fed at chosen positions (the SPRINTER verifier's ``current`` feature in train). For each row, the
sequence and the tokens to probe are concatenated into one input. A custom 4D attention mask lets each appended
token see only the prefix before its own position (and itself), while the explicit ``position_ids`` give it that
position. The result equals running the model on ``seq[:p] + [token]`` separately for each probe, at the cost of a
single forward.
"""

from __future__ import annotations

import torch

from specheads.shim import make_runner, pad_batch

# Attention implementations that honour an arbitrary additive 4D mask (others, e.g. flash
# attention, ignore or reject it, so those models take the per-position fallback).
_MASKABLE = {None, "eager", "sdpa"}


def _base_and_device(model):
    """The module whose ``last_hidden_state`` is the post-final-norm state (or None), and the device."""
    base = getattr(model, "model", None)
    if not isinstance(base, torch.nn.Module):
        base = getattr(model, "base_model", None)
    if not isinstance(base, torch.nn.Module) or base is model:
        base = None
    return base, next(model.parameters()).device


def _final_states(model, base, **inputs) -> torch.Tensor:
    """Hidden states after the final norm, ``[B, T, hidden]``.

    ``base(...).last_hidden_state`` for models with a decoder body (Llama family: ``model``, GPT-2:
    ``transformer``); otherwise the last ``hidden_states`` entry, which transformers ties to the
    post-norm ``last_hidden_state`` for language models (GPT-2's is after ``ln_f``).
    """
    if base is not None:
        return base(**inputs, use_cache=False).last_hidden_state
    return model(**inputs, use_cache=False, output_hidden_states=True).hidden_states[-1]


def _batched(model, base, device, seqs, positions, tokens, pad) -> list[torch.Tensor]:
    """One forward over ``seq + tokens`` rows with a custom additive 4D mask."""
    lengths = [len(s) + len(t) for s, t in zip(seqs, tokens)]
    width = max(lengths)
    ids, pos, limit = [], [], []
    for seq, ps, toks in zip(seqs, positions, tokens):
        n, m = len(seq), len(toks)
        pad_n = width - n - m
        ids.append(list(seq) + list(toks) + [pad] * pad_n)
        pos.append(list(range(n)) + list(ps) + [0] * pad_n)
        # query q sees keys k < limit[q] (plus itself, below): causal for the sequence,
        # the prefix seq[:p] for an appended token, nothing but itself for padding
        limit.append(list(range(1, n + 1)) + list(ps) + [0] * pad_n)
    keys = torch.arange(width, device=device)
    limit_t = torch.tensor(limit, device=device)
    allowed = (keys[None, None, :] < limit_t[:, :, None]) | torch.eye(width, dtype=torch.bool, device=device)
    dtype = next(model.parameters()).dtype
    if not dtype.is_floating_point:
        dtype = torch.float32
    # additive float mask: sdpa accepts it as attn_mask, eager adds it to the scores (a bool
    # mask would be added as 0/1 by eager attention, so it is not used)
    mask = torch.zeros(allowed.shape, dtype=dtype, device=device)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    hidden = _final_states(
        model,
        base,
        input_ids=torch.tensor(ids, device=device),
        attention_mask=mask[:, None],
        position_ids=torch.tensor(pos, device=device),
    )
    return [hidden[b, len(seq) : len(seq) + len(toks)].float() for b, (seq, toks) in enumerate(zip(seqs, tokens))]


def _looped(model, base, device, seqs, positions, tokens) -> list[torch.Tensor]:
    """Fallback: one forward of ``seq[:p] + [token]`` per probe."""
    out = []
    for seq, ps, toks in zip(seqs, positions, tokens):
        rows = [
            _final_states(model, base, input_ids=torch.tensor([list(seq[:p]) + [t]], device=device))[0, -1]
            for p, t in zip(ps, toks)
        ]
        out.append(torch.stack(rows).float() if rows else None)
    return out


@torch.inference_mode()
def states_after_tokens(
    model, seqs: list[list[int]], positions: list[list[int]], tokens: list[list[int]], pad: int
) -> list[torch.Tensor]:
    """Final-norm hidden states of ``tokens[b][i]`` fed right after ``seqs[b][:positions[b][i]]``.

    Row ``b``'s input is ``seqs[b] + tokens[b]`` (right-padded with ``pad``); appended token ``i``
    gets position id ``positions[b][i]`` and attends to ``seqs[b][:positions[b][i]]`` and itself
    only, so one forward serves the whole batch. Models whose attention cannot take a custom 4D
    mask (not eager/sdpa, a forward that raises on it, or sequences longer than a sliding window)
    fall back to one forward per probe.

    Args:
        model: A causal LM (Hugging Face style, e.g. ``LlamaForCausalLM``) in eval mode.
        seqs: Token ids of each row's sequence.
        positions: Per row, the positions ``p`` (``1 <= p <= len(seqs[b])``) to feed each token at.
        tokens: Per row, the token fed at the matching position; same lengths as ``positions``.
        pad: Token id used to right-pad rows to a common length.

    Returns:
        Per row, a float32 tensor ``[len(tokens[b]), hidden]`` on the model's device: the state of
        ``seqs[b][:positions[b][i]] + [tokens[b][i]]`` at its last position, after the final norm.
    """
    if len(seqs) != len(positions) or len(seqs) != len(tokens):
        raise ValueError("seqs, positions and tokens must have one entry per row")
    for seq, ps, toks in zip(seqs, positions, tokens):
        if len(ps) != len(toks):
            raise ValueError("positions and tokens must have the same length in every row")
        if any(not 1 <= p <= len(seq) for p in ps):
            raise ValueError("positions must satisfy 1 <= p <= len(seq)")
    base, device = _base_and_device(model)
    hidden_size = getattr(getattr(model, "config", None), "hidden_size", None)
    if not any(tokens):
        return [torch.empty(0, hidden_size or 0, device=device) for _ in seqs]

    cfg = getattr(model, "config", None)
    attn = getattr(cfg, "_attn_implementation", None)
    window = getattr(cfg, "sliding_window", None)
    width = max(len(s) + len(t) for s, t in zip(seqs, tokens))
    out = None
    if attn in _MASKABLE and not (window and width > window):
        try:
            out = _batched(model, base, device, seqs, positions, tokens, pad)
        except (TypeError, ValueError, RuntimeError):
            out = None
    if out is None:
        out = _looped(model, base, device, seqs, positions, tokens)
    width_h = next((o.shape[-1] for o in out if o is not None), hidden_size or 0)
    return [o if o is not None else torch.empty(0, width_h, device=device) for o in out]


@torch.inference_mode()
def logits_at(model, seqs: list[list[int]], positions: list[list[int]], pad: int) -> list[torch.Tensor]:
    """Per row, the model's next-token logits ``[len(positions[b]), V]`` after each prefix ``seqs[b][:t]``.

    One right-padded forward; the output layer runs only at the requested positions when the
    model exposes its body (``model.model``), else the full logits are sliced.
    """
    device = model.get_input_embeddings().weight.device
    ids, mask = pad_batch(seqs, pad, device)
    rows = torch.cat([torch.full((len(p),), b, dtype=torch.long) for b, p in enumerate(positions)])
    cols = torch.cat([torch.tensor(p, dtype=torch.long) - 1 for p in positions])
    body = getattr(model, "model", None)
    # the indices go where the states come out (a model split over GPUs: its last device, not its first)
    if body is not None and callable(body):
        hid = body(input_ids=ids, attention_mask=mask).last_hidden_state
        logits = model.get_output_embeddings()(hid[rows.to(hid.device), cols.to(hid.device)])
    else:
        full = model(input_ids=ids, attention_mask=mask).logits
        logits = full[rows.to(full.device), cols.to(full.device)]
    return list(logits.split([len(p) for p in positions]))


@torch.inference_mode()
def sequence_states(model, seqs: list[list[int]], layers: list[int], responses: list[int] | None = None):
    """Per sequence, the residual stream entering ``layers`` at every position, ``[T, len(layers) * d]`` fp16
    (one teacher-forced forward each, no output layer). With ``responses`` (each sequence's response length
    ``n``), also the logits ``[n, V]`` its response tokens were chosen from, from the same forward: returns
    ``(states, logits)``."""
    device = model.get_input_embeddings().weight.device
    runner = make_runner(model, capacity=max(len(s) for s in seqs), aux=layers)
    out, logits = [], []
    try:
        for i, seq in enumerate(seqs):
            runner.reset()
            n = responses[i] + 1 if responses else 0  # the last prompt position predicts the first response token
            got = runner.forward(torch.tensor([seq], device=device), n_logits=n)[0]
            out.append(runner.aux_states.to(torch.float16).cpu())
            logits.append(got[:-1] if n else None)
    finally:
        runner.close()
    return (out, logits) if responses else out
