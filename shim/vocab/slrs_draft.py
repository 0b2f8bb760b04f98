"""SLRS's drafting inside the decoding shim: the pair's process (:mod:`.slrs`) with its ``n_max`` cached on
disk, and a round of SLRS steps on the draft side of a :class:`~.hetero_loop.Bridge`."""

from __future__ import annotations

import hashlib
import json
import logging
import time

import torch

from specheads.shim.core.sampling import probs_from_logits
from specheads.shim.core.stats import count_tokens
from specheads.shim.vocab.slrs import Process, TargetStrings, n_max
from specheads.shim.vocab.token_text import common_prefix

log = logging.getLogger(__name__)


def cached_n_max(draft_text: list[bytes | None], strings: TargetStrings, cache_dir) -> tuple[int, bool]:
    """:func:`n_max` for a pair, read from (or written to) ``cache_dir``: ``(n_max, was cached)``."""
    from pathlib import Path

    h = hashlib.sha256()
    for b in draft_text:
        h.update(b"\x00" if b is None else len(b).to_bytes(4, "little") + b)
    key = f"slrs-nmax-{h.hexdigest()[:16]}-{strings.fingerprint()}.json"
    path = Path(cache_dir) / key
    if path.is_file():
        try:
            return int(json.loads(path.read_text(encoding="utf-8"))["n_max"]), True
        except (OSError, ValueError, KeyError):
            pass
    value = n_max(draft_text, strings)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"n_max": value}) + "\n", encoding="utf-8")
    tmp.replace(path)
    return value, False


def bridge_process(bridge, n: int) -> Process:
    """The SLRS process of a :class:`~.hetero_loop.Bridge`'s pair with lookahead ``n`` (0: the pair's ``n_max``,
    computed from the two vocabularies once and cached on disk under ``$SPECHEADS_CACHE/slrs``)."""
    from specheads.machine import cache_dir
    from specheads.shim.vocab.token_text import _canonical, _token_entries

    if bridge.n_max is None:
        canon = _canonical(_token_entries(bridge.target_tokenizer))
        bridge.strings = TargetStrings.from_texts(bridge.vmap.target_text, canon, bridge.vt)
        start = time.perf_counter()
        bridge.n_max, cached = cached_n_max(bridge.vmap.draft_text, bridge.strings, cache_dir("slrs"))
        log.info(
            "SLRS: n_max = %d draft tokens (%s in %.1f s)",
            bridge.n_max,
            "cached" if cached else "computed",
            time.perf_counter() - start,
        )
    n = n or bridge.n_max
    if n not in bridge.slrs:
        bridge.slrs[n] = Process(bridge.vmap.draft_text, bridge.strings, n)
    return bridge.slrs[n]


def slrs_round(crossing, rnd) -> None:
    """A round of SLRS steps on a :class:`~.hetero_loop._Crossing`: each step proposes one target token with its
    ``psi`` (``rnd.q``); steps chain while a step's draft string is exactly its token. A step that proposes
    nothing leaves its ``psi`` as the round's last ``q`` row, so the target draws from ``norm(max(0, p - psi))``
    there; a step over the budget ends the round without one (the target's own token, counted)."""
    c = crossing
    c.drafted = []
    if c.drf.pending:  # bytes of an unfinished character: the draft's text is behind; the target steps alone
        return
    policy = c.policy
    proc, ev, base = bridge_process(c.bridge, policy.lookahead), policy.events, list(c.drf.ids)
    smp = rnd.sampling
    if smp.do_sample and not smp.top_k and smp.top_p >= 1 and not policy.warned_untruncated:
        policy.warned_untruncated = True
        log.warning(
            "SLRS samples without top_k/top_p truncation: every draft token with text opens psi's prefix "
            "tree, so most steps exceed budget=%d and fall back to the target alone; set top_k (e.g. 8) "
            "or top_p",
            policy.budget,
        )
    for _ in range(rnd.limit):
        start, before = time.perf_counter(), c.runner.forwards
        tree = _Tree(c, base + c.drafted, rnd.sampling)
        try:
            step = proc.step(tree.q_of, c.bridge.vt, policy.budget, rnd.sampling.do_sample, c.generator)
        finally:
            tree.close()
        ev["slrs_steps"] += 1
        ev["slrs_psi_seconds"] += time.perf_counter() - start
        ev["slrs_tree_forwards"] += c.runner.forwards - before
        ev["slrs_tree_nodes"] += tree.nodes
        if step is None:
            ev["slrs_fallbacks"] += 1
            break
        if step.psi is not None:
            rnd.q.append(step.psi.to(c.runner.device))
        if step.token < 0:  # the drafted string has no first target token: psi's row is still verified
            ev["slrs_empty"] += 1
            break
        rnd.tokens.append(torch.tensor(step.token))
        c.drafted += step.path
        if not step.aligned:
            break


