"""The vLLM stop plugin's controller without vLLM: above ``rule_max_batch`` every request drafts the K the cost table
prices best for the acceptance the scheduled rounds saw; at or below it each request's rule decides."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from specheads.shim import CostTable
from specheads.vllm.stop_config import StopSettings
from specheads.vllm.stop_plugin import Controller, _AllStopped

K, V = 4, 16


@pytest.fixture()
def table(tmp_path):
    """Synthetic prices (no timing decides a test): batch 1 t_d 0.5, t_t(k) = 4 + 0.5 k; batch 2 t_d 1, t_t 8 + 2 k."""
    path = tmp_path / "costs.json"
    t = CostTable(
        t_draft_ms=0.5,
        t_target_ms=[4 + 0.5 * k for k in range(1, 12)],
        batches=[2],
        t_draft_batch_ms=[1.0],
        t_target_batch_ms=[[8 + 2.0 * k for k in range(1, 12)]],
    )
    path.write_text(json.dumps(t.to_dict()))
    return path


def step(ctl: Controller, reqs: list[str], confident: bool = True) -> list[list[int]]:
    """One vLLM step: the rounds begin, candidates are drawn (token 3, sure of it or not) until every row stopped."""
    ctl.begin(reqs)
    drawn = 0
    try:
        for _ in range(K):
            logits = torch.full((len(reqs), V), -10.0)
            logits[:, 3] = 10.0 if confident else -9.0
            drawn += 1
            ctl.drawn(torch.zeros(len(reqs), 8), logits, torch.full((len(reqs),), 3))
    except _AllStopped:
        pass
    return ctl.finish([[3] * drawn for _ in reqs])


def verdicts(ctl: Controller, reqs: list[str], drafts: list[list[int]], accepted: int) -> None:
    """vLLM verified each row's draft and accepted its first ``accepted`` candidates."""
    sampled = torch.full((len(reqs), K + 1), -1)
    for r, d in enumerate(drafts):
        sampled[r, : min(accepted, len(d)) + 1] = 3
    out = SimpleNamespace(finished_req_ids=set(), scheduled_spec_decode_tokens=dict(zip(reqs, drafts)))
    ctl.outcomes(out, reqs, sampled)


def by_hand(ctl: Controller, b: int) -> int:
    t, a, s, e, best, rate = ctl.costs, 0.5, 1.0, 1.0, 1, -1.0
    for j in range(1, K + 1):
        a = (ctl.kept[j] + 1) / (ctl.reached[j] + 2) if ctl.reached[j] else a
        s *= a
        e += s
        if e / t.round_ms(j, b) > rate:
            best, rate = j, e / t.round_ms(j, b)
    return best


def test_above_rule_max_batch_every_request_drafts_the_tables_best_k(table):
    ctl = Controller(StopSettings(rule="c-cost", costs=str(table), trace=True), K, None)
    reqs = ["a", "b"]
    first = by_hand(ctl, 2)
    drafts = step(ctl, reqs, confident=False)  # unsure candidates: the rule would stop at 1; the schedule does not
    assert [len(d) for d in drafts] == [first, first] and ctl.best_k(2) == first
    for _ in range(30):  # every candidate accepted: the best K grows to K
        verdicts(ctl, reqs, drafts, accepted=K)
        drafts = step(ctl, reqs, confident=False)
        assert [len(d) for d in drafts] == [by_hand(ctl, 2)] * 2
    assert len(drafts[0]) == K and ctl.reached[1] > 0
    for _ in range(200):  # then none: back to one candidate
        verdicts(ctl, reqs, drafts, accepted=0)
        drafts = step(ctl, reqs, confident=True)
    assert [len(d) for d in drafts] == [1, 1]
    assert all(e.get("scheduled") for e in ctl.trace if "draft" in e)


def test_at_or_below_rule_max_batch_the_rule_decides(table):
    ctl = Controller(StopSettings(rule="c-cost", costs=str(table), trace=True), K, None)
    unsure = step(ctl, ["a"], confident=False)
    sure = step(ctl, ["b"], confident=True)
    assert len(unsure[0]) == 1 and len(sure[0]) == K  # q(y) decides at batch 1
    wide = Controller(StopSettings(rule="c-cost", costs=str(table), rule_max_batch=None), K, None)
    assert [len(d) for d in step(wide, ["a", "b"], confident=False)] == [1, 1]  # None: the rule at every batch
    assert StopSettings(rule_max_batch=0, costs=str(table)).problems(K) == [
        "rule_max_batch=0 must be >= 1 (or None: the rules at every batch)"
    ]
