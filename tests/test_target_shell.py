"""engine=vllm loads the Transformers target without its weights (specheads/runtime/target_shell.py): the same config,
EOS ids, fingerprint and (when asked) output layer as the loaded model, no other weight, and no pass."""

from __future__ import annotations

import pytest
import torch
from conftest import pair_args

from specheads.config import load_config
from specheads.datagen.cli import _load
from specheads.datagen.config import DatagenConfig
from specheads.datagen.engines import runtime_of
from specheads.datagen.registry import labeller
from specheads.plan import memory as plan_memory
from specheads.runtime.target_shell import load_shell, load_target
from specheads.shim import ModelSpec, context_length, eos_ids, final_norm, load_model


def _real(model) -> dict[str, int]:
    """The parameters that hold data (not on the meta device), by name: their element counts."""
    return {n: p.numel() for n, p in model.named_parameters() if p.device.type != "meta"}


@pytest.mark.parametrize("output_layer", [False, True])
def test_shell_is_the_models_config_and_output_layer_alone(tiny_pair_dirs, output_layer):
    spec = ModelSpec(path=str(tiny_pair_dirs[0]), device="cpu", dtype="float32")
    whole, shell = load_model(spec, "target"), load_shell(spec, output_layer)
    assert shell.fingerprint == whole.fingerprint and shell.name == whole.name
    assert eos_ids(shell.model, shell.tokenizer) == eos_ids(whole.model, whole.tokenizer)
    assert context_length(shell.model) == context_length(whole.model) and shell.hidden_size == whole.hidden_size
    assert shell.model.get_output_embeddings().weight.shape == whole.model.get_output_embeddings().weight.shape
    assert shell.device == shell.output_device == torch.device("cpu")
    real = _real(shell.model)
    if not output_layer:
        assert real == {}
        return
    assert sorted(real) == ["lm_head.weight", "model.norm.weight"]
    # the real weights, bit for bit; the outputs to fp32 rounding (the matmul kernel may differ by CPU and layout)
    assert torch.equal(shell.model.get_output_embeddings().weight, whole.model.get_output_embeddings().weight)
    assert torch.equal(final_norm(shell.model).weight, final_norm(whole.model).weight)
    x = torch.randn(5, whole.hidden_size)
    got = shell.model.get_output_embeddings()(final_norm(shell.model)(x))
    torch.testing.assert_close(got, whole.model.get_output_embeddings()(final_norm(whole.model)(x)))


def test_a_pass_through_the_shell_is_refused(tiny_pair_dirs):
    shell = load_shell(ModelSpec(path=str(tiny_pair_dirs[0]), device="cpu"), output_layer=True)
    with pytest.raises(RuntimeError, match="without its weights"):
        shell.model(torch.tensor([[1, 2, 3]]))


def test_load_target_loads_the_whole_model_when_a_pass_is_needed(tiny_pair_dirs):
    spec = ModelSpec(path=str(tiny_pair_dirs[0]), device="cpu")
    assert _real(load_target(spec, "model").model) == _real(load_model(spec, "target").model)
    with pytest.raises(ValueError, match="not one of"):
        load_target(spec, "weights")


@pytest.mark.parametrize(
    "labels,extra,use",
    [
        ("acceptance", [], "config"),  # greedy: p is the response token
        ("acceptance", ["sampling.do_sample=true"], "config"),  # vLLM's log-probabilities
        ("acceptance", ["sampling.do_sample=true", "vllm.logprobs=false"], "model"),  # a Transformers pass
        ("fsd", [], "model"),
        ("drafter", [], "config"),
        ("judge", [], "output_layer"),  # its verdict on each token: the final norm and output layer
        ("sprinter", [], "output_layer"),
        ("eagle_rounds", [], "model"),
    ],
)
def test_each_family_asks_for_what_it_uses_of_the_target(labels, extra, use):
    """The labeller says what it needs; the plan (which imports no stage) counts the same."""
    cfg = load_config(DatagenConfig, "datagen", [f"labels={labels}", *extra])
    assert labeller(labels).target_under_vllm(cfg) == use == plan_memory.target_under_vllm(cfg)


def test_the_plan_counts_no_target_weights_beside_vllm_for_a_family_that_needs_none():
    """judge_405b's datagen under engine=vllm: vLLM holds the target; the labelling process holds only its final
    norm and output layer (the target's verdict on each token), as SPRINTER's does."""
    argv = ["recipe=judge_405b", "engine=vllm", "gpus=8", "gpu_memory_gb=141", "vllm.tensor_parallel=8"]
    judge = plan_memory.datagen_memory(load_config(DatagenConfig, "datagen", argv), 1)
    specheads = plan_memory.datagen_memory(load_config(DatagenConfig, "datagen", [*argv, "engine=specheads"]), 1)
    sprinter = plan_memory.datagen_memory(load_config(DatagenConfig, "datagen", [*argv, "labels=sprinter"]), 1)
    assert judge.kv_cache < specheads.kv_cache / 4  # the draft's alone
    assert 3e9 < judge.weights["target"] < 5e9  # the output layer: 128k x 16k in bf16
    assert specheads.weights["target"] > 700e9  # 405B in bf16
    assert 3e9 < sprinter.weights["target"] < 5e9  # 128k x 16k in bf16


@pytest.mark.parametrize("engine,weights", [("vllm", False), ("specheads", True)])
def test_datagen_loads_the_target_whole_only_for_its_own_engine(tiny_pair_dirs, tmp_path, engine, weights):
    argv = [*pair_args(tiny_pair_dirs), "labels=drafter", f"engine={engine}", f"output_dir={tmp_path}"]
    cfg = load_config(DatagenConfig, "datagen", argv)
    job = _load(cfg, labeller("drafter"), runtime_of(cfg))
    assert bool(_real(job.pair.target.model)) is weights
    assert job.pair.target.device == torch.device("cpu") and job.eos == [2] and job.limit == 256
