"""Device correctness on CUDA: sampled generation with a CUDA generator, a model split over two devices (as
``device_map`` splits a 70B/405B target over GPUs), heads on the device their states come out on, dtype
``auto``. Marked ``cuda``: skipped where no GPU is visible (CI); ``bench/gpu_smoke.sh`` runs them on a GPU.

The split model puts its first half on ``cuda:0`` and its second on the CPU, which exercises every
cross-device path a multi-GPU split does (inputs on the first device, states and logits on the last) with
one GPU. Each test compares against the same function on the unsplit model."""

from __future__ import annotations

import pytest
import torch
from conftest import make_tokenizer, tiny_llama

from specheads.datagen.acceptance_labels import response_logits
from specheads.runtime.numerics import numerics_settings
from specheads.runtime.states import logits_at, sequence_states, states_after_tokens
from specheads.shim import (
    HiddenCapture,
    ModelSpec,
    SamplingConfig,
    batch_generate,
    output_device,
    sample,
    sample_finite,
    uniform,
)
from specheads.shim.runners.hidden import AuxCapture
from specheads.shim.runners.models import resolve_dtype

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (bench/gpu_smoke.sh runs these)"),
]

V = len(make_tokenizer())


def _model(layers: int = 4, device: str = "cpu"):
    m = tiny_llama(V, seed=0, layers=layers)
    return m.to(device).eval()


def _split(layers: int = 4):
    """The same model with its first half on cuda:0 and the rest (final norm, output layer) on the CPU."""
    from accelerate import dispatch_model

    half = layers // 2
    dmap = {"model.embed_tokens": 0, "model.rotary_emb": 0, "model.norm": "cpu", "lm_head": "cpu"}
    dmap.update({f"model.layers.{i}": (0 if i < half else "cpu") for i in range(layers)})
    return dispatch_model(_model(layers), device_map=dmap, main_device="cpu")


PROMPTS = [[1, 5, 6, 7], [1, 8], [1, 9, 10]]
RESPONSES = [[11, 12, 13], [14, 15], [16]]


def test_sampled_generation_with_a_cuda_generator():
    model = _model(device="cuda")
    sampling = SamplingConfig(do_sample=True)
    runs = []
    for _ in range(2):
        g = torch.Generator(device="cuda").manual_seed(0)
        runs.append(batch_generate(model, PROMPTS, 8, sampling, g, [2], 2))
    assert runs[0] == runs[1]  # seeded: the same draws
    assert all(len(r) >= 1 for r in runs[0])


def test_draws_with_a_generator_on_another_device():
    probs = torch.softmax(torch.randn(64, V), -1)
    for g_dev, p_dev in (("cuda", "cpu"), ("cpu", "cuda")):
        a = sample(probs.to(p_dev), torch.Generator(device=g_dev).manual_seed(3))
        b = sample(probs.to(g_dev), torch.Generator(device=g_dev).manual_seed(3))
        assert a.device.type == p_dev and torch.equal(a.cpu(), b.cpu())  # the generator's draws, moved
        c = sample_finite(probs.to(p_dev), torch.Generator(device=g_dev).manual_seed(3))
        assert torch.equal(c.cpu(), b.cpu())
        u = uniform(5, torch.device(p_dev), torch.Generator(device=g_dev).manual_seed(4))
        assert u.device.type == p_dev and u.shape == (5,)


def test_split_model_response_logits_equal_the_whole_models():
    whole, split = _model(), _split()
    assert output_device(split).type == "cpu" and split.get_input_embeddings().weight.device.type == "cuda"
    for a, b in zip(response_logits(whole, PROMPTS, RESPONSES, 2), response_logits(split, PROMPTS, RESPONSES, 2)):
        torch.testing.assert_close(a, b.cpu(), atol=1e-4, rtol=1e-4)


