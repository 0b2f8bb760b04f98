"""Exported heads: safetensors round trip, metadata in the header, refusals."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch.testing import assert_close

from specheads.errors import UserError
from specheads.export import load_head, read_metadata, save_head
from specheads.export.package import set_default_threshold
from specheads.heads import HEADS, AcceptanceHead
from specheads.shim import ModelSpec, SamplingConfig, load_pair


@pytest.fixture()
def pair(tiny_pair_dirs):
    t, d = tiny_pair_dirs
    return load_pair(ModelSpec(path=str(t), device="cpu"), ModelSpec(path=str(d), device="cpu"))


def _export(tmp_path, pair, **over):
    torch.manual_seed(0)
    head = AcceptanceHead(pair.draft.hidden_size, depth=2)
    meta = {
        "head_config": head.config(),
        "hidden_size": pair.draft.hidden_size,
        "feature": {"model": "draft", "state": "post", "layer": -1},
        "draft": {"name": pair.draft.name, "fingerprint": pair.draft.fingerprint},
        "target": {"name": pair.target.name, "fingerprint": pair.target.fingerprint},
        "sampling": SamplingConfig().to_dict(),
        "default_threshold": 0.7,
        **over,
    }
    return head, save_head(tmp_path / "head.safetensors", head, "acceptance", meta)


def test_acceptance_head_blocks_have_separate_weights():
    head = AcceptanceHead(8, depth=3)
    assert len({id(b.linear.weight) for b in head.blocks}) == 3
    assert AcceptanceHead(8, depth=0)(torch.zeros(5, 8)).shape == (5,)


def test_every_head_type_has_the_exported_parameter_names():
    """Exported files name their tensors blocks.<i>.linear.* and out.*: every head type keeps them."""
    want = {
        "blocks.0.linear.weight",
        "blocks.0.linear.bias",
        "blocks.1.linear.weight",
        "blocks.1.linear.bias",
        "out.weight",
        "out.bias",
    }
    for name, cls in HEADS.items():
        if name == "eagle":  # a draft head, not a residual MLP: tests/test_speculators.py covers its layout
            continue
        head = cls(8, depth=2)
        assert set(head.state_dict()) == want, name
        assert cls(**head.config()).config() == head.config()


def test_round_trip_and_metadata(tmp_path, pair):
    head, path = _export(tmp_path, pair)
    meta = read_metadata(path)
    assert meta["head_type"] == "acceptance" and meta["hidden_size"] == 32 and meta["default_threshold"] == 0.7
    loaded = load_head(path, pair=pair, sampling=SamplingConfig())
    x = torch.randn(4, 32)
    assert_close(loaded.module(x), head(x))
    assert loaded.threshold == 0.7


def test_a_chosen_default_threshold_is_written_into_the_header(tmp_path, pair):
    """heads-eval write_default=true: the header's default changes (with how it was chosen), the tensors
    and their digest do not; a file whose tensors were altered is refused."""
    head, path = _export(tmp_path, pair)
    before = read_metadata(path)
    set_default_threshold(path, 0.55, {"command": "heads-eval select=max_drop:0.01", "acc_drop_upper": 0.008})
    after = read_metadata(path)
    assert after["default_threshold"] == 0.55 and after["default_threshold_chosen_by"]["acc_drop_upper"] == 0.008
    assert after["tensors_sha256"] == before["tensors_sha256"]
    loaded = load_head(path, pair=pair, sampling=SamplingConfig())
    assert loaded.threshold == 0.55
    x = torch.randn(2, 32)
    assert_close(loaded.module(x), head(x))
    tensors = load_file(str(path))
    tensors["out.bias"] += 1
    save_file(tensors, str(path), metadata={"format": "pt", "specheads": json.dumps(after)})
    with pytest.raises(UserError, match="digest"):
        set_default_threshold(path, 0.6, {})


def test_a_head_gated_on_some_sources_names_the_prompts_outside_its_gate():
    from specheads.export.package import outside_gate

    meta = {
        "default_threshold": 0.9,
        "default_threshold_chosen_by": {"gate": "max_drop:0.01", "competent_sources": ["facts"]},
    }
    assert outside_gate(meta, {"facts"}) is None and outside_gate({"default_threshold": 0.5}, {"gsm8k"}) is None
    why = outside_gate(meta, {"facts", "gsm8k", "mt_bench"})
    assert "gsm8k, mt_bench" in why and "max_drop:0.01" in why and "0.9" in why


def test_write_default_writes_only_a_choice_that_holds_on_the_test_half(tmp_path, pair, caplog):
    from types import SimpleNamespace

    from specheads.evaluate.cli import _write_defaults

    _, path = _export(tmp_path, pair)
    entry = {"row": "j0.9", "threshold": 0.9, "acc_drop": 0.0, "acc_drop_upper": 0.05, "tokens_per_s_vs_target": 1.2}
    summary = {"gated": {"select": "max_drop:0.01", "competent_sources": ["facts"], "rows": {"judge": entry}}}
    cfg = SimpleNamespace(
        judge=SimpleNamespace(head=str(path), heads={}),
        sprinter=SimpleNamespace(head=None),
        rows=[],
        select="max_drop:0.01",
        prompts="p",
    )
    with caplog.at_level(logging.WARNING):
        _write_defaults(cfg, summary, tmp_path)
    assert read_metadata(path)["default_threshold"] == 0.7 and entry["not_written"]  # failed on the test half
    assert any("not on the test half" in r.getMessage() for r in caplog.records)
    entry.update(within_gate_on_test=True, disagree_by_source={"facts": {}, "gsm8k": {}})
    _write_defaults(cfg, summary, tmp_path)
    meta = read_metadata(path)
    assert meta["default_threshold"] == 0.9 and meta["default_threshold_chosen_by"]["sources"] == ["facts", "gsm8k"]
    assert entry["written_to"] == str(path)


def test_refuses_other_hidden_size(tmp_path, pair):
    _, path = _export(tmp_path, pair, hidden_size=64)
    with pytest.raises(UserError, match="hidden_size=64 but draft hidden_size=32"):
        load_head(path, pair=pair)


def test_refuses_other_fingerprint(tmp_path, pair):
    _, path = _export(tmp_path, pair, draft={"name": "other", "fingerprint": "sha256:0000"})
    with pytest.raises(UserError, match="fingerprint"):
        load_head(path, pair=pair)


def test_sampling_mismatch_warns_or_refuses(tmp_path, pair, caplog):
    _, path = _export(tmp_path, pair)
    hot = SamplingConfig(do_sample=True, temperature=0.7)
    with caplog.at_level(logging.WARNING):
        load_head(path, pair=pair, sampling=hot)
    assert any("trained with sampling" in r.getMessage() for r in caplog.records)
    with pytest.raises(UserError, match="strict=false"):
        load_head(path, pair=pair, sampling=hot, strict=True)


def test_truncated_and_tampered_files(tmp_path, pair):
    _, path = _export(tmp_path, pair)
    data = path.read_bytes()
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(data[: len(data) // 2])
    with pytest.raises(UserError, match="truncated"):
        load_head(cut)
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(data[:-4] + bytes(4))  # flip the last weights
    with pytest.raises(UserError, match="modified after export"):
        load_head(bad)
    with pytest.raises(UserError, match="does not exist"):
        load_head(tmp_path / "missing.safetensors")


def test_refuses_newer_format(tmp_path, pair):
    _, path = _export(tmp_path, pair, format_version=99)
    with pytest.raises(UserError, match="upgrade specheads"):
        load_head(path)
