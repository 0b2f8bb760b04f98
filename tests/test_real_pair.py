"""The shared real pair (SmolLM2-135M-Instruct GGUF target, 4-layer draft): exactness and the main job."""

from __future__ import annotations

import json

import pytest
from conftest import SHARED

from specheads.export import ModelSpec, generate, load_pair
from specheads.export.decode_cli import main
from specheads.prompts import load_prompts

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not (SHARED / "models").is_dir(), reason="../shared/models not present")]


@pytest.fixture(scope="module")
def real_pair():
    return load_pair(ModelSpec(path=str(SHARED / "models/smollm2-135m-instruct"),
                               gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf", device="cpu"),
                     ModelSpec(path=str(SHARED / "models/smollm2-draft-4l"), device="cpu"))


def test_real_pair_loads_and_checks(real_pair):
    assert real_pair.target.model.config.num_hidden_layers == 30
    assert real_pair.draft.model.config.num_hidden_layers == 4
    assert real_pair.eos_token_ids == [2]
    assert real_pair.target.fingerprint != real_pair.draft.fingerprint


def test_real_pair_greedy_sd_equals_target(real_pair):
    prompts = load_prompts(SHARED / "data/gsm8k/test.jsonl", limit=2, offset=1000)
    ref = generate(real_pair, prompts, policy="ar", max_new_tokens=24)
    for k in (1, 4):
        got = generate(real_pair, prompts, policy="sd", k=k, max_new_tokens=24)
        assert [r.tokens for r in got] == [r.tokens for r in ref]
    assert sum(r.stats.accepted for r in got) > 0


def test_quickstart_recipe_runs(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECHEADS_SHARED", str(SHARED))
    out = tmp_path / "qs"
    assert main(["recipe=quickstart", "num_prompts=1", "max_new_tokens=16", f"output_dir={out}"]) == 0
    summary = json.loads((out / "metrics.json").read_text())
    assert summary["new_tokens"] == 16 and summary["target_calls"] >= 1
