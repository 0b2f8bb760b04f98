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

from specheads.errors import UserError
from specheads.shim.core.stats import GenerationStats, count_tokens
from specheads.shim.loop.drafting import take_candidate
from specheads.shim.runners.eagle_cache import EagleCache, full_scores


def check_head(head, target) -> None:
    """UserError when an EAGLE head does not fit ``target`` (width, depth, vocabulary)."""
    cfg = target.config
    if head.hidden_size != cfg.hidden_size:
        raise UserError(
            f"the EAGLE head reads {head.hidden_size}-wide states, the target's are {cfg.hidden_size}: "
            "a head for another target"
        )
    if not all(0 < i < cfg.num_hidden_layers for i in head.layer_ids):
        raise UserError(
            f"the EAGLE head reads layers {head.layer_ids}, the target has {cfg.num_hidden_layers}: "
            "a head for another target"
        )
    if head.vocab_size > target.get_input_embeddings().weight.shape[0]:
        raise UserError(
            f"the EAGLE head's vocabulary ({head.vocab_size}) exceeds the target's: a head for another target"
        )


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
        self.passes = verifier.forwards  # the verifier's passes whose states were taken
        self.forwards = 0

    def draft(self, rnd, seq: list[int], room: int) -> None:
        a = self.feed(seq)
        if a is None:
            return
        dtype = self.cache.dtype
        while True:
            last = a[:, -1:]
            logits, hidden = self._logits(last[0, 0])
            if not take_candidate(rnd, self.policy, logits, hidden, self.generator):
                break
            count_tokens(self.stats, "draft", self.cache.length, 1)
            a = self.cache.forward(self.embed(rnd.tokens[-1].view(1, 1)).to(dtype), last)
            self.forwards += 1

    def feed(self, seq: list[int]) -> torch.Tensor | None:
        """Cuts the cache back to the target-fed entries and feeds the target states the last pass added;
        returns the head's states ``[1, s, d]`` of the fed entries (the last one scores ``x_N``), or None
        when the newest tokens have no target states yet (nothing to draft from)."""
        n = len(seq)
        self.cache.length = self.fed
        first = self.fed
        rows = [s[max(0, first - p) :] for p, s in self.pending if p + s.shape[0] > first]
        self.pending = []
        states = torch.cat(rows) if rows else None
        if states is None or first + states.shape[0] < n - 1:  # no target states for the newest tokens
            return None
        states = states[: n - 1 - first]
        dtype = self.cache.dtype
        emb = self.embed(torch.tensor([seq[first + 1 : n]], device=self.device)).to(dtype)
        count_tokens(self.stats, "draft", first, emb.shape[1])
        a = self.cache.forward(emb, self.head.fuse(states.to(dtype))[None])
        self.fed = self.cache.length
        self.forwards += 1
        return a

    def _logits(self, a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The candidate's scores over the whole vocabulary (``-inf`` outside the head's) and its state."""
        post = self.head.norm(a)
        hidden = {"pre": a, "post": post}.get(self.policy.draft_hidden)
        return full_scores(self.head, self.vocab, post, self.width), hidden

    def commit(self, seq: list[int], new: list[int], kept: int) -> None:
        """Keeps the target states of the pass that just ran (positions up to ``len(seq) - 2``)."""
        v = self.verifier
        if v.forwards == self.passes or v.aux_states is None:
            return  # no new pass this round
        self.passes = v.forwards
        states, start = v.aux_states, v.aux_start
        usable = len(seq) - 1 - start
        if usable > 0:  # on the head's device: a split target's states come out on the last GPU the head reads
            self.pending.append((start, states[:usable].to(self.device)))

    def close(self) -> None:
        pass