def test_split_model_logits_at_and_states_after_tokens():
    whole, split = _model(), _split()
    seqs, pos = [[1, 5, 6, 7], [1, 8, 9]], [[2, 3], [1, 3]]
    for a, b in zip(logits_at(whole, seqs, pos, 2), logits_at(split, seqs, pos, 2)):
        torch.testing.assert_close(a, b.cpu(), atol=1e-4, rtol=1e-4)
    toks = [[11, 12], [13, 14]]
    for a, b in zip(states_after_tokens(whole, seqs, pos, toks, 2), states_after_tokens(split, seqs, pos, toks, 2)):
        torch.testing.assert_close(a, b.cpu(), atol=1e-4, rtol=1e-4)


def test_split_model_layer_states_for_drafters():
    whole, split = _model(), _split()
    seqs = [[1, 5, 6, 7, 8], [1, 9]]
    for a, b in zip(sequence_states(whole, seqs, [1, 3]), sequence_states(split, seqs, [1, 3])):
        torch.testing.assert_close(a.float(), b.float().cpu(), atol=2e-3, rtol=2e-3)
    cap = AuxCapture(split, [1, 3])  # layer 1 on cuda:0, layer 3 on the CPU: joined on the last's device
    split(torch.tensor([[1, 5, 6]], device="cuda:0"))
    assert cap.states.shape[-1] == 2 * split.config.hidden_size
    cap.remove()


def test_judge_head_sits_where_the_target_states_come_out():
    split = _split()
    with HiddenCapture(split) as cap:
        split(torch.tensor([[1, 5, 6]], device="cuda:0"))
    assert cap.pre is not None and cap.pre.device == output_device(split)


def test_dtype_auto_is_bf16_on_cuda_and_fp32_on_cpu():
    assert ModelSpec().dtype == "auto"
    assert resolve_dtype("auto", "cuda") == (torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float32)
    assert resolve_dtype("auto", "cpu") == torch.float32


def test_numerics_fingerprint_names_no_device_index():
    """One process per GPU writes the same footer on every GPU of one model (here: each GPU visible)."""
    first = numerics_settings(1, {"t": torch.bfloat16}, {"t": torch.device("cuda:0")})
    for i in range(torch.cuda.device_count()):
        if torch.cuda.get_device_name(i) == torch.cuda.get_device_name(0):
            assert numerics_settings(1, {"t": torch.bfloat16}, {"t": torch.device(f"cuda:{i}")}) == first
    assert "cuda:0" not in str(first["devices"])


def test_draft_beside_a_split_target_goes_to_the_freest_gpu():
    from specheads.shim.runners.model_facts import freest_gpu

    dev = freest_gpu()
    i = int(dev.split(":")[1])
    free = [torch.cuda.mem_get_info(j)[0] for j in range(torch.cuda.device_count())]
    assert free[i] == max(free) or abs(free[i] - max(free)) < 2**28  # the freest, give or take what moved since


def test_eagle_head_trains_and_evaluates_on_cuda(tiny_pair_dirs, prompts_file, tmp_path):
    """labels=drafter data written on the GPU, then heads-train head=eagle on it there (its evaluation included:
    the greedy runs once summed a CPU tensor with the GPU's hits)."""
    from conftest import datagen_args

    from specheads.datagen.cli import main as datagen_main
    from specheads.train.cli import main as train_main

    data, out = tmp_path / "dg", tmp_path / "tr"
    cuda = ["target.device=cuda", "draft.device=cuda"]
    drafter = ["labels=drafter", "sampling.do_sample=false", "max_new_tokens=8", "drafter.top_k=5"]
    assert datagen_main([*datagen_args(tiny_pair_dirs, prompts_file, data, *drafter), *cuda]) == 0
    train = [f"data_dir={data}", "head=eagle", f"target.path={tiny_pair_dirs[0]}", "target.gguf_file=null"]
    train += ["target.device=cuda", f"output_dir={out}", "batch_size=2", "epochs=1", "eval_fraction=0.3"]
    assert train_main([*train, "eagle.ttt_steps=2", "vocab_top_n=20"]) == 0
    assert (out / "head.safetensors").is_file()
