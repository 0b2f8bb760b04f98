"""SpecDec++ labels and loss against hand computations."""

from __future__ import annotations

import math

import torch
from torch.testing import assert_close

from specheads.datagen.acceptance_labels import acceptance_labels
from specheads.shim.core.sampling import SamplingConfig
from specheads.train.loss import binary_kl, weighted_soft_bce


def test_labels_match_hand_computation():
    p = torch.tensor([[0.5, 0.3, 0.2], [0.1, 0.1, 0.8]])
    q = torch.tensor([[0.2, 0.6, 0.2], [0.1, 0.1, 0.8]])
    out = acceptance_labels(p.log(), q.log(), SamplingConfig(do_sample=True), torch.Generator().manual_seed(0))
    y = out["draft_token"].tolist()
    want = [min(1.0, float(p[i, t] / q[i, t])) for i, t in enumerate(y)]
    assert_close(out["label"], torch.tensor(want))
    # 1 - TV: row 0: min(.5,.2)+min(.3,.6)+min(.2,.2) = 0.7 ; row 1: identical -> 1
    assert_close(out["expected_label"], torch.tensor([0.7, 1.0]))


def test_label_of_token_the_target_excludes_is_zero():
    p = torch.tensor([[0.0, 0.5, 0.5]])
    q = torch.tensor([[1.0, 0.0, 0.0]])
    out = acceptance_labels(p.log(), q.log(), SamplingConfig(do_sample=True), torch.Generator().manual_seed(0))
    assert out["draft_token"].item() == 0 and out["label"].item() == 0.0 and out["expected_label"].item() == 0.0


def test_greedy_labels_are_agreement():
    p = torch.tensor([[0.1, 2.0, 0.3], [1.0, 0.0, 0.0]])
    q = torch.tensor([[0.0, 3.0, 0.1], [0.0, 1.0, 0.0]])
    out = acceptance_labels(p, q, SamplingConfig(), None)
    assert out["draft_token"].tolist() == [1, 1] and out["label"].tolist() == [1.0, 0.0]


def test_weighted_soft_bce_hand_computed():
    logits = torch.tensor([0.0, 2.0, -1.0])
    b = torch.tensor([1.0, 0.25, 0.0])
    s = [0.5, 1 / (1 + math.exp(-2.0)), 1 / (1 + math.exp(1.0))]
    w_acc, w_rej = 1.0, 6.0
    num = sum(w_acc * bi * math.log(si) + w_rej * (1 - bi) * math.log(1 - si) for bi, si in zip(b.tolist(), s))
    den = sum(w_acc * bi + w_rej * (1 - bi) for bi in b.tolist())
    assert_close(weighted_soft_bce(logits, b, w_acc, w_rej), torch.tensor(-num / den))
    mask = torch.tensor([True, False, True])
    num_m = num - (w_acc * 0.25 * math.log(s[1]) + w_rej * 0.75 * math.log(1 - s[1]))
    den_m = den - (w_acc * 0.25 + w_rej * 0.75)
    assert_close(weighted_soft_bce(logits, b, w_acc, w_rej, mask), torch.tensor(-num_m / den_m))


def test_binary_kl_hand_computed():
    b, x = torch.tensor([0.3]), torch.tensor([0.0])
    want = 0.3 * math.log(0.3 / 0.5) + 0.7 * math.log(0.7 / 0.5)
    assert_close(binary_kl(b, x), torch.tensor(want))
    assert binary_kl(torch.tensor([1.0, 0.0]), torch.tensor([20.0, -20.0])) < 1e-6


def test_one_pass_labels_equal_teacher_forced_labels(tiny_pair):
    """Labels from the generation's own logits (no second target pass) and from the output layer
    at response positions only equal those of full teacher-forced passes."""
    from specheads.datagen.acceptance_labels import (
        generate_responses,
        label_batch,
        response_logits,
        teacher_forced_logits,
    )

    target, draft = tiny_pair
    prompts = [[1, 2, 3, 4], [5, 6], [7, 8, 9]]
    for sampling in (SamplingConfig(), SamplingConfig(do_sample=True, temperature=0.9)):
        responses, recorded = generate_responses(target, prompts, 6, sampling, seed=0, pad=0, eos=[])
        for model in (target, draft):
            for p, r, lg in zip(prompts, responses, response_logits(model, prompts, responses, pad=0)):
                ref = teacher_forced_logits(model, [p + r], len(p), pad=0)[0, : len(r)]
                torch.testing.assert_close(lg, ref, atol=1e-4, rtol=1e-4)
        one = label_batch(target, draft, prompts, responses, sampling, torch.Generator().manual_seed(0), 0, recorded)
        two = label_batch(target, draft, prompts, responses, sampling, torch.Generator().manual_seed(0), 0)
        for a, b in zip(one, two):
            assert torch.equal(a["draft_token"], b["draft_token"])
            torch.testing.assert_close(a["label"], b["label"], atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(a["expected_label"], b["expected_label"], atol=1e-4, rtol=1e-4)


def test_sampled_labels_in_row_blocks_equal_one_pass(monkeypatch):
    """A large vocabulary's fp32 buffers are built a block of rows at a time, with the same labels and draws."""
    from specheads.datagen import acceptance_labels as labels

    torch.manual_seed(0)
    p, q = torch.randn(50, 300), torch.randn(50, 300)
    sampling = SamplingConfig(do_sample=True, temperature=0.8)
    whole = acceptance_labels(p, q, sampling, torch.Generator().manual_seed(1))
    blocks: list[int] = []
    one = labels._sampled_labels
    monkeypatch.setattr(labels, "_sampled_labels", lambda a, *rest: blocks.append(a.shape[0]) or one(a, *rest))
    monkeypatch.setattr(labels, "LABEL_BUFFER_BYTES", 12 * 300 * 7)  # 7 rows per block
    split = acceptance_labels(p, q, sampling, torch.Generator().manual_seed(1))
    assert blocks == [7] * 7 + [1]
    for key in whole:
        assert torch.equal(whole[key], split[key]), key


def test_the_plan_counts_the_label_block_the_labeller_uses():
    from specheads.datagen.acceptance_labels import LABEL_BUFFER_BYTES
    from specheads.plan.memory import ACCEPTANCE_BLOCK_BYTES

    assert ACCEPTANCE_BLOCK_BYTES == LABEL_BUFFER_BYTES
