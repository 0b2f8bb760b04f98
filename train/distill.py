"""The standalone draft's batches and loss (``head=draft``): DistillSpec on the target's own responses.

A batch is a few ``labels=drafter`` sequences (prompt + the target's response), teacher-forced
through the draft in one forward. At every response position ``t`` the target stored the ``K`` most
likely tokens of the distribution ``x_t`` was chosen from; the draft's output layer runs only at
those positions (the prompt's positions feed the attention, nothing is scored there).

The two distributions compared are over ``K + 1`` outcomes: the target's top-``K`` ids and one bucket
for every other token. The target's bucket holds its rest mass ``1 - sum_k p_k`` (floored at 1e-6:
the stored log-probs are fp32), the draft's ``1 - sum_k q_k`` of its full softmax (computed as a
log-sum-exp over the other ids, so it stays exact when it is small). Every divergence of these
coarsened distributions is a lower bound of the full-vocabulary one (data processing) and is zero
exactly when the draft gives the top-``K`` ids the target's probabilities and the rest as much mass as
the target does; renormalising over the ``K`` ids instead would leave the rest's mass unconstrained
and make ``KL(q || p)`` infinite. With a pruned output layer (FR-Spec) the draft's softmax runs over
the subset and a top-``K`` id outside it joins the bucket (``q`` gives it nothing).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

DIVERGENCES = ("fkl", "rkl", "js", "tvd")
REST_FLOOR = 1e-6


def collate(seqs: list, index: torch.Tensor | None, pad: int, device) -> tuple[dict, dict]:
    """Inputs ``ids``/``mask`` ``[B, T]`` (right-padded) and ``sel`` ``[B, T]`` (the positions ``t`` whose
    next token is a response token); targets in ``sel``'s row-major order: ``tid`` ``[N, K]`` (output-layer
    rows; -1 outside a pruned subset), ``logp`` ``[N, K]`` the target's log-probabilities. ``index`` maps
    token ids to rows of a pruned output layer (None: the full vocabulary)."""
    b, t = len(seqs), max(len(s.ids) for s in seqs)
    ids = torch.full((b, t), pad, dtype=torch.long)
    mask = torch.zeros(b, t, dtype=torch.long)
    sel = torch.zeros(b, t, dtype=torch.bool)
    tids, logps = [], []
    for i, s in enumerate(seqs):
        n, r = len(s.ids), s.top_ids.shape[0]
        ids[i, :n], mask[i, :n] = s.ids, 1
        sel[i, s.start - 1 : s.start - 1 + r] = True
        tids.append(s.top_ids.long() if index is None else index[s.top_ids.long()])
        logps.append(s.top_logp.float())
    x = {"ids": ids.to(device), "mask": mask.to(device), "sel": sel.to(device)}
    return x, {"tid": torch.cat(tids).to(device), "logp": torch.cat(logps).to(device)}


def bucketed(logits: torch.Tensor, tid: torch.Tensor, logp: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``(logq, logp, valid)``, each ``[N, K + 1]``: the draft's and the target's log-probabilities of the
    top-``K`` ids and of the bucket of every other token (last column), and which entries exist (an id
    outside a pruned subset does not: its log-probs are finite placeholders, its target mass joins the
    bucket). ``logits`` ``[N, V]`` are the draft's at the scored positions."""
    n, v = logits.shape
    valid = tid >= 0
    idx = torch.where(valid, tid, v)  # column v: an extra -inf column, so masked ids take no mass away
    padded = F.pad(logits.float(), (0, 1), value=float("-inf"))
    lse = padded.logsumexp(-1, keepdim=True)
    top = padded.gather(-1, idx)
    rest = padded.scatter(-1, idx, float("-inf")).logsumexp(-1, keepdim=True)
    logq = (torch.cat([torch.where(valid, top, lse), rest], -1) - lse).clamp_min(-1e4)
    p_top = torch.where(valid, logp.exp(), 0.0)
    p_rest = (1.0 - p_top.sum(-1, keepdim=True)).clamp_min(REST_FLOOR)
    logp_all = torch.cat([torch.where(valid, logp, 0.0), p_rest.log()], -1)
    ok = torch.cat([valid, torch.ones(n, 1, dtype=torch.bool, device=valid.device)], -1)
    return logq, logp_all, ok


def divergence(logq: torch.Tensor, logp: torch.Tensor, ok: torch.Tensor, kind: str) -> torch.Tensor:
    """Per row ``[N]``: ``kind`` (one of :data:`DIVERGENCES`) between target ``p`` and draft ``q`` over the
    entries ``ok`` of :func:`bucketed`'s outcomes."""
    p, q = logp.exp(), logq.exp()
    if kind == "fkl":
        terms = p * (logp - logq)
    elif kind == "rkl":
        terms = q * (logq - logp)
    elif kind == "js":
        logm = torch.logaddexp(logp, logq) - math.log(2.0)
        terms = 0.5 * (p * (logp - logm) + q * (logq - logm))
    elif kind == "tvd":
        terms = 0.5 * (p - q).abs()
    else:
        raise ValueError(f"divergence {kind!r}: choose one of {DIVERGENCES}")
    return torch.where(ok, terms, 0.0).sum(-1)


def loss_and_stats(logits: torch.Tensor, y: dict, kind: str, stats: dict | None = None) -> torch.Tensor:
    """The mean divergence over the scored positions; ``stats`` (when given) gets their sums: ``loss``,
    ``hits`` (the draft's argmax is the target's top-1), ``accept`` (``sum_k min(p_k, q_k)`` over the top-``K``
    ids: a lower bound of the acceptance rate ``sum_v min(p_v, q_v)`` of sampled SD) and ``rows``."""
    logq, logp, ok = bucketed(logits, y["tid"], y["logp"])
    per_row = divergence(logq, logp, ok, kind)
    if stats is not None:
        with torch.no_grad():
            top = torch.where(ok[:, :-1], torch.minimum(logp[:, :-1], logq[:, :-1]).exp(), 0.0)
            stats["loss"] = stats.get("loss", 0.0) + float(per_row.sum())
            stats["hits"] = stats.get("hits", 0) + int((logits.argmax(-1) == y["tid"][:, 0]).sum())
            stats["accept"] = stats.get("accept", 0.0) + float(top.sum())
            stats["rows"] = stats.get("rows", 0) + int(per_row.numel())
    return per_row.mean()


def summarise(stats: dict, prefix: str = "eval_") -> dict:
    """Held-out figures from :func:`loss_and_stats`' sums: ``agreement``, ``accept_lb``, ``loss``, ``tokens``."""
    rows = max(stats.get("rows", 0), 1)
    return {
        f"{prefix}agreement": stats.get("hits", 0) / rows,
        f"{prefix}accept_lb": stats.get("accept", 0.0) / rows,
        f"{prefix}loss": stats.get("loss", 0.0) / rows,
        f"{prefix}tokens": stats.get("rows", 0),
    }
