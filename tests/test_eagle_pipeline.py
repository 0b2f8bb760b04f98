"""The EAGLE drafter end to end on the tiny pair: labels=drafter data, heads-train head=eagle, heads-decode eagle=."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import LABEL_PROMPTS, chunk_rows, datagen_args, same_heads
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from specheads.datagen.cli import main as datagen_main
from specheads.decode.decode_cli import main as decode_main
from specheads.shim.costs.cost_table import CostTable
from specheads.train.cli import main as train_main

PROMPTS = LABEL_PROMPTS


def drafter_args(pair_dirs, prompts, out, *extra):
    return datagen_args(
        pair_dirs,
        prompts,
        out,
        "labels=drafter",
        "sampling.do_sample=false",
        "max_new_tokens=8",
        "drafter.top_k=5",
        *extra,
    )


@pytest.fixture(scope="module")
def drafter_data(tmp_path_factory, tiny_pair_dirs):
    root = tmp_path_factory.mktemp("drafter")
    prompts = root / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": w}) + "\n" for w in PROMPTS))
    out = root / "dg"
    assert datagen_main(drafter_args(tiny_pair_dirs, prompts, out)) == 0
    return prompts, out


def test_drafter_data_holds_the_targets_states_and_distributions(drafter_data, tiny_pair_dirs):
    _, out = drafter_data
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["labels"] == "drafter" and manifest["drafter"]["layers"] == [1]
    assert manifest["prompts"] == len(PROMPTS) and manifest["disk_mb_per_100k_tokens"] > 0
    target = AutoModelForCausalLM.from_pretrained(tiny_pair_dirs[0], dtype=torch.float32).eval()
    rows = chunk_rows(out)
    side = load_file(str(out / "states" / "chunk-000000.safetensors"))
    for i, row in enumerate(rows[:2]):  # chunk 0 holds the first two prompts
        ids, start = row["input_ids"], row["response_start"]
        with torch.no_grad():
            ref = target(torch.tensor([ids]), output_hidden_states=True)
        states = side["states"][side["offsets"][i] : side["offsets"][i + 1]].float()
        torch.testing.assert_close(states, ref.hidden_states[1][0], atol=2e-3, rtol=2e-3)  # stored in fp16
        tops = side["top_ids"][side["response_offsets"][i] : side["response_offsets"][i + 1]]
        assert tops[:, 0].tolist() == ids[start:]  # greedy: each response token is the target's top-1
        want = ref.logits[0, start - 1 : len(ids) - 1].float().log_softmax(-1).topk(5).values
        logp = side["top_logp"][side["response_offsets"][i] : side["response_offsets"][i + 1]]
        torch.testing.assert_close(logp, want, atol=1e-4, rtol=1e-4)


def test_drafter_data_is_reproducible(drafter_data, tiny_pair_dirs, tmp_path):
    prompts, out = drafter_data
    again = tmp_path / "again"
    assert datagen_main(drafter_args(tiny_pair_dirs, prompts, again)) == 0
    for name in ("states/chunk-000000.safetensors", "data/chunk-000000.parquet"):
        assert (out / name).read_bytes() == (again / name).read_bytes()


def eagle_args(pair_dirs, data, out, *extra):
    return [
        f"data_dir={data}",
        "head=eagle",
        f"target.path={pair_dirs[0]}",
        "target.gguf_file=null",
        "target.device=cpu",
        f"output_dir={out}",
        "batch_size=2",
        "grad_accum=1",
        "epochs=2",
        "lr=3e-3",
        "eval_fraction=0.3",
        "patience=2",
        "eagle.ttt_steps=2",
        "vocab_top_n=20",
        *extra,
    ]


@pytest.fixture(scope="module")
def trained(drafter_data, tiny_pair_dirs, tmp_path_factory):
    out = tmp_path_factory.mktemp("eagle") / "train"
    assert train_main(eagle_args(tiny_pair_dirs, drafter_data[1], out)) == 0
    return out


def test_the_head_trains_exports_and_reports_its_steps(trained):
    metrics = json.loads((trained / "metrics.json").read_text())
    assert {"accept_length", "acc_step1", "acc_step2", "in_vocab_share"} <= set(metrics)
    from specheads.export import read_metadata

    meta = read_metadata(trained / "head.safetensors")
    assert meta["head_type"] == "eagle" and meta["feature"]["layers"] == [1]
    assert meta["head_config"]["draft_vocab_size"] == meta["draft_vocab"]["size"] <= 20
    assert meta["target"]["fingerprint"]


def test_same_seed_same_head(trained, drafter_data, tiny_pair_dirs, tmp_path):
    again = tmp_path / "again"
    assert train_main(eagle_args(tiny_pair_dirs, drafter_data[1], again)) == 0
    same_heads(trained, again)


@pytest.mark.parametrize(
    "bad, message",
    [
        ("eagle.ttt_steps=0", "ttt_steps"),
        ("vocab_top_n=0", "vocab_top_n"),
        ("target.path=", "target.path"),
        ("eagle.init_head=/no/such/head.safetensors", "init_head"),
        ("eagle.decoder_layers=0", "decoder_layers"),
    ],
)
def test_bad_settings_are_one_line_errors(bad, message, drafter_data, tiny_pair_dirs, tmp_path, capsys):
    assert train_main(eagle_args(tiny_pair_dirs, drafter_data[1], tmp_path / "x", bad)) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


def test_init_head_continues_from_a_trained_head(trained, drafter_data, tiny_pair_dirs, tmp_path):
    """With a vanishing learning rate the run's head is the head it started from (weights and vocabulary subset),
    not the head the target's own layers start."""
    start = trained / "head.safetensors"
    out = tmp_path / "more"
    assert (
        train_main(eagle_args(tiny_pair_dirs, drafter_data[1], out, f"eagle.init_head={start}", "lr=1e-12", "epochs=1"))
        == 0
    )
    a, b = load_file(str(start)), load_file(str(out / "head.safetensors"))
    assert a.keys() == b.keys() and all(torch.allclose(a[k].float(), b[k].float(), atol=1e-6) for k in a)
    fresh = load_file(str(_fresh_head(tiny_pair_dirs, drafter_data, tmp_path)))  # the same run without init_head
    assert not torch.allclose(fresh["fc.weight"].float(), a["fc.weight"].float(), atol=1e-3)


