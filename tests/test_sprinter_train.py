"""SPRINTER verifier: training on ratio labels (three features, ROC for several lambda), export, decoding."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import SPRINTER_PROMPTS, datagen_args, sprinter_args

from specheads.datagen.cli import main as datagen_main
from specheads.decode.decode_cli import main as decode_main
from specheads.export import load_head, read_metadata
from specheads.export.cli import main as export_main
from specheads.train import verifier_data as V
from specheads.train.cli import main as train_main


@pytest.fixture(scope="module")
def labelled(tmp_path_factory, tiny_pair_dirs):
    root = tmp_path_factory.mktemp("sprinter")
    prompts = root / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": w}) + "\n" for w in SPRINTER_PROMPTS * 2))
    out = root / "dg"
    assert (
        datagen_main(sprinter_args(tiny_pair_dirs, prompts, out, "max_new_tokens=10", "sampling.do_sample=false")) == 0
    )
    return out, prompts


def _targs(tiny_pair_dirs, data, out, *extra):
    return [
        f"data_dir={data}",
        f"draft.path={tiny_pair_dirs[1]}",
        "draft.gguf_file=null",
        "draft.device=cpu",
        f"output_dir={out}",
        "head=verifier",
        "depth=0",
        "batch_size=2",
        "grad_accum=1",
        "epochs=4",
        "lr=3e-2",
        "eval_fraction=0.25",
        "patience=4",
        "threshold=0.5",
        *extra,
    ]


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
    extra = ["verifier.roc_lambdas=[1.0,1.5]", "features=cached"] if feature == "previous" else ["features=online"]
    assert train_main(_targs(tiny_pair_dirs, data, out, f"verifier.feature={feature}", *extra)) == 0
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
        assert train_main(_targs(tiny_pair_dirs, data, again, f"verifier.feature={feature}", *extra)) == 0
        a, b = load_head(out / "head.safetensors").module, load_head(again / "head.safetensors").module
        assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    exp = tmp_path / "exp"
    assert export_main([f"train_dir={out}", f"output_dir={exp}"]) == 0
    dec = tmp_path / "dec"
    t, d = tiny_pair_dirs
    assert (
        decode_main(
            [
                f"target.path={t}",
                "target.gguf_file=null",
                f"draft.path={d}",
                "target.device=cpu",
                "draft.device=cpu",
                f"prompts={prompts}",
                f"output_dir={dec}",
                "max_new_tokens=12",
                "num_prompts=3",
                "policy=sprinter",
                f"sprinter.head={exp / 'head.safetensors'}",
            ]
        )
        == 0
    )
    rows = [json.loads(x) for x in (dec / "outputs.jsonl").read_text().splitlines()]
    assert len(rows) == 3
    stats = [r["stats"] for r in rows]
    assert sum(s["verifier_calls"] for s in stats) > 0
    assert all(s["target_calls"] <= s["new_tokens"] for s in stats)


def test_train_refuses_acceptance_data_for_a_verifier(tiny_pair_dirs, tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "the cat"}) + "\n" + json.dumps({"prompt": "a dog"}) + "\n")
    data = tmp_path / "acc"
    assert datagen_main(datagen_args(tiny_pair_dirs, prompts, data)) == 0
    capsys.readouterr()
    assert train_main(_targs(tiny_pair_dirs, data, tmp_path / "tr")) == 2
    assert "labels=sprinter" in capsys.readouterr().err


def test_decode_sprinter_needs_a_verifier_head(tiny_pair_dirs, labelled, tmp_path, capsys):
    data, prompts = labelled
    t, d = tiny_pair_dirs
    code = decode_main(
        [
            f"target.path={t}",
            "target.gguf_file=null",
            f"draft.path={d}",
            "target.device=cpu",
            "draft.device=cpu",
            f"prompts={prompts}",
            f"output_dir={tmp_path / 'dec'}",
            "policy=sprinter",
        ]
    )
    assert code == 2 and "verifier head" in capsys.readouterr().err


@pytest.fixture(scope="module")
def verifier_file(tiny_pair_dirs, labelled, tmp_path_factory):
    data, _ = labelled
    root = tmp_path_factory.mktemp("verifier")
    assert train_main(_targs(tiny_pair_dirs, data, root / "tr", "features=cached")) == 0
    assert export_main([f"train_dir={root / 'tr'}", f"output_dir={root / 'exp'}"]) == 0
    return root / "exp" / "head.safetensors"


def test_flops_by_hand(tiny_pair):
    from specheads.evaluate.quality import flops, matmul_parameters

    target, _ = tiny_pair
    n = sum(p.numel() for p in target.parameters()) - target.get_input_embeddings().weight.numel()  # untied
    assert matmul_parameters(target) == n
    assert flops(target, tokens=3, context=6) == 2.0 * n * 3 + 2.0 * 2 * 32 * 6  # 2 layers, d_attn 32


def test_verifier_errors_by_hand(tiny_pair):
    from specheads.evaluate.quality import verifier_errors
    from specheads.shim.core.sampling import SamplingConfig

    target, draft = tiny_pair
    prompt, output = [1, 5, 6], [7, 8, 9, 10]
    decisions = [(3, 11, True), (4, 12, False), (5, 13, True), (6, 14, True)]
    seq = prompt + output
    bad, approved_bad, tvs = 0, 0, []
    with torch.no_grad():
        for pos, tok, ok in decisions:
            ids = torch.tensor([seq[:pos]])
            q = draft(input_ids=ids).logits[0, -1].softmax(-1)
            p = target(input_ids=ids).logits[0, -1].softmax(-1)
            tvs.append(0.5 * float((p - q).abs().sum()))
            if q[tok] > p[tok]:
                bad += 1
                approved_bad += ok
    got = verifier_errors(target, draft, [prompt], [output], [decisions], SamplingConfig(do_sample=False), pad=2)
    assert got["decisions"] == 4 and got["approved"] == 3 and got["unacceptable"] == bad
    assert got["alpha"] == (pytest.approx(approved_bad / bad, abs=1e-4) if bad else None)
    assert got["mean_tv"] == pytest.approx(sum(tvs) / 4, abs=1e-4)
    # several outputs in batches of 2 (memory stays bounded) count as one pass over all of them
    many = verifier_errors(
        target, draft, [prompt] * 5, [output] * 5, [decisions] * 5, SamplingConfig(do_sample=False), pad=2, batch_size=2
    )
    assert many["decisions"] == 20 and many["approved"] == 15 and many["unacceptable"] == 5 * bad
    assert many["mean_tv"] == pytest.approx(got["mean_tv"], abs=1e-4)


def test_eval_compares_sprinter_with_sd(tiny_pair_dirs, labelled, verifier_file, tmp_path):
    from specheads.evaluate.cli import main as eval_main

    _, prompts = labelled
    t, d = tiny_pair_dirs
    out = tmp_path / "ev"
    assert (
        eval_main(
            [
                f"target.path={t}",
                "target.gguf_file=null",
                f"draft.path={d}",
                "target.device=cpu",
                "draft.device=cpu",
                f"prompts={prompts}",
                f"output_dir={out}",
                "max_new_tokens=12",
                "num_prompts=4",
                "ks=[1,2]",
                "head=null",
                f"sprinter.head={verifier_file}",
                "sprinter.etas=[0.0,0.5,1.0]",
            ]
        )
        == 0
    )
    summary = json.loads((out / "sweep.json").read_text())
    by = {r["config"]: r for r in summary["table"]}
    assert set(by) == {"ar", "draft", "k1", "k2", "s0", "s0.5", "s1"}
    assert by["k1"]["rouge_vs_target"]["rougeL"] == 1.0  # greedy SD is lossless
    assert by["ar"]["verifier_calls_per_token"] == 0 and by["s0.5"]["verifier_calls_per_token"] > 0
    assert all(r["gflops_per_token"] > 0 for r in summary["table"])
    sp = summary["sprinter"]
    assert sp["main"] == "s0" and set(sp["ratios"]) == {
        "target_calls_sd_over_sprinter",
        "sprinter_vs_sd_tokens_per_s",
        "flops_sd_over_sprinter",
    }
    # eta = 0 approves every scored token: alpha 1 (when any is unacceptable); eta = 1 approves none: alpha 0
    assert sp["by_eta"]["s0"]["alpha"] in (1.0, None) and sp["by_eta"]["s1"]["alpha"] in (0.0, None)
    assert sp["by_eta"]["s1"]["approved"] == 0
    # eta = 0 runs max_run approved tokens per target call
    assert by["s0"]["verification_rate"] < by["k1"]["verification_rate"]
