"""Heads in a Hub-style directory (``heads-export format=hf``, export/hub.py): bit-for-bit round trip, the
model card, config.json checked against the header, load by directory or repo id, threshold updates."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from conftest import train_args

import specheads
from specheads.errors import UserError
from specheads.export import hub, load_head, read_metadata
from specheads.export.cli import main as export
from specheads.export.package import set_default_threshold
from specheads.train.cli import main as train


@pytest.fixture(scope="module")
def trained(tiny_pair_dirs, labelled, tmp_path_factory):
    out = tmp_path_factory.mktemp("hub") / "tr"
    assert train(train_args(tiny_pair_dirs, labelled, out, "epochs=1")) == 0
    return out


def test_hf_layout_round_trips_bit_for_bit(trained, tmp_path):
    one, hf = tmp_path / "one", tmp_path / "hf"
    assert export([f"train_dir={trained}", f"output_dir={one}"]) == 0
    assert export([f"train_dir={trained}", f"output_dir={hf}", "format=hf"]) == 0
    assert {p.name for p in hf.iterdir()} >= set(hub.FILES) and not (hf / "head.safetensors").exists()
    # the same single-file head, byte for byte, under the Hub's weights name
    assert (hf / "model.safetensors").read_bytes() == (one / "head.safetensors").read_bytes()
    a, b = load_head(one / "head.safetensors"), specheads.load_head(hf)
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(0))
    assert torch.equal(a.module(x), b.module(x)) and a.metadata == b.metadata
    assert all(torch.equal(p, q) for p, q in zip(a.module.state_dict().values(), b.module.state_dict().values()))
    cfg = json.loads((hf / "config.json").read_text())
    assert cfg["library_name"] == "specheads" and cfg["head_type"] == "acceptance" and cfg["specheads"] == b.metadata
    manifest = json.loads((hf / "manifest.json").read_text())
    assert manifest["format"] == "hf" and manifest["round_trip_identical"] is True


def test_the_model_card_says_what_the_head_is(trained, tmp_path):
    hf = tmp_path / "hf"
    assert export([f"train_dir={trained}", f"output_dir={hf}", "format=hf", "threshold=0.35"]) == 0
    meta = read_metadata(hf)
    card = (hf / "README.md").read_text()
    assert card.startswith("---\nlibrary_name: specheads\n")
    assert meta["draft"]["fingerprint"] in card and meta["target"]["fingerprint"] in card
    data = meta["extra"]["training_data"]["data_sets"][0]
    assert data["labels"] and f"- `{data['data_dir']}`: {data['prompts']} prompts from `{data['prompts_file']}`" in card
    # an acceptance head's labels are soft: the card gives their mean, never "None positive"
    assert f"{data['labelled_tokens']} labelled tokens, mean label " in card and "None" not in card
    assert "auroc" in card or "binary_kl" in card
    assert "Calibration" in card and "`0.35`" in card


def test_a_threshold_chosen_later_updates_the_directory(trained, tmp_path):
    hf = tmp_path / "hf"
    assert export([f"train_dir={trained}", f"output_dir={hf}", "format=hf"]) == 0
    set_default_threshold(hf, 0.25, {"command": "heads-eval select=max_drop:0.01", "acc_drop": 0.0})
    assert load_head(hf).threshold == 0.25
    assert json.loads((hf / "config.json").read_text())["specheads"]["default_threshold"] == 0.25
    assert "heads-eval select=max_drop:0.01" in (hf / "README.md").read_text()
    # named by its model.safetensors, the directory's config.json and card still follow
    set_default_threshold(hf / "model.safetensors", 0.3, {"command": "by hand"})
    assert load_head(hf).threshold == 0.3 and "by hand" in (hf / "README.md").read_text()
    with pytest.raises(UserError, match="not a local file or directory"):
        set_default_threshold("acme/smollm2-acceptance", 0.3, {})


def test_an_edited_or_incomplete_directory_is_refused(trained, tmp_path, monkeypatch):
    hf = tmp_path / "hf"
    assert export([f"train_dir={trained}", f"output_dir={hf}", "format=hf"]) == 0
    bad = tmp_path / "edited"
    shutil.copytree(hf, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["specheads"]["hidden_size"] = 64
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UserError, match="config.json does not match"):
        load_head(bad)
    (bad / "config.json").unlink()
    with pytest.raises(UserError, match="without config.json"):
        load_head(bad)
    with pytest.raises(UserError, match="does not exist"):
        load_head(tmp_path / "nowhere" / "head.safetensors")
    (tmp_path / "plain").mkdir()
    shutil.copyfile(hf / "model.safetensors", tmp_path / "plain" / "head.safetensors")
    with pytest.raises(UserError, match="pass that file"):
        load_head(tmp_path / "plain")
    monkeypatch.chdir(tmp_path)  # plain/missing reads as owner/name, but plain/ is a local directory
    with pytest.raises(UserError, match="does not exist"):
        load_head("plain/missing")
    assert export([f"train_dir={trained}", f"output_dir={tmp_path / 'x'}", "format=onnx"]) == 2


def test_a_repo_id_is_fetched_through_the_hub_cache(trained, tmp_path, monkeypatch):
    """``owner/name`` that is no local path goes to huggingface_hub.snapshot_download (here a stand-in that
    serves the exported directory, as the Hub cache would offline); a failed fetch is a one-line error."""
    import huggingface_hub

    hf = tmp_path / "hf"
    assert export([f"train_dir={trained}", f"output_dir={hf}", "format=hf"]) == 0
    asked = []

    def snapshot(repo_id, allow_patterns=None, **kw):
        asked.append((repo_id, tuple(allow_patterns)))
        if repo_id != "acme/smollm2-acceptance":
            raise huggingface_hub.errors.LocalEntryNotFoundError("not in the cache and offline")
        return str(hf)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot)
    monkeypatch.chdir(tmp_path)
    head = load_head("acme/smollm2-acceptance")
    assert head.metadata == read_metadata(hf) and asked == [("acme/smollm2-acceptance", hub.FILES)]
    with pytest.raises(UserError, match="could not be fetched"):
        load_head("acme/missing")
