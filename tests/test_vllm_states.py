"""The target's hidden states from vLLM (``heads-datagen engine=vllm``, :mod:`specheads.datagen.vllm_states`): with
vLLM (``SPECHEADS_VLLM_PYTHON``: the python of vLLM's virtualenv), the states child's states at chosen layers,
the last layer's output before the final norm, the top-k and the judge's features equal the Transformers
target's within 1e-3 relative in fp32, and ``labels=drafter`` and ``labels=sprinter`` give the Transformers
engine's rows. Without vLLM: the judge's features and SPRINTER's logits built from states (here the Transformers
target's own, ``conftest.HFStates``) are the Transformers engine's; a child that dies is a one-line error."""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import pytest
import torch
from conftest import HFStates, chunk_rows

from specheads.datagen import vllm_states
from specheads.datagen.cli import main
from specheads.datagen.config import DatagenConfig
from specheads.errors import UserError
from specheads.vllm import child

VLLM_PYTHON = os.environ.get("SPECHEADS_VLLM_PYTHON")
needs_vllm = pytest.mark.skipif(not VLLM_PYTHON, reason="SPECHEADS_VLLM_PYTHON (vLLM's python) is not set")
SEQS = [[1, 5, 9, 13, 4, 4], [1, 7], [1, 20, 21, 22, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 3]]


def config(target, tmp_path, python) -> DatagenConfig:
    cfg = DatagenConfig()
    cfg.target.path, cfg.target.gguf_file, cfg.target.device, cfg.target.dtype = str(target), None, "cpu", "float32"
    cfg.output_dir, cfg.vllm.python, cfg.vllm.threads = str(tmp_path), python, 2
    return cfg


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest difference of a row, over that row's norm."""
    return float(((a.float() - b.float()).norm(dim=-1) / b.float().norm(dim=-1).clamp_min(1e-12)).max())


@pytest.fixture(scope="module")
def vllm_pair(tmp_path_factory):
    from in_vllm.pair import save_pair

    return save_pair(tmp_path_factory.mktemp("vllm-pair"))


@needs_vllm
def test_vllms_states_top_k_and_judge_features_are_the_transformers_targets(vllm_pair, tmp_path):
    from transformers import AutoModelForCausalLM

    from specheads.datagen.judge_labels import target_features
    from specheads.shim import HiddenCapture

    target = vllm_pair[0]
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    server = child.StatesServer(config(target, tmp_path, VLLM_PYTHON), limit=64)
    try:
        got = server.states(SEQS, [2, 1], top_k=3)  # layer 2 of 2: the output before the final norm
        job = SimpleNamespace(states=server, pair=SimpleNamespace(target=SimpleNamespace(model=model, hidden_size=128)))
        rows = [
            {"input_ids": s, "answer_start": 2, "labels": [-100 if j % 3 else j % 2 for j in range(len(s) - 2)]}
            for s in SEQS
        ]
        feats = vllm_states.judge_features(job, rows)
    finally:
        server.close()
    assert not list(tmp_path.glob(".vllm-states-*"))  # the exchange folder goes with the child
    for seq, (st, (ids, logp)) in zip(SEQS, got):
        with torch.inference_mode(), HiddenCapture(model) as cap:
            out = model(torch.tensor([seq]), output_hidden_states=True)
        assert st.shape == (len(seq), 2, 128) and st.dtype == torch.float32
        assert relative(st[:, 0], cap.pre[0]) < 1e-3 and relative(st[:, 1], out.hidden_states[1][0]) < 1e-3
        best = torch.log_softmax(out.logits[0, :-1], -1).topk(3, -1)
        assert torch.equal(ids, best.indices.to(torch.int32))
        torch.testing.assert_close(logp, best.values, atol=1e-4, rtol=0)
    want = target_features(model, rows, pad=2, batch_size=2)
    assert feats[2:4] == want[2:4] and torch.equal(feats[1], want[1])
    torch.testing.assert_close(feats[4], want[4], atol=1e-3, rtol=1e-3)  # the target's verdict on each token
    assert relative(feats[0], want[0]) < 1e-3


@needs_vllm
@pytest.mark.parametrize("labels", ["drafter", "sprinter"])
def test_vllm_engine_gives_the_transformers_engines_rows(vllm_pair, tmp_path, labels):
    from specheads.dataset import DrafterChunkFiles

    target, draft = vllm_pair
    prompts = tmp_path / "p.jsonl"
    words = ["the cat sat on", "one two three", "why is the sun", "a big red dog ran", "the moon", "two four six"]
    prompts.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in words[:4]))
    common = [
        f"target.path={target}",
        "target.gguf_file=null",
        f"draft.path={draft}",
        "target.device=cpu",
        "draft.device=cpu",
        "target.dtype=float32",
        "draft.dtype=float32",
        f"prompts={prompts}",
        "num_prompts=null",
        "offset=0",
        "max_new_tokens=12",
        "batch_size=4",
        "chunk_size=4",
        "chat_template=false",
        "sampling.do_sample=false",
        f"labels={labels}",
        "drafter.top_k=4",
    ]
    ours, theirs = tmp_path / "ours", tmp_path / "vllm"
    assert main([*common, f"output_dir={ours}"]) == 0
    assert main([*common, f"output_dir={theirs}", "engine=vllm", f"vllm.python={VLLM_PYTHON}"]) == 0
    a, b = chunk_rows(ours), chunk_rows(theirs)
    assert a and [r["input_ids"] for r in a] == [r["input_ids"] for r in b]
    for x, y in zip(a, b):
        for key in x:
            if key in ("p_token", "ratio", "tv"):
                torch.testing.assert_close(torch.tensor(y[key]), torch.tensor(x[key]), rtol=1e-4, atol=1e-6)
            else:
                assert x[key] == y[key], key
    if labels == "drafter":
        s, t = DrafterChunkFiles(ours, 0).load(), DrafterChunkFiles(theirs, 0).load()
        assert torch.equal(s["top_ids"], t["top_ids"]) and torch.equal(s["offsets"], t["offsets"])
        torch.testing.assert_close(t["top_logp"], s["top_logp"], atol=1e-4, rtol=0)
        assert relative(t["states"], s["states"]) < 1e-3  # fp16 on disk: one rounding step apart at most


