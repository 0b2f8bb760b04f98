"""The EAGLE head's data and loss: ``labels=drafter`` sequences, the pruned vocabulary, the unrolled loss.

A sequence is one prompt and the target's own response with the target's states at every position
and, at every response token, the target's top-k distribution it was chosen from. Step ``j`` (from
1) of the unrolled head at row ``t`` scores ``x_{t+j+1}``: its target is the distribution produced at
position ``t + j``, restricted to the pruned vocabulary and renormalised (EAGLE-3's choice; a position
whose top-k holds no token of the subset is left out of the loss, and counts as a miss in accuracy).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping

import torch

from specheads.heads.eagle_head import EagleHead
from specheads.runtime.checkpoint_tensors import from_model
from specheads.shim import read_ranking, subset_from_ranking
from specheads.train.drafter_data import DrafterData, Sequence


def vocabulary(cfg, data: DrafterData, eos: list[int], vocab_size: int) -> list[int]:
    """The pruned output layer's target ids, sorted: ``vocab_top_n`` of ``vocab_file``'s ranking, or of the
    responses' tokens and the target's top-1 at each when no file is given (EOS always kept; read chunk by
    chunk, no states)."""
    if cfg.vocab_file:
        ranking = read_ranking(cfg.vocab_file)
    else:
        counts = Counter()
        for response, top1 in data.response_tokens():
            counts.update(response)
            counts.update(top1)
        ranking = {"ranking": [t for t, _ in counts.most_common()], "vocab_size": vocab_size}
    return sorted(subset_from_ranking(ranking, min(cfg.vocab_top_n, vocab_size), eos, vocab_size))


def _shift(x: torch.Tensor, j: int, fill) -> torch.Tensor:
    """``out[:, t] = x[:, t + j]`` (``fill`` past the end)."""
    out = torch.full_like(x, fill)
    if j < x.shape[1]:
        out[:, : x.shape[1] - j] = x[:, j:]
    return out


def collate(seqs: list[Sequence], index: torch.Tensor, device) -> tuple[dict, dict]:
    """A padded batch: inputs ``ids`` ``[B, T]``, ``states`` ``[B, T, k*d]`` (fp32), ``mask`` ``[B, T]``; targets
    at every position ``p`` (the distribution of ``x_{p+1}``): ``tid`` ``[B, T, K]`` (draft-vocabulary rows,
    -1 outside the subset), ``tp`` (probabilities) and ``valid`` ``[B, T]``. ``index`` maps target ids to rows."""
    b, t = len(seqs), max(len(s.ids) for s in seqs)
    k = seqs[0].top_ids.shape[1]
    ids = torch.zeros(b, t, dtype=torch.long)
    states = torch.zeros(b, t, seqs[0].states.shape[1])
    mask = torch.zeros(b, t, dtype=torch.bool)
    tid = torch.full((b, t, k), -1, dtype=torch.long)
    tp = torch.zeros(b, t, k)
    valid = torch.zeros(b, t, dtype=torch.bool)
    for i, s in enumerate(seqs):
        n, r = len(s.ids), s.top_ids.shape[0]
        ids[i, :n], states[i, :n], mask[i, :n] = s.ids, s.states.float(), True
        tid[i, s.start - 1 : s.start - 1 + r] = index[s.top_ids]
        tp[i, s.start - 1 : s.start - 1 + r] = s.top_logp.exp()
        valid[i, s.start - 1 : s.start - 1 + r] = True
    put = lambda d: {key: v.to(device) for key, v in d.items()}  # noqa: E731
    return put({"ids": ids, "states": states, "mask": mask}), put({"tid": tid, "tp": tp, "valid": valid})


def step_rows(x: dict, y: dict, steps: int) -> list[torch.Tensor]:
    """Per step ``j`` (1..steps), the rows ``t`` that have a target: the distribution at ``t + j`` exists."""
    return [_shift(y["valid"], j, False) & _shift(x["mask"], j, False) for j in range(1, steps + 1)]


def step_embeds(embed: torch.Tensor, ids: torch.Tensor, steps: int) -> torch.Tensor:
    """``[steps, B, T, d]``: at step ``j``, row ``t`` reads token ``x_{t+j}``."""
    return torch.stack([embed[_shift(ids, j, 0)] for j in range(1, steps + 1)])


def unrolled_loss(
    head, embed: torch.Tensor, x: dict, y: dict, steps: int, decay: float, stats: dict | None = None
) -> torch.Tensor:
    """The weighted soft cross-entropy over the unrolled steps (step ``j`` weighs ``decay ** (j - 1)``);
    ``stats`` (when given) gets per step the summed loss, hits of the target's top-1 and row counts, and under
    ``runs`` the summed greedy runs and the rows they are over (:func:`run_lengths`)."""
    rows = step_rows(x, y, steps)
    dtype = next(head.parameters()).dtype
    out = head(x["states"].to(dtype), step_embeds(embed, x["ids"], steps).to(dtype), x["mask"], rows)
    total, weights = 0.0, 0.0
    hits = []
    for j, (sel, logits) in enumerate(zip(rows, out)):
        logq = torch.log_softmax(logits.float(), dim=-1)
        tid, tp = _shift(y["tid"], j + 1, -1)[sel], _shift(y["tp"], j + 1, 0.0)[sel]
        p = tp * (tid >= 0)
        mass = p.sum(-1)
        keep = mass > 0
        ce = -(p[keep] / mass[keep, None] * logq[keep].gather(-1, tid[keep].clamp_min(0))).sum(-1)
        if keep.any():
            total = total + decay**j * ce.mean()
            weights += decay**j
        if stats is not None:
            s = stats.setdefault(j + 1, {"loss": 0.0, "kept": 0, "hits": 0, "rows": 0})
            s["loss"] += float(ce.sum())
            s["kept"] += int(keep.sum())
            s["hits"] += int((logq.argmax(-1) == tid[:, 0]).sum())
            s["rows"] += int(sel.sum())
            hits.append((sel, logq.argmax(-1) == tid[:, 0]))
    if stats is not None:  # the greedy runs of this batch, summed (held-out memory stays one batch's)
        runs = stats.setdefault("runs", [0.0, 0])
        runs[0], full = _run_sums(hits, runs[0])
        runs[1] += full
    return total / max(weights, 1e-12)


def run_lengths(batches: list[list[tuple[torch.Tensor, torch.Tensor]]]) -> tuple[float, int]:
    """Mean number of leading steps whose top-1 matches the target's, over rows every step scores (the
    greedy tokens accepted per round at a fixed ``k = steps``), and how many rows that is. ``batches``: per
    batch, per step, the scored rows and their hits."""
    total, count = 0.0, 0
    for steps in batches:
        got, rows = _run_sums(steps, total)
        total, count = got, count + rows
    return (total / count if count else 0.0), count


def _run_sums(steps: list[tuple[torch.Tensor, torch.Tensor]], total: float = 0.0) -> tuple[float, int]:
    """One batch's leading-match runs added to ``total`` (step by step, in order), and its rows every step scores."""
    full = steps[0][0].clone()
    for sel, _ in steps[1:]:
        full &= sel
    run = torch.ones(int(full.sum()), dtype=torch.long, device=full.device)
    for sel, hit in steps:
        per_row = torch.zeros_like(sel, dtype=torch.bool)
        per_row[sel] = hit
        run = run * per_row[full].long()
        total += float(run.sum())
    return total, int(full.sum())


