"""The SD rule of ``policies/base.py`` at the level of one round: what it emits is distributed as the target alone.

Rounds go through ``speculative_accept`` itself (the candidates drawn from ``q`` with numpy, the rule's uniforms
and draws from a seeded ``torch.Generator``, one small row at a time: the same numbers on every machine and
thread count), and the counts meet the exact distribution in a chi-square test at level ``ALPHA``. The tables
and sample sizes are chosen so that the faults a change could plant in the rule move the statistic far past
its threshold (``test_the_sample_sizes_detect_the_planted_faults`` computes how far, exactly): the residual
drawn from ``p - 0.9 q``, the bonus drawn from ``p[m-1]``. The greedy rule is checked exhaustively.
"""

from __future__ import annotations

import bisect
import itertools

import numpy as np
import pytest
import torch
from scipy.stats import chi2, chisquare

from specheads.shim.policies.base import greedy_accept, speculative_accept

ALPHA = 1e-6  # a correct rule fails one seed in a million; the seeds below are fixed, so it never flakes

# The first position: q slightly above p on the large tokens, so a correct residual is almost a point mass on
# token 1 and a residual of p - 0.9 q spreads over tokens 0, 1 and 3.
P0 = np.array([0.40, 0.08, 0.07, 0.45])
Q0 = np.array([0.42, 0.01, 0.12, 0.45])
# The next positions (a first-order chain: row x is the distribution after token x): the same shape rotated,
# so the bonus after y_1 is far from P0.
PT = np.stack([np.roll(P0, x + 1) for x in range(4)])
QT = np.stack([np.roll(Q0, x + 1) for x in range(4)])
# First-token cases: (p rows n+1, q rows n, rounds). The first is the tables above; the others are any tables.
_RNG = np.random.default_rng(7)
FIRST = {
    "v4-n1": (np.stack([P0, PT[0]]), Q0[None], 30_000),
    "v6-n3": (_RNG.dirichlet(np.ones(6), 4), _RNG.dirichlet(np.ones(6), 3), 8_000),
}
JOINT_ROUNDS = 20_000


def _pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    counts, probs = counts.ravel(), probs.ravel()
    assert counts[probs == 0].sum() == 0  # never an impossible token
    return chisquare(counts[probs > 0], counts.sum() * probs[probs > 0]).pvalue


def _round(p: torch.Tensor, q: torch.Tensor, cand: tuple[int, ...], gen) -> list[int]:
    """The tokens one SD round emits: the accepted candidates, then the correction or the bonus."""
    v = speculative_accept(p, q, torch.tensor(cand), gen)
    assert 0 <= v.accepted <= len(cand) and v.token is not None
    return [*cand[: v.accepted], v.token]


def _f32(*arrays: np.ndarray) -> tuple[torch.Tensor, ...]:
    return tuple(torch.tensor(a, dtype=torch.float32) for a in arrays)


@pytest.mark.parametrize("case", list(FIRST))
def test_the_first_token_of_a_round_is_distributed_as_p0(case):
    p, q, rounds = FIRST[case]
    rng, gen = np.random.default_rng(1), torch.Generator().manual_seed(1)
    cands = np.stack([rng.choice(p.shape[1], rounds, p=row) for row in q], 1).tolist()  # [rounds, n]: y_j ~ q_j
    pt, qt = _f32(p, q)
    counts = np.zeros(p.shape[1], dtype=np.int64)
    for cand in cands:
        counts[_round(pt, qt, tuple(cand), gen)[0]] += 1
    assert _pvalue(counts, p[0]) > ALPHA


