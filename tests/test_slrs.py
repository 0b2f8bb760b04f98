"""SLRS (shim/vocab/slrs.py): psi against a brute-force enumeration of the drafting process on hand-built
vocabularies (the paper's hello_/world/wo/rld example and a target with longer tokens than the draft), n_max,
the sampler against psi, and the lossless rule (chi-square; a planted q(d_1)-for-psi(t_1) bug fails it)."""

from __future__ import annotations

import itertools

import pytest
import torch
from scipy.stats import chisquare

from specheads.errors import UserError
from specheads.shim.policies.base import speculative_accept
from specheads.shim.vocab.slrs import Process, TargetStrings, n_max

HELLO_D = [b"hello_", b"world", b"wo", b"rld"]
HELLO_T = HELLO_D + [b"hello_world"]
# A draft of single characters and a target whose tokens are longer (every character is a target token too,
# so every drafted string has a first target token).
CHARS_D = [b"a", b"b", b"c", b" "]
CHARS_T = [b"a", b"b", b"c", b" ", b"ab", b"abc", b"abca", b"ca", b"cab", b" a", b" ab", b"bb", b"bba"]


def _first(texts: list[bytes], s: bytes) -> int:
    """Independent of the code under test: the longest target string that is a prefix of s."""
    best = max((t for t in texts if s.startswith(t)), key=len, default=None)
    return -1 if best is None else texts.index(best)


def _open(texts: list[bytes], s: bytes) -> bool:
    return any(t.startswith(s) and len(t) > len(s) for t in texts)


def _brute_psi(draft: list[bytes], target: list[bytes], q_of, n: int) -> torch.Tensor:
    """psi by enumerating every draft sequence of 1..n tokens and keeping those at which the process stops."""
    psi = torch.zeros(len(target), dtype=torch.float64)
    for i in range(1, n + 1):
        for seq in itertools.product(range(len(draft)), repeat=i):
            strings = [b"".join(draft[d] for d in seq[:j]) for j in range(1, i + 1)]
            if any(not _open(target, s) for s in strings[:-1]):
                continue  # the process stopped earlier
            if i < n and _open(target, strings[-1]):
                continue  # the process goes on
            prob = 1.0
            for j in range(i):
                prob *= float(q_of([tuple(seq[:j])])[0][seq[j]])
            f = _first(target, strings[-1])
            if f >= 0:
                psi[f] += prob
    return psi


def _q_of(vocab: int, seed: int, zero: tuple[int, ...] = ()):
    """A draft whose distribution depends on the whole path (a fixed random softmax per path), some ids at 0."""

    def q_of(paths):
        out = []
        for path in paths:
            g = torch.Generator().manual_seed(hash((seed,) + tuple(path)) % (2**31))
            q = torch.softmax(torch.randn(vocab, generator=g) * 1.5, -1)
            q[list(zero)] = 0.0
            out.append(q / q.sum())
        return out

    return q_of


def _process(draft, target, n):
    return Process(draft, TargetStrings.from_texts(target), n)


def _brute_n_max(draft: list[bytes], target: list[bytes], longest: int = 7) -> int:
    """1 + the most draft tokens after which the drafted string can still be open, by enumeration."""
    most = 0
    for i in range(1, longest + 1):
        for seq in itertools.product(draft, repeat=i):
            if all(_open(target, b"".join(seq[:j])) for j in range(1, i + 1)):
                most = i
    return most + 1


def test_n_max_is_the_longest_tiling_of_an_open_prefix():
    assert n_max(HELLO_D, TargetStrings.from_texts(HELLO_T)) == 3 == _brute_n_max(HELLO_D, HELLO_T)  # the paper
    # chars: "abc" is open (abca extends it): three single characters, then a fourth decides
    assert n_max(CHARS_D, TargetStrings.from_texts(CHARS_T)) == 4 == _brute_n_max(CHARS_D, CHARS_T)
    odd_d, odd_t = [b"x", b"xy", b"yx", b"y"], [b"x", b"y", b"xyxyx", b"yy", b"xxy"]
    assert n_max(odd_d, TargetStrings.from_texts(odd_t)) == _brute_n_max(odd_d, odd_t)
    strings = TargetStrings.from_texts(CHARS_T)
    assert strings.open(b"") and strings.open(b"ab") and not strings.open(b"abca") and not strings.open(b"cc")
    assert strings.first(b"abcab") == CHARS_T.index(b"abca") and strings.first(b"x") == -1


