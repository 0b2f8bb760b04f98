"""The proposer a serving engine calls with token ids only (``shim/batching/row_proposer.py``; vLLM's
custom_class).

A simulated engine drives it as vLLM does: every step each running request's whole sequence under a
batch row, rows reordered, requests joining, finishing and preempted (absent for a while, then back);
it verifies greedily with the target. What must hold: every proposal equals the draft's own greedy
continuation computed from scratch on the whole sequence (the content-kept caches change nothing), the
outputs equal the target alone's, and each slot's policy sees its own request's rounds.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from conftest import perturbed_copy, tiny_llama

from specheads.heads import AcceptanceHead
from specheads.shim.batching.row_proposer import RowProposer, common_prefix
from specheads.shim.policies import ConfidenceStop, SpecDecPP, StandardSD

VOCAB, EOS = 48, 2


@pytest.fixture(scope="module")
def pair():
    target = tiny_llama(VOCAB, seed=0)
    return target, perturbed_copy(target, scale=0.3)


@torch.no_grad()
def greedy(model, seq: list[int], n: int, stop_at_eos: bool = True) -> list[int]:
    """``model``'s greedy continuation of ``seq``, ``n`` tokens, recomputed from scratch (no cache)."""
    out = []
    for _ in range(n):
        tok = int(model(torch.tensor([seq + out])).logits[0, -1].argmax())
        out.append(tok)
        if stop_at_eos and tok == EOS:
            break
    return out


def confidence_reference(draft, seq: list[int], tau: float, k: int) -> list[int]:
    """ConfidenceStop's candidates from scratch: greedy, stop after one whose probability is below tau."""
    out = []
    with torch.no_grad():
        for _ in range(k):
            p = draft(torch.tensor([seq + out])).logits[0, -1].softmax(-1)
            tok = int(p.argmax())
            out.append(tok)
            if tok == EOS or float(p[tok]) < tau:
                break
    return out


