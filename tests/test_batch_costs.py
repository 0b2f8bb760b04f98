"""The cost table's batch dimension: prices t_d(B), t_t(B, k), the cost rules and the draft gate priced at the
batch a round runs in, and the batched engine and the proposer telling each row's policy that batch.

Verdicts rest on synthetic tables; measured times are checked for shape only."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import perturbed_copy, tiny_llama

from specheads.errors import UserError
from specheads.shim.batching.batch_loop import BatchEngine, BatchJob
from specheads.shim.batching.row_proposer import RowProposer
from specheads.shim.core.sampling import SamplingConfig
from specheads.shim.costs.cost_profile import batch_sizes, measure_batches
from specheads.shim.costs.cost_rules import DraftGate, draft_more
from specheads.shim.costs.cost_table import CostTable, load_table
from specheads.shim.loop.engine import Engine
from specheads.shim.policies import ConfidenceStop, TargetOnly

VOCAB = 60


def batched_table(steep: float = 10.0) -> CostTable:
    """Batch 1: t_d 1, t_t(k) = 10 + 0.5 k (drafting pays). Batches 4 and 16: each token of a pass costs
    ``steep`` ms per row beyond the first (compute-bound: verification dearer than the target alone's step)."""
    one = [10.0 + 0.5 * k for k in range(1, 12)]
    by_b = {b: [10.0 + b + steep * b * (k - 1) for k in range(1, 12)] for b in (4, 16)}
    return CostTable(
        t_draft_ms=1.0,
        t_target_ms=one,
        batches=[4, 16],
        t_draft_batch_ms=[2.0, 5.0],
        t_target_batch_ms=[by_b[4], by_b[16]],
    )


def test_batch_prices_interpolate_and_extend():
    t = batched_table()
    assert t.t_target(3) == t.t_target(3, batch=1) == 11.5 and t.t_draft(1) == 1.0
    assert t.t_target(2, batch=4) == 14.0 + 40.0 and t.t_draft(16) == 5.0
    # between 1 and 4: a third of the way from t_t(1, 2) = 11 to t_t(4, 2) = 54 at B = 2
    assert t.t_target(2, batch=2) == pytest.approx(11.0 + (54.0 - 11.0) / 3)
    assert t.t_draft(10) == pytest.approx(2.0 + 3.0 * 6 / 12)
    # past B = 16: along the line through B = 4 and 16; past k = 11: along the last two sizes
    assert t.t_target(1, batch=28) == pytest.approx(26.0 + 12.0 * 12 / 12)
    assert t.t_target(13, batch=16) == pytest.approx(t.t_target(11, 16) + 2 * 160.0)
    assert t.round_ms(2, batch=4) == 2 * 2.0 + t.t_target(3, 4)
    assert CostTable(t_draft_ms=1.0, t_target_ms=[5.0]).t_target(1, batch=64) == 5.0  # no batch prices: batch 1's
    assert t.key != CostTable(**{**t.settings(), "batches": [4], "t_draft_ms": 1.0, "t_target_ms": [1.0]}).key


def test_batch_sizes_for_an_engine():
    assert batch_sizes(1) == () and batch_sizes(2) == (2,) and batch_sizes(16) == (2, 4, 8, 16)
    assert batch_sizes(12) == (2, 4, 8, 12)


def test_load_table_checks_the_batch_entries(tmp_path):
    good = tmp_path / "good.json"
    good.write_text(json.dumps(batched_table().to_dict()))
    assert load_table(good).t_target(2, 4) == batched_table().t_target(2, 4)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({**batched_table().to_dict(), "t_draft_batch_ms": [2.0]}))
    with pytest.raises(UserError, match="one entry per batch size"):
        load_table(bad)


def test_draft_more_prices_at_the_batch():
    t = batched_table()
    # a sure candidate: at batch 1 another one always pays (E grows by 1 for 1.5 ms on 12.5)
    assert draft_more(t, 1, 1, 0.9, 0.9, 0.9, batch=1)
    assert not draft_more(t, 1, 1, 0.9, 0.9, 0.9, batch=16)  # 160 ms more per candidate at B = 16
    assert draft_more(t, 1, 1, 0.9, 0.9, 0.9, batch=16) is draft_more(
        CostTable(t_draft_ms=5.0, t_target_ms=t.t_target_batch_ms[1]), 1, 1, 0.9, 0.9, 0.9
    )


