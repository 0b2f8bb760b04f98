"""``plan=true`` on heads-datagen and heads-train: figures from shapes alone, checked against hand arithmetic;
what cannot fit is one line and exit code 2; no model is loaded and nothing downloaded."""

from __future__ import annotations

import json

import pytest
from transformers import LlamaConfig

from specheads.config import list_recipes, load_config, schema_for, to_yaml
from specheads.datagen.cli import main as datagen_main
from specheads.model_shapes import KNOWN, shape_of
from specheads.plan import plan_figures
from specheads.train.cli import main as train_main

GB = 1e9


def _config_dir(path, layers: int):
    LlamaConfig(
        vocab_size=100,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    ).save_pretrained(path)  # config.json only: no weights exist
    return path


@pytest.fixture
def recipe(tmp_path):
    """A recipe over a 2-layer target and a 1-layer draft that exist only as config.json files."""
    target, draft = _config_dir(tmp_path / "target", 2), _config_dir(tmp_path / "draft", 1)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"q{i}"}) + "\n" for i in range(10)))
    path = tmp_path / "tiny.yaml"
    path.write_text(
        f"target: {{path: {target}, dtype: float32}}\ndraft: {{path: {draft}, dtype: float32}}\n"
        "sampling: {do_sample: true}\n"
        f"datagen: {{labels: acceptance, prompts: {prompts}, max_new_tokens: 8, batch_size: 4, prompt_tokens: 8,"
        f" output_dir: {tmp_path / 'dg'}}}\n"
        f"train: {{head: acceptance, depth: 1, batch_size: 2, epochs: 2, prompt_tokens: 8, data_dir: {tmp_path / 'dg'},"
        f" output_dir: {tmp_path / 'tr'}}}\n"
    )
    return str(path)


# Hand arithmetic for the recipe above. Target: per layer q, o 2*32*32 = 2048, k, v 2*32*(2*8) = 1024, MLP
# 3*32*64 = 6144, norms 64: 9280; 2 layers + embeddings and output layer 2*100*32 + final norm 32 = 24992
# parameters. Draft: 9280 + 6400 + 32 = 15712. fp32: 4 bytes each.
TARGET_W, DRAFT_W = 24992 * 4, 15712 * 4
ROWS = 4 * (8 + 8)  # batch x (prompt_tokens + max_new_tokens)
ACTIVATIONS = ROWS * (4 * 32 + 3 * 64) * 4  # one layer's forward, the larger model (same width)
KV_TARGET, KV_DRAFT = ROWS * 2 * 2 * 2 * 8 * 4, ROWS * 2 * 1 * 2 * 8 * 4  # K and V x layers x kv heads x dim
LABELS = 2 * 32 * 100 * 4 + 3 * 32 * 100 * 4  # logits p, q and fp32 p, q, min(p, q) for 4 x 8 rows
TOTAL = TARGET_W + DRAFT_W + ACTIVATIONS + KV_TARGET + KV_DRAFT + LABELS


def test_datagen_figures_match_hand_arithmetic(recipe):
    plan = plan_figures("heads-datagen", recipe, ["gpus=4", "tokens_per_s=10"])
    fig = plan["per_process_gb"]
    assert fig["weights"] == pytest.approx({"target": TARGET_W / GB, "draft": DRAFT_W / GB, "head": 0.0})
    assert fig["activations"] == pytest.approx(ACTIVATIONS / GB)
    assert fig["kv_cache"] == pytest.approx((KV_TARGET + KV_DRAFT) / GB)
    assert fig["label_buffers"] == pytest.approx(LABELS / GB)
    assert fig["total"] == pytest.approx(TOTAL / GB) and fig["fullest_gpu"] == pytest.approx(TOTAL / GB)
    assert plan["processes"] == 4 and plan["fits"] and plan["refusal"] is None
    assert plan["disk_gb"] == pytest.approx({"states": 0.0, "labels": (10 * 16 * 4 + 80 * 3 * 4) / GB})
    assert plan["time"]["tokens"] == 80 and plan["time"]["hours"] == pytest.approx(80 / (10 * 4) / 3600)