@pytest.mark.parametrize(
    "draft,target,n,zero",
    [
        (HELLO_D, HELLO_T, 3, ()),
        (HELLO_D, HELLO_T, 2, ()),
        (HELLO_D, HELLO_T, 3, (2,)),
        (CHARS_D, CHARS_T, 4, ()),
        (CHARS_D, CHARS_T, 2, ()),
        (CHARS_D, CHARS_T, 4, (2,)),
    ],
)
def test_psi_equals_brute_force_enumeration(draft, target, n, zero):
    q_of = _q_of(len(draft), seed=n + len(zero), zero=zero)
    psi, nodes = _process(draft, target, n).psi(q_of, len(target), budget=10_000)
    expect = _brute_psi(draft, target, q_of, n)
    assert torch.allclose(psi.double(), expect, atol=1e-6), (psi, expect)
    assert abs(float(psi.sum()) - 1.0) < 1e-5  # every string has a first target token here
    # a truncated draft (q = 0) is never expanded there: fewer nodes than the untruncated tree
    if zero:
        full = _process(draft, target, n).psi(_q_of(len(draft), seed=n + len(zero)), len(target), budget=10_000)[1]
        assert len(nodes) < len(full)


def test_the_dense_path_equals_the_sparse_one():
    q_of = _q_of(len(CHARS_D), seed=5)
    sparse = _process(CHARS_D, CHARS_T, 4).psi(q_of, len(CHARS_T), budget=10_000, dense_above=10_000)[0]
    dense = _process(CHARS_D, CHARS_T, 4).psi(q_of, len(CHARS_T), budget=10_000, dense_above=0)[0]
    assert torch.allclose(sparse, dense, atol=1e-7)


def test_the_sampler_follows_psi():
    q_of = _q_of(len(CHARS_D), seed=1)
    proc = _process(CHARS_D, CHARS_T, 4)
    psi, nodes = proc.psi(q_of, len(CHARS_T), budget=10_000)
    gen = torch.Generator().manual_seed(0)
    counts = torch.zeros(len(CHARS_T))
    for _ in range(3000):
        path, token = proc.walk(nodes, gen)
        counts[token] += 1
        assert proc.strings.first(proc.spell(path)) == token
    keep = psi * 3000 >= 5
    obs = torch.cat([counts[keep], counts[~keep].sum()[None]])
    exp = torch.cat([psi[keep] * 3000, (psi[~keep] * 3000).sum()[None]])
    assert chisquare(obs.numpy(), exp.numpy() * obs.sum().item() / exp.sum().item()).pvalue > 1e-3


def test_a_tree_over_the_budget_is_not_expanded():
    q_of = _q_of(len(CHARS_D), seed=2)
    proc = _process(CHARS_D, CHARS_T, 4)
    _, nodes = proc.psi(q_of, len(CHARS_T), budget=10_000)
    assert proc.psi(q_of, len(CHARS_T), budget=len(nodes)) is not None
    assert proc.psi(q_of, len(CHARS_T), budget=len(nodes) - 1) is None
    assert proc.step(q_of, len(CHARS_T), 1, True, torch.Generator()) is None
    with pytest.raises(UserError, match="n=0"):
        _process(CHARS_D, CHARS_T, 0)


def _slrs_outputs(draft, target, n, trials, p, bug=False, seed=0):
    """One SLRS step ``trials`` times: the process proposes t_1, the standard rule with psi accepts it or draws
    from norm(max(0, p - psi)). ``bug``: psi replaced by q(d_1) pushed onto d_1's own first target token."""
    q_of = _q_of(len(draft), seed=3)
    proc = _process(draft, target, n)
    psi, nodes = proc.psi(q_of, len(target), budget=10_000)
    if bug:
        psi = torch.zeros(len(target))
        for d, qd in enumerate(nodes[()].tolist()):
            psi[proc.strings.first(draft[d])] += qd
    gen = torch.Generator().manual_seed(seed)
    counts = torch.zeros(len(target))
    for _ in range(trials):
        _, token = proc.walk(nodes, gen)
        v = speculative_accept(torch.stack([p, p]), psi[None].float(), torch.tensor([token]), gen)
        counts[token if v.accepted else v.token] += 1
    return counts