def test_gate_reprices_its_rounds_at_the_batch_about_to_run():
    """The same history (every candidate kept): the gate stays open at batch 1, closes at 16, opens again when
    the batch shrinks, and agrees with the surplus mean priced at one batch throughout."""
    t = batched_table()
    gate = DraftGate(t, memory=4, probe_every=50, max_probe_every=50)
    for _ in range(6):
        gate.observe(2, 2)
    assert gate.estimate(1) > 1 and gate.open(1)

    def want(b):
        return (0.5 * 2 * 0.75**6 + sum(0.75**i * (3 - t.round_ms(2, b) / t.round_ms(0, b)) for i in range(6))) / (
            2 * 0.75**6 + sum(0.75**i for i in range(6))
        )

    assert gate.estimate(16) == pytest.approx(want(16)) and gate.estimate(1) == pytest.approx(want(1))
    assert gate.estimate(16) < 0 and not gate.open(16)
    assert gate.open(1)


@pytest.fixture(scope="module")
def engine():
    target = tiny_llama(VOCAB, seed=0)
    return Engine(target, perturbed_copy(target, scale=0.05), eos_token_ids=[2])


def _prompts(n=6):
    g = torch.Generator().manual_seed(5)
    return [torch.randint(3, VOCAB, (5 + 3 * i,), generator=g).tolist() for i in range(n)]


def _run(engine, policy, rows, prompts):
    jobs = [BatchJob(p, torch.Generator().manual_seed(i)) for i, p in enumerate(prompts)]
    out = dict(BatchEngine(engine, rows).generate(jobs, policy, 16, SamplingConfig()))
    return [out[i] for i in range(len(prompts))]


@pytest.mark.slow  # a long run: CI's slow step
def test_batched_engine_stops_drafting_where_the_batch_makes_it_lose(engine):
    """One table: at batch 1 the cost rule drafts; at batch 4 verification costs more than it yields, so the
    gated rule leaves almost every round to the target alone; greedy output is the target's either way."""
    policy = ConfidenceStop(k_max=4, stop="cost", costs=batched_table(), gate=True)
    prompts = _prompts()
    alone = _run(engine, TargetOnly(), 4, prompts)
    one = _run(engine, policy, 1, prompts)
    four = _run(engine, policy, 4, prompts)
    assert [g.tokens for g in one] == [g.tokens for g in four] == [g.tokens for g in alone]

    def drafted(gens):
        return sum(g.stats.drafted for g in gens)

    def undrafted(gens):
        return sum(g.stats.undrafted_rounds for g in gens)

    assert drafted(one) > 2 * len(prompts) and undrafted(one) == 0
    assert undrafted(four) > drafted(four)
    flat = ConfidenceStop(k_max=4, stop="cost", costs=CostTable(1.0, batched_table().t_target_ms), gate=True)
    assert undrafted(_run(engine, flat, 4, prompts)) == 0  # a table without batch prices: batch 1's decisions


def test_proposer_prices_at_its_row_count(engine):
    seen = []

    class Spy(ConfidenceStop):
        def start_round(self, rnd):
            seen.append(self.batch)
            super().start_round(rnd)

    core = RowProposer(engine.draft, Spy(k_max=3, stop="cost", costs=batched_table()), slots=4)
    rows = {i: p for i, p in enumerate(_prompts(3))}
    core.propose(rows)
    core.propose({0: rows[0]})
    assert seen == [3, 3, 3, 1]


def test_measure_batches_shape():
    target = tiny_llama(VOCAB, seed=0)
    drafts, targets = measure_batches(target, perturbed_copy(target, 0.1), 3, [2, 4], prefix_tokens=8, reps=2, warmup=1)
    assert len(drafts) == 2 and all(d > 0 for d in drafts)
    assert [len(t) for t in targets] == [3, 3] and all(x > 0 for t in targets for x in t)
    with pytest.raises(UserError, match="batch sizes"):
        measure_batches(target, target, 3, [1])


def test_proposer_keeps_a_closed_gate_closed_across_calls(engine):
    """Two requests at batch 2 on a table where drafting loses there: once the gate closes, each row's policy stays
    the same across calls (its cache lags, its request continues), so it drafts only on its probes; a cache far
    behind catches up through a prefill of its row alone. A planted reset of the policy on every call drafts far
    more."""
    t = batched_table(steep=40.0)
    core = RowProposer(engine.draft, ConfidenceStop(k_max=3, stop="cost", costs=t, gate=True), slots=2)
    g = torch.Generator().manual_seed(1)
    seqs = {r: torch.randint(3, VOCAB, (12,), generator=g).tolist() for r in (0, 1)}
    drafted = []
    for step in range(60):
        out = core.propose(seqs)
        drafted.append(sum(map(len, out.values())))
        for r in seqs:  # the target keeps none of the candidates and emits a token of its own
            seqs[r] = seqs[r] + [int(torch.randint(3, VOCAB, (1,), generator=g))]
    assert sum(drafted[20:]) <= 2 * 3 * 3  # probes only: at most 3 per row after step 20 (waits 8, 16, 32)
    assert core.stats["prefills"] >= 2  # the probes' caches caught up through a prefill
    assert core.policies[0].gate.estimate(2) < 0 and core.policies[0].gate.estimate(1) > core.policies[0].gate.estimate(
        2
    )
