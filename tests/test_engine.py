"""The draft/verify engine: exactness, losslessness, KV caches, counting, hand-computed cases."""

from __future__ import annotations

import itertools

import pytest
import torch
from conftest import SAMPLINGS, bigram, sd_pvalue, tiny_llama
from torch.testing import assert_close

from specheads.shim.core.sampling import SamplingConfig, probs_from_logits
from specheads.shim.loop.engine import Engine
from specheads.shim.policies import DraftOnly, StandardSD, TargetOnly, residual
from specheads.shim.policies import base as sd_rule
from specheads.shim.runners.model_runner import ModelRunner

PROMPTS = [[5], [7, 9, 11, 4, 6], [3, 8, 12, 15, 20, 4, 9, 10, 11, 13, 5, 6, 7, 8, 22, 30, 31]]


@pytest.mark.parametrize("k", [1, 3, 8])
def test_greedy_sd_equals_greedy_target(tiny_pair, k):
    target, draft = tiny_pair
    engine = Engine(target, draft, eos_token_ids=[])
    accepted = 0
    for prompt in PROMPTS:
        ref = engine.generate_ar(prompt, 40)
        got = engine.generate(prompt, StandardSD(k), 40)
        assert got.tokens == ref.tokens
        accepted += got.stats.accepted
    assert accepted > 0  # the noisy-copy draft must exercise multi-token acceptance


def test_greedy_ar_equals_hf_generate(tiny_pair):
    target, _ = tiny_pair
    engine = Engine(target, None, eos_token_ids=[])
    for prompt in PROMPTS:
        ids = torch.tensor([prompt])
        hf = target.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=25,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
        assert engine.generate_ar(prompt, 25).tokens == hf[0, len(prompt) :].tolist()


def test_greedy_sd_with_independent_draft(tiny_pair):
    """A draft that rarely agrees: mostly rejections, output still exact."""
    target, _ = tiny_pair
    other = tiny_llama(target.config.vocab_size, seed=7)
    engine = Engine(target, other, eos_token_ids=[])
    for prompt in PROMPTS:
        assert engine.generate(prompt, StandardSD(4), 30).tokens == engine.generate_ar(prompt, 30).tokens


def test_counting_identity_and_rates(tiny_pair):
    """N_draft = N - N_target + N_discard + delta (one draft forward per candidate)."""
    target, draft = tiny_pair
    engine = Engine(target, draft, eos_token_ids=[])
    for prompt, k in itertools.product(PROMPTS, (1, 3, 8)):
        s = engine.generate(prompt, StandardSD(k), 33).stats
        assert s.new_tokens == 33 and s.target_calls == s.rounds
        assert s.drafted == s.accepted + s.discarded
        assert s.draft_forwards == s.new_tokens - s.target_calls + s.discarded  # delta = 0 without EOS
        assert s.verification_rate == pytest.approx(s.target_calls / 33)
        assert s.tokens_per_call == pytest.approx(s.accepted_per_call + 1, rel=1e-6, abs=1e-6)


def _fresh_kv(model, ids):
    r = ModelRunner(model)
    r.forward(torch.tensor([ids]), n_logits=1)
    return r


@pytest.mark.parametrize("capacity", [4, 256])
def test_kv_cache_after_rejection_equals_recomputed(tiny_pair, capacity):
    target, _ = tiny_pair
    prompt, cand, accepted, nxt = [3, 8, 12, 15, 20, 4, 9], [10, 11, 13, 5, 6], 2, [30, 31, 7]
    r = ModelRunner(target, capacity=capacity)
    r.forward(torch.tensor([prompt]), n_logits=1)
    r.forward(torch.tensor([cand]), n_logits=len(cand))  # a verification pass
    r.trim(len(prompt) + accepted)  # 3 of 5 candidates rejected
    logits, _ = r.forward(torch.tensor([nxt]), n_logits=len(nxt))
    fresh = ModelRunner(target)
    ref_logits, _ = fresh.forward(torch.tensor([prompt + cand[:accepted] + nxt]), n_logits=len(nxt))
    assert r.length == fresh.length == len(prompt) + accepted + len(nxt)
    for a, b in zip(r.cache.layers, fresh.cache.layers):
        assert_close(a.keys, b.keys, atol=1e-5, rtol=1e-5)
        assert_close(a.values, b.values, atol=1e-5, rtol=1e-5)
    assert_close(logits, ref_logits, atol=1e-4, rtol=1e-4)


