"""states_after_tokens: one masked forward per batch equals one forward per probe."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_llama

from specheads.runtime import states as states_mod
from specheads.runtime.states import states_after_tokens

SEQS = [[1, 5, 9, 12, 7, 3, 20, 4], [1, 8, 8, 30], [1, 14, 2, 6, 6, 11]]
POSITIONS = [[1, 3, 3, 8, 5], [4, 1, 2], [6, 2, 1, 4]]
TOKENS = [[17, 9, 21, 5, 5], [3, 33, 8], [10, 10, 4, 25]]


def naive(model, seqs, positions, tokens):
    """One forward of ``seq[:p] + [token]`` per probe, last position of ``last_hidden_state``."""
    with torch.no_grad():
        return [
            torch.stack(
                [
                    model.model(input_ids=torch.tensor([seq[:p] + [t]])).last_hidden_state[0, -1]
                    for p, t in zip(ps, toks)
                ]
            )
            for seq, ps, toks in zip(seqs, positions, tokens)
        ]


@pytest.fixture(scope="module")
def model():
    return tiny_llama(40, seed=5)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_matches_naive(model, attn, monkeypatch):
    model.config._attn_implementation = attn
    try:
        # the batched path must be the one taken (no silent fallback)
        monkeypatch.setattr(states_mod, "_looped", lambda *a: pytest.fail("fell back to the loop"))
        got = states_after_tokens(model, SEQS, POSITIONS, TOKENS, pad=2)
        monkeypatch.undo()
        want = naive(model, SEQS, POSITIONS, TOKENS)
    finally:
        model.config._attn_implementation = "sdpa"
    assert len(got) == len(SEQS)
    for g, w, toks in zip(got, want, TOKENS):
        assert g.shape == (len(toks), model.config.hidden_size) and g.dtype == torch.float32
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)


def test_fallback_and_empty_rows(model):
    model.config._attn_implementation = "sdpa"
    seqs, positions, tokens = SEQS[:2] + [[1, 4, 4]], POSITIONS[:2] + [[]], TOKENS[:2] + [[]]
    want = naive(model, seqs[:2], positions[:2], tokens[:2])
    batched = states_after_tokens(model, seqs, positions, tokens, pad=2)
    looped = states_mod._looped(model, model.model, torch.device("cpu"), seqs, positions, tokens)
    for g, w in zip(batched, want):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)
    assert batched[2].shape == (0, model.config.hidden_size)
    for g, w in zip(looped[:2], want):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)


def test_rejects_bad_positions(model):
    with pytest.raises(ValueError):
        states_after_tokens(model, [[1, 2, 3]], [[4]], [[5]], pad=2)
    with pytest.raises(ValueError):
        states_after_tokens(model, [[1, 2, 3]], [[0]], [[5]], pad=2)
