"""The fused forward computes exactly what the model's own forward computes."""

from __future__ import annotations

import pytest
import torch
from conftest import BigramLM, tiny_llama
from torch.testing import assert_close
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config

from specheads.shim.batching import batch_generate as batched
from specheads.shim.core.sampling import SamplingConfig
from specheads.shim.loop.engine import Engine
from specheads.shim.policies import StandardSD
from specheads.shim.runners.fused import _row_major_ok, fused_weights, supports, unfuse
from specheads.shim.runners.model_runner import FusedRunner, ModelRunner, make_runner

COMMON = dict(
    vocab_size=50,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    initializer_range=0.3,
)


def _model(kind: str, seed: int = 0):
    torch.manual_seed(seed)
    if kind == "llama":
        cfg = LlamaConfig(
            **COMMON,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
        )
    elif kind == "qwen2":  # q/k/v biases
        cfg = Qwen2Config(**COMMON)
    else:
        cfg = MistralConfig(**COMMON, sliding_window=None)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():  # non-zero biases so a dropped bias would show
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.add_(0.1)
    return model


@pytest.mark.parametrize("kind", ["llama", "qwen2", "mistral"])
@pytest.mark.parametrize("hidden", [None, "pre", "post"])
def test_fused_runner_matches_model_forward(kind, hidden):
    model = _model(kind)
    assert supports(model) is None
    ref, fused = ModelRunner(model, hidden=hidden), FusedRunner(model, hidden=hidden, capacity=4)  # grows twice
    g = torch.Generator().manual_seed(0)
    steps = [(9, 1), (1, 1), (5, 5), (3, 0)]  # prefill, one token, a verification block, a no-logit pass
    for n, keep in steps:
        ids = torch.randint(0, 50, (1, n), generator=g)
        (la, ha), (lb, hb) = ref.forward(ids, keep), fused.forward(ids, keep)
        assert la.shape == lb.shape
        assert_close(lb, la, atol=1e-5, rtol=1e-5)
        if hidden:
            assert_close(hb, ha, atol=1e-5, rtol=1e-5)
        assert ref.length == fused.length
    for runner in (ref, fused):  # reject the last 6 positions, then continue
        runner.trim(runner.length - 6)
    ids = torch.randint(0, 50, (1, 4), generator=g)
    assert_close(fused.forward(ids, 4)[0], ref.forward(ids, 4)[0], atol=1e-5, rtol=1e-5)
    for i, layer in enumerate(ref.cache.layers):
        k, v = fused.kv(i)
        assert_close(k, layer.keys, atol=1e-5, rtol=1e-5)
        assert_close(v, layer.values, atol=1e-5, rtol=1e-5)


def test_fusing_shares_storage_and_keeps_the_model_working():
    model = tiny_llama(40, seed=3)
    ids = torch.tensor([[3, 5, 7, 9]])
    before = model(ids).logits
    w = fused_weights(model)
    _, qkv, _, _, _, _, gu, _ = w.layers[0]
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    assert attn.q_proj.weight.data_ptr() == qkv.data_ptr()
    assert attn.k_proj.weight.data_ptr() == qkv[attn.q_proj.weight.shape[0] :].data_ptr()
    assert mlp.up_proj.weight.data_ptr() == gu[mlp.gate_proj.weight.shape[0] :].data_ptr()
    assert_close(model(ids).logits, before)
    with torch.no_grad():  # an in-place update reaches the fused buffer
        attn.v_proj.weight.mul_(2.0)
    assert fused_weights(model) is w
    r, f = ModelRunner(model), FusedRunner(model)
    assert_close(f.forward(ids, 4)[0], r.forward(ids, 4)[0], atol=1e-5, rtol=1e-5)
    attn.o_proj.weight = torch.nn.Parameter(attn.o_proj.weight.detach().clone())  # o_proj is not fused
    attn.q_proj.weight = torch.nn.Parameter(attn.q_proj.weight.detach() * 0.5)  # replaced: fused again
    assert fused_weights(model) is not w
    r, f = ModelRunner(model), FusedRunner(model)
    assert_close(f.forward(ids, 4)[0], r.forward(ids, 4)[0], atol=1e-5, rtol=1e-5)
    # On CPU without smallm every weight is stored transposed (F.linear's fast path); with it, row-major.
    col = not _row_major_ok()
    assert (attn.o_proj.weight.stride() == (1, attn.o_proj.weight.shape[0])) == col
    assert (model.get_input_embeddings().weight.stride()[0] == 1) == col
    assert (model.get_output_embeddings().weight.stride()[0] == 1) == col
    mid = model(ids).logits
    unfuse(model)
    assert attn.k_proj.weight.data_ptr() != attn.q_proj.weight.data_ptr() + attn.q_proj.weight.nbytes
    assert all(p.is_contiguous() for p in model.parameters())
    assert_close(model(ids).logits, mid)


@pytest.mark.parametrize("layout", ["auto", "col"])
def test_fused_layout_follows_smallm_and_the_setting(monkeypatch, layout):
    """Row-major where smallm runs row-major weights at 1-8 rows; column-major without it, or when asked."""
    from specheads.shim.runners import smallm

    monkeypatch.setenv("SPECHEADS_FUSED_LAYOUT", layout)
    model = tiny_llama(40, seed=3)
    ids = torch.tensor([[3, 5, 7, 9]])
    before = model(ids).logits
    _, qkv, _, wo, _, _, gu, wd = fused_weights(model).layers[0]
    want_col = layout == "col" or not smallm.available()
    assert not _row_major_ok(torch.bfloat16)  # smallm is float32 only
    for w in (qkv, wo, gu, wd):
        assert (w.stride()[0] == 1 and not w.is_contiguous()) == want_col
    assert _row_major_ok() == (not want_col)
    assert_close(FusedRunner(model).forward(ids, 4)[0], before[0], atol=1e-5, rtol=1e-5)


