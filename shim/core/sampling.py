"""Sampling settings and the logit warping shared by draft and target.

Speculative sampling is lossless relative to the *warped* target distribution, so the
same temperature / top-k / top-p must be applied to both models (docs/algorithms/cost-model.md).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch


@dataclass
class SamplingConfig:
    """How tokens are chosen. ``do_sample=False`` is greedy (argmax); the rest is then unused."""

    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0

    def problems(self) -> list[str]:
        """Returns one line per invalid setting (empty when valid)."""
        out = []
        if not self.temperature > 0:
            out.append(f"sampling.temperature={self.temperature} must be > 0 (use sampling.do_sample=false for greedy)")
        if self.top_k < 0:
            out.append(f"sampling.top_k={self.top_k} must be >= 0 (0 disables top-k)")
        if not 0 < self.top_p <= 1:
            out.append(f"sampling.top_p={self.top_p} must be in (0, 1] (1 disables top-p)")
        return out

    def to_dict(self) -> dict:
        """The settings as recorded in outputs and head metadata (greedy drops the unused knobs)."""
        if not self.do_sample:
            return {"do_sample": False}
        return asdict(self)


def warp_logits(logits: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    """Temperature, then top-k, then top-p (the order Hugging Face applies them); fp32 out.

    Args:
        logits: ``[..., V]`` raw logits.
        cfg: sampling settings (``do_sample`` must be true).

    Returns:
        ``[..., V]`` fp32 logits with excluded tokens set to ``-inf``.
    """
    x = logits.float()
    if cfg.temperature != 1.0:
        x = x / cfg.temperature
    if 0 < cfg.top_k < x.shape[-1]:
        kth = torch.topk(x, cfg.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if cfg.top_p < 1.0:
        sorted_x, order = torch.sort(x, dim=-1, descending=True)
        probs = sorted_x.softmax(-1)
        # Drop a token when the mass strictly before it already reaches top_p: the smallest set
        # whose mass is >= top_p survives, and the most likely token always does.
        drop_sorted = (probs.cumsum(-1) - probs) >= cfg.top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        x = x.masked_fill(drop, float("-inf"))
    return x


def probs_from_logits(logits: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    """Warped probabilities ``[..., V]`` in fp32."""
    return warp_logits(logits, cfg).softmax(-1)


def on_generator(generator: torch.Generator | None, device: torch.device) -> bool:
    """Whether draws with ``generator`` can land on ``device`` directly (a CUDA generator draws only into
    tensors on its own GPU, a CPU one only on the CPU)."""
    if generator is None:
        return True
    g, d = generator.device, torch.device(device)
    return g.type == d.type and (g.type == "cpu" or (g.index or 0) == (d.index or 0))


def multinomial(flat: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """``torch.multinomial(flat, 1)`` drawn with ``generator`` on its own device, the result on ``flat``'s (the
    same draws wherever ``flat`` lives: a target split over GPUs hands its logits back on its last)."""
    if on_generator(generator, flat.device):
        return torch.multinomial(flat, 1, generator=generator)
    assert generator is not None
    return torch.multinomial(flat.to(generator.device), 1, generator=generator).to(flat.device)


def uniform(n: int, device: torch.device, generator: torch.Generator | None) -> torch.Tensor:
    """``n`` uniforms on ``device``, drawn with ``generator`` on its own device."""
    if on_generator(generator, device):
        return torch.rand(n, device=device, generator=generator)
    assert generator is not None
    return torch.rand(n, device=generator.device, generator=generator).to(device)


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One draw per row of ``probs`` ``[..., V]`` -> ``[...]`` token ids (long)."""
    flat = probs.reshape(-1, probs.shape[-1])
    return multinomial(flat, generator).reshape(probs.shape[:-1])


def usable_logits(logits: torch.Tensor) -> torch.Tensor:
    """Per row of ``logits`` ``[..., V]``: no NaN, no ``+inf`` and at least one finite value. A
    ``-inf`` logit is a token of probability 0 (a pruned draft's tokens outside its subset), not a fault."""
    return ~torch.isnan(logits).any(-1) & ~torch.isposinf(logits).any(-1) & torch.isfinite(logits).any(-1)


def sample_finite(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """:func:`sample` for batches of many prompts (data generation): a row from non-finite logits
    (NaN/Inf), which would make ``multinomial`` raise for the whole batch, draws from a uniform row
    instead; the caller, which checks its logits, drops that sample. Valid rows draw as in :func:`sample`."""
    flat = probs.reshape(-1, probs.shape[-1])
    bad = ~(torch.isfinite(flat).all(-1) & (flat.sum(-1) > 0))
    flat = torch.where(bad[:, None], torch.ones_like(flat), flat)
    return multinomial(flat, generator).reshape(probs.shape[:-1])
