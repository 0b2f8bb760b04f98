"""Drafting for a serving engine that hands over token ids only (vLLM's ``custom_class`` proposer).

The engine calls :meth:`RowProposer.propose` once per step with each running request's whole sequence
(prompt and output so far) under its batch row, and takes back each row's candidates. It does not say
which request a row holds: rows are reordered, requests finish, join and are preempted, and the batch
row index follows none of that. So the draft's KV cache is kept by content: each cache slot of a
:class:`~.batch_cache.BatchRunner` remembers the tokens it holds, and each call matches every row to a slot
(:meth:`RowProposer._assign`): the slot whose request it continues (its sequence extends the one that slot's
request had at its last call), else one sharing at least half of its sequence, else the slot idle longest,
emptied. The slot is cut back to the shared prefix and fed
the rest. Whatever the engine does with its rows, a slot's cache is never used past the tokens it matched,
so a wrong match costs time (a re-prefill), never correctness; and the target verifies every candidate. A
request whose rounds drafted nothing (its draft gate closed) keeps its slot and policy while its cache falls
behind; when it drafts again, a cache more than ``CATCH_UP`` tokens behind is refilled by a prefill of its row
alone rather than fed through a batched forward as wide as its gap.

Matching is linear in the batch: every row's prefixes are hashed once (:class:`PrefixHash`); a continuing
request is found by looking up its sequence as it was at most ``1 +`` (the most candidates offered) tokens ago
among the slots' last sequences (a dictionary, then one exact check), and a new request by the hash of its
first ``2**j`` tokens (``2**j`` at most half its length) among the free slots' caches, comparing at most
``PROBES`` of them; no row is compared with every slot.

With ``max_tokens`` (a memory budget: a serving engine's), the cache is one fixed buffer of ``max_tokens //
slots`` tokens per slot, allocated at start-up and never grown. A row may hold ``window`` of them (the rest
leaves room for a forward's new tokens); a request whose sequence and candidates would pass that drafts from
its latest ``window // 2`` tokens (its cache refilled from there, again each time it outgrows it). The draft
then sees a shorter context, which costs acceptance, never correctness; joining rows are prefilled in groups
of at most one slot's tokens, so no forward holds more than the budget allows either.

Each slot has its own fork of the policy (its stop rule and head); its last round is closed with
``end_round`` when the slot's request comes back, with the number of its candidates that the sequence
now starts with (counted by content: a target token that happens to equal a candidate vLLM did not
verify counts as accepted, which only skews the policy's feedback). Drafting is greedy (the engine's verification
keeps the output exact) and ends at an
EOS candidate; each draft step is one forward over every row still drafting, the rows' pending tokens
fed in the first one.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence

import numpy as np
import torch

from specheads.shim.batching.row_matching import PrefixHash, common_prefix, continuations, shared_prompts
from specheads.shim.core.sampling import SamplingConfig
from specheads.shim.loop.drafting import take_candidate
from specheads.shim.policies import Policy, Round
from specheads.shim.runners.batch_cache import BatchRunner

CATCH_UP = 16  # a cache more tokens behind than this is refilled by a prefill of its row alone


class RowProposer:
    """Candidates per batch row from token ids alone (see the module docstring).

    Args:
        draft: the draft model (Llama family: the fused forward), eval mode.
        policy: the stop rule (a same-vocabulary policy that drafts: ``sd``, ``specdecpp``,
            ``confidence_stop``); each slot runs its own fork.
        slots: draft cache slots (at least the engine's most concurrent requests).
        eos: EOS ids (a candidate EOS ends the round, as in the engine).
        vocab_size: the draft's logits are cut to this many columns (a padded output layer).
        capacity: initial cache slots per row (without ``max_tokens``: the cache grows as rows need).
        max_tokens: the most tokens the cache holds over all slots (its memory budget), allocated now.
    """

    def __init__(
        self,
        draft,
        policy: Policy,
        slots: int,
        eos: Sequence[int] = (),
        vocab_size: int | None = None,
        capacity: int = 512,
        max_tokens: int | None = None,
    ):
        if policy.bridge is not None or "draft" not in policy.models or policy.emitter != "target":
            raise ValueError(f"policy {policy.name} does not draft on the target's vocabulary")
        self.window: int | None = None  # the most tokens a slot's cache may hold (None: no bound)
        if max_tokens is not None:
            capacity = int(max_tokens) // slots
            self.window = capacity - max(capacity // 8, CATCH_UP + 1)  # the rest: a forward's new tokens
            least = 2 * (policy.max_candidates() + 1)
            if self.window < least:
                raise ValueError(
                    f"{max_tokens} cache tokens give each of the {slots} slots {max(self.window, 0)} usable tokens; "
                    f"drafting {policy.max_candidates()} candidates needs at least {least}"
                )
        self.runner = BatchRunner(draft, slots, policy.draft_hidden, vocab_size, capacity, fixed=max_tokens is not None)
        self.policies = [policy.fork() for _ in range(slots)]
        self.held = [np.zeros(0, dtype=np.int64) for _ in range(slots)]  # the tokens each slot's cache holds
        self.offset = [0] * slots  # where in its request's sequence the slot's cache starts (a window: > 0)
        self.offered: list[list[int] | None] = [None] * slots  # the candidates offered at the last call
        self.seen: list[np.ndarray | None] = [None] * slots  # the sequence the slot's request had at its last call
        self.key: list[tuple[int, int] | None] = [None] * slots  # (length, hash) of ``seen``
        self.used = [-1] * slots  # the call that last matched the slot
        self.calls = 0
        self.hasher = PrefixHash()
        self._held_hash: list[np.ndarray | None] = [None] * slots  # prefix hashes of ``held``, while it holds
        self.eos = frozenset(int(e) for e in eos)
        self.sampling = SamplingConfig()
        self.stats = {
            "calls": 0,
            "rows": 0,
            "candidates": 0,
            "draft_forwards": 0,
            "prefills": 0,
            "matched_tokens": 0,
            "compared": 0,  # row-slot content comparisons made by matching
            "windowed": 0,  # caches refilled from a request's latest tokens (the budget)
            "seconds": 0.0,
        }

    @staticmethod
    def tokens_for(length: int, slots: int) -> int:
        """The ``max_tokens`` whose window holds ``length`` tokens in each of ``slots`` slots."""
        return slots * max(length + CATCH_UP + 1, -(-8 * length // 7))

    @staticmethod
    def bytes_per_token(draft) -> int:
        """Bytes of the draft's KV cache per token (keys and values of every layer)."""
        cfg, emb = draft.config, draft.get_input_embeddings().weight
        heads = cfg.num_attention_heads
        kv, hd = getattr(cfg, "num_key_value_heads", None) or heads, getattr(cfg, "head_dim", None)
        return 2 * cfg.num_hidden_layers * kv * (hd or cfg.hidden_size // heads) * emb.element_size()

    @torch.inference_mode()
    def propose(
        self, seqs: Mapping[int, Sequence[int]], limits: Mapping[int, int] | None = None
    ) -> dict[int, list[int]]:
        """Candidates for each row of ``seqs`` (row -> its token ids, prompt and output so far), at most
        ``limits[row]`` (default: the policy's most) for each."""
        start = time.perf_counter()
        self.calls += 1
        rows = {i: np.asarray(s, dtype=np.int64) for i, s in seqs.items() if len(s)}
        slot_of, hashes = self._assign(rows)
        rounds: dict[int, Round] = {}
        for i, slot in slot_of.items():
            seq, policy = rows[i], self.policies[slot]
            limit = policy.max_candidates() if limits is None else min(policy.max_candidates(), limits.get(i, 0))
            rnd = Round(self.sampling, None, limit=max(limit, 0), position=len(seq), eos=self.eos)
            policy.batch = len(rows)
            policy.start_round(rnd)
            if rnd.limit > 0 and policy.draft_round():
                rounds[slot] = rnd
        views = {s: self._view(s, rows[i], rounds[s].limit) for i, s in slot_of.items() if s in rounds}
        self._prefill(views)
        feed = {s: v[len(self.held[s]) :] for s, v in views.items()}
        while feed:
            out = self.runner.forward(
                {s: t.tolist() if isinstance(t, np.ndarray) else t for s, t in feed.items()}, {s: 1 for s in feed}
            )
            self.stats["draft_forwards"] += 1
            nxt = {}
            for s, fed in feed.items():
                self._hold(
                    s,
                    np.concatenate(
                        [self.held[s], np.asarray(fed if isinstance(fed, np.ndarray) else [int(fed[0])], np.int64)]
                    ),
                )
                logits, hid = out[s]
                rnd = rounds[s]
                going = take_candidate(rnd, self.policies[s], logits[0], hid[-1] if hid is not None else None, None)
                if going and int(rnd.tokens[-1]) not in self.eos:  # nothing after an EOS is ever kept
                    nxt[s] = rnd.tokens[-1].view(1)
            feed = nxt
        result = {}
        for i, slot in slot_of.items():
            cand = [int(t) for t in rounds[slot].tokens] if slot in rounds else []
            self.offered[slot], self.seen[slot] = cand, rows[i]
            self.key[slot] = (len(rows[i]), int(hashes[i][-1]))
            result[i] = cand
        self.stats["calls"] += 1
        self.stats["rows"] += len(rows)
        self.stats["candidates"] += sum(len(c) for c in result.values())
        self.stats["seconds"] += time.perf_counter() - start
        return result

    def _view(self, s: int, seq: np.ndarray, limit: int) -> np.ndarray:
        """The part of ``seq`` the slot's cache covers this round (all of it but past the window), its cache emptied
        where it is to be refilled: a new window, or a cache more than ``CATCH_UP`` tokens behind (a prefill of
        the row alone rather than a batched forward as wide as its gap)."""
        view = seq[self.offset[s] :]
        if self.window is not None and len(view) + limit - 1 > self.window:  # the sequence and its candidates
            self.offset[s] = len(seq) - self.window // 2
            self._hold(s, self.held[s][:0])
            self.stats["windowed"] += 1
            return seq[self.offset[s] :]
        if len(view) - len(self.held[s]) > CATCH_UP:
            self._hold(s, self.held[s][:0])
        return view

    def _hold(self, s: int, tokens: np.ndarray) -> None:
        """What slot ``s``'s cache holds now (the runner cut to it)."""
        if len(tokens) < self.runner.length(s):
            self.runner.trim(s, len(tokens))
        self.held[s], self._held_hash[s] = tokens, None

    def _assign(self, rows: dict[int, np.ndarray]) -> tuple[dict[int, int], dict[int, np.ndarray]]:
        """Each row's slot (and each row's prefix hashes), in three passes: a row that continues a slot's request
        (its sequence starts with the whole sequence that slot last proposed for) takes it, longest first; a row
        whose sequence shares at least half its length with a free slot's cache (a long common prompt) takes that
        one as a new request; any other row takes the slot idle longest (lowest index first, so that the forwards
        run over few leading rows) with its cache emptied (its prompt then goes through one prefill). Slots are
        cut back to the matched prefix, and always before the sequence's last token (the next forward feeds it)."""
        n_slots = len(self.held)
        if len(rows) > n_slots:
            raise ValueError(f"{len(rows)} rows but {n_slots} draft cache slots: raise the slots (vLLM: max_num_seqs)")
        hashes = {i: self.hasher.of(seq) for i, seq in rows.items()}
        grow = 1 + max((len(c) for c in self.offered if c), default=0)  # a request's most tokens since its last call
        slot_of = continuations(rows, hashes, self.key, self.seen, grow, self.stats)
        same = set(slot_of)
        idle = sorted((s for s in range(n_slots) if not self.offset[s]), key=lambda s: self.used[s])  # no window
        slot_of.update(shared_prompts(rows, hashes, slot_of, self.held, self._held_hash, idle, self.hasher, self.stats))
        matched = set(slot_of)
        taken = set(slot_of.values())
        free = iter(sorted((s for s in range(n_slots) if s not in taken), key=lambda s: (self.used[s], s)))
        for i in rows:
            if i not in slot_of:
                slot_of[i] = next(free)
        for i, s in slot_of.items():
            seq = rows[i]
            if i in same:
                self._close_round(s, seq)
            else:  # another request: a fresh policy, its cache from the sequence's start
                self.policies[s].reset()
                self.offered[s] = self.seen[s] = self.key[s] = None
                if self.offset[s]:
                    self.offset[s] = 0
                    self._hold(s, self.held[s][:0])
            view = seq[self.offset[s] :]
            keep = min(common_prefix(view, self.held[s]), len(view) - 1) if i in matched else 0
            self._hold(s, self.held[s][:keep])
            self.used[s] = self.calls
            self.stats["matched_tokens"] += keep
        return slot_of, hashes

    def _close_round(self, s: int, seq: np.ndarray) -> None:
        """Ends the slot's last round: how many of its candidates the sequence went on with."""
        seen, cand = self.seen[s], self.offered[s]
        if cand is None or seen is None:
            return
        base = len(seen)
        self.offered[s] = None
        kept = seq[base : base + len(cand)]
        accepted = common_prefix(kept, np.asarray(cand, dtype=np.int64))
        self.policies[s].end_round(len(cand), accepted)

    def _prefill(self, views: dict[int, np.ndarray]) -> None:
        """Empty slots with long sequences get all but the last token in one prefill forward (with a budget: in
        groups of at most one slot's tokens, longest first, so that no forward holds more than the cache)."""
        todo = sorted(
            ((s, v[:-1]) for s, v in views.items() if not len(self.held[s]) and len(v) > 1), key=lambda t: -len(t[1])
        )
        while todo:
            group = todo if self.window is None else todo[: max(1, self.runner.capacity // len(todo[0][1]))]
            todo = todo[len(group) :]
            self.runner.prefill({s: t.tolist() for s, t in group})
            for s, t in group:
                self._hold(s, t)
            self.stats["prefills"] += 1
