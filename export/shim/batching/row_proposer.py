"""Drafting for a serving engine that hands over token ids only (vLLM's ``custom_class`` proposer).

The engine calls :meth:`RowProposer.propose` once per step with each running request's whole sequence
(prompt and output so far) under its batch row, and takes back each row's candidates. It does not say
which request a row holds: rows are reordered, requests finish, join and are preempted, and the batch
row index follows none of that. So the draft's KV cache is kept by content: each cache slot of a
:class:`~.batch_kv.BatchRunner` remembers the tokens it holds, and each call matches every row to a slot
(:meth:`RowProposer._assign`): the slot whose request it continues (its sequence extends the one that slot's
request had at its last call), else one sharing at least half of its sequence, else the slot idle longest,
emptied. The slot is cut back to the shared prefix and fed
the rest. Whatever the engine does with its rows, a slot's cache is never used past the tokens it matched,
so a wrong match costs time (a re-prefill), never correctness; and the target verifies every candidate. A
request whose rounds drafted nothing (its draft gate closed) keeps its slot and policy while its cache falls
behind; when it drafts again, a cache more than ``CATCH_UP`` tokens behind is refilled by a prefill of its row
alone rather than fed through a batched forward as wide as its gap.

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

from specheads.export.shim.batching.batch_cache import BatchRunner
from specheads.export.shim.loop.drafting import take_candidate
from specheads.export.shim.loop.sampling import SamplingConfig
from specheads.export.shim.policies import Policy, Round

CATCH_UP = 16  # a cache more tokens behind than this is refilled by a prefill of its row alone


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the longest common prefix of two 1-D integer arrays."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else n


class RowProposer:
    """Candidates per batch row from token ids alone (see the module docstring).

    Args:
        draft: the draft model (Llama family: the fused forward), eval mode.
        policy: the stop rule (a same-vocabulary policy that drafts: ``sd``, ``specdecpp``,
            ``confidence_stop``); each slot runs its own fork.
        slots: draft cache slots (at least the engine's most concurrent requests).
        eos: EOS ids (a candidate EOS ends the round, as in the engine).
        vocab_size: the draft's logits are cut to this many columns (a padded output layer).
        capacity: initial cache slots per row.
    """

    def __init__(
        self,
        draft,
        policy: Policy,
        slots: int,
        eos: Sequence[int] = (),
        vocab_size: int | None = None,
        capacity: int = 512,
    ):
        if policy.bridge is not None or "draft" not in policy.models or policy.emitter != "target":
            raise ValueError(f"policy {policy.name} does not draft on the target's vocabulary")
        self.runner = BatchRunner(draft, slots, policy.draft_hidden, vocab_size, capacity)
        self.policies = [policy.fork() for _ in range(slots)]
        self.held = [np.zeros(0, dtype=np.int64) for _ in range(slots)]  # the tokens each slot's cache holds
        self.offered: list[list[int] | None] = [None] * slots  # the candidates offered at the last call
        self.seen: list[np.ndarray | None] = [None] * slots  # the sequence the slot's request had at its last call
        self.used = [-1] * slots  # the call that last matched the slot
        self.calls = 0
        self.eos = frozenset(int(e) for e in eos)
        self.sampling = SamplingConfig()
        self.stats = {
            "calls": 0,
            "rows": 0,
            "candidates": 0,
            "draft_forwards": 0,
            "prefills": 0,
            "matched_tokens": 0,
            "seconds": 0.0,
        }

    @torch.inference_mode()
    def propose(
        self, seqs: Mapping[int, Sequence[int]], limits: Mapping[int, int] | None = None
    ) -> dict[int, list[int]]:
        """Candidates for each row of ``seqs`` (row -> its token ids, prompt and output so far), at most
        ``limits[row]`` (default: the policy's most) for each."""
        start = time.perf_counter()
        self.calls += 1
        rows = {i: np.asarray(s, dtype=np.int64) for i, s in seqs.items() if len(s)}
        slot_of = self._assign(rows)
        rounds: dict[int, Round] = {}
        for i, slot in slot_of.items():
            seq, policy = rows[i], self.policies[slot]
            limit = policy.max_candidates() if limits is None else min(policy.max_candidates(), limits.get(i, 0))
            rnd = Round(self.sampling, None, limit=max(limit, 0), position=len(seq), eos=self.eos)
            policy.batch = len(rows)
            policy.start_round(rnd)
            if rnd.limit > 0 and policy.draft_round():
                rounds[slot] = rnd
        for i, s in slot_of.items():  # a cache far behind (rounds that drafted nothing) catches up in the prefill
            if s in rounds and len(rows[i]) - len(self.held[s]) > CATCH_UP:
                self.runner.trim(s, 0)
                self.held[s] = self.held[s][:0]
        self._prefill({s: rows[i] for i, s in slot_of.items() if s in rounds})
        feed = {s: rows[i][len(self.held[s]) :] for i, s in slot_of.items() if s in rounds}
        while feed:
            out = self.runner.forward(
                {s: t.tolist() if isinstance(t, np.ndarray) else t for s, t in feed.items()}, {s: 1 for s in feed}
            )
            self.stats["draft_forwards"] += 1
            nxt = {}
            for s, fed in feed.items():
                self.held[s] = np.concatenate(
                    [self.held[s], np.asarray(fed if isinstance(fed, np.ndarray) else [int(fed[0])], dtype=np.int64)]
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
            result[i] = cand
        self.stats["calls"] += 1
        self.stats["rows"] += len(rows)
        self.stats["candidates"] += sum(len(c) for c in result.values())
        self.stats["seconds"] += time.perf_counter() - start
        return result

    def _assign(self, rows: dict[int, np.ndarray]) -> dict[int, int]:
        """Each row's slot, in three passes: a row that continues a slot's request (its sequence starts with
        the whole sequence that slot last proposed for) takes it, longest first; a row whose sequence shares
        at least half its length with a slot's cache (a long common prompt) takes that one as a new request;
        any other row takes the slot idle longest (lowest index first, so that the forwards run over few
        leading rows) with its cache emptied (its prompt then goes through one prefill). Slots are cut back
        to the matched prefix, and always before the sequence's last token (the next forward feeds it)."""
        n_slots = len(self.held)
        if len(rows) > n_slots:
            raise ValueError(f"{len(rows)} rows but {n_slots} draft cache slots: raise the slots (vLLM: max_num_seqs)")
        lcp = {
            (i, s): common_prefix(seq, self.held[s])
            for i, seq in rows.items()
            for s in range(n_slots)
            if len(self.held[s])
        }
        seen = {s: v for s in range(n_slots) if (v := self.seen[s]) is not None}
        same = {
            (i, s): len(v)
            for i, seq in rows.items()
            for s, v in seen.items()
            if len(seq) >= len(v) and common_prefix(seq, v) == len(v)
        }
        slot_of: dict[int, int] = {}
        prefix: dict[int, int] = {}
        for pairs in (same, {k: n for k, n in lcp.items() if 2 * n >= len(rows[k[0]])}):
            for i, s in sorted(pairs, key=lambda k: -pairs[k]):
                if i not in slot_of and s not in slot_of.values():
                    slot_of[i], prefix[i] = s, lcp.get((i, s), 0)
        free = sorted((s for s in range(n_slots) if s not in slot_of.values()), key=lambda s: (self.used[s], s))
        for i in rows:
            if i not in slot_of:
                slot_of[i], prefix[i] = free.pop(0), 0
        for i, s in slot_of.items():
            seq, keep = rows[i], min(prefix[i], len(rows[i]) - 1)
            if (i, s) in same:
                self._close_round(s, seq)
            else:  # another request: a fresh policy
                self.policies[s].reset()
                self.offered[s] = self.seen[s] = None
            self.runner.trim(s, keep)
            self.held[s] = self.held[s][:keep]
            self.used[s] = self.calls
            self.stats["matched_tokens"] += keep
        return slot_of

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

    def _prefill(self, fresh: dict[int, np.ndarray]) -> None:
        """Empty slots with long sequences get all but the last token in one prefill forward."""
        todo = {s: seq[:-1].tolist() for s, seq in fresh.items() if not len(self.held[s]) and len(seq) > 1}
        if not todo:
            return
        self.runner.prefill(todo)
        for s, t in todo.items():
            self.held[s] = np.asarray(t, dtype=np.int64)
        self.stats["prefills"] += 1
