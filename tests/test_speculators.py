"""``heads-export format=speculators``: the Eagle-3 directory vLLM loads (names, shapes, vocabulary mapping,
config fields), its bit-identical round trip, and the refusals."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from safetensors import safe_open

from specheads.errors import UserError
from specheads.export import load_head, save_head, speculators
from specheads.export.export_config import ExportConfig
from specheads.heads import AcceptanceHead, EagleHead

H, VOCAB, DRAFT = 16, 40, 12
ARGS = dict(
    hidden_size=H,
    layers=[1, 2, 4],
    draft_vocab_size=DRAFT,
    vocab_size=VOCAB,
    num_heads=4,
    num_kv_heads=2,
    head_dim=4,
    intermediate_size=24,
    rms_norm_eps=1e-5,
    rope_theta=50000.0,
)
META = {
    "hidden_size": H,
    "feature": {"model": "target", "state": "aux", "layers": [1, 2, 4]},
    "target": {"name": "tiny-target", "fingerprint": "abc", "max_position_embeddings": 4096},
    "sampling": {"temperature": 0.0},
    "ttt_steps": 4,
    "extra": {"note": "test"},
}


def _head(draft: int = DRAFT, dtype=torch.float32, **over) -> EagleHead:
    torch.manual_seed(0)
    head = EagleHead(**{**ARGS, "draft_vocab_size": draft, **over})
    with torch.no_grad():
        for p in head.parameters():
            p.copy_(torch.randn_like(p))
        g = torch.Generator().manual_seed(1)
        head.vocab_ids.copy_(torch.randperm(VOCAB, generator=g)[:draft].sort().values)
    return head.to(dtype)


NAMES = {
    "fc.weight": [H, 3 * H],
    "layers.0.input_layernorm.weight": [H],
    "layers.0.hidden_norm.weight": [H],
    "layers.0.self_attn.q_proj.weight": [16, 2 * H],
    "layers.0.self_attn.k_proj.weight": [8, 2 * H],
    "layers.0.self_attn.v_proj.weight": [8, 2 * H],
    "layers.0.self_attn.o_proj.weight": [H, 16],
    "layers.0.post_attention_layernorm.weight": [H],
    "layers.0.mlp.gate_proj.weight": [24, H],
    "layers.0.mlp.up_proj.weight": [24, H],
    "layers.0.mlp.down_proj.weight": [H, 24],
    "norm.weight": [H],
    "lm_head.weight": [DRAFT, H],
    "d2t": [DRAFT],
    "t2d": [VOCAB],
}


def _tensors(d):
    with safe_open(str(d / "model.safetensors"), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def test_weights_have_vllm_names_shapes_and_dtypes(tmp_path):
    head = _head(dtype=torch.bfloat16)
    got = _tensors(speculators.write(tmp_path / "x", head, META))
    assert {k: list(v.shape) for k, v in got.items()} == NAMES
    assert not any("embed_tokens" in k or "vocab_ids" in k for k in got)  # the target's embedding is shared
    assert got["d2t"].dtype == torch.int64 and got["t2d"].dtype == torch.bool
    assert {v.dtype for k, v in got.items() if k not in ("d2t", "t2d")} == {torch.bfloat16}
    assert torch.equal(got["lm_head.weight"], head.lm_head.weight)


def test_d2t_and_t2d_map_rows_to_the_heads_target_ids(tmp_path):
    head = _head()
    got = _tensors(speculators.write(tmp_path / "x", head, META))
    rows = torch.arange(DRAFT)
    assert torch.equal(rows + got["d2t"], head.vocab_ids)  # vLLM: logit of row i goes to target id i + d2t[i]
    assert torch.equal(got["t2d"].nonzero().flatten(), head.vocab_ids)
    assert int(got["t2d"].sum()) == DRAFT
    # vLLM's scatter of draft logits into the target vocabulary puts each row's score at its own token
    logits = torch.randn(3, DRAFT)
    full = torch.full((3, VOCAB), float("-inf"))
    full[:, rows + got["d2t"]] = logits
    assert torch.equal(full[:, head.vocab_ids], logits)


def test_full_vocabulary_writes_no_mapping(tmp_path):
    head = _head(draft=VOCAB)
    d = speculators.write(tmp_path / "x", head, META)
    assert "d2t" not in _tensors(d) and "t2d" not in _tensors(d)
    assert torch.equal(speculators.read(d).module.vocab_ids, torch.arange(VOCAB))


def test_config_fields(tmp_path):
    d = speculators.write(tmp_path / "x", _head(), META, verifier="org/target")
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["speculators_model_type"] == "eagle3" and cfg["architectures"] == ["Eagle3Speculator"]
    assert cfg["draft_vocab_size"] == DRAFT and cfg["target_hidden_size"] == H
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [1, 2, 4]
    # vLLM 0.32 defaults norm_before_residual to True when absent: the file must say False
    assert cfg["norm_before_residual"] is False and cfg["norm_before_fc"] is False and cfg["norm_output"] is False
    layer = cfg["transformer_layer_config"]
    assert layer["model_type"] == "llama" and layer["num_hidden_layers"] == 1
    assert (
        layer["hidden_size"],
        layer["num_attention_heads"],
        layer["num_key_value_heads"],
        layer["head_dim"],
        layer["intermediate_size"],
        layer["vocab_size"],
    ) == (H, 4, 2, 4, 24, VOCAB)
    assert layer["rope_theta"] == 50000.0 and layer["rope_parameters"]["rope_theta"] == 50000.0
    assert layer["rms_norm_eps"] == 1e-5 and layer["tie_word_embeddings"] is False
    spec = cfg["speculators_config"]
    assert spec["algorithm"] == "eagle3" and spec["verifier"]["name_or_path"] == "org/target"
    assert spec["proposal_methods"][0]["speculative_tokens"] == 4  # the training's ttt_steps
    assert cfg["specheads"]["head_type"] == "eagle" and cfg["specheads"]["extra"] == {"note": "test"}
    assert cfg["specheads"]["head_config"] == _head().config()
    assert speculators.is_speculators_dir(d) and (d / "README.md").is_file()
    # without a verifier argument: the target name recorded at training
    d2 = speculators.write(tmp_path / "y", _head(), META)
    assert (
        json.loads((d2 / "config.json").read_text())["speculators_config"]["verifier"]["name_or_path"] == "tiny-target"
    )


def test_max_position_embeddings_is_the_targets(tmp_path):
    """The Eagle-3 layer's context length is the target's: the verifier's config, else the metadata's, else the
    config of the target recorded at training; with none of them readable, a one-line error."""
    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text(json.dumps({"model_type": "llama", "max_position_embeddings": 131072}))

    def written(meta, **kw):
        d = speculators.write(tmp_path / f"d{len(list(tmp_path.iterdir()))}", _head(), meta, **kw)
        return json.loads((d / "config.json").read_text())["transformer_layer_config"]["max_position_embeddings"]

    assert written(META, verifier=str(target)) == 131072
    assert written(META) == 4096
    recorded = {**META, "target": {"name": str(target), "fingerprint": "abc"}}
    assert written(recorded) == 131072
    assert written(recorded, max_position_embeddings=2048) == 2048
    unknown = {**META, "target": {"name": "tiny-target", "fingerprint": "abc"}}
    with pytest.raises(UserError, match="max_position_embeddings=") as err:
        written(unknown, verifier="org/target")
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_trip_is_bit_identical(tmp_path, dtype):
    head = _head(dtype=dtype)
    back = speculators.read(speculators.write(tmp_path / "x", head, META))
    assert isinstance(back.module, EagleHead) and back.module.config() == head.config()
    mine, theirs = head.state_dict(), back.module.state_dict()
    assert mine.keys() == theirs.keys()
    assert all(mine[k].dtype == theirs[k].dtype and torch.equal(mine[k], theirs[k]) for k in mine)
    assert back.metadata["target"] == META["target"] and back.metadata["layout"] == "speculators"
    # the same head and metadata always give the same bytes
    again = speculators.write(tmp_path / "y", head, META)
    for name in ("model.safetensors", "config.json"):
        assert (tmp_path / "x" / name).read_bytes() == (again / name).read_bytes()


def test_a_two_layer_head_round_trips_and_tells_vllm_its_layers(tmp_path):
    """A later layer is a plain Llama layer over ``d`` (no hidden_norm), as vLLM's Eagle-3 Llama builds it."""
    head = _head(num_layers=2)
    out = speculators.write(tmp_path / "x", head, META)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["transformer_layer_config"]["num_hidden_layers"] == 2
    shapes = {k: list(v.shape) for k, v in _tensors(out).items()}
    assert shapes["layers.1.self_attn.q_proj.weight"] == [16, H] and shapes["layers.1.mlp.down_proj.weight"] == [H, 24]
    assert "layers.1.hidden_norm.weight" not in shapes and shapes.keys() - NAMES.keys() == {
        k.replace("layers.0.", "layers.1.") for k in NAMES if k.startswith("layers.0.") and "hidden_norm" not in k
    }
    back = speculators.read(out)
    assert back.module.config() == head.config() and back.module.num_layers == 2
    assert all(torch.equal(v, back.module.state_dict()[k]) for k, v in head.state_dict().items())