def init_from_target(head: EagleHead, target, vocab_ids: list[int], seed: int) -> None:
    """Starts the head from the target: its last decoder layer (the state half of the attention inputs;
    the embedding half small and random), final norm and output-layer rows; ``fc`` passes the highest
    layer's state through; later decoder layers as :func:`grow_from_target` starts them. ``target``:
    :meth:`TargetCheckpoint.tensors` (the rows of ``vocab_ids``) or a loaded causal LM."""
    if not isinstance(target, Mapping):
        target = from_model(target, vocab_ids)
    gen = torch.Generator().manual_seed(seed)
    ly = head.layer
    d, parts = head.hidden_size, len(head.layer_ids)
    with torch.no_grad():
        for name in ("q_proj", "k_proj", "v_proj"):
            w = target[f"self_attn.{name}"].float()
            noise = torch.randn(w.shape, generator=gen).to(w.device) * 0.02  # seeded on the CPU, any device
            getattr(ly.self_attn, name).weight.copy_(torch.cat([noise, w], dim=1))
        ly.self_attn.o_proj.weight.copy_(target["self_attn.o_proj"].float())
        for name in ("gate_proj", "up_proj", "down_proj"):
            getattr(ly.mlp, name).weight.copy_(target[f"mlp.{name}"].float())
        for mine, theirs in (
            (ly.input_layernorm, "input_layernorm"),
            (ly.hidden_norm, "input_layernorm"),
            (ly.post_attention_layernorm, "post_attention_layernorm"),
            (head.norm, "norm"),
        ):
            mine.weight.copy_(target[theirs].float())
        fc = torch.randn(d, parts * d, generator=gen) * 0.01
        fc[:, (parts - 1) * d :] += torch.eye(d)
        head.fc.weight.copy_(fc)
        head.lm_head.weight.copy_(target["lm_head"].float())
        head.vocab_ids.copy_(torch.tensor(vocab_ids, dtype=torch.long))
    grow_from_target(head, target, 1)


def decoder_layers(state: Mapping[str, torch.Tensor]) -> int:
    """How many decoder layers an EAGLE head's ``state`` holds (its ``layers.N.`` entries)."""
    return len({k.split(".")[1] for k in state if k.startswith("layers.")})


def grow_from_target(head: EagleHead, target, first: int) -> None:
    """Starts the head's decoder layers from ``first`` on (plain layers over the state) from the target's last
    layer, with their output projections (``o_proj``, ``down_proj``) zeroed: each adds nothing at first, so
    the head drafts as its first ``first`` layers do. ``target``: as :func:`init_from_target`'s (the last
    layer's tensors are all it reads)."""
    if first >= head.num_layers:
        return
    if not isinstance(target, Mapping):
        target = from_model(target, [])
    with torch.no_grad():
        for ly in head.layers[first:]:
            for name in ("q_proj", "k_proj", "v_proj"):
                getattr(ly.self_attn, name).weight.copy_(target[f"self_attn.{name}"].float())
            for name in ("gate_proj", "up_proj"):
                getattr(ly.mlp, name).weight.copy_(target[f"mlp.{name}"].float())
            ly.self_attn.o_proj.weight.zero_()
            ly.mlp.down_proj.weight.zero_()
            ly.input_layernorm.weight.copy_(target["input_layernorm"].float())
            ly.post_attention_layernorm.weight.copy_(target["post_attention_layernorm"].float())
