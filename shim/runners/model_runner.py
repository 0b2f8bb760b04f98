"""A model plus its KV cache: forward over new tokens, trim on rejection.

The cache lives across rounds (the Hugging Face cache :class:`ModelRunner` runs on: :mod:`.hf_cache`). A rejected
suffix is cut off (``trim``), never recomputed;
the next forward appends after the kept prefix. Two runners share one interface:
:class:`ModelRunner` (the model's own forward) and :class:`FusedRunner` (the fused forward of
:mod:`.fused`); :func:`make_runner` picks one.
"""

from __future__ import annotations

import inspect

import torch

from specheads.errors import UserError
from specheads.shim.runners.fused import decoder_layers, fused_weights, output_logits, rms_norm, supports, use_fused
from specheads.shim.runners.hf_cache import new_cache
from specheads.shim.runners.hidden import AuxCapture, HiddenCapture
from specheads.shim.runners.kernels import route


class ModelRunner:
    """Incremental forward passes of one causal LM over a growing, trimmable KV cache.

    Args:
        model: a Hugging Face causal LM (eval mode).
        hidden: ``None``, ``"pre"`` or ``"post"``: which final-norm state each forward
            returns alongside the logits (captured by a hook, no extra pass).
        vocab_size: logits are cut to this many columns when the model pads its vocabulary.
        capacity: initial cache length (prompt + new tokens + a round); it grows if exceeded.
        aux: decoder-layer indices whose entering residual stream each forward keeps in ``aux_states``
            (``[S, len(aux) * d]``: what an EAGLE head reads), or None.
    """

    def __init__(
        self,
        model,
        hidden: str | None = None,
        vocab_size: int | None = None,
        capacity: int = 256,
        aux: list[int] | None = None,
    ):
        self.model = route(model)  # its linears on the kernels measured fastest here (CPU)
        self.aux_capture = AuxCapture(model, aux) if aux else None
        self.aux_states: torch.Tensor | None = None
        self.device = model.get_input_embeddings().weight.device
        self.hidden = hidden
        self.capture = HiddenCapture(model) if hidden else None
        self.vocab_size = vocab_size
        self._keep_arg = "logits_to_keep" in inspect.signature(model.forward).parameters
        self.capacity = capacity
        self.cache = new_cache(model, capacity)
        self.forwards = 0

    @property
    def length(self) -> int:
        """Tokens held in the cache."""
        return self.cache.get_seq_length()

    def reset(self) -> None:
        """Empties the cache (a new prompt)."""
        self.cache = new_cache(self.model, self.capacity)

    def forward(self, ids: torch.Tensor, n_logits: int = 1) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Consumes ``ids`` ``[1, S]`` after the cached prefix.

        Returns:
            logits ``[n_logits, V]`` for the last ``n_logits`` positions (0 = none, e.g. prefill)
            and the requested hidden state ``[S, d]`` (or None).
        """
        kwargs = {"past_key_values": self.cache, "use_cache": True}
        self.aux_start = self.length
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
        if self.aux_capture is not None:
            self.aux_states = self.aux_capture.states[0]
        return logits, hid

    def trim(self, length: int) -> None:
        """Keeps the first ``length`` cached positions (no-op when the cache is not longer)."""
        extra = self.length - length
        if extra > 0:
            self.cache.crop(-extra)

    def close(self) -> None:
        """Removes the hidden-state hooks."""
        if self.capture is not None:
            self.capture.remove()
            self.capture = None
        if self.aux_capture is not None:
            self.aux_capture.remove()
            self.aux_capture = None


class FusedRunner:
    """Same interface as :class:`~specheads.shim.runners.model_runner.ModelRunner`, on the fused forward.

    Args:
        model: a model for which :func:`supports` returns None (eval mode).
        hidden: ``None``, ``"pre"`` or ``"post"``: the final-norm state returned with the logits.
        vocab_size: logits are cut to this many columns when the model pads its vocabulary.
        capacity: initial cache length; doubles when exceeded.
        aux: decoder-layer indices whose entering residual stream each forward keeps in ``aux_states``.
    """

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    aux: list[int] | None

    def __init__(
        self,
        model,
        hidden: str | None = None,
        vocab_size: int | None = None,
        capacity: int = 256,
        aux: list[int] | None = None,
    ):
        self.model = model
        self.weights = fused_weights(model)
        if aux and not all(0 < i < len(self.weights.layers) for i in aux):
            raise UserError(
                f"layers {list(aux)} must lie in the target's decoder layers 1..{len(self.weights.layers) - 1}"
            )
        self.aux = [int(i) for i in aux] if aux else None
        self.aux_states: torch.Tensor | None = None
        cfg = model.config
        self.heads = cfg.num_attention_heads
        self.kv_heads = getattr(cfg, "num_key_value_heads", None) or self.heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.heads
        self.sizes = [self.heads * self.head_dim, self.kv_heads * self.head_dim, self.kv_heads * self.head_dim]
        emb = model.get_input_embeddings().weight
        self.device, self.dtype = emb.device, emb.dtype
        self.hidden = hidden
        self.vocab_size = vocab_size
        self.forwards = 0
        self._length = 0
        self._alloc(max(int(capacity), 1))

    def _alloc(self, capacity: int) -> None:
        shape = (1, self.kv_heads, capacity, self.head_dim)
        keys = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in self.weights.layers]
        values = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in self.weights.layers]
        if self._length:  # growing mid-sequence: carry the filled part over
            n = self._length
            for new, old in zip(keys + values, self.keys + self.values):
                new[:, :, :n] = old[:, :, :n]
        self.keys, self.values = keys, values
        positions = torch.arange(capacity, device=self.device).unsqueeze(0)
        probe = torch.zeros(1, 1, self.head_dim, dtype=self.dtype, device=self.device)
        cos, sin = self.model.model.rotary_emb(probe, positions)
        self.cos, self.sin = cos[0].to(self.dtype), sin[0].to(self.dtype)  # [capacity, head_dim]
        self.capacity = capacity

    @property
    def length(self) -> int:
        """Tokens held in the cache."""
        return self._length

    def reset(self) -> None:
        """Empties the cache (a new prompt)."""
        self._length = 0

    def trim(self, length: int) -> None:
        """Keeps the first ``length`` cached positions; later writes overwrite the rest."""
        self._length = min(self._length, max(int(length), 0))

    def kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Cached keys and values of ``layer``, ``[1, kv_heads, length, head_dim]`` (views)."""
        return self.keys[layer][:, :, : self._length], self.values[layer][:, :, : self._length]

    def _reserve(self, s: int) -> tuple[int, int]:
        """The cache slots ``start:end`` of ``s`` new tokens, capacity doubled until they fit."""
        start, end = self._length, self._length + s
        if end > self.capacity:
            cap = self.capacity
            while cap < end:
                cap *= 2
            self._alloc(cap)
        return start, end

    def forward(self, ids: torch.Tensor, n_logits: int = 1) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Consumes ``ids`` ``[1, S]`` after the cached prefix.

        Returns:
            logits ``[n_logits, V]`` for the last ``n_logits`` positions (0 = none) and the
            requested hidden state ``[S, d]`` (or None).
        """
        s = ids.shape[1]
        start, end = self._reserve(s)
        cos, sin = self.cos[start:end], self.sin[start:end]
        mask = None
        if s > 1 and start > 0:  # queries see the whole prefix and the causal part of the new block
            mask = torch.ones(s, end, dtype=torch.bool, device=self.device).tril(start)
        causal = s > 1 and start == 0
        x = self.model.get_input_embeddings()(ids)
        seen = dict.fromkeys(self.aux) if self.aux else None
        x = decoder_layers(self, x, cos, sin, self.keys, self.values, start, end, mask, causal, seen)
        if seen is not None:
            self.aux_states, self.aux_start = torch.cat([seen[i] for i in self.aux or ()], dim=-1)[0], start  # type: ignore[misc]
        self._length = end
        self.forwards += 1
        norm = self.model.model.norm
        hid = None
        if self.hidden == "pre":
            hid = x[0]
        if self.hidden == "post":
            hid = rms_norm(norm, x)[0]
            last = hid[s - n_logits :] if n_logits else hid[:0]
        else:
            last = rms_norm(norm, x[0, s - n_logits :]) if n_logits else x[0, :0]
        if n_logits:
            logits = output_logits(self.weights, last)
        else:
            logits = last.new_zeros(0, self.weights.lm_weight.shape[0])
        if self.vocab_size is not None and logits.shape[-1] != self.vocab_size:
            logits = logits[..., : self.vocab_size]
        return logits, hid

    def forward_tree(self, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Consumes ``ids`` ``[1, S]``, tokens of a tree of continuations of the cached sequence, in one forward:
        token ``j`` sits at rotary position ``positions[j]`` and attends where ``mask[j]`` (``[S, length + S]``,
        True = attend) says, i.e. the shared prefix and its own ancestors in the tree. Their keys and values
        stay in the cache after the prefix (a later tree level attends to them; ``trim`` drops them).

        Returns:
            the logits of every fed token ``[S, V]``.
        """
        s = ids.shape[1]
        start, end = self._reserve(s)
        x = self.model.get_input_embeddings()(ids)
        seen = dict.fromkeys(self.aux) if self.aux else None
        x = decoder_layers(
            self,
            x,
            self.cos[positions],
            self.sin[positions],
            self.keys,
            self.values,
            start,
            end,
            mask.to(self.device),
            False,
            seen,
        )
        if seen is not None:
            self.aux_states, self.aux_start = torch.cat([seen[i] for i in self.aux or ()], dim=-1)[0], start  # type: ignore[misc]
        self._length = end
        self.forwards += 1
        logits = output_logits(self.weights, rms_norm(self.model.model.norm, x[0]))
        if self.vocab_size is not None and logits.shape[-1] != self.vocab_size:
            logits = logits[..., : self.vocab_size]
        return logits

    def keep(self, start: int, rows: list[int]) -> None:
        """After the first ``start`` cached positions keeps only the entries at slots ``start + rows`` (in that
        order; a tree pass's accepted path), moved to ``start, start + 1, ...``; the ``aux_states`` of a pass
        that began at ``start`` follow."""
        if rows != list(range(len(rows))):
            idx = torch.tensor(rows, device=self.device) + start
            for buf in self.keys + self.values:
                buf[:, :, start : start + len(rows)] = buf[:, :, idx]
        self._length = start + len(rows)
        if self.aux_states is not None and self.aux_start == start:
            self.aux_states = self.aux_states[rows]

    def close(self) -> None:
        """Nothing to release (no hooks); kept for interface parity."""


def make_runner(
    model,
    hidden: str | None = None,
    vocab_size: int | None = None,
    capacity: int = 256,
    fused: bool = True,
    aux: list[int] | None = None,
    tree: bool = False,
):
    """The fastest runner that computes ``model`` exactly: the fused forward where it applies and
    pays (:func:`specheads.shim.runners.fused.use_fused`: CPU), else the model's own forward.
    ``tree``: the runner verifies draft trees, which only the fused forward does: it is used wherever it
    applies, on a GPU too."""
    if fused and (use_fused(model) or (tree and supports(model) is None)):
        return FusedRunner(model, hidden, vocab_size, capacity, aux)
    return ModelRunner(model, hidden, vocab_size, capacity, aux)