def test_from_an_exported_head_file(tmp_path):
    """The path heads-export takes: an exported head.safetensors, loaded, then written as speculators."""
    head = _head()
    path = save_head(tmp_path / "head.safetensors", head, "eagle", {"head_config": head.config(), **META})
    loaded = load_head(path)
    back = speculators.read(speculators.write(tmp_path / "x", loaded.module, loaded.metadata)).module
    assert all(torch.equal(v, back.state_dict()[k]) for k, v in head.state_dict().items())


def test_refusals(tmp_path):
    with pytest.raises(UserError, match="EAGLE heads only"):
        speculators.write(tmp_path / "a", AcceptanceHead(H, depth=1), META)
    with pytest.raises(UserError, match="ascending"):
        speculators.write(tmp_path / "b", _head(layers=[4, 2, 1]), META)
    with pytest.raises(UserError, match="not a speculators directory"):
        speculators.read(tmp_path)
    d = speculators.write(tmp_path / "c", _head(), META)
    cfg = json.loads((d / "config.json").read_text())
    cfg.pop("norm_before_residual")  # vLLM would read True
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UserError, match="norm_before_residual"):
        speculators.read(d)
    d = speculators.write(tmp_path / "e", _head(), META)
    t = _tensors(d)
    t["norm.weight"] = t["norm.weight"] + 1
    from safetensors.torch import save_file

    save_file(t, str(d / "model.safetensors"))
    with pytest.raises(UserError, match="modified after export"):
        speculators.read(d)