def test_hidden_capture_pre_and_post_norm(tiny_pair):
    target, _ = tiny_pair
    ids = torch.tensor([PROMPTS[1]])
    out = target(ids, output_hidden_states=True)
    pre, post = ModelRunner(target, hidden="pre"), ModelRunner(target, hidden="post")
    _, h_pre = pre.forward(ids, n_logits=1)
    _, h_post = post.forward(ids, n_logits=1)
    assert_close(h_post, out.hidden_states[-1][0])
    assert_close(target.model.norm(h_pre), h_post)
    assert not torch.allclose(h_pre, h_post)


# ---- stub models with fixed logits: hand-computed cases -------------------------------------


def _cycle(v: int, shift: int = 1, override: dict | None = None):
    """Greedy bigram table: next = (last + shift) % v, with per-row overrides."""
    rows = []
    for last in range(v):
        nxt = (override or {}).get(last, (last + shift) % v)
        rows.append([0.9 if j == nxt else 0.1 / (v - 1) for j in range(v)])
    return rows


def test_stub_greedy_hand_computed():
    # Target: 0->1->2->3->4->5->0 ... Draft agrees except after 2, where it proposes 5.
    target, draft = bigram(_cycle(6)), bigram(_cycle(6, override={2: 5}))
    g = Engine(target, draft, eos_token_ids=[]).generate([0], StandardSD(3), 7)
    assert g.tokens == [1, 2, 3, 4, 5, 0, 1]
    # Round 1: drafts 1,2,5 ; 1,2 accepted, 5 rejected, target emits 3 -> [1,2,3]
    # Round 2: drafts 4,5,0 ; all accepted + bonus 1 -> [4,5,0,1] (7 tokens, limit reached)
    s = g.stats
    assert (s.rounds, s.target_calls, s.drafted, s.accepted, s.discarded) == (2, 2, 6, 5, 1)
    assert s.draft_forwards == 6
    assert target.calls == [4, 4]  # [last, y1, y2, y3] per round (round 1 is also the prefill)
    assert draft.calls == [1, 1, 1, 1, 1, 1]


def test_stub_eos_and_length_limit():
    # EOS = 3 is drafted and accepted in round 1: output stops there, later drafts discarded.
    target, draft = bigram(_cycle(6)), bigram(_cycle(6))
    g = Engine(target, draft, eos_token_ids=[3]).generate([0], StandardSD(5), 50)
    assert g.tokens == [1, 2, 3] and g.stats.eos == 1
    assert (g.stats.accepted, g.stats.discarded) == (3, 2)
    # delta = 1: the round's target token was not emitted
    s = g.stats
    assert s.draft_forwards == s.new_tokens - s.target_calls + s.discarded + 1
    # Length: with 4 tokens left the round drafts at most 3 so that the bonus still fits.
    g = Engine(target, draft, eos_token_ids=[]).generate([0], StandardSD(8), 4)
    assert g.tokens == [1, 2, 3, 4] and g.stats.drafted == 3 and g.stats.rounds == 1


def test_stub_sampling_always_reject_uses_residual():
    # Draft always proposes 0; the target never produces 0 -> every candidate is rejected and the
    # correction comes from norm(max(0, p - q)) = p.
    v = 4
    draft = bigram([[1.0, 0.0, 0.0, 0.0]] * v)
    target = bigram([[0.0, 0.2, 0.3, 0.5]] * v)
    gen = torch.Generator().manual_seed(0)
    g = Engine(target, draft, eos_token_ids=[]).generate([1], StandardSD(3), 200, SamplingConfig(do_sample=True), gen)
    s = g.stats
    assert s.accepted == 0 and s.rounds == 200 and s.discarded == s.drafted
    assert 0 not in g.tokens
    freq = torch.bincount(torch.tensor(g.tokens), minlength=v).float() / 200
    assert_close(freq, torch.tensor([0.0, 0.2, 0.3, 0.5]), atol=0.1, rtol=0)


def test_stub_sampling_identical_models_accept_everything():
    rows = [[0.1, 0.2, 0.3, 0.4], [0.4, 0.3, 0.2, 0.1], [0.25] * 4, [0.7, 0.1, 0.1, 0.1]]
    gen = torch.Generator().manual_seed(0)
    g = Engine(bigram(rows), bigram(rows), eos_token_ids=[]).generate(
        [0], StandardSD(4), 50, SamplingConfig(do_sample=True), gen
    )
    assert g.stats.accepted == g.stats.drafted and g.stats.discarded == 0
    assert g.stats.rounds == 10  # 4 accepted + 1 bonus per round


