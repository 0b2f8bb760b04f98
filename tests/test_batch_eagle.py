"""Batched drafting with an EAGLE head: every row decodes as it would alone, greedy and sampled.

Rows of very different prompt lengths (one of a single token, which has no prefill) leave and join;
a policy that skips the target pass (SPRINTER) leaves rows without target states for a round.
"""

from __future__ import annotations

import pytest
import torch
from test_batch_engine import _counts, _same_scores
from test_eagle import eagle_head, target_model

from specheads.heads import AcceptanceHead, JudgeHead, VerifierHead
from specheads.shim.batching.batch_loop import BatchEngine, BatchJob
from specheads.shim.core.sampling import SamplingConfig
from specheads.shim.costs.cost_table import CostTable
from specheads.shim.loop.engine import Engine
from specheads.shim.policies import FSD, ConfidenceStop, EagleTree, Judge, SpecDecPP, Sprinter, StandardSD, TopKVerify
from specheads.shim.runners.batch_cache import BatchRunner

pytestmark = pytest.mark.slow  # trains or decodes for minutes in all: CI's slow step

LENGTHS, NEW = (3, 30, 1, 7, 18, 2, 11), 18
COSTS = CostTable(t_draft_ms=1.0, t_target_ms=[10.0 + 0.5 * k for k in range(1, 24)])
GATED = CostTable(t_draft_ms=4.0, t_target_ms=[10.0 + 3.0 * k for k in range(1, 24)])  # drafting barely pays


@pytest.fixture(scope="module")
def engine():
    return Engine(target_model(), eagle=eagle_head(ids=list(range(0, 40, 2)) + [3, 5]), eos_token_ids=[2])


@pytest.fixture(scope="module")
def engine2():
    """A head of two decoder layers."""
    return Engine(target_model(), eagle=eagle_head(ids=list(range(0, 40, 2)) + [3, 5], num_layers=2), eos_token_ids=[2])


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(7)
    return [[1] + torch.randint(3, 40, (n - 1,), generator=g).tolist() for n in LENGTHS]


def _policies():
    torch.manual_seed(3)
    acc, ver, judge = AcceptanceHead(32, depth=1).eval(), VerifierHead(32).eval(), JudgeHead(32).eval()
    return {
        "sd1": StandardSD(1),
        "sd4": StandardSD(4),
        "confidence": ConfidenceStop(tau=0.3, k_max=5),
        "confidence_cost": ConfidenceStop(k_max=6, stop="cost", costs=COSTS),
        "online_cost": ConfidenceStop(k_max=6, stop="cost", costs=COSTS, estimate="online"),
        "confidence_gated": ConfidenceStop(k_max=6, stop="cost", costs=GATED, gate=True),
        "specdecpp": SpecDecPP(acc, threshold=0.5, k_min=1, k_max=5),
        "topk": TopKVerify(3, 2),
        "fsd": FSD(0.4, "js", k=3),
        "sprinter": Sprinter(ver, eta=0.5, max_run=4),
        "judge": Judge(judge, delta=0.5, k=3),
    }


def _run(engine, prompts, policy, sampling, rows):
    if rows == 1:
        return [
            engine.generate(p, policy.fork(), NEW, sampling, torch.Generator().manual_seed(50 + i))
            for i, p in enumerate(prompts)
        ]
    jobs = [BatchJob(p, torch.Generator().manual_seed(50 + i)) for i, p in enumerate(prompts)]
    out = dict(BatchEngine(engine, rows).generate(jobs, policy, NEW, sampling))
    return [out[i] for i in range(len(prompts))]


@pytest.mark.parametrize(
    "name, layers",
    [(n, 1) for n in ("sd1", "sd4", "confidence", "confidence_cost", "confidence_gated", "specdecpp")]
    + [("sd4", 2), ("confidence_cost", 2)],
)
def test_greedy_batched_eagle_equals_batch_one_and_the_target(request, prompts, name, layers):
    """Also with a head of two decoder layers (each keeps its own cache rows)."""
    engine = request.getfixturevalue("engine2" if layers == 2 else "engine")
    policy = _policies()[name]
    alone = _run(engine, prompts, policy, SamplingConfig(), 1)
    batched = _run(engine, prompts, policy, SamplingConfig(), 3)
    assert [_counts(g) for g in batched] == [_counts(g) for g in alone]
    _same_scores(batched, alone)
    assert [g.tokens for g in batched] == [engine.generate_ar(p, NEW).tokens for p in prompts]
    assert sum(g.stats.accepted for g in batched) > 0 and all(g.stats.draft_forwards for g in batched)


@pytest.mark.parametrize("name", list(_policies()))
def test_sampled_batched_eagle_rows_make_batch_one_decisions(engine, prompts, name):
    sampling = SamplingConfig(do_sample=True, temperature=0.8)
    policy = _policies()[name]
    alone = _run(engine, prompts, policy, sampling, 1)
    batched = _run(engine, prompts, policy, sampling, 4)
    assert [_counts(g) for g in batched] == [_counts(g) for g in alone]
    _same_scores(batched, alone)
    if name == "sprinter":  # some rounds ended without a target pass: the next drafts from no states
        assert any(g.stats.rounds > g.stats.target_calls for g in batched)


def test_the_runner_keeps_each_rows_states_of_its_last_forward_only(engine):
    """A forward that skips a row (or feeds nothing) leaves it no states: none are reused from before."""
    runner = BatchRunner(engine.target, 2, aux=engine.eagle.layer_ids)
    runner.prefill({0: [1, 5, 9], 1: [1, 4]})
    assert {r: (s, t.shape[0]) for r, (s, t) in runner.aux_states.items()} == {0: (0, 3), 1: (0, 2)}
    runner.forward({0: [7]}, {0: 1})
    assert list(runner.aux_states) == [0] and runner.aux_states[0][0] == 3
    runner.forward({}, {})
    assert runner.aux_states == {}
    runner.forward({0: [8], 1: [3, 6]}, {0: 1, 1: 1})
    full = engine.target(torch.tensor([[1, 5, 9, 7, 8]]), output_hidden_states=True).hidden_states
    want = torch.cat([full[i][0, 4:] for i in engine.eagle.layer_ids], dim=-1)
    torch.testing.assert_close(runner.aux_states[0][1], want, atol=1e-5, rtol=1e-5)
    assert runner.aux_states[1][0] == 2 and runner.aux_states[1][1].shape[0] == 2


def test_trees_stay_at_batch_one(engine, prompts):
    with pytest.raises(ValueError, match="batch 1"):
        list(BatchEngine(engine, 2).generate([BatchJob(prompts[0])], EagleTree(3, 2, 4), NEW))
