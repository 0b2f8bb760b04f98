"""The hidden-states connector's two halves without an engine: the scheduler side's book of blocks (a request's
prompt computed over several steps, preempted and resumed, requests that asked for no states) and the worker
side's gather from a ``[blocks, layers, block_size, hidden]`` cache."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")

from specheads.vllm.states import PATH_KEY, Schedule, gather  # noqa: E402


def new(req_id, prompt_len, blocks, path=None, computed=0):
    extra = {"kv_transfer_params": {PATH_KEY: path}} if path else None
    return SimpleNamespace(
        req_id=req_id,
        prompt_token_ids=list(range(prompt_len)),
        block_ids=(blocks,),
        num_computed_tokens=computed,
        sampling_params=SimpleNamespace(extra_args=extra),
    )


def step(news=(), cached=(), scheduled=None, resumed=()):
    """A ``SchedulerOutput`` as the connector reads it; ``cached``: ``(req_id, new blocks or None, computed)``."""
    return SimpleNamespace(
        scheduled_new_reqs=list(news),
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=[c[0] for c in cached],
            new_block_ids=[None if c[1] is None else (c[1],) for c in cached],
            num_computed_tokens=[c[2] for c in cached],
            resumed_req_ids=set(resumed),
        ),
        num_scheduled_tokens=scheduled or {},
    )


def test_a_prompt_is_saved_in_the_step_that_computes_its_last_token():
    book = Schedule(group=0)
    first = step(
        [new("a", 10, [3], "a.st"), new("b", 4, [7]), new("c", 3, [9], "c.st")], scheduled={"a": 4, "b": 4, "c": 3}
    )
    saves = book.step(first)  # c is whole in one step; b asked for nothing; a goes on
    assert [(s.path, s.blocks, s.length) for s in saves] == [("c.st", [9], 3)]
    assert book.step(step(cached=[("a", [5], 4)], scheduled={"a": 4})) == []
    last = book.step(step(cached=[("a", None, 8)], scheduled={"a": 2}))
    assert [(s.path, s.blocks, s.length) for s in last] == [("a.st", [3, 5], 10)]
    assert book.tracked == {}  # nothing kept once saved


def test_a_resumed_request_starts_again_on_its_new_blocks():
    book = Schedule(group=0)
    book.step(step([new("a", 6, [1], "a.st")], scheduled={"a": 4}))
    assert book.step(step(cached=[("a", [8, 2], 0)], scheduled={"a": 6}, resumed={"a"}))[0].blocks == [8, 2]


def test_a_finished_request_is_forgotten():
    book = Schedule(group=0)
    book.step(step([new("a", 6, [1], "a.st")], scheduled={"a": 4}))
    book.drop("a")
    assert book.step(step(cached=[("a", None, 4)], scheduled={"a": 2})) == []


def test_gather_reads_a_request_across_its_blocks():
    blocks, layers, size, hidden = 6, 2, 4, 3
    cache = torch.arange(blocks * layers * size * hidden, dtype=torch.float32).reshape(blocks, layers, size, hidden)
    got = gather(cache, [4, 1], 6)  # positions 0..3 in block 4, 4..5 in block 1
    want = torch.stack([cache[4, :, p] for p in range(4)] + [cache[1, :, p] for p in range(2)])
    assert got.shape == (6, layers, hidden) and torch.equal(got, want)