def test_fusing_keeps_tied_embeddings_tied():
    model = AutoModelForCausalLM.from_config(LlamaConfig(**COMMON, tie_word_embeddings=True)).eval()
    ids = torch.tensor([[3, 5, 7, 9]])
    before = model(ids).logits
    fused_weights(model)
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    assert_close(FusedRunner(model).forward(ids, 4)[0], before[0], atol=1e-5, rtol=1e-5)
    unfuse(model)
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    assert_close(model(ids).logits, before)


def test_unsupported_models_fall_back_to_their_own_forward():
    assert supports(BigramLM(torch.full((4, 4), 0.25))) is not None
    assert isinstance(make_runner(BigramLM(torch.full((4, 4), 0.25))), ModelRunner)
    llama = tiny_llama(40)
    assert isinstance(make_runner(llama), FusedRunner)
    assert isinstance(make_runner(llama, fused=False), ModelRunner)
    mistral = AutoModelForCausalLM.from_config(MistralConfig(**COMMON, sliding_window=8)).eval()
    assert "sliding" in supports(mistral)
    eager = AutoModelForCausalLM.from_config(LlamaConfig(**COMMON), attn_implementation="eager").eval()
    assert "eager" in supports(eager)


@pytest.mark.parametrize("sampling", [None, SamplingConfig(do_sample=True, temperature=0.8, top_k=10)])
def test_engine_output_is_the_same_fused_or_not(tiny_pair, sampling):
    target, draft = tiny_pair
    outs = []
    for fused in (True, False):
        engine = Engine(target, draft, eos_token_ids=[], fused=fused)
        g = torch.Generator().manual_seed(11)
        sd = engine.generate([1, 5, 9, 4], StandardSD(3), 30, sampling, g).tokens
        ar = engine.generate_ar([1, 5, 9, 4], 30, sampling, torch.Generator().manual_seed(11)).tokens
        outs.append((sd, ar))
    assert outs[0] == outs[1]


def test_fusing_inside_inference_mode_leaves_trainable_parameters():
    model = tiny_llama(40, seed=4)
    with torch.inference_mode():
        FusedRunner(model).forward(torch.tensor([[3, 4]]), 1)
    model.train()
    model(torch.tensor([[3, 4, 5]])).logits.sum().backward()
    assert model.model.layers[0].self_attn.k_proj.weight.grad is not None


def _hf_greedy(model, prompt, n, eos):
    out = model.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        max_new_tokens=n,
        do_sample=False,
        eos_token_id=eos,
        pad_token_id=0,
    )[0, len(prompt) :].tolist()
    cut = next((i + 1 for i, t in enumerate(out) if t in eos), len(out))
    return out[:cut]


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_batched_generation_equals_one_prompt_at_a_time(kind):
    model = _model(kind)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, 50, (n,), generator=g).tolist() for n in (3, 9, 1, 6, 12, 4, 7)]
    # An EOS the responses actually reach, so rows finish at different steps and the batch shrinks.
    eos = [_hf_greedy(model, prompts[0], 3, [])[-1]]
    ref = [_hf_greedy(model, p, 10, eos) for p in prompts]
    assert len({len(r) for r in ref}) > 1, "the test needs responses of different lengths"
    out, logits = batched.generate(model, prompts, 10, SamplingConfig(), None, eos, pad=0, record_logits=True)
    assert out == ref
    for p, r, lg in zip(prompts, out, logits):  # the recorded logits are the teacher-forced ones
        full = model(torch.tensor([p + r])).logits[0, len(p) - 1 : len(p) - 1 + len(r)]
        assert lg.shape == full.shape
        assert_close(lg, full, atol=1e-4, rtol=1e-4)


def test_batched_sampling_follows_the_generator_and_the_warping():
    model = _model("llama")
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
    s = SamplingConfig(do_sample=True, temperature=0.7, top_k=1)  # top-k 1: sampling must equal greedy
    greedy = batched.generate(model, prompts, 8, SamplingConfig(), None, [], pad=0)
    assert batched.generate(model, prompts, 8, s, torch.Generator().manual_seed(3), [], pad=0) == greedy
    s = SamplingConfig(do_sample=True, temperature=1.5)
    a = batched.generate(model, prompts, 8, s, torch.Generator().manual_seed(3), [], pad=0)
    b = batched.generate(model, prompts, 8, s, torch.Generator().manual_seed(3), [], pad=0)
    c = batched.generate(model, prompts, 8, s, torch.Generator().manual_seed(4), [], pad=0)
    assert a == b and a != c and all(len(r) == 8 for r in a)


def test_batched_generation_falls_back_to_generate():
    target = _model("llama")
    target.config._attn_implementation = "eager"
    assert supports(target) is not None
    prompts = [[1, 2, 3], [4, 5]]
    out = batched.generate(target, prompts, 5, SamplingConfig(), None, [], pad=0)
    assert out == [_hf_greedy(target, p, 5, []) for p in prompts]
