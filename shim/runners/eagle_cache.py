"""An EAGLE head's own KV cache and its draft step behind the runners' interface (no policy imports: the
cost table times the step through here)."""

from __future__ import annotations

import torch

from specheads.shim.runners.kernels import route


class EagleCache:
    """The head's KV cache (``[layers, 1, kv_heads, capacity, hd]``), its entries' count and the cached rotary
    table."""

    keys: torch.Tensor
    values: torch.Tensor

    def __init__(self, head, capacity: int, device, dtype):
        self.head, self.device, self.dtype = route(head), device, dtype  # linears on the kernels measured fastest
        self.length = 0
        self._alloc(max(capacity, 8))

    def _alloc(self, capacity: int) -> None:
        shape = (self.head.num_layers, 1, self.head.num_kv_heads, capacity, self.head.head_dim)
        keys, values = torch.zeros(shape, dtype=self.dtype), torch.zeros(shape, dtype=self.dtype)
        if self.length:
            keys[..., : self.length, :] = self.keys[..., : self.length, :]
            values[..., : self.length, :] = self.values[..., : self.length, :]
        self.keys, self.values = keys.to(self.device), values.to(self.device)
        self.cos, self.sin = self.head.rope(torch.arange(capacity, device=self.device))
        self.capacity = capacity

    def forward(self, emb: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """Feeds ``s`` entries ``[1, s, d]`` at the next positions; returns the head's states ``[1, s, d]``."""
        s = emb.shape[1]
        start, end = self.length, self.length + s
        mask = torch.ones(s, end, dtype=torch.bool, device=self.device).tril(start) if s > 1 else None
        return self._feed(emb, h, slice(start, end), mask)

    def forward_tree(
        self, emb: torch.Tensor, h: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        """Feeds ``s`` entries ``[1, s, d]`` of a draft tree into the next slots: entry ``j`` sits at rotary
        position ``positions[j]`` and attends where ``mask[j]`` (``[s, length + s]``, True = attend) says (the
        fed prefix, its ancestors, itself). Returns the head's states ``[1, s, d]``."""
        return self._feed(emb, h, positions, mask.to(self.device))

    def _feed(self, emb: torch.Tensor, h: torch.Tensor, positions, mask: torch.Tensor | None) -> torch.Tensor:
        """Writes the entries' keys and values into the next slots and attends under ``mask`` (None: the one
        entry sees every slot); ``positions`` index the rotary table (a slice or a tensor)."""
        start, end = self.length, self.length + emb.shape[1]
        if end > self.capacity:
            self._alloc(max(end, 2 * self.capacity))
        cos, sin = self.cos[positions], self.sin[positions]
        for layer in range(self.head.num_layers):
            keys, values = self.keys[layer], self.values[layer]
            q, k, v = self.head.qkv(emb, h, cos, sin, layer)
            keys[:, :, start:end], values[:, :, start:end] = k, v
            h = self.head.finish(self.head.attend(q, keys[:, :, :end], values[:, :, :end], mask), h, layer)
        self.length = end
        return h


def full_scores(head, vocab: torch.Tensor, post: torch.Tensor, width: int) -> torch.Tensor:
    """The head's scores for final-norm states ``post`` ``[..., d]`` over the whole vocabulary ``[..., width]``
    (fp32; ``-inf`` outside the head's rows ``vocab``, as a pruned draft's)."""
    small = head.lm_head(post).float()
    full = small.new_full((*small.shape[:-1], width), float("-inf"))
    return full.index_copy_(full.dim() - 1, vocab, small)


class EagleStepRunner:
    """An EAGLE head's draft step behind the model runners' interface (``forward``/``trim``/``close``), so the
    cost table times it as it times a draft model's forward: each fed token joins the previous step's state."""

    def __init__(self, head, target, capacity: int = 256):
        self.head, self.embed = head, target.get_input_embeddings()
        self.device = self.embed.weight.device
        self.cache = EagleCache(head, capacity, self.device, next(head.parameters()).dtype)
        self.state = torch.zeros(1, 1, head.hidden_size, dtype=self.cache.dtype, device=self.device)
        self.vocab = head.vocab_ids.to(self.device)
        self.width = head.vocab_size
        self.forwards = 0

    @property
    def length(self) -> int:
        return self.cache.length

    def forward(self, ids: torch.Tensor, n_logits: int = 1) -> tuple[torch.Tensor, None]:
        emb = self.embed(ids).to(self.cache.dtype)
        a = self.cache.forward(emb, self.state.expand(1, ids.shape[1], -1))
        self.state = a[:, -1:]
        self.forwards += 1
        if not n_logits:
            return a.new_zeros(0, self.width), None
        return full_scores(self.head, self.vocab, self.head.norm(a[0, -n_logits:]), self.width), None

    def trim(self, length: int) -> None:
        self.cache.length = min(self.cache.length, max(int(length), 0))

    def close(self) -> None:
        pass