def test_residual_guard_and_hand_values():
    p = torch.tensor([0.5, 0.3, 0.2])
    assert_close(residual(p, p.clone()), p)  # all-zero residual -> p itself
    q = torch.tensor([0.1, 0.6, 0.3])
    assert_close(residual(p, q), torch.tensor([1.0, 0.0, 0.0]))
    assert_close(
        residual(torch.tensor([0.5, 0.5, 0.0]), torch.tensor([0.25, 0.25, 0.5])), torch.tensor([0.5, 0.5, 0.0])
    )


def test_sampling_warp_top_k_top_p():
    logits = torch.log(torch.tensor([0.5, 0.25, 0.15, 0.1]))
    assert_close(probs_from_logits(logits, SamplingConfig(True, 1.0, 2, 1.0)), torch.tensor([2 / 3, 1 / 3, 0, 0]))
    assert_close(probs_from_logits(logits, SamplingConfig(True, 1.0, 0, 0.7)), torch.tensor([2 / 3, 1 / 3, 0, 0]))
    assert_close(probs_from_logits(logits, SamplingConfig(True, 1.0, 0, 0.75)), torch.tensor([2 / 3, 1 / 3, 0, 0]))
    assert_close(probs_from_logits(logits, SamplingConfig(True, 1.0, 0, 0.76)).gt(0).sum(), torch.tensor(3))
    hot = probs_from_logits(logits, SamplingConfig(True, 0.5, 0, 1.0))
    assert_close(hot, torch.tensor([0.25, 0.0625, 0.0225, 0.01]) / 0.345)


# ---- losslessness: chi-square on a tiny vocabulary ------------------------------------------


@SAMPLINGS
def test_sampled_sd_is_distributed_as_target(sampling):
    assert sd_pvalue(sampling) > 1e-3


def test_chi_square_catches_a_broken_rule(monkeypatch):
    """Planted one-line bug: the correction drawn from p instead of the residual -> must fail."""
    monkeypatch.setattr(sd_rule, "residual", lambda p, q: p)
    assert sd_pvalue(SamplingConfig(do_sample=True)) < 1e-6


def test_policy_sees_aligned_hidden_states(tiny_pair):
    """A policy asking for target states gets [n+1, d] at last, y_1..y_n, even in the prefill round."""
    target, draft = tiny_pair
    seen = []

    class Probe(StandardSD):
        target_hidden = "pre"
        draft_hidden = "post"

        def verify(self, rnd, logits, hidden):
            seen.append((rnd.n, logits.shape[0], hidden.shape[0], len(rnd.draft_hidden)))
            return super().verify(rnd, logits, hidden)

    engine = Engine(target, draft, eos_token_ids=[])
    assert engine.generate(PROMPTS[2], Probe(3), 12).tokens == engine.generate_ar(PROMPTS[2], 12).tokens
    assert all(n + 1 == nl == nh and nd == n for n, nl, nh, nd in seen)


def test_one_model_alone_is_a_policy_of_the_same_loop(tiny_pair):
    """The target alone and the draft alone run through Engine.generate like every policy: one round per
    token, no candidate, counted as target calls (pass size 1) or as draft forwards."""
    target, draft = tiny_pair
    engine = Engine(target, draft, eos_token_ids=[])
    ids = torch.tensor([PROMPTS[1]])
    with torch.no_grad():
        hf = draft.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=12,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    alone = engine.generate(PROMPTS[1], DraftOnly(), 12)
    assert alone.tokens == hf[0, len(PROMPTS[1]) :].tolist()
    s = alone.stats
    assert (s.rounds, s.draft_forwards, s.target_calls, s.drafted, s.target_pass_sizes) == (12, 12, 0, 0, {})
    s = engine.generate(PROMPTS[1], TargetOnly(), 12).stats
    assert (s.rounds, s.target_calls, s.draft_forwards, s.drafted, s.target_pass_sizes) == (12, 12, 0, 0, {1: 12})


def test_every_round_starts_with_start_round(tiny_pair):
    """start_round opens each round before anything is drafted; its state lives on that round only."""
    target, draft = tiny_pair
    opened, seen = [], []

    class Probe(StandardSD):
        def start_round(self, rnd):
            assert rnd.n == 0 and rnd.state is None
            rnd.state = len(opened)
            opened.append(rnd)

        def stop_drafting(self, rnd):
            seen.append(rnd.state == len(opened) - 1 and rnd is opened[-1])
            return super().stop_drafting(rnd)

    g = Engine(target, draft, eos_token_ids=[]).generate(PROMPTS[0], Probe(3), 20)
    assert len(opened) == g.stats.rounds and seen and all(seen)


