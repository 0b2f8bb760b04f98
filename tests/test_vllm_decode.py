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
from specheads.export.decode_cli import main as decode_main

VLLM_PYTHON = os.environ.get("SPECHEADS_VLLM_PYTHON")
needs_vllm = pytest.mark.skipif(not VLLM_PYTHON, reason="SPECHEADS_VLLM_PYTHON (vLLM's python) is not set")


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm_decode")
    save_pair(root)
    prompts = root / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in
                               ["the cat sat on", "one two three", "why is the sun", "a big red dog ran"]))
    return root, prompts


def args(root, prompts, out, *extra):
    return [f"target.path={root / 'target'}", "target.gguf_file=null", f"draft.path={root / 'draft'}",
            "target.device=cpu", "draft.device=cpu", f"prompts={prompts}", "max_new_tokens=20", "chat_template=false",
            f"output_dir={out}", *extra]


def tokens(out: Path) -> list[list[int]]:
    rows = [json.loads(x) for x in (out / "outputs.jsonl").read_text().splitlines()]
    return [r["tokens"] for r in sorted(rows, key=lambda r: r["index"])]


@pytest.mark.parametrize("extra, message", [
    (["policy=judge"], "engine=vllm runs policy"), (["eagle=h.safetensors"], "does not take eagle="),
    (["stream=true"], "does not stream"), (["vllm_python=/nowhere/python"], "does not exist")])
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
    assert "vllm_python=" in capsys.readouterr().err


@needs_vllm
def test_vllm_decodes_the_shims_greedy_tokens(pair, tmp_path):
    root, prompts = pair
    assert decode_main(args(root, prompts, tmp_path / "ar", "policy=ar")) == 0
    for policy in (["policy=ar"], ["policy=confidence_stop", "tau=0.3", "k_max=4"], ["policy=sd", "k=2"]):
        out = tmp_path / policy[0]
        assert decode_main(args(root, prompts, out, "engine=vllm", f"vllm_python={VLLM_PYTHON}", "batch_size=2",
                                *policy)) == 0
        assert tokens(out) == tokens(tmp_path / "ar"), policy
        metrics = json.loads((out / "metrics.json").read_text())
        assert metrics["engine"] == "vllm" and metrics["new_tokens"] == sum(map(len, tokens(out)))
        if policy[0] != "policy=ar":
            assert metrics["tokens_per_call"] > 1 and metrics["acceptance_rate"] > 0
    assert json.loads((tmp_path / "policy=confidence_stop" / "metrics.json").read_text())["proposer"]["candidates"] > 0


@needs_vllm
def test_the_gguf_target_is_converted_once(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECHEADS_CACHE", str(tmp_path / "cache"))
    target = SHARED / "models/smollm2-135m-instruct"
    common = [f"target.path={target}", "target.gguf_file=SmolLM2-135M-Instruct.Q4_1.gguf", "policy=ar",
              f"prompts={SHARED / 'data/gsm8k/test.jsonl'}", "num_prompts=2", "max_new_tokens=16"]
    assert decode_main([*common, f"output_dir={tmp_path / 'ours'}"]) == 0
    assert decode_main([*common, "engine=vllm", f"vllm_python={VLLM_PYTHON}", f"output_dir={tmp_path / 'v1'}"]) == 0
    converted = list((tmp_path / "cache" / "vllm").iterdir())
    assert len(converted) == 1 and (converted[0] / "config.json").is_file()
    stamp = (converted[0] / "config.json").stat().st_mtime
    assert decode_main([*common, "engine=vllm", f"vllm_python={VLLM_PYTHON}", f"output_dir={tmp_path / 'v2'}"]) == 0
    assert (converted[0] / "config.json").stat().st_mtime == stamp  # reused, not converted again
    assert tokens(tmp_path / "v1") == tokens(tmp_path / "v2") == tokens(tmp_path / "ours")
