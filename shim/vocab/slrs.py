"""SLRS: string-level rejection sampling (Timor et al., Algorithm 3, Theorems 3.1 and 3.2), lossless across
vocabularies.

One SLRS step proposes one target token. The draft samples draft tokens ``d_1, d_2, ...`` from its (warped)
distribution until the lookahead condition holds; the drafted string ``s = d_1 + ... + d_i`` gives the
candidate ``t_1``, its first target token; the target accepts ``t_1`` with probability
``min(1, p(t_1) / psi(t_1))`` and otherwise samples from ``norm(max(0, p - psi))``, where ``psi(t)`` is the
probability that this drafting process proposes ``t``. That is the standard rule of speculative decoding with
``psi`` in the place of the draft's token probabilities, so the output follows ``p`` exactly, whatever the
lookahead rule and the map from strings to target tokens, as long as ``psi`` is computed for the same process.

Here (every choice is the process's definition, shared by the sampler and by ``psi``):

* the first target token of a string is the longest target-vocabulary string that is a prefix of it (its
  canonical id); a string with no such prefix proposes nothing (that probability is always rejected);
* the lookahead stops after ``d_i`` when no target token extends the string drafted so far (its first target
  token is determined: the paper's early stop), or at ``i = n``; ``n_max`` (:func:`n_max`) is the most draft
  tokens the early stop can need on a pair, so ``n >= n_max`` never cuts it; a draft token without text (a
  special token) ends the process and proposes nothing;
* ``psi`` is computed exactly over the prefix tree of the process: each node whose string some target token
  extends is expanded with one draft forward (its distribution ``q``), each stopping child adds its path's
  probability to ``psi`` of its target token. Sampling then walks the same tree. Children with ``q = 0``
  (top-k / top-p truncation) are never expanded, which is what makes the tree small enough; a tree that would
  need more than ``budget`` nodes (draft positions evaluated) is not expanded at all: that step falls back (the
  caller proposes
  nothing there, so the target samples the token itself: lossless) and is counted.

Greedy decoding needs no ``psi``: the process is deterministic (argmax draft tokens) and the rule reduces to
exact match with the target's argmax, which returns the target's greedy output.
"""

from __future__ import annotations

import bisect
import hashlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from specheads.errors import UserError

log = logging.getLogger(__name__)


class TargetStrings:
    """The target vocabulary's token strings: the first target token of a string, and whether more text could
    still change it.

    Args:
        ids: token string (bytes) -> the target id that represents it.
    """

    def __init__(self, ids: dict[bytes, int]):
        if not ids:
            raise UserError("the target vocabulary has no token with text; SLRS proposes target tokens by string")
        self.ids = ids
        self.sorted = sorted(ids)
        self.max_len = max(len(s) for s in ids)

    @classmethod
    def from_texts(
        cls, texts: list[bytes | None], canonical: dict[bytes, int] | None = None, width: int | None = None
    ) -> "TargetStrings":
        """From each target id's bytes (None: no text); duplicates go to ``canonical`` or the lowest id. With
        ``width`` (the target's logit columns), ids at or past it (added tokens the model cannot emit) are left
        out: SLRS never proposes a token the target has no probability for."""
        ids: dict[bytes, int] = {}
        for i, b in enumerate(texts):
            if b:
                ids.setdefault(b, i)
        if canonical:
            ids = {b: canonical.get(b, i) for b, i in ids.items()}
        if width is not None:
            ids = {b: i for b, i in ids.items() if i < width}
        return cls(ids)

    def first(self, s: bytes) -> int:
        """The id of the longest target token that is a prefix of ``s``; -1 when there is none."""
        for n in range(min(len(s), self.max_len), 0, -1):
            i = self.ids.get(s[:n])
            if i is not None:
                return i
        return -1

    def open(self, s: bytes) -> bool:
        """Whether some target token extends ``s`` (``s`` is a proper prefix of it)."""
        k = bisect.bisect_right(self.sorted, s)
        return k < len(self.sorted) and self.sorted[k].startswith(s)

    def fingerprint(self) -> str:
        h = hashlib.sha256()
        for s in self.sorted:
            h.update(len(s).to_bytes(4, "little") + s)
        return h.hexdigest()[:16]