# ---- SpecDec++ stopping ------------------------------------------------------------------------


def _beta_head(betas: list[float]) -> torch.nn.Module:
    """A linear head over one-hot stub states: token t gets acceptance probability betas[t]."""
    head = torch.nn.Linear(len(betas), 1)
    with torch.no_grad():
        head.weight.copy_(torch.logit(torch.tensor([betas], dtype=torch.float32)))
        head.bias.zero_()
    return head


@pytest.mark.parametrize("h, expected_n", [(0.05, 2), (0.3, 4), (0.5, 5), (0.7, 6), (0.95, 8)])
def test_specdecpp_stops_where_the_product_crosses_h(h, expected_n):
    """Draft cycles 0 -> 1 -> 2 ...; the head gives token t the score betas[t].

    After drafting y_n the scored candidates are y_1..y_{n-1} (the reference's order): with
    prompt [0] the draft proposes 1, 2, 3, ...; betas = 0.9, 0.8, 0.7, 0.6, 0.5, 0.5, 0.5 for
    tokens 1..7, so 1 - prod = 0.1, 0.28, 0.496, 0.698, 0.849, 0.924, 0.962 after drafting
    y_2..y_8: the round stops after the first y_n where 1 - prod > h.
    """
    from specheads.shim.policies import SpecDecPP

    v = 12
    betas = [0.5, 0.9, 0.8, 0.7, 0.6, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5]
    keep = 1.0
    want = None
    for n in range(2, 9):
        keep *= betas[n - 1]
        if 1 - keep > h:
            want = n
            break
    assert want == expected_n
    draft, target = bigram(_cycle(v)), bigram(_cycle(v))
    rounds = []

    class Probe(SpecDecPP):
        def verify(self, rnd, logits, hidden):
            rounds.append((rnd.n, self.scored))
            return super().verify(rnd, logits, hidden)

    g = Engine(target, draft, eos_token_ids=[]).generate([0], Probe(_beta_head(betas), h, 2, 20), 11)
    assert rounds[0] == (expected_n, expected_n - 1)  # the newest candidate is never scored
    assert g.tokens[: expected_n + 1] == list(range(1, expected_n + 2))


def test_specdecpp_bounds():
    from specheads.shim.policies import SpecDecPP

    v = 8
    draft, target = bigram(_cycle(v)), bigram(_cycle(v))
    low = SpecDecPP(_beta_head([0.01] * v), threshold=0.5, k_min=3, k_max=20)  # wants to stop at once
    g = Engine(target, draft, eos_token_ids=[]).generate([0], low, 4)
    assert g.stats.drafted == 3  # k_min
    high = SpecDecPP(_beta_head([0.999] * v), threshold=0.9, k_min=1, k_max=5)  # never wants to stop
    g = Engine(target, draft, eos_token_ids=[]).generate([0], high, 30)
    assert g.stats.drafted == 25 and g.stats.rounds == 5  # k_max per round, 5 + 1 tokens per round
    with pytest.raises(Exception, match="threshold"):
        SpecDecPP(_beta_head([0.5] * v), threshold=1.5)


@pytest.mark.parametrize("h", [0.3, 0.7, 0.9])
def test_specdecpp_previous_position_scores_every_candidate(h):
    """An expected-label head reads the state that produced q_n (returned with y_n): here the
    one-hot of the consumed token, so y_n gets betas[y_{n-1}] with y_0 = the prompt token 0."""
    from specheads.shim.policies import SpecDecPP

    v = 12
    betas = [0.5, 0.9, 0.8, 0.7, 0.6, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5]
    keep, want = 1.0, None
    for n in range(1, 12):
        keep *= betas[n - 1]
        if n >= 2 and 1 - keep > h:
            want = n
            break
    rounds = []

    class Probe(SpecDecPP):
        def verify(self, rnd, logits, hidden):
            rounds.append((rnd.n, self.scored))
            return super().verify(rnd, logits, hidden)

    draft, target = bigram(_cycle(v)), bigram(_cycle(v))
    Engine(target, draft, eos_token_ids=[]).generate([0], Probe(_beta_head(betas), h, 2, 20, position="previous"), 11)
    assert rounds[0] == (want, want)  # every candidate, the newest included, was scored
