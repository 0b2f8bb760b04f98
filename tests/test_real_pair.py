"""The shared real pair (SmolLM2-135M-Instruct GGUF target, 4-layer draft): exactness and the main job."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import SHARED

from specheads.decode import generate
from specheads.decode.decode_cli import main
from specheads.prompts import load_prompts
from specheads.shim import ModelSpec, load_pair

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not (SHARED / "models").is_dir(), reason="../shared/models not present"),
]


@pytest.fixture(scope="module")
def real_pair():
    return load_pair(
        ModelSpec(
            path=str(SHARED / "models/smollm2-135m-instruct"), gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf", device="cpu"
        ),
        ModelSpec(path=str(SHARED / "models/smollm2-draft-4l"), device="cpu"),
    )


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


def test_sprinter_without_run_cap_decodes(real_pair, tmp_path, monkeypatch):
    """heads-decode policy=sprinter max_run=null: the caches are sized from the prompt and the new
    tokens, not from the uncapped max_candidates() (2**30 positions: hundreds of GB)."""
    import torch

    from specheads.export import save_head
    from specheads.heads import VerifierHead
    from specheads.shim import SamplingConfig
    from specheads.shim.loop import engine as engine_module

    d = real_pair.draft.hidden_size
    head = VerifierHead(d, depth=0)
    with torch.no_grad():  # approves every candidate: one uncapped run per prompt, no target call
        head.out.weight.zero_()
        head.out.bias.fill_(30.0)
    path = save_head(
        tmp_path / "verifier.safetensors",
        head,
        "verifier",
        {
            "head_config": head.config(),
            "hidden_size": d,
            "feature": {"model": "draft", "state": "post", "layer": -1, "position": "previous"},
            "draft": {"name": real_pair.draft.name, "fingerprint": real_pair.draft.fingerprint},
            "target": {"name": real_pair.target.name, "fingerprint": real_pair.target.fingerprint},
            "sampling": SamplingConfig().to_dict(),
            "default_threshold": 0.5,
        },
    )
    caps = []
    make_runner = engine_module.make_runner

    def recording(model, hidden, vocab_size, capacity, fused, **kwargs):
        caps.append(capacity)
        return make_runner(model, hidden, vocab_size, capacity, fused, **kwargs)

    monkeypatch.setattr(engine_module, "make_runner", recording)
    monkeypatch.setenv("SPECHEADS_SHARED", str(SHARED))
    out = tmp_path / "sprinter"
    assert (
        main(
            [
                "recipe=quickstart",
                "policy=sprinter",
                f"sprinter.head={path}",
                "sprinter.max_run=null",
                "num_prompts=1",
                "max_new_tokens=8",
                f"output_dir={out}",
            ]
        )
        == 0
    )
    summary = json.loads((out / "metrics.json").read_text())
    assert summary["max_run"] is None and 1 <= summary["new_tokens"] <= 8 and summary["target_calls"] == 0
    assert len(caps) == 2 and max(caps) <= summary["prompt_tokens"] + 2 * 8 + 2


def test_real_pair_pruned_draft_greedy_sd_equals_target(real_pair, tmp_path):
    """The draft's output layer pruned to 2,048 corpus-frequent tokens: greedy SD is still the target's
    greedy output (tokens outside the subset come from the target's correction)."""
    from specheads.datagen.vocab_ranking import main as vocab_main
    from specheads.shim.runners.vocab_pruning import prune, read_ranking, subset_from_ranking, unprune

    out = tmp_path / "vocab.json"
    assert (
        vocab_main(
            [
                f"target.path={SHARED / 'models/smollm2-135m-instruct'}",
                f"corpus={SHARED / 'data/gsm8k/train.jsonl'}",
                "num_rows=500",
                f"output={out}",
            ]
        )
        == 0
    )
    draft = real_pair.draft.model
    prompts = load_prompts(SHARED / "data/mt_bench/question.jsonl", limit=2, offset=70)
    ref = generate(real_pair, prompts, policy="ar", max_new_tokens=32)
    prune(draft, subset_from_ranking(read_ranking(out), 2048, real_pair.eos_token_ids, 49152))
    try:
        assert real_pair.draft.vocab["size"] == 2048
        got = generate(real_pair, prompts, policy="sd", k=3, max_new_tokens=32)
    finally:
        unprune(draft)
    assert [r.tokens for r in got] == [r.tokens for r in ref]
    assert sum(r.stats.accepted for r in got) > 0


def test_real_pair_hf_generate_with_a_head_equals_target(real_pair, tmp_path):
    """Transformers' generate with specheads.hf.Assistant on the shared pair (a SpecDec++ head for this draft,
    random weights: exactness does not depend on its quality) gives the target's own greedy output."""
    import torch

    from specheads.decode.api import format_prompt
    from specheads.export import save_head
    from specheads.heads import AcceptanceHead
    from specheads.hf import Assistant
    from specheads.shim import SamplingConfig

    d = real_pair.draft
    torch.manual_seed(0)
    head = AcceptanceHead(d.hidden_size, depth=1)
    path = save_head(
        tmp_path / "acceptance.safetensors",
        head,
        "acceptance",
        {
            "head_config": head.config(),
            "hidden_size": d.hidden_size,
            "feature": {"model": "draft", "state": "post", "layer": -1, "position": "own"},
            "draft": {"name": d.name, "fingerprint": d.fingerprint, "vocab": None},
            "target": {"name": real_pair.target.name, "fingerprint": real_pair.target.fingerprint},
            "sampling": SamplingConfig().to_dict(),
            "default_threshold": 0.7,
        },
    )
    target, tok = real_pair.target.model, real_pair.tokenizer
    assistant = Assistant(d.model, path, k_min=1, k_max=8)
    for prompt in load_prompts(SHARED / "data/gsm8k/test.jsonl", limit=2, offset=1010):
        x = torch.tensor([format_prompt(tok, prompt)])
        kw = dict(max_new_tokens=32, do_sample=False, pad_token_id=2)
        ref = target.generate(x, **kw)
        assert torch.equal(target.generate(x, assistant_model=d.model, custom_generate=assistant, **kw), ref)
        assert assistant.stats.accepted > 0


def test_the_shared_target_is_competent_on_the_fact_task(real_pair):
    """The fact task exists to be graded where the shared target is well above chance (0 for an open answer):
    the lower bound of its accuracy on 32 of the questions clears 30%."""
    from specheads.evaluate.intervals import mean_interval
    from specheads.facts import NAME
    from specheads.grading import grade
    from specheads.prompts import load_prompt_files

    prompts = load_prompt_files(NAME, limit=32)
    target = generate(real_pair, prompts, policy="ar", max_new_tokens=12, batch_size=16)
    ok = [int(grade(p, r.text)) for p, r in zip(prompts, target)]
    assert mean_interval(ok)["low"] > 0.3


def test_the_real_targets_shell_matches_it(real_pair):
    """engine=vllm's target without weights (specheads/runtime/target_shell.py), from the GGUF file: the loaded target's
    fingerprint and EOS ids, and its output layer (dequantised from the file alone) gives its logits."""
    from specheads.runtime.target_shell import load_shell
    from specheads.shim import eos_ids, final_norm

    whole = real_pair.target
    shell = load_shell(whole.spec, output_layer=True)
    assert shell.fingerprint == whole.fingerprint and eos_ids(shell.model, shell.tokenizer) == [2]
    assert sum(p.numel() for p in shell.model.parameters() if p.device.type != "meta") == 576 + 49152 * 576
    for part in (lambda m: m.get_output_embeddings().weight, lambda m: final_norm(m).weight):  # the same tensors
        torch.testing.assert_close(part(shell.model), part(whole.model), rtol=0, atol=0)
    x = torch.randn(4, 576)
    logits = shell.model.get_output_embeddings()(final_norm(shell.model)(x))
    want = whole.model.get_output_embeddings()(final_norm(whole.model)(x))  # its linears may take another kernel
    torch.testing.assert_close(logits, want, rtol=1e-4, atol=1e-4)
