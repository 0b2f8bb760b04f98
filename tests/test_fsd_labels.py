"""``heads-datagen labels=fsd`` and the FSD acceptance head on the tiny pair.

Stored divergences against a hand computation from teacher-forced logits, labels against
``div < T``, seeding, the bad settings, and datagen -> train -> export -> ``policy=specdecpp``.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from conftest import chunk_rows, datagen_args

from specheads.datagen.cli import main as datagen
from specheads.export import read_metadata
from specheads.train.cli import main as train

PROMPTS = [
    "the cat sat",
    "a dog ran up",
    "one two three four",
    "why is the sun red",
    "big blue moon",
    "yes no",
    "left right up",
    "who was it",
]
THRESHOLDS = [0.1, 0.2, 0.3, 0.5]
GREEDY = (
    "sampling.do_sample=false",
    "labels=fsd",
    "fsd.divergences=[js,tv,kl]",
    f"fsd.thresholds=[{','.join(map(str, THRESHOLDS))}]",
    "max_new_tokens=8",
)


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    path = tmp_path_factory.mktemp("fsd") / "p.jsonl"
    path.write_text("".join(json.dumps({"prompt": w}) + "\n" for w in PROMPTS))
    return path


@pytest.fixture(scope="module")
def greedy_data(tmp_path_factory, tiny_pair_dirs, prompts):
    out = tmp_path_factory.mktemp("fsd") / "dg"
    assert datagen(datagen_args(tiny_pair_dirs, prompts, out, *GREEDY)) == 0
    return out


def _models(pair_dirs):
    from transformers import AutoModelForCausalLM

    return [AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32).eval() for d in pair_dirs]


@torch.no_grad()
def _teacher_forced(model, row) -> torch.Tensor:
    """fp64 logits ``[n, V]`` of the response positions: row ``j`` predicts response token ``j``."""
    start, ids = row["response_start"], row["input_ids"]
    logits = model(input_ids=torch.tensor([ids])).logits[0].double()
    return logits[start - 1 : len(ids) - 1]


def _kl(a, b):
    return torch.where(a > 0, a * (a / b).log(), torch.zeros_like(a)).sum(-1)


def _by_hand(name: str, p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    if name == "tv":
        return 0.5 * (p - q).abs().sum(-1)
    if name == "kl":
        return _kl(p, q)
    m = 0.5 * (p + q)
    return 0.5 * _kl(p, m) + 0.5 * _kl(q, m)


def test_divergences_match_a_hand_computation_and_labels_are_div_below_t(greedy_data, tiny_pair_dirs):
    rows = chunk_rows(greedy_data)
    target, draft = _models(tiny_pair_dirs)
    for row in rows[:3]:  # a few prompts by hand, every token of them
        p = _teacher_forced(target, row).softmax(-1)
        q = _teacher_forced(draft, row).softmax(-1)
        assert row["draft_token"] == q.argmax(-1).tolist()  # greedy drafting
        for name in ("js", "tv", "kl"):
            torch.testing.assert_close(
                torch.tensor(row[f"div_{name}"], dtype=torch.float64), _by_hand(name, p, q), rtol=1e-4, atol=1e-5
            )
    manifest = json.loads((greedy_data / "manifest.json").read_text())
    fsd = manifest["fsd"]
    assert fsd["dist"] == "raw" and fsd["top_k"] == 0 and fsd["thresholds"] == THRESHOLDS
    assert fsd["tokens"] == manifest["labelled_tokens"] == sum(len(r["div_js"]) for r in rows)
    for name in ("js", "tv", "kl"):
        divs = [v for r in rows for v in r[f"div_{name}"]]
        assert all(v >= 0 for v in divs)
        for t in THRESHOLDS:
            labels = [v for r in rows for v in r[fsd["label_columns"][f"{name}@{t:g}"]]]
            assert labels == [v < t for v in divs]
            assert fsd["label_mean"][name][f"{t:g}"] == pytest.approx(sum(labels) / len(labels))
    means = [fsd["label_mean"]["js"][f"{t:g}"] for t in THRESHOLDS]
    assert 0 < means[1] < 1 and means == sorted(means)  # a real mix of accept and reject; monotone in T


def test_sampled_warped_labels_are_seeded_and_match_the_warped_distributions(tiny_pair_dirs, prompts, tmp_path):
    sampled = (
        "labels=fsd",
        "sampling.do_sample=true",
        "sampling.temperature=0.8",
        "sampling.top_k=20",
        "fsd.dist=warped",
        "fsd.top_k=5",
        "fsd.divergences=[js,tv]",
        "fsd.thresholds=[0.2,0.4]",
        "num_prompts=4",
    )
    runs = {}
    for name, seed in (("a", 3), ("b", 3), ("c", 4)):
        assert datagen(datagen_args(tiny_pair_dirs, prompts, tmp_path / name, *sampled, f"seed={seed}")) == 0
        runs[name] = chunk_rows(tmp_path / name)
    assert runs["a"] == runs["b"]
    assert [r["draft_token"] for r in runs["a"]] != [r["draft_token"] for r in runs["c"]]
    manifest = json.loads((tmp_path / "a" / "manifest.json").read_text())
    assert manifest["fsd"]["dist"] == "warped" and manifest["fsd"]["top_k"] == 5
    target, draft = _models(tiny_pair_dirs)

    def warped(logits):  # temperature, then the 20 most likely tokens
        x = logits / 0.8
        kth = x.topk(20, dim=-1).values[..., -1:]
        return x.masked_fill(x < kth, float("-inf")).softmax(-1)

    row = runs["a"][0]
    p, q = warped(_teacher_forced(target, row)), warped(_teacher_forced(draft, row))
    top = p.topk(5, dim=-1).indices  # the target's top 5 plus one bucket for the rest
    pk, qk = p.gather(-1, top), q.gather(-1, top)
    pb, qb = torch.cat([pk, 1 - pk.sum(-1, keepdim=True)], -1), torch.cat([qk, 1 - qk.sum(-1, keepdim=True)], -1)
    for name in ("js", "tv"):
        torch.testing.assert_close(
            torch.tensor(row[f"div_{name}"], dtype=torch.float64), _by_hand(name, pb, qb), rtol=1e-4, atol=1e-5
        )
        assert row[f"fsd_{name}@0.4"] == [v < 0.4 for v in row[f"div_{name}"]]


def _error(capsys, prog: str) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"{prog}: error: "), err
    return err[0]


@pytest.mark.parametrize(
    "setting, message",
    [
        ("fsd.divergences=[js,hellinger]", "choose one or more of"),
        ("fsd.thresholds=[]", "fsd.thresholds is empty"),
        ("fsd.thresholds=[0.3,-0.1]", "must be finite and >= 0"),
        ("fsd.dist=warped", "one-hot"),
        ("fsd.top_k=-1", "fsd.top_k=-1"),
    ],
)
def test_bad_datagen_settings_are_one_line_errors(tiny_pair_dirs, prompts, tmp_path, capsys, setting, message):
    args = datagen_args(tiny_pair_dirs, prompts, tmp_path / "bad", *GREEDY, setting)
    assert datagen(args) == 2
    assert message in _error(capsys, "heads-datagen")


def _targs(tiny_pair_dirs, data, out, *extra):
    return [
        f"data_dir={data}",
        f"draft.path={tiny_pair_dirs[1]}",
        "draft.gguf_file=null",
        "draft.device=cpu",
        f"output_dir={out}",
        "batch_size=2",
        "grad_accum=1",
        "epochs=2",
        "lr=1e-2",
        "eval_fraction=0.25",
        "depth=1",
        "w_rej=1.0",
        "acceptance.label=fsd",
        *extra,
    ]


def test_bad_train_settings_are_one_line_errors(tiny_pair_dirs, prompts, greedy_data, tmp_path, capsys):
    cases = [
        ("acceptance.fsd_label=js@0.25", "is not in"),
        ("acceptance.fsd_label=hellinger@0.3", "unknown divergence"),
        ("acceptance.fsd_label=js@-1", ">= 0"),
        ("acceptance.fsd_label=js", "<divergence>@<threshold>"),
        ("acceptance.label=fsd", "acceptance.fsd_label=''"),
    ]  # acceptance.label=fsd without acceptance.fsd_label
    for setting, message in cases:
        assert train(_targs(tiny_pair_dirs, greedy_data, tmp_path / "t", setting, "overwrite=true")) == 2
        assert message in _error(capsys, "heads-train")
    # labels=acceptance data with the same seed: the same draws and SD labels, but no FSD decisions
    acc = tmp_path / "acc"
    assert datagen(datagen_args(tiny_pair_dirs, prompts, acc, "sampling.do_sample=false", "max_new_tokens=8")) == 0
    keep = ("prompt_index", "input_ids", "draft_token", "label", "expected_label")
    assert [{k: r[k] for k in keep} for r in chunk_rows(acc)] == [
        {k: r[k] for k in keep} for r in chunk_rows(greedy_data)
    ]
    capsys.readouterr()
    assert train(_targs(tiny_pair_dirs, acc, tmp_path / "t2", "acceptance.fsd_label=js@0.2")) == 2
    assert "needs labels=fsd data" in _error(capsys, "heads-train")


def test_fsd_head_end_to_end_drives_specdecpp_losslessly(tiny_pair_dirs, greedy_data, prompts, tmp_path):
    from specheads.decode.decode_cli import main as decode
    from specheads.export.cli import main as export

    shutil.rmtree(greedy_data / "features", ignore_errors=True)
    assert (
        train(_targs(tiny_pair_dirs, greedy_data, tmp_path / "tr", "acceptance.fsd_label=js@0.2", "features=cached"))
        == 0
    )
    assert export([f"train_dir={tmp_path / 'tr'}", f"output_dir={tmp_path / 'ex'}", "threshold=0.5"]) == 0
    head = tmp_path / "ex" / "head.safetensors"
    meta = read_metadata(head)
    assert meta["head_type"] == "acceptance" and meta["label"] == "fsd"
    assert meta["feature"]["position"] == "previous"  # Div(p_i, q_i) depends on the prefix alone
    assert {k: meta["fsd"][k] for k in ("divergence", "threshold", "dist", "top_k")} == {
        "divergence": "js",
        "threshold": 0.2,
        "dist": "raw",
        "top_k": 0,
    }
    cached = [p.name for p in next((greedy_data / "features").iterdir()).iterdir()]
    assert sorted(cached) == ["epoch-0.safetensors", "epoch-4095.safetensors"]  # no mixing: one training file
    t, d = tiny_pair_dirs
    common = [
        f"target.path={t}",
        "target.gguf_file=null",
        f"draft.path={d}",
        "target.device=cpu",
        "draft.device=cpu",
        f"prompts={prompts}",
        "num_prompts=null",
        "max_new_tokens=16",
    ]
    assert (
        decode(
            [
                *common,
                "policy=specdecpp",
                f"specdecpp.head={head}",
                "specdecpp.k_min=1",
                f"output_dir={tmp_path / 'pp'}",
            ]
        )
        == 0
    )
    assert decode([*common, "policy=ar", f"output_dir={tmp_path / 'ar'}"]) == 0
    outs = {
        n: [json.loads(x)["tokens"] for x in (tmp_path / n / "outputs.jsonl").read_text().splitlines()]
        for n in ("pp", "ar")
    }
    assert outs["pp"] == outs["ar"] and len(outs["pp"]) == len(PROMPTS)
    summary = json.loads((tmp_path / "pp" / "metrics.json").read_text())
    assert summary["threshold"] == 0.5 and summary["target_calls"] < summary["new_tokens"]
    # The same head stopping FSD's drafting: with rule=or and T=0 FSD verifies as SD does, so the
    # tokens and the rounds (the head's stopping decisions) are SpecDec++'s exactly.
    assert (
        decode(
            [
                *common,
                "policy=fsd",
                f"fsd.head={head}",
                "fsd.k_min=1",
                "fsd.fsd_rule=or",
                "fsd.T=0",
                f"output_dir={tmp_path / 'fsd'}",
            ]
        )
        == 0
    )
    fsd_out = [json.loads(x)["tokens"] for x in (tmp_path / "fsd" / "outputs.jsonl").read_text().splitlines()]
    assert fsd_out == outs["ar"]
    assert json.loads((tmp_path / "fsd" / "metrics.json").read_text())["target_calls"] == summary["target_calls"]
