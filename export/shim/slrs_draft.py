"""SLRS's drafting inside the decoding shim: the pair's process (:mod:`.slrs`) with its ``n_max`` cached on
disk, and a round of SLRS steps on the draft side of a :class:`~.hetero.Bridge`."""

from __future__ import annotations

import hashlib
import json
import logging
import time

import torch

from .sampling import probs_from_logits
from .slrs import Process, TargetStrings, n_max
from .stats import count_tokens
from .token_text import common_prefix

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
    """The SLRS process of a :class:`~.hetero.Bridge`'s pair with lookahead ``n`` (0: the pair's ``n_max``,
    computed from the two vocabularies once and cached on disk under ``$SPECHEADS_CACHE/slrs``)."""
    from specheads.machine import cache_dir

    from .token_text import _canonical, _token_entries

    if bridge.n_max is None:
        canon = _canonical(_token_entries(bridge.target_tokenizer))
        bridge.strings = TargetStrings.from_texts(bridge.vmap.target_text, canon)
        start = time.perf_counter()
        bridge.n_max, cached = cached_n_max(bridge.vmap.draft_text, bridge.strings, cache_dir("slrs"))
        log.info("SLRS: n_max = %d draft tokens (%s in %.1f s)", bridge.n_max, "cached" if cached else "computed",
                 time.perf_counter() - start)
    n = n or bridge.n_max
    if n not in bridge.slrs:
        bridge.slrs[n] = Process(bridge.vmap.draft_text, bridge.strings, n)
    return bridge.slrs[n]


def slrs_round(crossing, rnd) -> None:
    """A round of SLRS steps on a :class:`~.hetero._Crossing`: each step proposes one target token with its
    ``psi`` (``rnd.q``); steps chain while a step's draft string is exactly its token. A step that proposes
    nothing leaves its ``psi`` as the round's last ``q`` row, so the target draws from ``norm(max(0, p - psi))``
    there; a step over the budget ends the round without one (the target's own token, counted)."""
    c = crossing
    c.drafted = []
    if c.drf.pending:  # bytes of an unfinished character: the draft's text is behind; the target steps alone
        return
    policy = c.policy
    proc, ev, base = bridge_process(c.bridge, policy.lookahead), policy.events, list(c.drf.ids)
    for _ in range(rnd.limit):
        start, before = time.perf_counter(), c.runner.forwards
        step = proc.step(lambda paths: _q_after(c, base + c.drafted, paths, rnd.sampling), c.bridge.vt,
                         policy.budget, rnd.sampling.do_sample, c.generator)
        ev["slrs_steps"] += 1
        ev["slrs_psi_seconds"] += time.perf_counter() - start
        ev["slrs_tree_forwards"] += c.runner.forwards - before
        if step is None:
            ev["slrs_fallbacks"] += 1
            break
        if step.psi is not None:
            rnd.q.append(step.psi.to(c.runner.device))
        if step.token < 0:
            break
        rnd.tokens.append(torch.tensor(step.token))
        c.drafted += step.path
        if not step.aligned:
            break


def _q_after(c, base: list[int], paths, sampling) -> list[torch.Tensor]:
    """The draft's distribution after ``base`` + each path (one forward each, its cache reused as far as it
    agrees): warped probabilities over the tokens with text when sampling, masked logits when greedy."""
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
        if not sampling.do_sample:
            out.append(logits[0].masked_fill(~c.mask, float("-inf")))
            continue
        q = probs_from_logits(logits[0], sampling) * c.mask
        out.append(q / q.sum() if q.sum() > 0 else q)
    return out
