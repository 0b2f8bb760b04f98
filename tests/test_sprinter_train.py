"""SPRINTER verifier: training on ratio labels (three features, ROC for several lambda), export, decoding."""

from __future__ import annotations

import json

import pytest
import torch
from test_sprinter_data import WORDS, _args as datagen_args

from specheads.datagen.cli import main as datagen_main
from specheads.export import load_head, read_metadata
from specheads.export.cli import main as export_main
from specheads.export.decode_cli import main as decode_main
from specheads.train import verifier as V
from specheads.train.cli import main as train_main


@pytest.fixture(scope="module")
def labelled(tmp_path_factory, tiny_pair_dirs):
    root = tmp_path_factory.mktemp("sprinter")
    prompts = root / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": w}) + "\n" for w in WORDS * 2))
    out = root / "dg"
    assert datagen_main(datagen_args(tiny_pair_dirs, prompts, out, "max_new_tokens=10",
                                     "sampling.do_sample=false")) == 0
    return out, prompts


def _targs(tiny_pair_dirs, data, out, *extra):
    return [f"data_dir={data}", f"draft.path={tiny_pair_dirs[1]}", "draft.gguf_file=null", "draft.device=cpu",
            f"output_dir={out}", "head=verifier", "depth=0", "batch_size=2", "grad_accum=1", "epochs=4",
            "lr=3e-2", "eval_fraction=0.25", "patience=4", "threshold=0.5", *extra]


def test_roc_metrics_by_hand():
    scores = torch.tensor([0.9, 0.8, 0.3, 0.6, 0.1])
    ratio = torch.tensor([0.5, 1.1, 0.9, 2.0, float("inf")])  # labels at lam=1: 1 0 1 0 0
    m = V.roc_metrics(scores, ratio, lam=1.0, eta=0.5)
    assert m["tpr_at_eta"] == 0.5 and m["fpr_at_eta"] == pytest.approx(2 / 3)
    assert m["alpha"] == pytest.approx(2 / 3)  # approved among q > p
    assert m["auroc"] == pytest.approx(4 / 6)  # positive/negative pairs ranked right: (0.9>all 3)+(0.3>0.1)
    m12 = V.roc_metrics(scores, ratio, lam=1.2, eta=0.5)  # lam 1.2 makes 1.1 acceptable; alpha stays at lam 1
    assert m12["tpr_at_eta"] == pytest.approx(2 / 3) and m12["alpha"] == pytest.approx(2 / 3)


@pytest.mark.parametrize("feature", ["previous", "previous+embedding", "current"])
def test_verifier_trains_exports_and_decodes(tiny_pair_dirs, labelled, tmp_path, feature):
    data, prompts = labelled
    out = tmp_path / "tr"
    extra = ["roc_lambdas=[1.0,1.5]", "features=cached"] if feature == "previous" else ["features=online"]
    assert train_main(_targs(tiny_pair_dirs, data, out, f"feature={feature}", *extra)) == 0
    meta = read_metadata(out / "head.safetensors")
    width = 64 if feature == "previous+embedding" else 32
    assert meta["head_type"] == "verifier" and meta["head_config"] == {"in_features": width, "depth": 0}
    assert meta["feature"]["position"] == feature and meta["default_threshold"] == 0.5 and meta["lam"] == 1.0
    report = json.loads((out / "metrics.json").read_text())
    assert 0.0 <= report["auroc"] <= 1.0 and (out / "roc.png").stat().st_size > 1000
    assert report["roc_png"] == str(out / "roc.png")
    assert {"tpr_at_eta", "fpr_at_eta", "alpha"} <= set(report)
    if feature == "previous":
        assert sorted(report["by_lambda"]) == ["1", "1.5"]
        assert read_metadata(out / "lambda-1.5" / "head.safetensors")["lam"] == 1.5
        # Same seed, same head.
        again = tmp_path / "again"
        assert train_main(_targs(tiny_pair_dirs, data, again, f"feature={feature}", *extra)) == 0
        a, b = load_head(out / "head.safetensors").module, load_head(again / "head.safetensors").module
        assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    exp = tmp_path / "exp"
    assert export_main([f"train_dir={out}", f"output_dir={exp}"]) == 0
    dec = tmp_path / "dec"
    t, d = tiny_pair_dirs
    assert decode_main([f"target.path={t}", "target.gguf_file=null", f"draft.path={d}", "target.device=cpu",
                        "draft.device=cpu", f"prompts={prompts}", f"output_dir={dec}", "max_new_tokens=12",
                        "num_prompts=3", "policy=sprinter", f"head={exp / 'head.safetensors'}"]) == 0
    rows = [json.loads(x) for x in (dec / "outputs.jsonl").read_text().splitlines()]
    assert len(rows) == 3
    stats = [r["stats"] for r in rows]
    assert sum(s["verifier_calls"] for s in stats) > 0
    assert all(s["target_calls"] <= s["new_tokens"] for s in stats)


def test_train_refuses_acceptance_data_for_a_verifier(tiny_pair_dirs, tmp_path, capsys):
    from test_datagen import _args as acc_args

    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "the cat"}) + "\n" + json.dumps({"prompt": "a dog"}) + "\n")
    data = tmp_path / "acc"
    assert datagen_main(acc_args(tiny_pair_dirs, prompts, data)) == 0
    capsys.readouterr()
    assert train_main(_targs(tiny_pair_dirs, data, tmp_path / "tr")) == 2
    assert "labels=sprinter" in capsys.readouterr().err


def test_decode_sprinter_needs_a_verifier_head(tiny_pair_dirs, labelled, tmp_path, capsys):
    data, prompts = labelled
    t, d = tiny_pair_dirs
    code = decode_main([f"target.path={t}", "target.gguf_file=null", f"draft.path={d}", "target.device=cpu",
                        "draft.device=cpu", f"prompts={prompts}", f"output_dir={tmp_path / 'dec'}",
                        "policy=sprinter"])
    assert code == 2 and "verifier head" in capsys.readouterr().err