def simulate(target, proposer, prompts, new_tokens, reference, seed=0, slots_check=None):
    """vLLM-like steps: rows shuffled each step, requests join at staggered steps, finish at their length,
    and one is preempted for two steps; returns each request's output and the number of proposals checked."""
    rng = random.Random(seed)
    seqs = {j: list(p) for j, p in enumerate(prompts)}
    done, checked, step = {}, 0, 0
    while len(done) < len(prompts):
        step += 1
        live = [j for j in seqs if j not in done and j <= step // 2 and not (j == 1 and step in (5, 6))]
        rng.shuffle(live)
        rows = {row: seqs[j] for row, j in enumerate(live)}
        limits = {row: max(0, len(prompts[j]) + new_tokens[j] - len(seqs[j]) - 1) for row, j in enumerate(live)}
        got = proposer.propose(rows, limits)
        for row, j in enumerate(live):
            cand = got[row]
            want = reference(seqs[j])[: limits[row]]
            assert cand == want, (step, j)
            checked += 1
            ok = greedy(target, seqs[j] + [], len(cand) + 1, stop_at_eos=False)
            n = common_prefix(np.array(cand), np.array(ok))
            seqs[j] += ok[: n + 1]
            end = len(prompts[j]) + new_tokens[j]
            if EOS in seqs[j][len(prompts[j]) :] or len(seqs[j]) >= end:
                cut = seqs[j][len(prompts[j]) :]
                cut = cut[: cut.index(EOS) + 1] if EOS in cut else cut
                done[j] = cut[: new_tokens[j]]
    return [done[j] for j in range(len(prompts))], checked


PROMPTS = [[1, 5, 9, 13], [1, 7], [1, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30], [1, 5, 9, 13], [1], [1, 44, 3]]
NEW = [14, 9, 16, 11, 6, 12]


@pytest.mark.parametrize("slots", [6, 8])
def test_proposals_equal_the_drafts_own_from_scratch_through_joins_finishes_and_preemption(pair, slots):
    target, draft = pair
    proposer = RowProposer(draft, StandardSD(3), slots, eos=[EOS], capacity=8)  # small: the caches grow
    outs, checked = simulate(target, proposer, PROMPTS, NEW, lambda s: greedy(draft, s, 3))
    assert outs == [greedy(target, p, n)[:n] for p, n in zip(PROMPTS, NEW)]
    assert checked > 30 and proposer.stats["matched_tokens"] > 0 and proposer.stats["candidates"] > 0


def test_a_stop_rule_runs_per_slot(pair):
    target, draft = pair
    proposer = RowProposer(draft, ConfidenceStop(tau=0.6, k_max=5), 6, eos=[EOS])
    outs, _ = simulate(target, proposer, PROMPTS, NEW, lambda s: confidence_reference(draft, s, 0.6, 5), seed=3)
    assert outs == [greedy(target, p, n)[:n] for p, n in zip(PROMPTS, NEW)]


def test_each_slots_policy_gets_its_own_requests_rounds(pair):
    """SpecDec++ closes each round with the number of its candidates the sequence went on with."""
    target, draft = pair
    torch.manual_seed(0)
    policy = SpecDecPP(AcceptanceHead(32, depth=1).eval(), threshold=0.9, k_min=1, k_max=4)
    proposer = RowProposer(draft, policy, 2, eos=[EOS])
    seq = [1, 5, 9]
    first = proposer.propose({0: seq})[0]
    kept = first[:1] + [(first[1] + 1) % VOCAB] if len(first) > 1 else first + [3]
    closed = []
    slot_policy = next(p for p, h in zip(proposer.policies, proposer.held) if len(h))
    slot_policy.end_round = lambda n, accepted: closed.append((n, accepted))
    proposer.propose({1: seq + kept})  # the same request, now under another row
    assert closed == [(len(first), 1 if len(first) > 1 else len(first))]


def test_a_new_request_sharing_a_short_prefix_gets_a_fresh_slot_and_policy(pair):
    """Every prompt starts alike (BOS, a chat header): a new request must not be taken for a finished one."""
    proposer = RowProposer(pair[1], StandardSD(2), 1, eos=[EOS])  # one slot: the new request must reuse it
    proposer.propose({0: [1, 5, 9, 13, 7]})
    used = 0
    closed = []
    proposer.policies[used].end_round = lambda n, accepted: closed.append((n, accepted))
    resets = []
    proposer.policies[used].reset = lambda: resets.append(used)
    proposer.propose({0: [1, 5, 20, 21, 22, 23]})  # shares [1, 5] only: another request
    assert closed == [] and resets == [used]
    assert proposer.stats["prefills"] == 2  # its prompt went through a prefill, not the batched step


def test_more_rows_than_slots_is_an_error(pair):
    with pytest.raises(ValueError, match="slots"):
        RowProposer(pair[1], StandardSD(2), 1).propose({0: [1, 2], 1: [1, 3]})


def test_common_prefix():
    assert common_prefix(np.array([1, 2, 3]), np.array([1, 2, 4, 5])) == 2
    assert common_prefix(np.array([1, 2]), np.array([1, 2, 3])) == 2 and common_prefix(np.array([]), np.array([1])) == 0


def _slot_of(proposer, seq: list[int]) -> int:
    return next(s for s, v in enumerate(proposer.seen) if v is not None and list(v) == seq)


def test_a_budget_bounds_the_cache_and_long_rows_draft_from_their_latest_tokens(pair):
    """With ``max_tokens`` the buffer is allocated once and never grows; a request longer than its share drafts
    from its latest tokens (the draft's greedy continuation of that window), and the outputs stay the target's."""
    target, draft = pair
    draft = target  # every candidate accepted until the windows start: the rows grow fast
    proposer = RowProposer(draft, StandardSD(3), 2, eos=[EOS], max_tokens=2 * 40)  # 40 per slot: 23 usable
    shapes = [k.shape for k in proposer.runner.keys]
    assert proposer.runner.capacity == 40 and proposer.window == 23
    prompts = [[1, 5, 9, 13], [1, 20, 21, 22, 23]]
    seqs = [list(p) for p in prompts]
    while min(map(len, seqs)) <= 56:  # well past the 40 slots
        got = proposer.propose(dict(enumerate(seqs)))
        for row, seq in enumerate(seqs):
            s = _slot_of(proposer, seq)
            assert got[row] == greedy(draft, seq[proposer.offset[s] :], 3), (row, len(seq))
            ok = greedy(target, seq, len(got[row]) + 1, stop_at_eos=False)
            seq += ok[: common_prefix(np.array(got[row]), np.array(ok)) + 1]
            assert proposer.runner.length(s) <= proposer.window
    assert [k.shape for k in proposer.runner.keys] == shapes
    assert proposer.stats["windowed"] >= 4
    assert seqs == [p + greedy(target, p, len(q) - len(p), stop_at_eos=False) for p, q in zip(prompts, seqs)]


def test_a_budget_too_small_for_the_candidates_is_an_error(pair):
    with pytest.raises(ValueError, match="usable tokens"):
        RowProposer(pair[1], StandardSD(6), 4, max_tokens=4 * 20)


def test_a_joining_prompt_longer_than_the_window_is_windowed_at_once(pair):
    target, draft = pair
    proposer = RowProposer(draft, StandardSD(2), 1, eos=[EOS], max_tokens=40)  # window 23
    seq = list(range(3, 43))
    got = proposer.propose({0: seq})[0]
    assert proposer.offset[0] == 40 - 11 and got == greedy(draft, seq[29:], 2)


@pytest.mark.parametrize("rows", [8, 24])
def test_matching_is_linear_in_the_batch(pair, rows):
    """Continuing requests are each confirmed against one slot; a new request sharing a long prompt with free
    caches is compared with at most PROBES of them; no row is compared with every slot (the pairwise matching
    made rows x slots comparisons per call)."""
    draft = pair[1]
    proposer = RowProposer(draft, StandardSD(2), rows + 2, eos=[])
    system = [1, 30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40]
    seqs = {j: system + [3 + j % 40, 4 + j // 40] for j in range(rows)}
    rng = random.Random(0)
    per_call = []
    for step in range(6):
        if step == 3:  # two requests finish and two new ones, sharing the long prompt, join
            for j in (0, 1):
                del seqs[j]
            seqs.update({rows + 10: system + [44, 45], rows + 11: system + [45, 44]})
        order = list(seqs)
        rng.shuffle(order)
        before = proposer.stats["compared"]
        got = proposer.propose({row: seqs[j] for row, j in enumerate(order)})
        per_call.append(proposer.stats["compared"] - before)
        for row, j in enumerate(order):
            seqs[j] = seqs[j] + got[row][:1] + [5 + step]
    assert per_call[1:3] == [rows, rows] and per_call[4:] == [rows, rows]  # one confirmation per continuing row
    assert per_call[0] <= len(system) and rows - 2 <= per_call[3] <= rows - 2 + 2 * 4
    assert proposer.stats["prefills"] == 1  # the joining requests reused a finished one's cached prompt
