"""``heads-decode engine=vllm``: settings checked in one line; with vLLM (``SPECHEADS_VLLM_PYTHON``: the python of
vLLM's virtualenv, as ``.ci/run``'s vLLM step sets it), the same recipe decoded by vLLM gives the shim's greedy
tokens, for the target alone and through the proposer, on a tiny pair and on the shared GGUF target (converted
once to a cached Hugging Face directory)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from conftest import SHARED
from in_vllm.pair import save_pair

from specheads.decode.decode_cli import main as decode_main

VLLM_PYTHON = os.environ.get("SPECHEADS_VLLM_PYTHON")
needs_vllm = pytest.mark.skipif(not VLLM_PYTHON, reason="SPECHEADS_VLLM_PYTHON (vLLM's python) is not set")


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm_decode")
    save_pair(root)
    prompts = root / "p.jsonl"
    prompts.write_text(
        "".join(
            json.dumps({"prompt": t}) + "\n"
            for t in ["the cat sat on", "one two three", "why is the sun", "a big red dog ran"]
        )
    )
    return root, prompts


def args(root, prompts, out, *extra):
    return [
        f"target.path={root / 'target'}",
        "target.gguf_file=null",
        f"draft.path={root / 'draft'}",
        "target.device=cpu",
        "draft.device=cpu",
        f"prompts={prompts}",
        "max_new_tokens=20",
        "chat_template=false",
        f"output_dir={out}",
        *extra,
    ]


def tokens(out: Path) -> list[list[int]]:
    rows = [json.loads(x) for x in (out / "outputs.jsonl").read_text().splitlines()]
    return [r["tokens"] for r in sorted(rows, key=lambda r: r["index"])]


@pytest.mark.parametrize(
    "extra, message",
    [
        (["policy=judge"], "engine=vllm runs policy"),
        (["eagle=h.safetensors"], "does not take eagle="),
        (["stream=true"], "does not stream"),
        (["vllm.python=/nowhere/python"], "does not exist"),
        (["vllm.tensor_parallel=0"], "vllm.tensor_parallel=0 must be >= 1"),
        (["vllm.executor_backend=slurm"], "vllm.executor_backend='slurm'"),
    ],
)
def test_engine_vllm_settings_are_one_line_errors(pair, tmp_path, capsys, extra, message):
    root, prompts = pair
    assert decode_main(args(root, prompts, tmp_path / "x", "engine=vllm", *extra)) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


def test_engine_vllm_without_vllm_is_a_one_line_error(pair, tmp_path, capsys):
    pytest.importorskip("transformers")
    if __import__("importlib").util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed here")
    root, prompts = pair
    assert decode_main(args(root, prompts, tmp_path / "x", "engine=vllm", "policy=ar")) == 2
    assert "vllm.python=" in capsys.readouterr().err


@needs_vllm
def test_vllm_decodes_the_shims_greedy_tokens(pair, tmp_path):
    root, prompts = pair
    assert decode_main(args(root, prompts, tmp_path / "ar", "policy=ar")) == 0
    for policy in (
        ["policy=ar"],
        ["policy=confidence_stop", "confidence_stop.tau=0.3", "confidence_stop.k_max=4"],
        ["policy=sd", "sd.k=2"],
    ):
        out = tmp_path / policy[0]
        assert (
            decode_main(args(root, prompts, out, "engine=vllm", f"vllm.python={VLLM_PYTHON}", "batch_size=2", *policy))
            == 0
        )
        assert tokens(out) == tokens(tmp_path / "ar"), policy
        metrics = json.loads((out / "metrics.json").read_text())
        assert metrics["engine"] == "vllm" and metrics["new_tokens"] == sum(map(len, tokens(out)))
        if policy[0] != "policy=ar":
            assert metrics["tokens_per_call"] > 1 and metrics["acceptance_rate"] > 0
    assert json.loads((tmp_path / "policy=confidence_stop" / "metrics.json").read_text())["proposer"]["candidates"] > 0


@needs_vllm
def test_serving_settings_and_a_draft_cache_budget_keep_the_targets_tokens(pair, tmp_path):
    """The vllm_* settings reach LLM (recorded in metrics.json); a draft cache of 32 tokens per row makes the
    proposer draft from windows of the longer requests, and the output is still the target alone's."""
    root, prompts = pair
    assert decode_main(args(root, prompts, tmp_path / "ar", "policy=ar")) == 0
    out = tmp_path / "budget"
    run = [
        "engine=vllm",
        f"vllm.python={VLLM_PYTHON}",
        "batch_size=2",
        "policy=confidence_stop",
        "confidence_stop.tau=0.3",
        "confidence_stop.k_max=4",
        "target.dtype=float32",
        "vllm.enforce_eager=true",
        "vllm.executor_backend=uni",
        "vllm.draft_cache_mb=0.125",  # 2 rows x 32 tokens x 2 KiB (2 layers, 2 KV heads of 64, fp32)
    ]
    assert decode_main(args(root, prompts, out, *run)) == 0
    assert tokens(out) == tokens(tmp_path / "ar")
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["serving"] == {
        "dtype": "float32",
        "tensor_parallel_size": 1,
        "pipeline_parallel_size": 1,
        "distributed_executor_backend": "uni",
        "enforce_eager": True,
    }
    assert metrics["speculative"]["specheads"]["cache_mb"] == 0.125
    assert metrics["proposer"]["windowed"] > 0 and metrics["proposer"]["candidates"] > 0