class _Tree:
    """The draft's distributions over one SLRS step's prefix tree (``q_of`` of :meth:`.slrs.Process.step`).

    The root is the draft's state after ``base`` (its cache reused as far as it agrees). Sampled, on a runner
    with a tree forward (the fused CPU forward), every later level of the tree is one draft forward: each new
    node's token attends to ``base`` and its own ancestors (a tree attention mask), its keys and values kept in
    scratch slots after ``base`` until :meth:`close` trims them. Otherwise (greedy: one path; the model's own
    forward) one forward per path. ``nodes`` counts the draft positions evaluated.
    """

    def __init__(self, c, base: list[int], sampling):
        self.c, self.base, self.sampling = c, base, sampling
        self.batched = sampling.do_sample and hasattr(c.runner, "forward_tree")
        self.slots: dict[tuple[int, ...], int] = {}
        self.nodes = 0
        self.scratch = False

    def q_of(self, paths) -> list[torch.Tensor]:
        self.nodes += len(paths)
        if not self.batched or list(paths) == [()]:
            return self._q(torch.stack(_logits_after(self.c, self.base, paths)))
        return self._q(self._level(paths))

    def _level(self, paths) -> torch.Tensor:
        c, n = self.c, len(self.base)
        if not self.scratch:  # the root's forward left the runner holding exactly ``base``
            assert c.runner.length == n == len(c.held)
            self.scratch = True
        start = c.runner.length
        mask = torch.zeros(len(paths), start + len(paths), dtype=torch.bool)
        mask[:, :n] = True
        for row, path in enumerate(paths):
            for depth in range(1, len(path)):
                mask[row, self.slots[path[:depth]]] = True
            mask[row, start + row] = True
            self.slots[tuple(path)] = start + row
        ids = torch.tensor([[path[-1] for path in paths]], device=c.runner.device)
        positions = torch.tensor([n + len(path) - 1 for path in paths], device=c.runner.device)
        count_tokens(c.stats, "draft", start, len(paths), c.prompt_tokens)
        return c.runner.forward_tree(ids, positions, mask)

    def _q(self, logits: torch.Tensor) -> list[torch.Tensor]:
        """Per row of ``logits`` ``[m, V]``: warped probabilities over the tokens with text when sampling (a
        row without such mass stays zero), masked logits when greedy; one warp for the whole level."""
        if not self.sampling.do_sample:
            return list(logits.masked_fill(~self.c.mask, float("-inf")))
        q = probs_from_logits(logits, self.sampling) * self.c.mask
        return list(q / q.sum(-1, keepdim=True).clamp_min(torch.finfo(q.dtype).tiny))

    def close(self) -> None:
        """Drops the tree's scratch slots: the draft's cache holds ``base`` again."""
        if self.scratch:
            self.c.runner.trim(len(self.base))


def _logits_after(c, base: list[int], paths) -> list[torch.Tensor]:
    """The draft's logits after ``base`` + each path, one forward each, its cache reused as far as it agrees."""
    out = []
    for path in paths:
        seq = base + list(path)
        keep = min(common_prefix(c.held, seq), len(seq) - 1)
        c.runner.trim(keep)
        del c.held[keep:]
        feed = seq[keep:]
        count_tokens(c.stats, "draft", c.runner.length, len(feed), c.prompt_tokens)
        logits, _ = c.runner.forward(torch.tensor([feed], device=c.runner.device), n_logits=1)
        c.held.extend(feed)
        out.append(logits[0])
    return out