def test_a_grown_head_drafts_as_the_head_it_grew_from(trained, drafter_data, tiny_pair_dirs, tmp_path):
    """eagle.decoder_layers=2 on a one-layer init_head keeps its layer and adds one whose output projections start at
    zero: with a vanishing learning rate its scores are the one-layer head's. Back to one layer is refused."""
    from specheads.export.package import load_head
    from specheads.heads.eagle_head import unrolled_forward

    start, out = trained / "head.safetensors", tmp_path / "grown"
    args = eagle_args(tiny_pair_dirs, drafter_data[1], out, f"eagle.init_head={start}", "lr=1e-12", "epochs=1")
    assert train_main([*args, "eagle.decoder_layers=2"]) == 0
    one, two = load_head(str(start)).module, load_head(str(out / "head.safetensors")).module
    assert one.num_layers == 1 and two.num_layers == 2 and two.config()["num_layers"] == 2
    assert float(two.layers[1].self_attn.q_proj.weight.abs().sum()) > 0  # the target's last layer, not zeros
    g = torch.Generator().manual_seed(0)
    states = torch.randn(1, 9, len(one.layer_ids) * one.hidden_size, generator=g)
    embeds = torch.randn(2, 1, 9, one.hidden_size, generator=g)
    rows = [torch.ones(1, 9, dtype=torch.bool)] * 2
    for a, b in zip(
        unrolled_forward(one, states, embeds, None, rows), unrolled_forward(two, states, embeds, None, rows)
    ):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    back = tmp_path / "back"
    assert (
        train_main(eagle_args(tiny_pair_dirs, drafter_data[1], back, f"eagle.init_head={out / 'head.safetensors'}"))
        == 2
    )


def _fresh_head(tiny_pair_dirs, drafter_data, tmp_path):
    out = tmp_path / "fresh"
    assert train_main(eagle_args(tiny_pair_dirs, drafter_data[1], out, "lr=1e-12", "epochs=1")) == 0
    return out / "head.safetensors"


