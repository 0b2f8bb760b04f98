"""A model plus its KV cache: forward over new tokens, trim on rejection.

The cache lives across rounds. A rejected suffix is cut off (``trim``), never recomputed;
the next forward appends after the kept prefix.
"""

from __future__ import annotations

import inspect

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from .kernels import route
from .models import HiddenCapture


class ModelRunner:
    """Incremental forward passes of one causal LM over a growing, trimmable KV cache.

    Args:
        model: a Hugging Face causal LM (eval mode).
        hidden: ``None``, ``"pre"`` or ``"post"``: which final-norm state each forward
            returns alongside the logits (captured by a hook, no extra pass).
        vocab_size: logits are cut to this many columns when the model pads its vocabulary.
        capacity: initial cache length (prompt + new tokens + a round); it grows if exceeded.
    """

    def __init__(self, model, hidden: str | None = None, vocab_size: int | None = None, capacity: int = 256):
        self.model = route(model)  # its linears on the kernels measured fastest here (CPU)
        self.device = model.get_input_embeddings().weight.device
        self.hidden = hidden
        self.capture = HiddenCapture(model) if hidden else None
        self.vocab_size = vocab_size
        self._keep_arg = "logits_to_keep" in inspect.signature(model.forward).parameters
        self.capacity = capacity
        self.cache = _new_cache(model, capacity)
        self.forwards = 0

    @property
    def length(self) -> int:
        """Tokens held in the cache."""
        return self.cache.get_seq_length()

    def reset(self) -> None:
        """Empties the cache (a new prompt)."""
        self.cache = _new_cache(self.model, self.capacity)

    def forward(self, ids: torch.Tensor, n_logits: int = 1) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Consumes ``ids`` ``[1, S]`` after the cached prefix.

        Returns:
            logits ``[n_logits, V]`` for the last ``n_logits`` positions (0 = none, e.g. prefill)
            and the requested hidden state ``[S, d]`` (or None).
        """
        kwargs = {"past_key_values": self.cache, "use_cache": True}
        if self._keep_arg:
            kwargs["logits_to_keep"] = max(n_logits, 1)
        out = self.model(input_ids=ids, **kwargs)
        self.forwards += 1
        logits = out.logits[0, -n_logits:] if n_logits else out.logits[0, :0]
        if self.vocab_size is not None and logits.shape[-1] != self.vocab_size:
            logits = logits[..., : self.vocab_size]
        hid = None
        if self.capture is not None:
            hid = (self.capture.pre if self.hidden == "pre" else self.capture.post)[0]
        return logits, hid

    def trim(self, length: int) -> None:
        """Keeps the first ``length`` cached positions (no-op when the cache is not longer)."""
        extra = self.length - length
        if extra > 0:
            self.cache.crop(-extra)

    def close(self) -> None:
        """Removes the hidden-state hook."""
        if self.capture is not None:
            self.capture.remove()
            self.capture = None


class GrowableLayer(DynamicLayer):
    """A full-attention cache layer that writes in place into a preallocated buffer.

    ``DynamicLayer`` concatenates on every forward (a new allocation and a copy of the whole
    layer cache per token); here new keys/values are copied into spare capacity and
    ``keys``/``values`` are views of the filled part. ``crop`` (inherited) shrinks the view,
    so a rejected suffix is simply overwritten by the next round. Capacity doubles when full.
    """

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
        self._kbuf[..., n:end, :] = key_states
        self._vbuf[..., n:end, :] = value_states
        self.keys = self._kbuf[..., :end, :]
        self.values = self._vbuf[..., :end, :]
        return self.keys, self.values


def _new_cache(model, capacity: int = 256) -> DynamicCache:
    try:
        cache = DynamicCache(config=model.config)  # per-layer types (sliding windows) from the config
    except TypeError:  # older transformers
        return DynamicCache()
    # Plain full-attention layers get the in-place layer; sliding-window and other layer types keep theirs.
    cache.layers = [GrowableLayer(capacity) if type(layer) is DynamicLayer else layer for layer in cache.layers]
    return cache


def make_runner(model, hidden: str | None = None, vocab_size: int | None = None, capacity: int = 256,
                fused: bool = True):
    """The fastest runner that computes ``model`` exactly: the fused forward where it applies and
    pays (:func:`specheads.export.shim.fused.use_fused`: CPU), else the model's own forward."""
    from .fused import FusedRunner, use_fused

    if fused and use_fused(model):
        return FusedRunner(model, hidden, vocab_size, capacity)
    return ModelRunner(model, hidden, vocab_size, capacity)
