"""The training-free acceptance estimates of the confidence stop (shim/policies/estimates.py): their
values, the online model's learning, and that every rule reading them stays lossless."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import perturbed_copy, tiny_llama

from specheads.errors import UserError
from specheads.shim.core.sampling import SamplingConfig
from specheads.shim.costs.cost_table import CostTable
from specheads.shim.loop.engine import Engine
from specheads.shim.policies import ConfidenceStop, TargetOnly
from specheads.shim.policies.estimates import OnlineLogistic, entropy_bound, features

COSTS = CostTable(t_draft_ms=1.0, t_target_ms=[10.0 + 0.5 * k for k in range(1, 24)])


def test_features_are_q_of_the_candidate_the_log_odds_of_the_top_and_the_entropy():
    logits = torch.tensor([2.0, 0.5, -1.0, 0.0])
    p = torch.softmax(logits, -1)
    q_y, z, ent = features(logits, 1)
    assert q_y == pytest.approx(float(p[1]), rel=1e-6)
    assert z == pytest.approx(math.log(float(p[0]) / (1 - float(p[0]))), rel=1e-5)
    assert ent == pytest.approx(float(-(p * p.log()).sum()), rel=1e-5)


def test_a_point_mass_is_clipped_not_infinite():
    _, z, ent = features(torch.tensor([80.0, -80.0, -80.0]), 0)
    assert 0 < z <= 12.0 and ent == pytest.approx(0.0, abs=1e-6)


def test_the_entropy_bound_is_one_at_a_point_mass_and_falls_with_entropy():
    assert entropy_bound(0.0, 1.0) == 1.0
    values = [entropy_bound(h, 0.5) for h in (0.1, 0.5, 1.0, 2.0, 5.0)]
    assert values == sorted(values, reverse=True) and values[-1] == 0.0
    assert entropy_bound(0.5, 0.5) == pytest.approx(0.5)


def test_the_online_model_starts_at_max_q_and_learns_from_the_outcomes():
    m = OnlineLogistic(lr=0.2)
    for p in (0.1, 0.5, 0.9):
        assert m.predict(math.log(p / (1 - p))) == pytest.approx(p)
    confident, unsure = 2.0, -0.5  # logit(max q) of a confident and an unsure candidate
    for _ in range(200):  # the confident one is always accepted, the unsure one never
        m.observe([confident, unsure, 3.0], accepted=1)  # the third, after a rejection, is never observed
    assert m.seen == 400
    assert m.predict(confident) > 0.95 and m.predict(unsure) < 0.1
    m.reset()
    assert (m.w, m.b, m.seen) == (1.0, 0.0, 0)


def test_an_overconfident_drafter_is_corrected():
    m = OnlineLogistic()
    z = math.log(0.9 / 0.1)  # the drafter says 0.9 ...
    for _ in range(300):
        m.observe([z, z], accepted=0)  # ... and its first candidate is rejected every time
    assert m.predict(z) < 0.2


@pytest.fixture(scope="module")
def engine():
    target = tiny_llama(60, seed=0)
    return Engine(target, perturbed_copy(target, scale=0.3), eos_token_ids=[2])


@pytest.mark.parametrize(
    "policy",
    [
        lambda: ConfidenceStop(k_max=6, stop="cost", costs=COSTS, estimate="online"),
        lambda: ConfidenceStop(tau=0.4, k_max=6, estimate="online"),
        lambda: ConfidenceStop(k_max=6, stop="cost", costs=COSTS, estimate="entropy"),
        lambda: ConfidenceStop(tau=0.3, k_max=6, estimate="entropy", entropy_gamma=0.3),
    ],
    ids=["online-cost", "online-threshold", "entropy-cost", "entropy-threshold"],
)
def test_every_estimate_keeps_greedy_decoding_lossless(engine, policy):
    prompts = [[5, 9, 11], [7, 3, 40, 41, 12], [33]]
    for ids in prompts:
        ours = engine.generate(ids, policy(), 24, SamplingConfig())
        alone = engine.generate(ids, TargetOnly(), 24, SamplingConfig())
        assert ours.tokens == alone.tokens
        assert ours.stats.drafted > 0  # it drafted: the rule ran


def test_the_online_rule_learns_while_decoding_and_starts_over_per_prompt(engine):
    policy = ConfidenceStop(k_max=6, stop="cost", costs=COSTS, estimate="online")
    first = engine.generate([5, 9, 11], policy, 24, SamplingConfig())
    again = engine.generate([5, 9, 11], policy, 24, SamplingConfig())
    assert first.trace["online"]["observed"] > 0 and first.trace["online"]["w"] != 1.0
    assert first.trace == again.trace and first.stats.drafted == again.stats.drafted


@pytest.mark.parametrize(
    "kwargs,message",
    [({"estimate": "vibes"}, "estimate='vibes'"), ({"estimate": "entropy", "entropy_gamma": 0}, "entropy_gamma=0")],
)
def test_bad_estimate_settings_are_one_line_errors(kwargs, message):
    with pytest.raises(UserError, match=message):
        ConfidenceStop(**kwargs)