def test_judge_features_and_sprinters_logits_from_states_are_the_transformers_targets(tiny_pair):
    from specheads.datagen.judge_labels import target_features
    from specheads.runtime.states import logits_at

    model = tiny_pair[0]
    job = SimpleNamespace(
        states=HFStates(model), pair=SimpleNamespace(target=SimpleNamespace(model=model, hidden_size=32))
    )
    seqs = [[3, 5, 9, 13, 4, 4, 7], [3, 7, 8], [3, 20, 21, 22, 6, 4, 5]]
    rows = [
        {"input_ids": s, "answer_start": 1, "labels": [-1 if j % 3 else j % 2 for j in range(len(s) - 1)]} for s in seqs
    ]
    got, want = vllm_states.judge_features(job, rows), target_features(model, rows, pad=0, batch_size=2)
    assert got[2:4] == want[2:4] and torch.equal(got[1], want[1]) and relative(got[0], want[0]) < 1e-3
    torch.testing.assert_close(got[4], want[4], rtol=1e-3, atol=1e-3)  # the target's verdicts: logp, gap, entropy, rank
    positions = [[1, 4, 7], [3], [2, 5]]
    for a, b in zip(vllm_states.target_logits(job, seqs, positions), logits_at(model, seqs, positions, pad=0)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_a_states_child_that_dies_is_a_one_line_error(tmp_path):
    import sys

    server = child.StatesServer(config(tmp_path / "nowhere", tmp_path, sys.executable), limit=64)
    server.cfg.vllm.python = sys.executable  # this python: the child fails before vLLM starts
    with pytest.raises(UserError, match="failed with exit code") as err:
        server.states(SEQS, [1])
    assert len(str(err.value).splitlines()) == 1
    server.close()


@needs_vllm
def test_an_eagle_head_trains_on_states_streamed_from_vllm(vllm_pair, tmp_path):
    """heads-datagen engine=vllm drafter.store_states=false (responses and top-k from one engine), then heads-train
    eagle.states=online eagle.engine=vllm: the states of vLLM's extract_hidden_states while the head trains give the
    loss curve of the states and top-k vLLM's datagen stored (fp16 rounding, and the last digits of the top-k)."""
    from specheads.train.cli import main as train_main

    target, draft = vllm_pair
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(
        "".join(json.dumps({"prompt": f"{w} one two"}) + "\n" for w in ("the", "a", "why", "two", "six"))
    )
    model = [f"target.path={target}", "target.gguf_file=null", "target.device=cpu", "target.dtype=float32"]
    data = tmp_path / "data"
    datagen = [*model, f"draft.path={draft}", "draft.device=cpu", f"prompts={prompts}", "num_prompts=null"]
    datagen += ["max_new_tokens=16", "batch_size=5", "chunk_size=5", "chat_template=false", "sampling.do_sample=false"]
    datagen += ["labels=drafter", "drafter.top_k=4", "engine=vllm", f"vllm.python={VLLM_PYTHON}", f"output_dir={data}"]
    assert main(datagen) == 0
    ids = tmp_path / "ids"  # no states: the top-k from the engine that generates the responses, no states child
    assert main([*datagen, f"output_dir={ids}", "drafter.store_states=false"]) == 0
    from specheads.dataset import DrafterChunkFiles

    full, bare = DrafterChunkFiles(data, 0).load(), DrafterChunkFiles(ids, 0).load()
    assert bare["states"].shape == (full["states"].shape[0], 0) and torch.equal(bare["top_ids"], full["top_ids"])
    torch.testing.assert_close(bare["top_logp"], full["top_logp"], atol=1e-4, rtol=0)
    assert [r["input_ids"] for r in chunk_rows(ids)] == [r["input_ids"] for r in chunk_rows(data)]
    common = [*model, "head=eagle", "batch_size=2", "grad_accum=1", "epochs=2", "lr=3e-3"]
    common += ["eval_fraction=0.4", "patience=2", "eagle.ttt_steps=2", "vocab_top_n=16", "vllm.threads=2"]
    curves = {}
    for mode in ("offline", "online"):
        out = tmp_path / mode
        extra = [f"data_dir={data}"]
        if mode == "online":  # on the data without states: the whole online flow
            extra = [f"data_dir={ids}", "eagle.engine=vllm", f"vllm.python={VLLM_PYTHON}"]
        assert train_main([*common, f"output_dir={out}", f"eagle.states={mode}", *extra]) == 0
        curves[mode] = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
        manifest = json.loads((out / "manifest.json").read_text())
        assert manifest["states"]["mode"] == mode
    assert manifest["states"]["engine"] == "vllm" and manifest["states"]["made_tokens"] > 0
    assert not list((tmp_path / "online").glob(".vllm-states-*"))  # the child and its folder end with the run
    loss = [(a["loss"], b["loss"]) for a, b in zip(curves["offline"], curves["online"]) if "loss" in a]
    assert len(loss) >= 2 and all(abs(a - b) <= 1e-3 * abs(a) for a, b in loss), loss
