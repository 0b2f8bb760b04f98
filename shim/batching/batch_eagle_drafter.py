"""Drafting with an EAGLE head for a batch of rows (:class:`~.batch_loop.BatchEngine`).

Each row follows :class:`~.eagle_drafter.EagleDrafter`'s rule (cut the head's cache back to the entries the
target fed, feed the target states the last pass added, then roll the head's own state forward one
candidate per step), but the rows share the forwards: each step is one forward of the head over
every row still drafting. The head's cache keeps one row per batch row, each row's entries at slots
``0 .. length - 1`` (its rotary positions), so a row is cut by setting its length and a finished
row's place is taken by resetting it to zero.

A row that joins drafts nothing in its first round, as a prompt alone does (there, the first pass is
the prompt's prefill and no target states exist before it); the states of the batch's prefill are
kept for its later rounds. A row whose round skipped the target pass drafts nothing in its next round,
as alone.
"""

from __future__ import annotations

import torch

from specheads.shim.core.stats import count_tokens
from specheads.shim.loop.drafting import take_candidate
from specheads.shim.runners.eagle_cache import full_scores
from specheads.shim.runners.kernels import route


class BatchEagleCache:
    """The head's KV cache (``[layers, rows, kv_heads, capacity, hd]``) for ``rows`` rows of their own lengths
    (``length[r]``)."""

    keys: torch.Tensor
    values: torch.Tensor

    def __init__(self, head, rows: int, capacity: int, device, dtype):
        self.head, self.rows, self.device, self.dtype = route(head), rows, device, dtype
        self.length = [0] * rows
        self.capacity = 0
        self._alloc(max(capacity, 8))

    def _alloc(self, capacity: int) -> None:
        shape = (self.head.num_layers, self.rows, self.head.num_kv_heads, capacity, self.head.head_dim)
        keys = torch.zeros(shape, dtype=self.dtype, device=self.device)
        values = torch.zeros(shape, dtype=self.dtype, device=self.device)
        if self.capacity:
            keys[..., : self.capacity, :], values[..., : self.capacity, :] = self.keys, self.values
        self.keys, self.values, self.capacity = keys, values, capacity
        self.cos, self.sin = self.head.rope(torch.arange(capacity, device=self.device))

    def forward(self, feeds: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> dict[int, torch.Tensor]:
        """Feeds each row ``r`` its entries ``(emb, h)`` (``[s_r, d]`` each) after the ones it holds, in one
        forward over those rows; returns the head's states ``[s_r, d]`` per row."""
        rows = list(feeds)
        width = max(feeds[r][0].shape[0] for r in rows)
        end = max(self.length[r] + feeds[r][0].shape[0] for r in rows)
        if end > self.capacity:
            self._alloc(max(end, 2 * self.capacity))
        d = self.head.hidden_size
        emb = torch.zeros(len(rows), width, d, dtype=self.dtype, device=self.device)
        h = torch.zeros_like(emb)
        pos = torch.zeros(len(rows), width, dtype=torch.long, device=self.device)
        for i, r in enumerate(rows):
            e, s = feeds[r]
            emb[i, : e.shape[0]], h[i, : e.shape[0]] = e, s
            pos[i] = torch.arange(self.length[r], self.length[r] + width, device=self.device)
        cos, sin = self.cos[pos.clamp_max(self.capacity - 1)], self.sin[pos.clamp_max(self.capacity - 1)]
        idx = torch.tensor(rows, device=self.device)
        # query j of row r sees the row's slots up to its own (padding queries see the row's real ones)
        last = torch.tensor([self.length[r] + feeds[r][0].shape[0] - 1 for r in rows], device=self.device)
        see = torch.minimum(pos, last[:, None])
        mask = torch.arange(end, device=self.device)[None, None, :] <= see[:, :, None]
        a = h
        for layer in range(self.head.num_layers):
            keys, values = self.keys[layer], self.values[layer]
            q, k, v = self.head.qkv(emb, a, cos, sin, layer)
            for i, r in enumerate(rows):
                n, at = feeds[r][0].shape[0], self.length[r]
                keys[r, :, at : at + n], values[r, :, at : at + n] = k[i, :, :n], v[i, :, :n]
            attn = self.head.attend(q, keys[idx, :, :end], values[idx, :, :end], mask[:, None])
            a = self.head.finish(attn, a, layer)
        out = {}
        for i, r in enumerate(rows):
            n = feeds[r][0].shape[0]
            self.length[r] += n
            out[r] = a[i, :n]
        return out


class BatchEagleDrafter:
    """The batch engine's drafter for an EAGLE head.

    Args:
        head: the loaded head (eval mode); target: the target model (its embeddings are the head's).
        verifier: the target's :class:`~.batch_cache.BatchRunner`, built with ``aux=head.layer_ids``.
        rows: batch rows; capacity: initial cache slots per row.
    """

    def __init__(self, head, target, verifier, rows: int, capacity: int):
        self.head, self.verifier = head, verifier
        self.embed = target.get_input_embeddings()
        self.device = self.embed.weight.device
        self.cache = BatchEagleCache(head, rows, capacity, self.device, next(head.parameters()).dtype)
        self.vocab = head.vocab_ids.to(self.device)
        self.width = verifier.vocab_size or target.get_output_embeddings().weight.shape[0]
        self.fed = [0] * rows
        self.pending: list[list[tuple[int, torch.Tensor]]] = [[] for _ in range(rows)]
        self.hold = [False] * rows

    def join(self, r: int, seq: list[int]) -> None:
        """Row ``r`` starts a prompt whose prefill just ran: keeps its states, drafts nothing this round."""
        self.clear(r)
        self.take(r, seq)
        self.hold[r] = True

    def clear(self, r: int) -> None:
        self.cache.length[r], self.fed[r], self.pending[r], self.hold[r] = 0, 0, [], False

    def take(self, r: int, seq: list[int]) -> None:
        """Keeps the target states row ``r`` got from the verifier's last forward (positions up to
        ``len(seq) - 2``); nothing when the row was not in it."""
        self.hold[r] = False  # its first round is over, drafted or not
        got = self.verifier.aux_states.get(r)
        if got is None:
            return
        start, states = got
        usable = len(seq) - 1 - start
        if usable > 0:
            self.pending[r].append((start, states[:usable]))

    def draft(self, rows, drafting: list[int]) -> None:
        """Draft steps until every row's policy stops: one head forward per step over the rows drafting."""
        dtype = self.cache.dtype
        feeds = {}
        for r in drafting:
            if self.hold[r]:
                continue
            feed = self._feed(r, rows[r].seq, rows[r].stats)
            if feed is not None:
                feeds[r] = feed
        while feeds:
            out = self.cache.forward(feeds)
            live = list(out)
            last = torch.stack([out[r][-1] for r in live])
            post = self.head.norm(last)
            scores = full_scores(self.head, self.vocab, post, self.width)
            feeds = {}
            for i, r in enumerate(live):
                row = rows[r]
                row.forwards += 1
                hidden = {"pre": last[i], "post": post[i]}.get(row.policy.draft_hidden)
                if take_candidate(row.rnd, row.policy, scores[i], hidden, row.generator):
                    count_tokens(row.stats, "draft", self.cache.length[r], 1)
                    feeds[r] = (self.embed(row.rnd.tokens[-1].view(1)).to(dtype), last[i : i + 1])

    def _feed(self, r: int, seq: list[int], stats) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Cuts row ``r`` back to its target-fed entries and returns the entries the last pass's states add
        (None when the newest tokens have no target states yet)."""
        n, first = len(seq), self.fed[r]
        self.cache.length[r] = first
        parts = [s[max(0, first - p) :] for p, s in self.pending[r] if p + s.shape[0] > first]
        self.pending[r] = []
        states = torch.cat(parts) if parts else None
        if states is None or first + states.shape[0] < n - 1:
            return None
        dtype = self.cache.dtype
        states = states[: n - 1 - first]
        emb = self.embed(torch.tensor(seq[first + 1 : n], device=self.device)).to(dtype)
        count_tokens(stats, "draft", first, emb.shape[0])
        self.fed[r] = n - 1
        return emb, self.head.fuse(states.to(dtype))
