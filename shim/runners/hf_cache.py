"""The Hugging Face KV cache :class:`~.model_runner.ModelRunner` runs on: its full-attention layers write in place into
a preallocated buffer (:class:`GrowableLayer`)."""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer


class GrowableLayer(DynamicLayer):
    """A full-attention cache layer that writes in place into a preallocated buffer.

    ``DynamicLayer`` concatenates on every forward (a new allocation and a copy of the whole
    layer cache per token); here new keys/values are copied into spare capacity and
    ``keys``/``values`` are views of the filled part. ``crop`` (inherited) shrinks the view,
    so a rejected suffix is simply overwritten by the next round. Capacity doubles when full.
    """

    keys: torch.Tensor
    values: torch.Tensor
    _kbuf: torch.Tensor | None
    _vbuf: torch.Tensor | None

    def __init__(self, capacity: int = 256):
        super().__init__()
        self.capacity = max(int(capacity), 1)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self._kbuf = self._vbuf = None

    def _grow(self, key_states: torch.Tensor, value_states: torch.Tensor, need: int) -> None:
        cap = max(self.capacity, need)
        while cap < need:
            cap *= 2
        n = self.keys.shape[-2] if self.keys.numel() else 0
        kb = key_states.new_empty(*key_states.shape[:-2], cap, key_states.shape[-1])
        vb = value_states.new_empty(*value_states.shape[:-2], cap, value_states.shape[-1])
        if n:
            kb[..., :n, :] = self.keys
            vb[..., :n, :] = self.values
        self._kbuf, self._vbuf, self.capacity = kb, vb, cap * 2

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n = self.keys.shape[-2] if self.keys.numel() else 0
        end = n + key_states.shape[-2]
        if self._kbuf is None or end > self._kbuf.shape[-2]:
            self._grow(key_states, value_states, end)
        kbuf, vbuf = self._kbuf, self._vbuf
        assert kbuf is not None and vbuf is not None  # grown above
        kbuf[..., n:end, :] = key_states
        vbuf[..., n:end, :] = value_states
        self.keys = kbuf[..., :end, :]
        self.values = vbuf[..., :end, :]
        return self.keys, self.values


def new_cache(model, capacity: int = 256) -> DynamicCache:
    try:
        cache = DynamicCache(config=model.config)  # per-layer types (sliding windows) from the config
    except TypeError:  # older transformers
        return DynamicCache()
    # Plain full-attention layers get the in-place layer; sliding-window and other layer types keep theirs.
    cache.layers = [GrowableLayer(capacity) if type(layer) is DynamicLayer else layer for layer in cache.layers]
    return cache
