"""Drafting from the target's own states with an EAGLE head (:class:`specheads.heads.EagleHead`).

The verification pass runs anyway; its runner keeps the target's residual stream entering the head's
layers (``aux``) at every position it consumed. After a round commits ``S`` (length ``N``), the target
has states at positions ``0..N-2`` (it holds ``S[:-1]``), and the head holds one cache entry per
position ``p`` it was fed: the fused state ``g_p`` joined to the embedding of ``x_{p+1}``. Drafting a
round then

1. cuts the head's cache back to the entries the target fed (its own speculative entries of the last
   round are dropped: the rejected ones are wrong and the accepted ones are replaced by the target's);
2. feeds the positions the last pass added, in one forward; the last one's output scores ``x_N``;
3. rolls its own state forward: the next entry joins the candidate's embedding to the head's output
   state at the position before, one entry per further candidate, until the policy stops.

Every same-vocabulary policy drafts through it unchanged: candidates, their distributions (over the
pruned vocabulary, ``-inf`` elsewhere, like a pruned draft's) and the head's state per candidate for
the stop heads. A round that ended without a target pass (a policy that ``may_skip_target``) leaves no
target states for its tokens: the next round drafts nothing, and its pass (one token) supplies them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specheads.errors import UserError

from .drafting import take_candidate
from .stats import GenerationStats, count_tokens


def check_head(head, target) -> None:
    """UserError when an EAGLE head does not fit ``target`` (width, depth, vocabulary)."""
    cfg = target.config
    if head.hidden_size != cfg.hidden_size:
        raise UserError(f"the EAGLE head reads {head.hidden_size}-wide states, the target's are {cfg.hidden_size}: "
                        "a head for another target")
    if not all(0 < i < cfg.num_hidden_layers for i in head.layer_ids):
        raise UserError(f"the EAGLE head reads layers {head.layer_ids}, the target has {cfg.num_hidden_layers}: "
                        "a head for another target")
    if head.vocab_size > target.get_input_embeddings().weight.shape[0]:
        raise UserError(f"the EAGLE head's vocabulary ({head.vocab_size}) exceeds the target's: a head for another "
                        "target")


class EagleCache:
    """The head's KV cache (one layer), its entries' count and the cached rotary table."""

    def __init__(self, head, capacity: int, device, dtype):
        self.head, self.device, self.dtype = head, device, dtype
        self.length = 0
        self._alloc(max(capacity, 8))

    def _alloc(self, capacity: int) -> None:
        shape = (1, self.head.num_kv_heads, capacity, self.head.head_dim)
        keys, values = torch.zeros(shape, dtype=self.dtype), torch.zeros(shape, dtype=self.dtype)
        if self.length:
            keys[:, :, : self.length] = self.keys[:, :, : self.length]
            values[:, :, : self.length] = self.values[:, :, : self.length]
        self.keys, self.values = keys.to(self.device), values.to(self.device)
        self.cos, self.sin = self.head.rope(torch.arange(capacity, device=self.device))
        self.capacity = capacity

    def forward(self, emb: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """Feeds ``s`` entries ``[1, s, d]`` at the next positions; returns the head's states ``[1, s, d]``."""
        s = emb.shape[1]
        start, end = self.length, self.length + s
        if end > self.capacity:
            self._alloc(max(end, 2 * self.capacity))
        q, k, v = self.head.qkv(emb, h, self.cos[start:end], self.sin[start:end])
        self.keys[:, :, start:end], self.values[:, :, start:end] = k, v
        mask = torch.ones(s, end, dtype=torch.bool, device=self.device).tril(start) if s > 1 else None
        attn = F.scaled_dot_product_attention(q, self.keys[:, :, :end], self.values[:, :, :end], attn_mask=mask,
                                              enable_gqa=self.head.num_kv_heads != self.head.num_heads)
        self.length = end
        return self.head.finish(attn, h)


class EagleDrafter:
    """The engine's drafter for an EAGLE head (same interface as the draft model's drafter).

    Args:
        head: the loaded head (eval mode).
        target: the target model (its token embeddings are the head's).
        verifier: the target's runner, built with ``aux=head.layer_ids``.
        policy, stats, generator: the round's policy, the prompt's stats, the draws' RNG.
        capacity: initial cache length.
    """

    def __init__(self, head, target, verifier, policy, stats: GenerationStats, generator, capacity: int):
        self.head, self.verifier, self.policy, self.stats, self.generator = head, verifier, policy, stats, generator
        self.embed = target.get_input_embeddings()
        self.device = self.embed.weight.device
        dtype = next(head.parameters()).dtype
        self.cache = EagleCache(head, capacity, self.device, dtype)
        self.vocab = head.vocab_ids.to(self.device)
        self.width = verifier.vocab_size or target.get_output_embeddings().weight.shape[0]
        self.fed = 0  # entries fed with the target's states (positions 0..fed-1)
        self.pending: list[tuple[int, torch.Tensor]] = []  # (first position, states) not fed yet
        self.forwards = 0

    def draft(self, rnd, seq: list[int], room: int) -> None:
        n = len(seq)
        self.cache.length = self.fed
        first = self.fed
        rows = [s[max(0, first - p):] for p, s in self.pending if p + s.shape[0] > first]
        self.pending = []
        states = torch.cat(rows) if rows else None
        if states is None or first + states.shape[0] < n - 1:  # no target states for the newest tokens
            return
        states = states[: n - 1 - first]
        dtype = self.cache.dtype
        emb = self.embed(torch.tensor([seq[first + 1: n]], device=self.device)).to(dtype)
        count_tokens(self.stats, "draft", first, emb.shape[1])
        a = self.cache.forward(emb, self.head.fuse(states.to(dtype))[None])
        self.fed = self.cache.length
        self.forwards += 1
        while True:
            last = a[:, -1:]
            logits, hidden = self._logits(last[0, 0])
            if not take_candidate(rnd, self.policy, logits, hidden, self.generator):
                break
            count_tokens(self.stats, "draft", self.cache.length, 1)
            a = self.cache.forward(self.embed(rnd.tokens[-1].view(1, 1)).to(dtype), last)
            self.forwards += 1

    def _logits(self, a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The candidate's scores over the whole vocabulary (``-inf`` outside the head's) and its state."""
        post = self.head.norm(a)
        small = self.head.lm_head(post).float()
        full = small.new_full((self.width,), float("-inf"))
        full.index_copy_(0, self.vocab, small)
        hidden = {"pre": a, "post": post}.get(self.policy.draft_hidden)
        return full, hidden

    def commit(self, seq: list[int], new: list[int], kept: int) -> None:
        """Keeps the target states of the pass that just ran (positions up to ``len(seq) - 2``)."""
        v = self.verifier
        states, start = getattr(v, "aux_states", None), getattr(v, "aux_start", None)
        if states is None or start is None or getattr(v, "_eagle_seen", None) == v.forwards:
            return  # no new pass this round
        v._eagle_seen = v.forwards
        usable = len(seq) - 1 - start
        if usable > 0:
            self.pending.append((start, states[:usable]))

    def close(self) -> None:
        pass


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
        small = self.head.lm_head(self.head.norm(a[0, -n_logits:])).float()
        full = small.new_full((small.shape[0], self.width), float("-inf"))
        return full.index_copy_(1, self.vocab, small), None

    def trim(self, length: int) -> None:
        self.cache.length = min(self.cache.length, max(int(length), 0))

    def close(self) -> None:
        pass
