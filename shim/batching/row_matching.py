"""Matching a serving engine's batch rows to the row proposer's cache slots by content, in time linear in the batch
(:class:`~.row_proposer.RowProposer`'s first two passes).

Every row's prefixes are hashed once (:class:`PrefixHash`, one vectorised pass over its tokens). A request that
continues is found by looking up its sequence as it was ``0 .. grow`` tokens ago among the slots' last sequences
(a dictionary keyed by length and hash), then confirmed token by token; a new request that shares a long prompt
with a free slot's cache is found by the hash of its first ``2**j`` tokens (``2**j`` at most half its length)
among those caches, comparing at most ``PROBES`` of them. No row is compared with every slot; the counts of
comparisons go to ``stats["compared"]``.
"""

from __future__ import annotations

import numpy as np

PROBES = 4  # free slots compared with a new request that shares its first tokens with them
_MUL = 0x9E3779B97F4A7C15  # odd: its powers never vanish modulo 2**64


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the longest common prefix of two 1-D integer arrays."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else n


class PrefixHash:
    """Hashes of every prefix of a token array: ``of(tokens)[n]`` hashes ``tokens[:n]`` (a polynomial in a fixed
    odd multiplier, modulo 2**64; with the length, a key that equal prefixes share and others almost never do)."""

    def __init__(self):
        self.powers = np.ones(1, dtype=np.uint64)

    def of(self, tokens: np.ndarray) -> np.ndarray:
        n = len(tokens)
        if len(self.powers) < n:
            grown = np.full(max(2 * n, 64), _MUL, dtype=np.uint64)
            grown[0] = 1
            self.powers = np.cumprod(grown, dtype=np.uint64)  # wraps modulo 2**64, as meant
        out = np.zeros(n + 1, dtype=np.uint64)
        np.cumsum((tokens.astype(np.uint64) + np.uint64(1)) * self.powers[:n], dtype=np.uint64, out=out[1:])
        return out


def continuations(
    rows: dict[int, np.ndarray],
    hashes: dict[int, np.ndarray],
    keys: list[tuple[int, int] | None],
    seen: list[np.ndarray | None],
    grow: int,
    stats: dict,
) -> dict[int, int]:
    """Row -> the slot whose request it continues: its sequence starts with the whole sequence ``seen[slot]`` that
    the slot last proposed for (``keys[slot]``: its length and hash), at most ``grow`` tokens shorter; the longest
    such sequence first, each slot to one row."""
    index: dict[tuple[int, int], list[int]] = {}
    for s, key in enumerate(keys):
        if key is not None:
            index.setdefault(key, []).append(s)
    hits = [
        (n, i)
        for i, seq in rows.items()
        for n in range(len(seq), max(len(seq) - grow, 1) - 1, -1)
        if (n, int(hashes[i][n])) in index
    ]
    out: dict[int, int] = {}
    for n, i in sorted(hits, key=lambda h: -h[0]):
        bucket = index[(n, int(hashes[i][n]))]
        if i in out or not bucket:
            continue
        stats["compared"] += 1
        held = seen[bucket[-1]]
        if held is not None and np.array_equal(rows[i][:n], held):  # the hash found it; the tokens confirm it
            out[i] = bucket.pop()
    return out


def shared_prompts(
    rows: dict[int, np.ndarray],
    hashes: dict[int, np.ndarray],
    slot_of: dict[int, int],
    held: list[np.ndarray],
    held_hash: list[np.ndarray | None],
    idle: list[int],
    hasher: PrefixHash,
    stats: dict,
) -> dict[int, int]:
    """Row (not in ``slot_of``) -> a free slot among ``idle`` (idle longest first) whose cache ``held[slot]`` shares at
    least half the row's sequence (the longest share of the ``PROBES`` compared). ``held_hash`` caches each
    slot's prefix hashes (None: to compute)."""
    rest = [i for i in rows if i not in slot_of]
    if not rest:
        return {}
    taken = set(slot_of.values())
    starts: dict[tuple[int, int], list[int]] = {}  # (2**j, hash of a cache's first 2**j tokens) -> slots
    for s in reversed(idle):  # each list ends with the slot idle longest
        if s in taken or not len(held[s]):
            continue
        prefix = held_hash[s]
        if prefix is None:
            prefix = held_hash[s] = hasher.of(held[s])
        q = 1
        while q <= len(held[s]):
            starts.setdefault((q, int(prefix[q])), []).append(s)
            q *= 2
    out: dict[int, int] = {}
    for i in sorted(rest, key=lambda i: -len(rows[i])):
        seq, need = rows[i], (len(rows[i]) + 1) // 2
        q = 1 << (need.bit_length() - 1)  # a cache sharing >= need tokens shares the first q
        bucket = starts.get((q, int(hashes[i][q])), [])
        while bucket and bucket[-1] in taken:
            bucket.pop()  # a slot leaves a list once
        best, most = None, need - 1
        for s in [s for s in bucket[-2 * PROBES :] if s not in taken][-PROBES:]:
            stats["compared"] += 1
            n = common_prefix(seq, held[s])
            if n > most:
                best, most = s, n
        if best is not None:
            out[i] = best
            taken.add(best)
    return out