def test_a_sharded_target_spreads_its_weights_and_cache_over_the_node(recipe):
    plan = plan_figures("heads-datagen", recipe, ["gpus=4", "target.device_map=auto"])
    sharded = TARGET_W + KV_TARGET
    assert plan["processes"] == 1 and plan["per_process_gb"]["gpus_per_process"] == 4
    assert plan["per_process_gb"]["fullest_gpu"] == pytest.approx((sharded / 4 + TOTAL - sharded) / GB)
    # no rate given or recorded: one GPU at a time reads the target's weights (and cache) once a step
    assert plan["time"]["tokens_per_s"] == pytest.approx(4 * 3350 * GB / (TARGET_W + KV_TARGET + KV_DRAFT))


def test_what_does_not_fit_names_what_would(recipe):
    plan = plan_figures("heads-datagen", recipe, ["gpu_memory_gb=0.0003"])  # 270,000 bytes usable
    assert not plan["fits"] and TOTAL > 0.9 * 0.0003 * GB
    # FP8: 1-byte weights, bf16 activations, caches and logits: 145,152 bytes, at the recipe's batch
    assert plan["would_fit"][0].startswith("FP8 weights") and "batch_size" not in plan["would_fit"][0]
    assert any("gpu_memory_gb=141" in x for x in plan["would_fit"])
    assert "\n" not in plan["refusal"] and "would fit: FP8" in plan["refusal"]


def test_a_recorded_rate_times_the_run(recipe, tmp_path):
    (tmp_path / "dg").mkdir()
    (tmp_path / "dg/metrics.rank0.jsonl").write_text(json.dumps({"chunk": 0, "prompts": 5, "seconds": 10.0}) + "\n")
    t = plan_figures("heads-datagen", recipe, ["gpus=1"])["time"]
    assert t["hours"] == pytest.approx(10 / 0.5 / 3600) and t["rate_source"].startswith("recorded")


def test_train_figures_from_a_finished_datagen_output(recipe, tmp_path):
    data = tmp_path / "dg"
    data.mkdir()
    dcfg = load_config(schema_for("datagen"), "datagen", [f"recipe={recipe}"])
    (data / "config.yaml").write_text(to_yaml(dcfg))
    (data / "manifest.json").write_text(json.dumps({"shards": [{"prompts": 10, "labelled_tokens": 80}]}))
    (data / "features").mkdir()
    (data / "features/chunk-00000.safetensors").write_bytes(b"\0" * 1000)
    plan = plan_figures("heads-train", recipe, ["gpus=2", "tokens_per_s=4"])
    fig = plan["per_process_gb"]
    head = 1 * (32 * 32 + 32) + 32 + 1  # one residual block and the output layer on the draft's 32-wide state
    rows = 2 * (8 + 8)
    activations = rows * 32 * 4 * (2 * 1 + 2) + rows * (4 * 32 + 3 * 64) * 2  # the head's, the bf16 draft forward
    assert fig["weights"] == pytest.approx({"target": 0.0, "draft": DRAFT_W / GB, "head": head * 4 / GB})
    assert fig["optimizer"] == pytest.approx(head * 12 / GB)
    assert fig["activations"] == pytest.approx(activations / GB)
    assert plan["disk_gb"]["states"] == pytest.approx(1000 / GB)
    assert plan["processes"] == 2 and plan["time"]["hours"] == pytest.approx(2 * 80 / (4 * 2) / 3600)


