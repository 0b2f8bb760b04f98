"""Judge decoding policy: delta = 1 is SD draw for draw; a judge that accepts everything is draft-only."""

from __future__ import annotations

import pytest
import torch

from specheads.errors import UserError
from specheads.shim.core.sampling import SamplingConfig
from specheads.shim.loop.engine import Engine
from specheads.shim.policies import Judge, StandardSD

PROMPTS = [[1, 5, 6, 7], [1, 9, 10], [1, 20, 21, 22, 23, 24]]


class ConstantJudge(torch.nn.Module):
    """A stub judge: the same logit for every state."""

    def __init__(self, logit: float):
        super().__init__()
        self.logit = torch.nn.Parameter(torch.tensor(logit), requires_grad=False)

    def forward(self, h):
        return self.logit.expand(h.shape[:-1])


def _gen(engine, policy, prompt, sampling, seed):
    g = torch.Generator().manual_seed(seed)
    return engine.generate(prompt, policy, 24, sampling, g).tokens


@pytest.mark.parametrize("do_sample", [False, True])
@pytest.mark.parametrize("k", [1, 4])
def test_delta_one_is_sd_exactly(tiny_pair, do_sample, k):
    target, draft = tiny_pair
    engine = Engine(target, draft, [2])
    sampling = SamplingConfig(do_sample=do_sample, temperature=0.9)
    for i, prompt in enumerate(PROMPTS):
        # the judge scores high everywhere, but delta = 1 never accepts (sigmoid <= 1, strict >)
        judge = _gen(engine, Judge(ConstantJudge(50.0), delta=1.0, k=k), prompt, sampling, i)
        sd = _gen(engine, StandardSD(k), prompt, sampling, i)
        assert judge == sd


@pytest.mark.parametrize("k", [1, 3, 5])
def test_accept_everything_is_draft_only_greedy(tiny_pair, k):
    target, draft = tiny_pair
    engine = Engine(target, draft, [2])
    for prompt in PROMPTS:
        policy = Judge(ConstantJudge(50.0), delta=0.5, k=k)
        out = engine.generate(prompt, policy, 24, SamplingConfig(), None)
        ref = engine.generate_ar(prompt, 24, SamplingConfig(), None, use_draft=True)
        assert out.tokens == ref.tokens
        assert out.stats.target_calls == out.stats.rounds  # still one target pass per round


def test_judge_reads_the_candidates_own_states(tiny_pair):
    """A judge that accepts only candidates whose state is the one at the candidate's position."""
    target, draft = tiny_pair
    seen = []

    class Spy(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(1), requires_grad=False)

        def forward(self, h):
            seen.append(h.clone())
            return torch.full(h.shape[:-1], -50.0)

    engine = Engine(target, draft, [2], fused=False)
    prompt = PROMPTS[0]
    out = engine.generate(prompt, Judge(Spy(), delta=0.5, k=3), 3, SamplingConfig(), None)
    cand = seen[0].shape[0]
    assert cand >= 1
    # the first round's candidates, teacher-forced through the target: pre-norm states at their positions
    from specheads.shim.runners.hidden import HiddenCapture

    with HiddenCapture(target) as cap, torch.no_grad():
        drafted = []
        ids = list(prompt)
        for _ in range(cand):
            drafted.append(int(draft(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
            ids.append(drafted[-1])
        target(input_ids=torch.tensor([ids]))
        want = cap.pre[0, len(prompt) : len(prompt) + cand]
    torch.testing.assert_close(seen[0], want, atol=1e-4, rtol=1e-4)
    assert len(out.tokens) == 3


def test_bad_delta():
    with pytest.raises(UserError, match="delta"):
        Judge(ConstantJudge(0.0), delta=1.5)


def test_topk_verify_with_top1_is_greedy_sd_and_larger_k_accepts_more(tiny_pair):
    from specheads.shim.policies import TopKVerify

    target, draft = tiny_pair
    engine = Engine(target, draft, [2])
    for prompt in PROMPTS:
        one = engine.generate(prompt, TopKVerify(k=3, top_k=1), 24, SamplingConfig(), None)
        sd = engine.generate(prompt, StandardSD(3), 24, SamplingConfig(), None)
        assert one.tokens == sd.tokens and one.stats.accepted == sd.stats.accepted
        wide = engine.generate(prompt, TopKVerify(k=3, top_k=40), 24, SamplingConfig(), None)
        # every candidate is within the top 40 of a 41-token vocabulary unless it is the least likely one
        assert wide.stats.accepted >= one.stats.accepted


def test_relaxed_acceptance_between_greedy_sd_and_top_k(tiny_pair):
    """verify_delta=0 accepts only the target's own choice (greedy SD); a huge delta is top-K alone."""
    from specheads.shim.policies import TopKVerify

    target, draft = tiny_pair
    engine = Engine(target, draft, [2])
    for prompt in PROMPTS:
        sd = engine.generate(prompt, StandardSD(3), 24, SamplingConfig(), None)
        zero = engine.generate(prompt, TopKVerify(k=3, top_k=5, delta=0.0), 24, SamplingConfig(), None)
        assert zero.tokens == sd.tokens and zero.stats.accepted == sd.stats.accepted
        top = engine.generate(prompt, TopKVerify(k=3, top_k=5), 24, SamplingConfig(), None)
        wide = engine.generate(prompt, TopKVerify(k=3, top_k=5, delta=1e6), 24, SamplingConfig(), None)
        assert wide.tokens == top.tokens
    with pytest.raises(UserError, match="delta"):
        TopKVerify(k=3, top_k=2, delta=-1.0)


def test_margin_floor_zero_is_greedy_sd_and_signals_are_the_targets_verdict(tiny_pair):
    """max_gap=0 lets the judge accept only the target's own choice: greedy SD even with a judge that accepts
    everything. judge_signal_values: log p(y), its gap to the top, the entropy and y's rank, by hand."""
    from specheads.heads.judge_head import JudgeHead, judge_signal_values

    target, draft = tiny_pair
    engine = Engine(target, draft, [2])
    for prompt in PROMPTS:
        floor = engine.generate(prompt, Judge(ConstantJudge(50.0), 0.5, 3, max_gap=0.0), 24, SamplingConfig(), None)
        sd = engine.generate(prompt, StandardSD(3), 24, SamplingConfig(), None)
        assert floor.tokens == sd.tokens
    logits = torch.tensor([[2.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    got = judge_signal_values(logits, torch.tensor([1, 2]))
    lp = logits.log_softmax(-1)
    assert got[0, 0].item() == pytest.approx(lp[0, 1].item()) and got[0, 1].item() == pytest.approx(-1.0)
    assert got[1, 1].item() == 0.0 and got[1, 3].item() == 0.0  # ties: nothing is preferred to y
    assert got[1, 2].item() == pytest.approx(torch.log(torch.tensor(3.0)).item())
    assert got[0, 3].item() > 0 and judge_signal_values(logits, torch.tensor([0, 0]), ("rank",)).shape == (2, 1)
    head = JudgeHead(8, 1, ("gap", "rank"))
    assert head.in_features == 10 and JudgeHead(**head.config()).in_features == 10
    with pytest.raises(ValueError, match="signals"):
        JudgeHead(8, 0, ("margin",))
