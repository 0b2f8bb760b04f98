"""Batched speculative decoding (``BatchEngine``): every row decodes as it would alone.

Greedy: each lossless policy's outputs and counts equal batch 1's, with prompts of very different
lengths, rows leaving and joining, and a cache small enough to be compacted and grown. Sampled:
with the same per-prompt generators every policy (lossy ones included) makes batch 1's decisions;
batched SD follows the target (chi-square), and a planted bug in the draft's distribution fails it.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from conftest import BigramLM, bigram, perturbed_copy, tiny_llama
from scipy.stats import chisquare

from specheads.heads import AcceptanceHead, JudgeHead, VerifierHead
from specheads.shim.batching.batch_loop import BatchEngine, BatchJob
from specheads.shim.core.sampling import SamplingConfig, probs_from_logits
from specheads.shim.costs.cost_table import CostTable
from specheads.shim.loop import drafting as engine_mod  # where every drafter draws its candidates
from specheads.shim.loop.engine import Engine
from specheads.shim.policies import (
    FSD,
    SLEM,
    ConfidenceStop,
    DraftOnly,
    Judge,
    SpecDecPP,
    Sprinter,
    StandardSD,
    TargetOnly,
    TopKVerify,
)
from specheads.shim.runners.batch_cache import BatchRunner

VOCAB, LENGTHS, NEW = 60, (3, 41, 7, 1, 25, 12, 60, 2), 20
COSTS = CostTable(t_draft_ms=1.0, t_target_ms=[10.0 + 0.5 * k for k in range(1, 24)])


@pytest.fixture(scope="module")
def engine():
    target = tiny_llama(VOCAB, seed=0)
    return Engine(target, perturbed_copy(target, scale=0.3), eos_token_ids=[2])


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(5)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in LENGTHS]


def _heads():
    torch.manual_seed(3)
    return AcceptanceHead(32, depth=1).eval(), VerifierHead(32).eval(), JudgeHead(32).eval()


def _policies(lossy: bool):
    acc, ver, judge = _heads()
    if not lossy:
        return {
            "sd": StandardSD(3),
            "ar": TargetOnly(),
            "draft": DraftOnly(),
            "confidence": ConfidenceStop(tau=0.5, k_max=5),
            "confidence_cost_gated": ConfidenceStop(k_max=6, stop="cost", costs=COSTS, gate=True),
            "online_cost": ConfidenceStop(k_max=6, stop="cost", costs=COSTS, estimate="online"),
            "entropy": ConfidenceStop(tau=0.3, k_max=5, estimate="entropy", entropy_gamma=0.5),
            "specdecpp": SpecDecPP(acc, threshold=0.5, k_min=1, k_max=6),
            "specdecpp_cost": SpecDecPP(acc, k_min=1, k_max=6, stop="cost", costs=COSTS),
        }
    return {
        "topk": TopKVerify(3, 2),
        "fsd": FSD(0.4, "js", k=3),
        "fsd_stopper": FSD(0.4, "kl", stopper=SpecDecPP(acc, threshold=0.5, k_min=1, k_max=5)),
        "sprinter": Sprinter(ver, eta=0.5, max_run=4),
        "judge": Judge(judge, delta=0.5, k=4),
    }


def _alone(engine, prompts, policy, sampling):
    return [
        engine.generate(p, policy, NEW, sampling, torch.Generator().manual_seed(100 + i)) for i, p in enumerate(prompts)
    ]


def _batched(engine, prompts, policy, sampling, rows=3, capacity=None):
    jobs = [BatchJob(p, torch.Generator().manual_seed(100 + i)) for i, p in enumerate(prompts)]
    out = dict(BatchEngine(engine, rows, capacity=capacity).generate(jobs, policy, NEW, sampling))
    return [out[i] for i in range(len(prompts))]


def _counts(g):
    s = g.stats
    return (
        g.tokens,
        s.new_tokens,
        s.target_calls,
        s.draft_forwards,
        s.drafted,
        s.accepted,
        s.discarded,
        s.rounds,
        s.eos,
        s.undrafted_rounds,
        s.target_tokens,
        s.target_context,
        s.draft_tokens,
        s.draft_context,
        s.target_pass_sizes,
        {k: round(v, 4) for k, v in s.counters.items()},  # float sums: rounding
        {k: v for k, v in g.trace.items() if k != "acceptance"},
        [(j, ok) for j, _, ok in g.trace.get("acceptance", [])],
    )


def _same_scores(batched, alone):
    """The acceptance head's recorded scores agree to float rounding (batched products)."""
    for a, b in zip(batched, alone):
        assert [x[1] for x in a.trace.get("acceptance", [])] == pytest.approx(
            [x[1] for x in b.trace.get("acceptance", [])], abs=1e-5
        )