def test_405b_in_bf16_on_8x80_gb_is_refused_in_one_line(capsys):
    assert datagen_main(["recipe=judge_405b", "plan=true", "gpus=8", "gpu_memory_gb=80", "nodes=1"]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("heads-datagen: error: plan:") and "Traceback" not in captured.err
    assert "FP8" in err[0] and "gpu_memory_gb=141" in err[0] and "2 nodes with pipeline parallelism" in err[0]
    assert "target 811.7 (101.5 per GPU)" in captured.out  # 405.85e9 parameters x 2 bytes over 8 GPUs


def test_plan_loads_no_model_and_downloads_nothing(recipe, monkeypatch, capsys):
    import huggingface_hub
    import transformers

    def refuse(*args, **kwargs):
        raise AssertionError("plan=true loaded or downloaded something")

    for owner, name in (
        (transformers.AutoModelForCausalLM, "from_pretrained"),
        (transformers.AutoConfig, "from_pretrained"),
        (transformers.AutoTokenizer, "from_pretrained"),
        (huggingface_hub, "hf_hub_download"),
        (huggingface_hub, "snapshot_download"),
        (huggingface_hub.file_download, "hf_hub_download"),
    ):
        monkeypatch.setattr(owner, name, refuse)
    monkeypatch.setattr("specheads.datagen.cli.load_pair", refuse)
    assert datagen_main([f"recipe={recipe}", "plan=true"]) == 0
    assert datagen_main(["recipe=specdecpp_llama31_8b_70b", "plan=true", "num_prompts=64"]) == 0
    assert train_main(["recipe=judge_405b", "plan=true"]) == 0
    out = capsys.readouterr().out
    assert out.count("fits") == 3 and "per process, GB" in out


def test_an_unknown_model_without_a_local_config_is_one_line(capsys):
    assert datagen_main(["recipe=judge_405b", "plan=true", "target.path=acme/mystery-13b"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "acme/mystery-13b" in err[0] and "config.json" in err[0] and "target.path=DIR" in err[0]


def test_every_recipes_models_have_a_shape():
    planned = {name: "train" for name in list_recipes("train")} | {name: "datagen" for name in list_recipes("datagen")}
    for name, section in planned.items():  # the recipe's common target and draft: one section reads them
        cfg = load_config(schema_for(section), section, [f"recipe={name}"])
        for role in ("target", "draft"):
            spec = getattr(cfg, role)
            if spec.path:
                assert shape_of(spec, role).params() > 0, (name, role)
    assert KNOWN["llama-3.1-405b"].params() == pytest.approx(405.85e9, rel=1e-3)  # the published 405B
    assert KNOWN["llama-3.1-70b"].params() == pytest.approx(70.55e9, rel=1e-3)


@pytest.fixture
def conversations(tmp_path, monkeypatch):
    path = tmp_path / "conv.jsonl"
    path.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"q{i}"}]}) + "\n" for i in range(50)))
    monkeypatch.setenv("CONVERSATIONS", str(path))
    return 50


def test_eagle_plans_set_offline_states_against_online_and_the_engine_beside_the_head(conversations):
    p8 = plan_figures("heads-train", "eagle_llama31_8b")
    e, s8 = p8["eagle"], KNOWN["llama-3.1-8b"]
    positions = 3 * conversations * (1024 + 1024)  # three turn parts, each prompt + response at most
    assert e["mode"] == "online" and e["engine"] == "specheads" and p8["fits"] and p8["processes"] == 8
    assert e["disk_gb"]["offline"] == pytest.approx(positions * 3 * s8.hidden * 2 / GB + e["disk_gb"]["online"], 1e-4)
    assert e["disk_gb"]["online"] < e["disk_gb"]["offline"] / 100
    assert p8["per_process_gb"]["weights"]["target"] == pytest.approx(
        (s8.params() * 2 + s8.vocab * s8.hidden * 4) / GB, 1e-4
    )  # the bf16 target beside the head, and the head's fp32 copy of its embeddings
    p70 = plan_figures("heads-train", "eagle_llama31_70b")
    assert p70["eagle"]["engine"] == "vllm" and p70["processes"] == 2  # one per vLLM engine of 4 GPUs
    assert p70["per_process_gb"]["gpus_per_process"] == 4 and not p70["fits"]
    assert "ZeRO-2" in p70["refusal"] and len(p70["refusal"].splitlines()) == 1
    assert plan_figures("heads-train", "eagle_llama31_70b", ["gpu_memory_gb=141"])["fits"]
    p405 = plan_figures(
        "heads-train", "eagle_llama31_70b", ["target.path=meta-llama/Llama-3.1-405B-Instruct", "vllm.tensor_parallel=8"]
    )
    assert p405["processes"] == 1 and not p405["fits"]


def test_an_eagle_mode_whose_states_exceed_the_disk_is_refused_naming_the_modes_that_fit(conversations, capsys):
    plan = plan_figures("heads-train", "eagle_llama31_8b", ["eagle.states=offline", "disk_gb=0.5"])
    assert not plan["fits"] and "eagle.states=online" in plan["refusal"] and "disk_gb=0.5" in plan["refusal"]
    assert train_main(["recipe=eagle_llama31_8b", "plan=true", "eagle.states=offline", "disk_gb=0.5"]) == 2
    err = capsys.readouterr().err.strip()
    assert "would fit: eagle.states=online" in err and len(err.splitlines()) == 1