def _train_dir(tmp_path, head, head_type):
    d = tmp_path / "train"
    meta = {"head_config": head.config(), **META}
    if head_type != "eagle":
        meta = {**meta, "feature": {"model": "draft", "state": "post", "layer": -1}}
    save_head(d / "head.safetensors", head, head_type, meta)
    return d


def test_cli_writes_the_directory_and_refuses_other_heads(tmp_path):
    from specheads.export.cli import export_head

    head = _head()
    out = tmp_path / "out"
    train = str(_train_dir(tmp_path, head, "eagle"))
    with pytest.raises(UserError, match="embed_tokens=false") as err:  # no local target: no embedding to write
        export_head(ExportConfig(train_dir=train, format="speculators", verifier="org/target"), out)
    assert "\n" not in str(err.value)
    cfg = ExportConfig(train_dir=train, format="speculators", verifier="org/target", embed_tokens=False)
    info = export_head(dataclasses.replace(cfg, output_dir=str(out)), out)
    assert info["round_trip_identical"] and info["format"] == "speculators" and info["head"] == str(out)
    back = speculators.read(out).module
    assert all(torch.equal(v, back.state_dict()[k]) for k, v in head.state_dict().items())
    assert (
        json.loads((out / "config.json").read_text())["speculators_config"]["verifier"]["name_or_path"] == "org/target"
    )

    other = tmp_path / "acc"
    other.mkdir()
    cfg = ExportConfig(
        train_dir=str(_train_dir(other, AcceptanceHead(H, depth=1), "acceptance")),
        format="speculators",
        output_dir=str(tmp_path / "out2"),
    )
    with pytest.raises(UserError, match="EAGLE heads") as err:
        export_head(cfg, tmp_path / "out2")
    assert "\n" not in str(err.value)


def test_the_targets_embedding_and_architecture_go_with_the_head(tmp_path):
    """speculators' loader takes ``embed_tokens.weight`` from the directory (a missing one stays zeros): written
    from the target's own checkpoint, checked by its fingerprint; its ``architectures`` name the verifier."""
    from conftest import tiny_llama

    from specheads.export.cli import export_head
    from specheads.runtime.checkpoint_tensors import TargetCheckpoint
    from specheads.shim import ModelSpec

    model = tiny_llama(VOCAB)
    target = tmp_path / "target"
    model.save_pretrained(target)
    fp = TargetCheckpoint(ModelSpec(path=str(target), dtype="float32", device="cpu")).fingerprint
    head = _head(hidden_size=32, num_heads=4, num_kv_heads=2, head_dim=8)
    meta = {**META, "hidden_size": 32, "target": {"name": str(target), "fingerprint": fp}}
    train = tmp_path / "train"
    train.mkdir()
    save_head(train / "head.safetensors", head, "eagle", {"head_config": head.config(), **meta})
    out = tmp_path / "out"
    export_head(ExportConfig(train_dir=str(train), format="speculators", output_dir=str(out)), out)
    got = _tensors(out)
    assert torch.equal(got["embed_tokens.weight"], model.get_input_embeddings().weight.detach().float())
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["speculators_config"]["verifier"]["architectures"] == ["LlamaForCausalLM"]
    assert cfg["dtype"] == cfg["torch_dtype"] == "float32"
    back = speculators.read(out).module  # the embedding is the target's: the head round-trips without it
    assert all(torch.equal(v, back.state_dict()[k]) for k, v in head.state_dict().items())
    # another target than the one trained on is refused in one line
    other = tmp_path / "other"
    tiny_llama(VOCAB, seed=5).save_pretrained(other)
    cfg = ExportConfig(train_dir=str(train), format="speculators", verifier=str(other), output_dir=str(tmp_path / "o2"))
    with pytest.raises(UserError, match="not the target this head was trained on") as err:
        export_head(cfg, tmp_path / "o2")
    assert "\n" not in str(err.value)


def test_a_directory_with_the_embedding_and_a_misfit_say_why_in_one_line(tmp_path):
    d = speculators.write(tmp_path / "x", _head(), META, embed=torch.randn(VOCAB, H))
    assert list(_tensors(d)["embed_tokens.weight"].shape) == [VOCAB, H]
    speculators.read(d)  # a directory speculators wrote carries it: read, not refused
    from safetensors.torch import save_file

    tensors = _tensors(d)
    tensors["extra.weight"] = torch.zeros(2)
    save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(UserError, match="extra.weight") as err:
        speculators.read(d)
    assert "\n" not in str(err.value)