def test_heads_decode_with_the_head_equals_the_target_alone(trained, tiny_pair_dirs, drafter_data, tmp_path):
    prompts = drafter_data[0]
    common = [
        f"target.path={tiny_pair_dirs[0]}",
        "target.gguf_file=null",
        f"draft.path={tiny_pair_dirs[1]}",
        f"prompts={prompts}",
        "max_new_tokens=12",
        "num_prompts=4",
    ]
    assert decode_main([*common, "policy=ar", f"output_dir={tmp_path / 'ar'}"]) == 0
    assert (
        decode_main(
            [
                *common,
                "policy=sd",
                "sd.k=3",
                f"eagle={trained / 'head.safetensors'}",
                f"output_dir={tmp_path / 'eagle'}",
            ]
        )
        == 0
    )
    assert (
        decode_main(
            [
                *common,
                "policy=tree",
                "tree.k=3",
                "tree.tree_width=2",
                "tree.tree_nodes=5",
                f"eagle={trained / 'head.safetensors'}",
                f"output_dir={tmp_path / 'tree'}",
            ]
        )
        == 0
    )
    assert (
        decode_main(
            [
                *common,
                "policy=sd",
                "sd.k=3",
                "batch_size=3",
                f"eagle={trained / 'head.safetensors'}",
                f"output_dir={tmp_path / 'batched'}",
            ]
        )
        == 0
    )
    rows = lambda d: [json.loads(x) for x in (tmp_path / d / "outputs.jsonl").read_text().splitlines()]  # noqa: E731
    read = lambda d: [r["tokens"] for r in sorted(rows(d), key=lambda r: r["index"])]  # noqa: E731
    assert read("eagle") == read("ar") == read("tree") == read("batched")
    metrics = json.loads((tmp_path / "eagle" / "metrics.json").read_text())
    assert metrics.get("drafted", metrics.get("totals", {}).get("drafted", 1)) > 0


def test_a_drafter_layer_past_the_targets_depth_is_a_one_line_error(tiny_pair_dirs, tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "the cat"}) + "\n")
    assert datagen_main(drafter_args(tiny_pair_dirs, prompts, tmp_path / "x", "drafter.layers=[5]")) == 2
    err = capsys.readouterr().err.strip()
    assert "layer" in err and len(err.splitlines()) == 1


@pytest.mark.parametrize(
    "extra,message",
    [
        ([], "EAGLE head"),
        (["sampling.do_sample=true", "eagle=X"], "greedy only"),
        (["tree.tree_nodes=0", "eagle=X"], "tree_nodes=0"),
    ],
)
def test_tree_settings_are_one_line_errors(extra, message, tiny_pair_dirs, tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "the cat"}) + "\n")
    argv = [
        f"target.path={tiny_pair_dirs[0]}",
        "target.gguf_file=null",
        f"prompts={prompts}",
        "policy=tree",
        f"output_dir={tmp_path / 'out'}",
        *extra,
    ]
    assert decode_main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


def test_heads_decode_sizes_trees_by_the_cost_table(trained, tiny_pair_dirs, drafter_data, tmp_path):
    table = tmp_path / "costs.json"  # synthetic: no timing decides a test
    table.write_text(json.dumps(CostTable(t_draft_ms=0.5, t_target_ms=[4 + 0.5 * k for k in range(1, 14)]).to_dict()))
    common = [
        f"target.path={tiny_pair_dirs[0]}",
        "target.gguf_file=null",
        f"prompts={drafter_data[0]}",
        "max_new_tokens=12",
        "num_prompts=4",
    ]
    assert decode_main([*common, "policy=ar", f"output_dir={tmp_path / 'ar'}"]) == 0
    assert (
        decode_main(
            [
                *common,
                "policy=tree",
                "tree.k=4",
                "tree.tree_width=3",
                "tree.tree_nodes=12",
                "tree.stop=cost",
                f"profile={table}",
                f"eagle={trained / 'head.safetensors'}",
                f"output_dir={tmp_path / 't'}",
            ]
        )
        == 0
    )
    read = lambda d: [json.loads(x)["tokens"] for x in (tmp_path / d / "outputs.jsonl").read_text().splitlines()]  # noqa: E731
    assert read("t") == read("ar")
    assert json.loads((tmp_path / "t" / "metrics.json").read_text())["stop"] == "cost"