def n_max(draft_text: list[bytes | None], strings: TargetStrings) -> int:
    """The most draft tokens the lookahead can need before the first target token is determined: one more than
    the longest tiling, by draft token strings, of a proper prefix of a target token (the strings still open
    after that many draft tokens). Draft strings are walked in a byte trie from each reachable position."""
    trie: dict = {}
    for w in {b for b in draft_text if b}:
        node = trie
        for byte in w:
            node = node.setdefault(byte, {})
        node[None] = True  # a draft token ends here
    most = 0
    for u in strings.sorted:
        best = [0] + [-1] * len(u)  # best[j]: most draft tokens spelling u[:j] (-1: none)
        for i in range(len(u) - 1):
            if best[i] < 0:
                continue
            node, j = trie, i
            while j < len(u) - 1 and u[j] in node:  # words ending before the end of u: proper prefixes
                node, j = node[u[j]], j + 1
                if None in node and best[i] + 1 > best[j]:
                    best[j] = best[i] + 1
        most = max(most, max(best[1 : len(u)], default=0))
    return most + 1


@dataclass
class Step:
    """One SLRS step's drafting: the sampled draft path, the target token it proposes (-1: none), ``psi``
    over the target vocabulary (None when greedy), the draft forwards it took, and whether the path's string
    is exactly the proposed token's (the next step can then continue from the draft's state)."""

    path: list[int]
    token: int
    psi: torch.Tensor | None
    forwards: int
    aligned: bool
    nodes: dict = field(default_factory=dict)