def _chain_rows(context: int | None, cand: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """``p`` ``[n+1, V]`` and ``q`` ``[n, V]`` of a round after ``context`` (None: none yet) with these candidates."""
    rows = [context, *cand]
    p = np.stack([P0 if c is None else PT[c] for c in rows])
    return p, np.stack([Q0 if c is None else QT[c] for c in rows[:-1]])


def _first_two(n: int, rounds: int, seed: int) -> np.ndarray:
    """``[V, V]`` counts of the first two tokens of ``rounds`` decodes whose every round drafts ``n`` candidates
    from the chain ``Q0, QT`` (by inverse CDF on seeded uniforms)."""
    uniforms = iter(np.random.default_rng(seed).random(rounds * 2 * n).tolist())
    gen = torch.Generator().manual_seed(seed)
    cdf = {c: np.cumsum(Q0 if c is None else QT[c])[:-1].tolist() for c in (None, 0, 1, 2, 3)}
    tensors = {}  # (context, candidates) -> the round's (p, q)
    counts = np.zeros((4, 4), dtype=np.int64)
    for _ in range(rounds):
        out: list[int] = []
        while len(out) < 2:
            cand, context = (), out[-1] if out else None
            for _ in range(n):
                cand += (bisect.bisect_right(cdf[cand[-1] if cand else context], next(uniforms)),)
            if (context, cand) not in tensors:
                tensors[context, cand] = _f32(*_chain_rows(context, list(cand)))
            out += _round(*tensors[context, cand], cand, gen)
        counts[out[0], out[1]] += 1
    return counts


@pytest.mark.parametrize("n", [1, 2])
def test_the_first_two_tokens_are_distributed_as_the_target_chain(n):
    """n=1: the second token is the bonus (or the next round's first); n=2: the residual after y_1 too."""
    assert _pvalue(_first_two(n, JOINT_ROUNDS, seed=2), P0[:, None] * PT) > ALPHA


# ---- the power of the tests above, from the exact distributions of faulty rules --------------------------------


def _residual(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    r = np.clip(p - q, 0, None)
    return r / r.sum() if r.sum() > 1e-12 else p


def _given(p: np.ndarray, q: np.ndarray, cand: tuple, fault: str | None) -> dict[tuple, float]:
    """Emitted tokens -> probability of one round given its candidates; ``fault``: None (the rule),
    ``"residual"`` (drawn from ``p - 0.9 q``) or ``"bonus"`` (drawn from ``p[n-1]``)."""
    n, out, reach = len(cand), {}, 1.0
    for m in range(n + 1):
        if m == n:
            stop, dist = reach, p[n - 1 if fault == "bonus" and n else n]
        else:
            accept = min(1.0, p[m, cand[m]] / q[m, cand[m]])
            stop, dist = reach * (1 - accept), _residual(p[m], q[m] * (0.9 if fault == "residual" else 1.0))
            reach *= accept
        for t, prob in enumerate(dist):
            out[(*cand[:m], t)] = out.get((*cand[:m], t), 0.0) + stop * prob
    return out


def _exact_round(rows, n: int, vocab: int, fault: str | None) -> dict[tuple, float]:
    """Emitted tokens -> probability of one round of ``n`` candidates; ``rows(cand)`` gives its ``(p, q)``."""
    out: dict[tuple, float] = {}
    for cand in itertools.product(range(vocab), repeat=n):
        p, q = rows(cand)
        drawn = np.prod([q[j, y] for j, y in enumerate(cand)])
        for key, prob in _given(p, q, cand, fault).items():
            out[key] = out.get(key, 0.0) + drawn * prob
    return out


def _exact_first(p: np.ndarray, q: np.ndarray, fault: str | None) -> np.ndarray:
    first = np.zeros(p.shape[1])
    for key, prob in _exact_round(lambda cand: (p, q), q.shape[0], p.shape[1], fault).items():
        first[key[0]] += prob
    return first


def _exact_first_two(n: int, fault: str | None) -> np.ndarray:
    """``[V, V]``: the first two tokens of :func:`_first_two`, exactly."""

    def after(context):
        return _exact_round(lambda cand: _chain_rows(context, list(cand)), n, 4, fault)

    joint = np.zeros((4, 4))
    for key, prob in after(None).items():
        if len(key) >= 2:
            joint[key[:2]] += prob
        else:  # a one-token round: the second token is the next round's first
            for nxt, prob2 in after(key[0]).items():
                joint[key[0], nxt[0]] += prob * prob2
    return joint


def _sigmas(exact: np.ndarray, faulty: np.ndarray, samples: int) -> float:
    """Standard deviations of the faulty rule's chi-square statistic between its mean and the level-ALPHA threshold."""
    exact, faulty = exact.ravel(), faulty.ravel()
    df, shift = exact.size - 1, samples * ((faulty - exact) ** 2 / exact).sum()
    return (df + shift - chi2.isf(ALPHA, df)) / np.sqrt(2 * (df + 2 * shift))


def test_the_sample_sizes_detect_the_planted_faults():
    """The exact reference is lossless for the rule; each fault moves a statistic > 8 sigma past its threshold."""
    for p, q, _ in FIRST.values():
        assert np.allclose(_exact_first(p, q, None), p[0], atol=1e-12)
    p, q, rounds = FIRST["v4-n1"]
    assert _sigmas(p[0], _exact_first(p, q, "residual"), rounds) > 8
    target = P0[:, None] * PT
    for n in (1, 2):
        assert np.allclose(_exact_first_two(n, None), target, atol=1e-12)
    assert _sigmas(target, _exact_first_two(2, "residual"), JOINT_ROUNDS) > 8
    assert _sigmas(target, _exact_first_two(1, "bonus"), JOINT_ROUNDS) > 8


# ---- greedy ------------------------------------------------------------------------------------------------------


def test_greedy_keeps_the_longest_matching_prefix_then_the_argmax():
    """Every candidate sequence of up to 3 tokens over 4 against fixed logits: the verdict of the plain rule."""
    logits = torch.tensor([[0.1, 2.0, 0.3, 0.0], [1.5, 0.2, 0.1, 0.0], [0.0, 0.1, 0.2, 3.0], [0.3, 0.0, 2.5, 0.1]])
    top = logits.argmax(-1).tolist()  # [1, 0, 3, 2]: a different token at every position
    for n in range(4):
        for cand in itertools.product(range(4), repeat=n):
            m = next((j for j in range(n) if cand[j] != top[j]), n)
            v = greedy_accept(torch.tensor(cand, dtype=torch.long), logits[: n + 1])
            assert (v.accepted, v.token) == (m, top[m]), cand
