"""Judge decoding policy: delta = 1 is SD draw for draw; a judge that accepts everything is draft-only."""

from __future__ import annotations

import pytest
import torch

from specheads.errors import UserError
from specheads.export.shim.loop.engine import Engine
from specheads.export.shim.loop.sampling import SamplingConfig
from specheads.export.shim.policies import Judge, StandardSD

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
    from specheads.export.shim.runners.hidden import HiddenCapture

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
    from specheads.export.shim.policies import TopKVerify

    target, draft = tiny_pair
    engine = Engine(target, draft, [2])
    for prompt in PROMPTS:
        one = engine.generate(prompt, TopKVerify(k=3, top_k=1), 24, SamplingConfig(), None)
        sd = engine.generate(prompt, StandardSD(3), 24, SamplingConfig(), None)
        assert one.tokens == sd.tokens and one.stats.accepted == sd.stats.accepted
        wide = engine.generate(prompt, TopKVerify(k=3, top_k=40), 24, SamplingConfig(), None)
        # every candidate is within the top 40 of a 41-token vocabulary unless it is the least likely one
        assert wide.stats.accepted >= one.stats.accepted