@pytest.mark.parametrize("name", list(_policies(False)))
@pytest.mark.parametrize("capacity", [None, 12], ids=["roomy", "compacting"])
def test_greedy_batched_equals_batch_one(engine, prompts, name, capacity):
    policy = _policies(False)[name]
    alone = _alone(engine, prompts, policy, SamplingConfig())
    batched = _batched(engine, prompts, _policies(False)[name], SamplingConfig(), capacity=capacity)
    assert [_counts(g) for g in batched] == [_counts(g) for g in alone]
    _same_scores(batched, alone)
    assert any(g.stats.eos for g in alone) and any(not g.stats.eos for g in alone)  # both ways to finish


@pytest.mark.parametrize("name", [*_policies(False), *_policies(True)])
def test_sampled_batched_rows_make_batch_one_decisions(engine, prompts, name):
    """Given the same per-prompt draws, a row decides as the prompt alone does: lossy policies included."""
    policy = {**_policies(False), **_policies(True)}[name]
    sampling = SamplingConfig(do_sample=True, temperature=0.8)
    alone = _alone(engine, prompts, policy, sampling)
    batched = _batched(engine, prompts, policy, sampling, rows=4)
    assert [_counts(g) for g in batched] == [_counts(g) for g in alone]
    _same_scores(batched, alone)


def test_one_row_and_more_rows_than_prompts(engine, prompts):
    alone = _alone(engine, prompts[:2], StandardSD(2), SamplingConfig())
    for rows in (1, 5):
        got = _batched(engine, prompts[:2], StandardSD(2), SamplingConfig(), rows=rows)
        assert [_counts(g) for g in got] == [_counts(g) for g in alone]


# ---- sampled SD follows the target -------------------------------------------------------------

SMALL = 5  # vocabulary of the chi-square pair: every 3-token continuation is a cell


@pytest.fixture(scope="module")
def small_pair():
    torch.manual_seed(0)
    target = tiny_llama(SMALL, seed=11, init=0.6)
    return Engine(target, perturbed_copy(target, scale=1.0, seed=4), eos_token_ids=[])


def _exact(engine, prompt, horizon, sampling):
    """The target's probability of every ``horizon``-token continuation of ``prompt``."""
    seqs = list(itertools.product(range(SMALL), repeat=horizon))
    ids = torch.tensor([prompt + list(s) for s in seqs])
    with torch.no_grad():
        logits = engine.target(ids).logits[:, len(prompt) - 1 : -1]
    p = probs_from_logits(logits.reshape(-1, SMALL), sampling).view(len(seqs), horizon, SMALL)
    chosen = p.gather(2, torch.tensor(seqs)[..., None])[..., 0].prod(1)
    return dict(zip(seqs, chosen.tolist()))


def _batched_sd_pvalue(engine, n=2400, horizon=3):
    sampling, prompt = SamplingConfig(do_sample=True), [1, 3]
    exact = _exact(engine, prompt, horizon, sampling)
    jobs = (BatchJob(prompt, torch.Generator().manual_seed(i)) for i in range(n))
    counts = dict.fromkeys(exact, 0)
    for _, g in BatchEngine(engine, 16).generate(jobs, StandardSD(2), horizon, sampling):
        counts[tuple(g.tokens)] += 1
    obs, exp = zip(*((counts[s], p * n) for s, p in exact.items() if p * n >= 5))
    rest = n - sum(obs)
    obs, exp = list(obs) + [rest], list(exp) + [n - sum(exp)]
    return chisquare(obs, exp).pvalue


def test_sampled_batched_sd_follows_the_target(small_pair):
    assert _batched_sd_pvalue(small_pair) > 1e-3


def test_chi_square_catches_a_batched_draw_from_the_wrong_q(small_pair, monkeypatch):
    """Planted bug: the SD rule sees a distorted draft distribution (not the one the candidate came from)."""
    pick = engine_mod.pick_token

    def broken(logits, sampling, generator):
        tok, q = pick(logits, sampling, generator)
        return tok, (q.flip(-1) if q is not None else q)

    monkeypatch.setattr(engine_mod, "pick_token", broken)
    assert _batched_sd_pvalue(small_pair) < 1e-6


# ---- what batching refuses ---------------------------------------------------------------------


def test_batching_refuses_cross_vocabulary_policies_and_unfusable_models(engine):
    with pytest.raises(ValueError, match="batch 1"):
        next(BatchEngine(engine, 2).generate([BatchJob([3, 4])], SLEM(k=2), 4))
    stub = Engine(bigram([[0.5, 0.5], [0.5, 0.5]]), bigram([[0.5, 0.5], [0.5, 0.5]]))
    assert isinstance(stub.target, BigramLM)
    with pytest.raises(ValueError, match="fused forward"):
        next(BatchEngine(stub, 2).generate([BatchJob([0])], StandardSD(2), 4))
    with pytest.raises(ValueError, match="rows"):
        BatchEngine(engine, 0)