class Process:
    """The drafting process of SLRS on one pair: which draft continuations stop and what they propose.

    Args:
        draft_text: per draft id, its bytes (None: a special token, no text).
        strings: the target's token strings.
        n: most draft tokens per step (the lookahead limit; ``n_max`` or less).
    """

    def __init__(self, draft_text: list[bytes | None], strings: TargetStrings, n: int):
        if n < 1:
            raise UserError(f"SLRS lookahead n={n} must be >= 1")
        self.text, self.strings, self.n = draft_text, strings, n
        self._children: dict[bytes, tuple[torch.Tensor, torch.Tensor]] = {}
        self._child: dict[tuple[bytes, int], tuple[int, bool]] = {}
        self.by_id = {i: b for b, i in strings.ids.items()}

    def child(self, s: bytes, d: int, depth: int) -> tuple[int, bool]:
        """``(proposed target id or -1, stops)`` after drafting ``d`` onto string ``s`` as token ``depth``."""
        key = (s, d)
        hit = self._child.get(key)
        if hit is None:
            w = self.text[d] if 0 <= d < len(self.text) else None
            if not w:
                hit = (-1, True)
            else:
                s2 = s + w
                hit = (self.strings.first(s2), not self.strings.open(s2))
            if len(self._child) > 1_000_000:
                self._child.clear()
            self._child[key] = hit
        return hit[0], hit[1] or depth >= self.n

    def children(self, s: bytes, depth: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Every draft id's ``(proposed target id, stops)`` after ``s``, as two tensors (cached per string)."""
        hit = self._children.get(s)
        if hit is None:
            pairs = [self.child(s, d, 0) for d in range(len(self.text))]
            hit = (torch.tensor([p[0] for p in pairs], dtype=torch.long), torch.tensor([p[1] for p in pairs]))
            if len(self._children) > 256:
                self._children.clear()
            self._children[s] = hit
        f, stop = hit
        return f, stop | (depth >= self.n)

    def spell(self, path) -> bytes:
        return b"".join(self.text[d] or b"" for d in path)

    def psi(
        self, q_of: Callable[[list[tuple[int, ...]]], list[torch.Tensor]], vt: int, budget: int, dense_above: int = 512
    ) -> tuple[torch.Tensor, dict] | None:
        """``psi`` over the ``vt`` target ids and the tree's draft distributions (path -> q), or None when the
        tree needs more than ``budget`` nodes. ``q_of(paths)`` returns the draft's warped distribution after each
        path; it is called with the root, then once per level with every node of that level (batchable)."""
        if budget < 1:
            return None
        psi = torch.zeros(vt, dtype=torch.float64)
        root: tuple[int, ...] = ()
        nodes = {root: q_of([root])[0].double()}
        if not nodes[root].sum() > 0:  # the warped draft puts nothing on tokens with text
            return None
        level = [(root, 1.0)]
        while level:
            nxt: list[tuple[tuple[int, ...], float]] = []
            for path, mass in level:
                q = nodes[path]
                s, depth = self.spell(path), len(path) + 1
                support = q.nonzero().view(-1)
                if support.numel() > dense_above:
                    f, stop = self.children(s, depth)
                    f, stop = f.to(q.device), stop.to(q.device)
                    hit = (q > 0) & stop & (f >= 0)
                    psi.index_add_(0, f[hit].cpu(), (mass * q[hit]).cpu())
                    more = ((q > 0) & ~stop).nonzero().view(-1).tolist()
                    nxt += [(path + (d,), mass * float(q[d])) for d in more]
                    continue
                for d, qd in zip(support.tolist(), q[support].tolist()):
                    fi, stopped = self.child(s, d, depth)
                    if stopped:
                        if fi >= 0:
                            psi[fi] += mass * qd
                    else:
                        nxt.append((path + (d,), mass * qd))
            if len(nodes) + len(nxt) > budget:
                return None
            if nxt:
                for (path, _), q in zip(nxt, q_of([p for p, _ in nxt])):
                    nodes[path] = q.double()
            level = nxt
        return psi.float(), nodes

    def walk(self, nodes: dict, generator) -> tuple[list[int], int]:
        """Samples the process's path through an expanded tree: ``(draft path, proposed target id)``."""
        path: tuple[int, ...] = ()
        while True:
            q = nodes[path]
            if not q.sum() > 0:  # the (truncated) draft puts no mass on tokens with text here: psi counted this
                return list(path), -1  # path's mass as proposing nothing, and so does the sampler
            d = int(torch.multinomial(q.float(), 1, generator=generator))
            f, stop = self.child(self.spell(path), d, len(path) + 1)
            path += (d,)
            if stop:
                return list(path), f

    def greedy(self, q_of: Callable[[list[tuple[int, ...]]], list[torch.Tensor]]) -> tuple[list[int], int]:
        """The process with argmax draft tokens: ``(draft path, proposed target id)``."""
        path: tuple[int, ...] = ()
        while True:
            d = int(q_of([path])[0].argmax())
            f, stop = self.child(self.spell(path), d, len(path) + 1)
            path += (d,)
            if stop:
                return list(path), f

    def step(self, q_of, vt: int, budget: int, sampling: bool, generator) -> Step | None:
        """One SLRS step's drafting; None when ``psi`` would exceed ``budget`` tree nodes (fall back)."""
        if not sampling:
            calls = []

            def counted(paths):
                calls.append(len(paths))
                return q_of(paths)

            path, token = self.greedy(counted)
            return Step(path, token, None, sum(calls), self._aligned(path, token))
        out = self.psi(q_of, vt, budget)
        if out is None:
            return None
        psi, nodes = out
        path, token = self.walk(nodes, generator)
        return Step(path, token, psi, len(nodes), self._aligned(path, token), nodes)

    def _aligned(self, path: list[int], token: int) -> bool:
        """Whether the path spells exactly the proposed token (the draft's state then continues the text)."""
        return token >= 0 and self.spell(path) == self.by_id.get(token)
