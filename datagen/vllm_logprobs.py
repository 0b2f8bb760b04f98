"""``engine=vllm``: acceptance labels from the target's log-probabilities in vLLM, with no Transformers target pass.

What the labels need of the target's distribution ``p`` at each response position, and what vLLM gives:

* **greedy**: ``p``'s argmax, which along vLLM's greedy response is the response token itself. No
  log-probabilities; the labels are the Transformers engine's (the same responses, the same draft).
* **sampled**: the label ``min(1, p_w(y)/q_w(y))`` at the draft's sample ``y`` and the expected label
  ``sum_v min(p_w, q_w)``, ``p_w`` being ``p`` warped by the decoding settings (temperature, then top-k, then
  top-p). ``y`` is drawn from the draft after vLLM has run, so vLLM must give ``p_w`` wherever ``y`` may fall
  and wherever ``q_w > 0``. Each response request asks vLLM, while it generates, for the raw log-probabilities
  (vLLM's ``raw_logprobs``: before any warping) of the distribution each response token was drawn from: the
  teacher-forced distribution along the response, from the pass that generated it (no second pass):

  - ``sampling.top_k = k``: ``p_w`` is zero outside the target's ``k`` most likely tokens, and temperature and
    top-p act on those ``k`` alone, so vLLM's top ``k`` give ``p_w`` **exactly** (``k`` floats per token);
  - no top-k: ``p_w`` can be non-zero on every token, so the request asks for the **whole vocabulary**
    (``V`` floats per token: 0.2 MB at V = 49,152, 0.5 MB at Llama 3's 128k; about 3x vLLM's generation time
    on a CPU at 49k). That is exact too; where it is too heavy, ``vllm.logprobs=false`` runs the Transformers
    target pass over vLLM's responses instead.

  What is not exact: vLLM's kernels are not Transformers' (fp32 log-probabilities differ in the last digits;
  on the shared pair the labels differ by at most 5e-5 with the top 50 or the whole vocabulary,
  ``bench/scale_vllm_labels.py``), and a tie at the ``k``-th value (which the Transformers warp keeps, vLLM's
  top ``k`` cuts).

``labels=fsd`` (divergences over the whole distribution) keeps its Transformers target pass.
"""

from __future__ import annotations

from pathlib import Path

import torch

from specheads.errors import UserError

MISSING = -1e30  # a token vLLM gave no log-probability for: zero after warping, finite for the NaN/Inf checks


def top_k_only(cfg) -> bool:
    """``labels=drafter drafter.store_states=false``: the top-k come from the pass that generates the responses
    (vLLM's raw log-probabilities along each response), and no states child runs."""
    return cfg.labels == "drafter" and not cfg.drafter.store_states and cfg.vllm.logprobs


def wanted(cfg) -> int | None:
    """The log-probabilities each response request asks vLLM for: ``k`` (the top ``k``), ``-1`` (the whole
    vocabulary) or None (the chosen token's only: greedy, other families, ``vllm.logprobs=false``)."""
    if top_k_only(cfg):
        return cfg.drafter.top_k
    if cfg.labels != "acceptance" or not cfg.sampling.do_sample or not cfg.vllm.logprobs:
        return None
    return cfg.sampling.top_k if cfg.sampling.top_k > 0 else -1


def max_logprobs(requests) -> int:
    """vLLM's ``max_logprobs`` for a run's requests (-1: no cap; at least vLLM's default 20)."""
    ks = [r["logprobs"] for r in requests if r.get("logprobs") is not None]
    return -1 if any(k < 0 for k in ks) else max([20, *ks])


def dense(ids: torch.Tensor | None, logp: torch.Tensor, vocab: int) -> torch.Tensor:
    """``[n, vocab]`` log-probabilities from a response's tensors (top ``k``: the rest :data:`MISSING`)."""
    if ids is None:  # the whole vocabulary
        return logp.float()
    out = torch.full((logp.shape[0], vocab + 1), MISSING)
    cols = torch.where(ids >= 0, ids.long(), vocab)  # padding goes to the extra column, then is cut
    out.scatter_(1, cols, torch.where(ids >= 0, logp.float(), MISSING))
    return out[:, :vocab]


def top_k(job, keys: list[str], k: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per key, the target's ``k`` most likely tokens at every response token, ``(ids [n, k] int32, logp [n, k]
    fp32)`` in decreasing order, from the chunk's logprobs file (:func:`top_k_only`): of vLLM's top ``k`` and the
    chosen token, a repeated id or padding counted once at most (:data:`MISSING` where fewer than ``k`` remain).
    Read from the ``k + 1`` stored columns, never spread over the vocabulary."""
    out = []
    for ids, logp in _stored(job, keys)[1]:
        if ids is None:  # the whole vocabulary was stored
            vals, top = logp.float().topk(min(k, logp.shape[-1]), dim=-1)
            out.append((top.to(torch.int32), vals))
            continue
        seen = (ids[:, :, None] == ids[:, None, :]).tril(-1).any(-1)  # an id an earlier column holds already
        lp = torch.where(seen | (ids < 0), MISSING, logp.float())
        vals, col = lp.topk(min(k, lp.shape[-1]), dim=-1)
        out.append((ids.gather(1, col).to(torch.int32), vals))
    return out


def target_logits(job, keys: list[str], device) -> list[torch.Tensor] | None:
    """Per key, the target's ``[len(response), V]`` log-probabilities from the chunk's logprobs file (logits
    for :func:`~specheads.datagen.acceptance_labels.acceptance_labels`: warping is shift-invariant); None when
    the run asked vLLM for none (the labeller then runs the Transformers target pass)."""
    if wanted(job.cfg) is None:
        return None
    vocab, rows = _stored(job, keys)
    return [dense(ids, logp, vocab).to(device) for ids, logp in rows]


def _path(job) -> Path:
    name = (job.pregenerated or {}).get("logprobs")
    if not name:  # the target beside vLLM has no weights for a pass (specheads/runtime/target_shell.py)
        raise UserError(
            f"engine=vllm: a chunk's responses in {Path(job.cfg.output_dir) / 'vllm'} come without the target's "
            "log-probabilities (written with vllm.logprobs=false?); set vllm.logprobs=false, or delete that folder"
        )
    return Path(job.cfg.output_dir) / "vllm" / name


def _stored(job, keys: list[str]) -> tuple[int, list[tuple[torch.Tensor | None, torch.Tensor]]]:
    """The chunk's logprobs file: its vocabulary size and, per key, ``(ids [n, k + 1] or None for the whole
    vocabulary, logp)``."""
    from safetensors import safe_open

    path = _path(job)
    try:
        with safe_open(str(path), framework="pt") as fh:
            have = set(fh.keys())
            return int(fh.metadata()["vocab"]), [
                (fh.get_tensor(f"{key}.ids") if f"{key}.ids" in have else None, fh.get_tensor(f"{key}.logp"))
                for key in keys
            ]
    except (OSError, KeyError, ValueError) as err:
        raise UserError(f"engine=vllm: {path} is unreadable ({err}); delete it and run the same command again") from err