def test_batch_runner_keeps_rows_apart(engine):
    """Trimming one row leaves the others; a compacted, grown cache gives the same logits."""
    a = BatchRunner(engine.target, 2, capacity=8)
    b = BatchRunner(engine.target, 2, capacity=64)
    for runner in (a, b):
        runner.prefill({0: [5, 6, 7], 1: [8]})
        runner.forward({0: [9, 10], 1: [11, 12, 13]}, {})
        runner.trim(0, 4)
        runner.forward({1: [14]}, {})
    out_a = a.forward({0: [20], 1: [21, 22]}, {0: 1, 1: 2})
    out_b = b.forward({0: [20], 1: [21, 22]}, {0: 1, 1: 2})
    assert a.capacity > 8 and [a.length(r) for r in (0, 1)] == [5, 7]
    for r in (0, 1):
        torch.testing.assert_close(out_a[r][0], out_b[r][0])
    alone = BatchRunner(engine.target, 1, capacity=64)
    alone.prefill({0: [5, 6, 7]})
    ref = alone.forward({0: [9, 20]}, {0: 1})  # row 0's tokens after its trim: 5 6 7 9 | 20
    torch.testing.assert_close(out_a[0][0], ref[0][0], atol=1e-5, rtol=1e-5)


def test_a_jobs_own_budget_is_batch_ones_at_that_budget(engine, prompts):
    """A job may stop sooner than the run's max_new_tokens (heads-eval: ARC needs only the letter)."""
    budgets = [3, None, 7, 1, None, 5, 2, 20]
    alone = [engine.generate(p, StandardSD(3), min(b or NEW, NEW), SamplingConfig()) for p, b in zip(prompts, budgets)]
    jobs = [BatchJob(p, max_new_tokens=b) for p, b in zip(prompts, budgets)]
    out = dict(BatchEngine(engine, 3).generate(jobs, StandardSD(3), NEW, SamplingConfig()))
    assert [_counts(out[i]) for i in range(len(prompts))] == [_counts(g) for g in alone]
    assert all(len(out[i].tokens) <= (b or NEW) for i, b in enumerate(budgets))


def test_packed_forward_equals_the_padded_one_and_computes_only_real_tokens(engine):
    """Rows fed 1, 3 and no tokens (a row below the last fed one): the packed forward gives the padded one's
    logits, final-norm states and captured layer states, and its products cover the 4 real tokens, not 3 x 3."""
    runners = [BatchRunner(engine.target, 3, hidden="post", capacity=16, aux=[1], packed=p) for p in (True, False)]
    outs, prefills = [], []
    for runner in runners:
        runner.prefill({0: [5, 6, 7], 1: [8], 2: [9, 10]})  # prompts of unequal length: packed as well
        prefills.append(dict(runner.aux_states))
        got = runner.forward({0: [11], 2: [12, 13, 14]}, {0: 1, 2: 3})
        outs.append((got, dict(runner.aux_states)))
    (packed, aux_p), (padded, aux_d) = outs
    for r in (0, 1, 2):
        torch.testing.assert_close(prefills[0][r][1], prefills[1][r][1], atol=1e-5, rtol=1e-5)
    for r in (0, 2):
        torch.testing.assert_close(packed[r][0], padded[r][0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(packed[r][1], padded[r][1], atol=1e-5, rtol=1e-5)
        assert aux_p[r][0] == aux_d[r][0]
        torch.testing.assert_close(aux_p[r][1], aux_d[r][1], atol=1e-5, rtol=1e-5)
    assert set(aux_p) == set(aux_d) == {0, 2}
    assert runners[0].fed_tokens == runners[1].fed_tokens == 4
    assert runners[0].computed_tokens == 4 and runners[1].computed_tokens == 9
    # the caches agree too: a next step reads what both wrote
    nxt = [r.forward({0: [15], 1: [16], 2: [17]}, {0: 1, 1: 1, 2: 1}) for r in runners]
    for r in (0, 1, 2):
        torch.testing.assert_close(nxt[0][r][0], nxt[1][r][0], atol=1e-5, rtol=1e-5)
    assert runners[0].computed_tokens == 4 + 3  # equal widths: nothing to pack


@pytest.mark.parametrize("name", ["confidence", "specdecpp_cost"])
def test_packed_and_padded_batches_decode_alike(engine, prompts, name):
    """Rows that stop drafting at different points: packing changes what is computed, not the outputs."""
    jobs = lambda: [BatchJob(p, torch.Generator().manual_seed(100 + i)) for i, p in enumerate(prompts)]  # noqa: E731
    runs = []
    for packed in (True, False):
        out = dict(BatchEngine(engine, 3, packed=packed).generate(jobs(), _policies(False)[name], NEW))
        runs.append([_counts(out[i]) for i in range(len(prompts))])
    assert runs[0] == runs[1]
    assert len({c[4] for c in runs[0]}) > 1  # rows drafted different numbers of candidates
