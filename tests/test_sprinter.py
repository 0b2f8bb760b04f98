"""SPRINTER policy: sequential approximate verification (docs/algorithms/sprinter.md)."""

from __future__ import annotations

import pytest
import torch
from conftest import P_ROWS, Q_ROWS, bigram, sd_pvalue

from specheads.errors import UserError
from specheads.shim.core.sampling import SamplingConfig, probs_from_logits
from specheads.shim.loop.engine import Engine
from specheads.shim.policies import Sprinter

V = 4


class RatioVerifier(torch.nn.Module):
    """Stub verifier on ``previous+embedding`` features of the bigram pair (one-hot states):
    approves ``y`` after token ``a`` iff ``q(y|a) <= scale * p(y|a)`` (the true label)."""

    def __init__(self, sampling: SamplingConfig, scale: float = 1.0):
        super().__init__()
        self.p = probs_from_logits(torch.log(torch.tensor(P_ROWS)), sampling)
        self.q = probs_from_logits(torch.log(torch.tensor(Q_ROWS)), sampling)
        self.scale = scale

    def forward(self, x):
        a, y = int(x[:V].argmax()), int(x[V:].argmax())
        return torch.tensor(30.0 if self.q[a, y] <= self.scale * self.p[a, y] else -30.0)


class Constant(torch.nn.Module):
    def __init__(self, logit: float):
        super().__init__()
        self.logit = logit

    def forward(self, x):
        return torch.tensor(self.logit)


def _engine():
    return Engine(bigram(P_ROWS), bigram(Q_ROWS), eos_token_ids=[])


def _embedding():
    return bigram(Q_ROWS).get_input_embeddings()


@pytest.mark.parametrize(
    "sampling",
    [SamplingConfig(do_sample=True), SamplingConfig(do_sample=True, temperature=0.7, top_k=3)],
    ids=["plain", "warped"],
)
def test_perfect_verifier_is_distributed_as_sd(sampling):
    policy = Sprinter(RatioVerifier(sampling), eta=0.5, feature="previous+embedding", embedding=_embedding())
    assert sd_pvalue(sampling, policy=policy) > 1e-3


def test_always_accept_is_draft_only_sampling():
    sampling = SamplingConfig(do_sample=True)
    policy = Sprinter(Constant(30.0), eta=0.5, max_run=None)
    assert sd_pvalue(sampling, policy=policy, rows=Q_ROWS) > 1e-3
    assert sd_pvalue(sampling, policy=policy) < 1e-6  # ... and not the target's distribution


def test_a_too_lenient_verifier_is_caught():
    """Approving q(y) <= 3 p(y) lets through tokens the target would sometimes reject: not p."""
    sampling = SamplingConfig(do_sample=True)
    policy = Sprinter(RatioVerifier(sampling, scale=3.0), feature="previous+embedding", embedding=_embedding())
    assert sd_pvalue(sampling, policy=policy) < 1e-6


def test_always_reject_calls_the_target_for_every_token_and_is_lossless():
    sampling = SamplingConfig(do_sample=True)
    policy = Sprinter(Constant(-30.0), eta=0.5)
    out = _engine().generate([0], policy, 10, sampling, torch.Generator().manual_seed(0))
    s = out.stats
    assert s.new_tokens == 10 and s.draft_forwards == s.target_calls
    assert s.target_calls <= 10 and s.target_calls >= 5  # one judged token per call, plus a bonus when accepted
    assert policy.verifier_calls == s.draft_forwards == s.verifier_calls
    assert sd_pvalue(sampling, policy=Sprinter(Constant(-30.0))) > 1e-3


@pytest.mark.parametrize("feature", ["previous", "current"])
def test_run_cap_forces_target_calls(feature):
    policy = Sprinter(Constant(30.0), eta=0.5, max_run=3, feature=feature)
    out = _engine().generate([0], policy, 40, SamplingConfig(do_sample=True), torch.Generator().manual_seed(0))
    s = out.stats
    # every round: 3 approved + 1 judged by the target (+ its bonus when accepted), so at most 5 per call
    assert s.new_tokens == 40
    assert s.target_calls >= 40 // 5
    assert s.accepted + s.target_calls >= s.new_tokens - 1
    if feature == "current":  # the candidate drafted to score the judged one is thrown away
        assert s.discarded >= s.target_calls - 1


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "hf"])
@pytest.mark.parametrize("logit", [30.0, -30.0], ids=["approve", "reject"])
def test_uncapped_run_sizes_caches_from_the_round(tiny_pair, monkeypatch, logit, fused):
    """max_run=None makes max_candidates() 2**30: the caches are sized from what a round can use
    (prompt + new tokens + a round bounded by them), not from it, and decoding is unchanged."""
    from specheads.shim.loop import engine as engine_module
    from specheads.shim.runners.model_runner import FusedRunner

    made = []
    make_runner = engine_module.make_runner

    def recording(model, hidden, vocab_size, capacity, fused, **kwargs):
        runner = make_runner(model, hidden, vocab_size, capacity, fused, **kwargs)
        made.append((capacity, runner))
        return runner

    monkeypatch.setattr(engine_module, "make_runner", recording)
    target, draft = tiny_pair
    engine = Engine(target, draft, eos_token_ids=[], fused=fused)
    prompt, n = [3, 8, 12, 15, 20], 24
    policy = Sprinter(Constant(logit), eta=0.5, max_run=None)
    assert policy.max_candidates() >= 1 << 30
    out = engine.generate(prompt, policy, n)
    assert len(made) == 2 and all(cap <= len(prompt) + 2 * n + 2 for cap, _ in made)
    assert all(isinstance(r, FusedRunner) == fused for _, r in made)
    assert all(r.capacity == cap for cap, r in made)  # the fused runner never had to grow
    # approve-all: one round of n candidates, draft-only greedy, no target call; reject-all: greedy target
    ref = engine.generate_ar(prompt, n, use_draft=logit > 0)
    assert out.tokens == ref.tokens and len(out.tokens) == n
    assert (out.stats.target_calls == 0) == (logit > 0)


def test_greedy_perfect_verifier_matches_greedy_target():
    """Greedy: approving exactly the tokens equal to the target's argmax reproduces greedy decoding."""
    p = torch.tensor(P_ROWS)

    class Argmax(torch.nn.Module):
        def forward(self, x):
            a, y = int(x[:V].argmax()), int(x[V:].argmax())
            return torch.tensor(30.0 if int(p[a].argmax()) == y else -30.0)

    engine = _engine()
    ref = engine.generate_ar([0], 12).tokens
    out = engine.generate([0], Sprinter(Argmax(), feature="previous+embedding", embedding=_embedding()), 12)
    assert out.tokens == ref


def test_bad_settings_are_refused():
    with pytest.raises(UserError, match="eta"):
        Sprinter(Constant(0.0), eta=1.5)
    with pytest.raises(UserError, match="feature"):
        Sprinter(Constant(0.0), feature="next")
    with pytest.raises(UserError, match="embedding"):
        Sprinter(Constant(0.0), feature="previous+embedding")


def test_decode_by_name_explains_what_sprinter_needs():
    from specheads.decode.api import make_policy

    with pytest.raises(UserError, match="verifier"):
        make_policy("sprinter", pair=None)
