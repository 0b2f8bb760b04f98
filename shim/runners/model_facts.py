"""Facts read off a loaded model: its end-of-sequence ids and context length; a batch of prompts padded; the
freest GPU."""

from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)


def eos_ids(model, tokenizer) -> list[int]:
    """EOS ids from the generation config and the tokenizer (deduplicated, sorted)."""
    ids: set[int] = set()
    gen = getattr(model, "generation_config", None)
    for src in (getattr(gen, "eos_token_id", None), getattr(tokenizer, "eos_token_id", None)):
        if isinstance(src, int):
            ids.add(src)
        elif src:
            ids.update(int(i) for i in src)
    return sorted(ids)


def context_length(model) -> int | None:
    """The model's maximum sequence length, when its config states one."""
    cfg = model.config
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        val = getattr(cfg, key, None)
        if isinstance(val, int) and val > 0:
            return val
    return None


def pad_batch(seqs: list[list[int]], pad: int, device=None, left: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Token lists as one ``[B, T]`` batch and its attention mask, padded on the right (or left)."""
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        cols = slice(width - len(s), width) if left else slice(0, len(s))
        ids[i, cols] = torch.tensor(s, dtype=torch.long)
        mask[i, cols] = 1
    return ids.to(device), mask.to(device)


def freest_gpu() -> str:
    """The visible GPU with the most free memory now (``cpu`` without one): where a draft goes beside a target
    that ``device_map`` spread over the node's GPUs."""
    if not torch.cuda.is_available():
        return "cpu"
    free = [torch.cuda.mem_get_info(i)[0] for i in range(torch.cuda.device_count())]
    best = max(range(len(free)), key=free.__getitem__)
    log.info("draft on cuda:%d (%.1f GiB free, the most of %d GPUs)", best, free[best] / 2**30, len(free))
    return f"cuda:{best}"