@needs_vllm
def test_the_gguf_target_is_converted_once(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECHEADS_CACHE", str(tmp_path / "cache"))
    target = SHARED / "models/smollm2-135m-instruct"
    common = [
        f"target.path={target}",
        "target.gguf_file=SmolLM2-135M-Instruct.Q4_1.gguf",
        "policy=ar",
        f"prompts={SHARED / 'data/gsm8k/test.jsonl'}",
        "num_prompts=2",
        "max_new_tokens=16",
    ]
    assert decode_main([*common, f"output_dir={tmp_path / 'ours'}"]) == 0
    assert decode_main([*common, "engine=vllm", f"vllm.python={VLLM_PYTHON}", f"output_dir={tmp_path / 'v1'}"]) == 0
    converted = list((tmp_path / "cache" / "vllm").iterdir())
    assert len(converted) == 1 and (converted[0] / "config.json").is_file()
    stamp = (converted[0] / "config.json").stat().st_mtime
    assert decode_main([*common, "engine=vllm", f"vllm.python={VLLM_PYTHON}", f"output_dir={tmp_path / 'v2'}"]) == 0
    assert (converted[0] / "config.json").stat().st_mtime == stamp  # reused, not converted again
    assert tokens(tmp_path / "v1") == tokens(tmp_path / "v2") == tokens(tmp_path / "ours")


def test_vllm_cost_table_from_the_profilers_samples():
    from specheads.decode.vllm_costs import table_from_samples
    from specheads.errors import UserError
    from specheads.shim.costs.cost_table import CostTable

    samples = {
        "t_t 1 1": [30.0, 31.0, 29.0],
        "t_t 1 2": [33.0],
        "t_t 1 4": [40.0],
        "t_d 1": [2.0, 2.2],
        "t_t 2 1": [35.0],
        "t_t 2 2": [45.0],
        "t_t 2 3": [50.0],
        "t_t 2 4": [60.0],
    }
    fields = table_from_samples(samples, [2], k_max=3)
    assert fields["t_target_ms"] == [30.0, 33.0, 33.0, 40.0]  # k = 3 untimed: its neighbour's price
    assert fields["t_draft_ms"] == pytest.approx(2.1) and fields["t_draft_batch_ms"] == [pytest.approx(2.1)]
    table = CostTable.from_dict(fields)
    assert table.t_target(2, batch=2) == 45.0 and table.round_ms(1, batch=2) == pytest.approx(2.1 + 45.0)
    with pytest.raises(UserError, match="batch 4"):
        table_from_samples(samples, [2, 4], k_max=3)


@needs_vllm
def test_stop_cost_in_vllm_prices_vllms_steps_once(pair, tmp_path, monkeypatch):
    """stop=cost: the proposer's cost table is measured in vLLM (batch 1 and 2), cached, reused; output lossless."""
    monkeypatch.setenv("SPECHEADS_CACHE", str(tmp_path / "cache"))
    root, prompts = pair
    assert decode_main(args(root, prompts, tmp_path / "ar", "policy=ar")) == 0
    run = [
        "engine=vllm",
        f"vllm.python={VLLM_PYTHON}",
        "batch_size=2",
        "policy=confidence_stop",
        "confidence_stop.stop=cost",
        "confidence_stop.k_max=3",
    ]
    assert decode_main(args(root, prompts, tmp_path / "c1", *run)) == 0
    tables = list((tmp_path / "cache" / "costs").glob("vllm-*.json"))
    assert len(tables) == 1
    table = json.loads(tables[0].read_text())
    assert table["batches"] == [2] and len(table["t_target_ms"]) == 4 and len(table["t_target_batch_ms"][0]) == 4
    assert all(t > 0 for t in table["t_target_ms"]) and table["target_runner"].startswith("vllm")
    stamp = tables[0].stat().st_mtime
    assert decode_main(args(root, prompts, tmp_path / "c2", *run)) == 0
    assert tables[0].stat().st_mtime == stamp
    assert tokens(tmp_path / "c1") == tokens(tmp_path / "c2") == tokens(tmp_path / "ar")
    metrics = json.loads((tmp_path / "c1" / "metrics.json").read_text())
    assert metrics["speculative"]["specheads"]["costs"] == str(tables[0])


def eval_args(root, prompts, out, *extra):
    return [
        f"target.path={root / 'target'}",
        "target.gguf_file=null",
        f"draft.path={root / 'draft'}",
        "target.device=cpu",
        "draft.device=cpu",
        f"prompts={prompts}",
        "max_new_tokens=16",
        "chat_template=false",
        f"output_dir={out}",
        "engine=vllm",
        "offset=0",
        *extra,
    ]


def test_heads_eval_engine_vllm_settings_are_one_line_errors(pair, tmp_path, capsys):
    from specheads.evaluate.cli import main as eval_main

    root, prompts = pair
    assert eval_main(eval_args(root, prompts, tmp_path / "x", "judge.head=j.safetensors")) == 2
    err = capsys.readouterr().err.strip()
    assert "engine=vllm sweeps" in err and "judge" in err and len(err.splitlines()) == 1


@needs_vllm
def test_heads_eval_engine_vllm_rows_side_by_side(pair, tmp_path, monkeypatch, capsys):
    """ar, fixed K through draft_model, confidence through the proposer (threshold and cost), batch 2: every row's
    greedy tokens are the target alone's; a second run resumes from rows.jsonl without decoding again."""
    from specheads.evaluate.cli import main as eval_main

    monkeypatch.setenv("SPECHEADS_CACHE", str(tmp_path / "cache"))
    root, prompts = pair
    common = eval_args(
        root,
        prompts,
        tmp_path / "eval",
        f"vllm.python={VLLM_PYTHON}",
        "ks=[2]",
        "confidence.taus=[0.3]",
        "confidence.k_max=3",
        "batch_size=2",
        "head=null",
    )
    assert eval_main(common) == 0
    sweep = json.loads((tmp_path / "eval" / "sweep.json").read_text())
    assert list(sweep["rows"]) == ["ar", "k2", "c0.3", "c-cost"]
    assert all(r["greedy_identical"] for r in sweep["rows"].values())
    assert sweep["rows"]["k2"]["tokens_per_call"] > 1 and sweep["rows"]["c0.3"]["propose_share_of_wall_time"] > 0
    printed = capsys.readouterr().out
    assert "c-cost" in printed and "tokens/s" in printed
    d = sweep["deploy"]  # the fastest speculating row, with what heads-export deploy= packs
    assert d["config"] == max((n for n in sweep["rows"] if n != "ar"), key=lambda n: sweep["rows"][n]["tokens_per_s"])
    assert (d["policy"], d["regime"]["engine"]) == ({"k2": "sd"}.get(d["config"], "confidence_stop"), "vllm")
    stamp = (tmp_path / "eval" / "rows.jsonl").stat().st_mtime
    assert eval_main(common) == 0  # resumed: every row already there
    assert (tmp_path / "eval" / "rows.jsonl").stat().st_mtime == stamp