@pytest.mark.parametrize("draft,target,n", [(HELLO_D, HELLO_T, 3), (CHARS_D, CHARS_T, 4), (CHARS_D, CHARS_T, 2)])
def test_slrs_output_follows_the_target_and_a_planted_bug_fails(draft, target, n):
    p = torch.softmax(torch.randn(len(target), generator=torch.Generator().manual_seed(9)) * 1.2, -1)
    trials = 4000
    counts = _slrs_outputs(draft, target, n, trials, p)
    assert chisquare(counts.numpy(), (p * trials).numpy()).pvalue > 1e-3
    bad = _slrs_outputs(draft, target, n, trials, p, bug=True)
    assert chisquare(bad.numpy(), (p * trials).numpy()).pvalue < 1e-6


def test_greedy_is_the_argmax_path():
    q_of = _q_of(len(HELLO_D), seed=4)
    proc = _process(HELLO_D, HELLO_T, 3)
    step = proc.step(q_of, len(HELLO_T), 64, False, None)
    path, s = [], b""
    while True:
        d = int(q_of([tuple(path)])[0].argmax())
        path.append(d)
        s += HELLO_D[d]
        if not _open(HELLO_T, s) or len(path) == 3:
            break
    assert step.path == path and step.token == _first(HELLO_T, s) and step.psi is None
    assert step.aligned == (HELLO_T[step.token] == s)


# ---- the tree forward: one draft forward per level, the same distributions as a forward per path ----------


def test_each_tree_level_is_one_forward_with_the_distributions_of_a_forward_per_path():
    """``_Tree`` on the fused runner: the root, then two levels of a prefix tree (siblings, and children of
    different parents), each level one forward; every node's q equals a separate full forward of base + path."""
    from types import SimpleNamespace

    from conftest import tiny_llama

    from specheads.shim.core.sampling import SamplingConfig, probs_from_logits
    from specheads.shim.core.stats import GenerationStats
    from specheads.shim.runners.model_runner import FusedRunner
    from specheads.shim.vocab.slrs_draft import _Tree

    model, vocab = tiny_llama(40, seed=5, init=0.6), 40
    base = [1, 5, 7, 9, 11]
    c = SimpleNamespace(
        runner=FusedRunner(model, capacity=8),
        held=[1, 5, 30],
        stats=GenerationStats(),
        prompt_tokens=2,
        mask=torch.ones(vocab, dtype=torch.bool),
    )
    c.runner.forward(torch.tensor([[1, 5, 30]]))  # a stale suffix in the cache, as after a rejected round
    sampling = SamplingConfig(do_sample=True, temperature=0.9, top_k=12)
    tree = _Tree(c, base, sampling)
    levels = [[()], [(3,), (4,), (8,)], [(3, 2), (4, 6), (4, 7), (8, 8)]]
    got, forwards = {}, []
    for paths in levels:
        before = c.runner.forwards
        got.update(zip(paths, tree.q_of(paths)))
        forwards.append(c.runner.forwards - before)
    tree.close()
    assert forwards == [1, 1, 1] and tree.nodes == 8 and c.runner.length == len(base) and c.held == base
    with torch.no_grad():
        for path, q in got.items():
            ref = probs_from_logits(model(torch.tensor([base + list(path)])).logits[0, -1], sampling)
            assert torch.allclose(q, ref / ref.sum(), atol=1e-5), path


def test_a_node_without_mass_on_text_proposes_nothing_in_psi_and_in_the_sampler():
    """A draft whose (truncated) distribution after "wo" is all on a token without text: psi leaves that mass
    unassigned (rejected at verification) and the sampler returns -1 there instead of failing."""
    draft = HELLO_D + [None]  # id 4: a special token (no text)
    proc = Process(draft, TargetStrings.from_texts(HELLO_T), n=3)
    root = torch.tensor([0.0, 0.5, 0.5, 0.0, 0.0])
    after_wo = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0])  # what the shim hands over: the text-only mass is zero

    def q_of(paths):
        return [root if p == () else after_wo for p in paths]

    psi, nodes = proc.psi(q_of, len(HELLO_T), budget=16)
    assert torch.allclose(psi.double(), torch.tensor([0.0, 0.5, 0.0, 0.0, 0.0], dtype=torch.float64))
    seen = {tuple(proc.walk(nodes, torch.Generator().manual_seed(s))[1:]) for s in range(40)}
    assert seen == {(1,), (-1,)}


def test_added_target_ids_past_the_logit_width_are_never_proposed():
    strings = TargetStrings.from_texts(HELLO_T + [b"zz"], width=len(HELLO_T))
    assert strings.first(b"zz") == -1 and strings.first(b"hello_world") == 4
