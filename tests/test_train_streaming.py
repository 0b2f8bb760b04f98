"""Training that streams: labels=drafter rows read a batch at a time, the EAGLE task's target tensors read by
name from the checkpoint (never the whole target), the unrolled attention through SDPA, and the EAGLE and
draft tasks under DeepSpeed ZeRO-2/3."""

from __future__ import annotations

import json
import random

import pyarrow.parquet as pq
import pytest
import torch
from conftest import SHARED, datagen_args, same_heads, tiny_llama
from safetensors import safe_open

from specheads.datagen.cli import main as datagen_main
from specheads.heads.eagle_head import EagleHead, unrolled_attention
from specheads.runtime.checkpoint_tensors import TargetCheckpoint, from_model
from specheads.shim import ModelSpec, load_model
from specheads.train.cli import main as train_main
from specheads.train.drafter_data import DrafterData

PROMPTS = ["the cat sat", "a dog ran up", "one two three", "why is the sun red", "big moon", "yes no up down"]
PROMPTS += ["left right", "the red sun", "two three four", "who was it", "ten nine", "blue mat"]


@pytest.fixture(scope="module")
def drafter_dir(tmp_path_factory, tiny_pair_dirs):
    root = tmp_path_factory.mktemp("drafter")
    prompts = root / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": w}) + "\n" for w in PROMPTS))
    out = root / "dg"
    extra = ("labels=drafter", "sampling.do_sample=false", "max_new_tokens=8", "drafter.top_k=5", "chunk_size=3")
    assert datagen_main(datagen_args(tiny_pair_dirs, prompts, out, *extra)) == 0
    return out


def _whole(out):
    """Every sequence of a drafter run, read the plain way: each chunk's files whole."""
    rows = []
    for path in sorted((out / "data").glob("chunk-*.parquet")):
        table = pq.read_table(path).to_pylist()
        with safe_open(str(out / "states" / (path.stem + ".safetensors")), framework="pt") as f:
            side = {k: f.get_tensor(k) for k in f.keys()}
        off, roff = side["offsets"].tolist(), side["response_offsets"].tolist()
        for i, row in enumerate(table):
            r = slice(roff[i], roff[i + 1])
            rows.append((row, side["states"][off[i] : off[i + 1]], side["top_ids"][r], side["top_logp"][r]))
    return rows


def test_rows_read_lazily_equal_the_whole_files_and_only_their_bytes(drafter_dir):
    data, whole = DrafterData([str(drafter_dir)]), _whole(drafter_dir)
    assert len(data) == len(whole) == len(PROMPTS) and len(data.chunks) == 4 and data.layers == [1]
    assert data.tokens() == sum(len(w[0]["input_ids"]) for w in whole) and data.top_k == 5
    order = list(range(len(data)))
    random.Random(3).shuffle(order)
    got = data.rows(order[:5])
    for i, seq in zip(order[:5], got):
        row, states, top_ids, top_logp = whole[i]
        assert seq.ids.tolist() == row["input_ids"] and seq.start == row["response_start"]
        assert torch.equal(seq.states, states) and torch.equal(seq.top_ids, top_ids.long())
        assert torch.equal(seq.top_logp, top_logp)
    # the bytes read are those five rows' and nothing else: no chunk was read whole
    want = sum(sum(t.numel() * t.element_size() for t in whole[i][1:]) for i in order[:5])
    assert data.bytes_read == want
    bare = DrafterData([str(drafter_dir)], states=False)
    seq = bare.rows([order[0]])[0]
    assert seq.states.shape == (0, 0) and seq.ids.tolist() == whole[order[0]][0]["input_ids"]
    assert bare.bytes_read == sum(t.numel() * t.element_size() for t in whole[order[0]][2:])
    tokens = list(bare.response_tokens())
    assert [r for r, _ in tokens] == [w[0]["input_ids"][w[0]["response_start"] :] for w in whole]
    assert [t for _, t in tokens] == [w[2][:, 0].tolist() for w in whole]
    with pytest.raises(IndexError):
        data.rows([len(data)])


def _reference_attention(qs, ks, vs, key_mask):
    """The explicit scores the SDPA path replaced: [B, h, T, T] for the first step, one column per later step."""
    q = qs[-1]
    b, h, t, hd = q.shape
    rep = h // ks[0].shape[1]
    k1, v1 = ks[0].repeat_interleave(rep, 1), vs[0].repeat_interleave(rep, 1)
    scale = hd**-0.5
    main = (q @ k1.transpose(-1, -2)) * scale
    allowed = torch.ones(t, t, dtype=torch.bool).tril()
    if key_mask is not None:
        allowed = allowed[None, None] & key_mask[:, None, None, :]
    main = main.masked_fill(~allowed, float("-inf"))
    diag_k = [k.repeat_interleave(rep, 1) for k in ks[1:]]
    diag_v = [v.repeat_interleave(rep, 1) for v in vs[1:]]
    diag = [(q * k).sum(-1, keepdim=True) * scale for k in diag_k]
    weights = torch.softmax(torch.cat([main, *diag], dim=-1).float(), dim=-1).to(q.dtype)
    out = weights[..., :t] @ v1
    for i, v in enumerate(diag_v):
        out = out + weights[..., t + i : t + i + 1] * v
    return out


@pytest.mark.parametrize("steps", [1, 2, 4])
@pytest.mark.parametrize("padded", [False, True])
def test_sdpa_attention_equals_the_explicit_scores_and_their_gradients(steps, padded):
    g = torch.Generator().manual_seed(steps)
    b, h, kv, t, hd = 2, 4, 2, 7, 8
    qs = [torch.randn(b, h, t, hd, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(steps)]
    ks = [torch.randn(b, kv, t, hd, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(steps)]
    vs = [torch.randn(b, kv, t, hd, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(steps)]
    mask = None
    if padded:  # right padding in row 0, a hole in row 1 (a position no query may read)
        mask = torch.ones(b, t, dtype=torch.bool)
        mask[0, 5:] = False
        mask[1, 2] = False
    head = EagleHead(
        hidden_size=h * hd,
        layers=[1],
        draft_vocab_size=4,
        vocab_size=4,
        num_heads=h,
        num_kv_heads=kv,
        head_dim=hd,
        intermediate_size=8,
    )
    want, got = _reference_attention(qs, ks, vs, mask), unrolled_attention(head, qs, ks, vs, mask)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)  # the old path's softmax ran in fp32
    w = torch.randn(want.shape, generator=g, dtype=torch.float64)
    grads_want = torch.autograd.grad((want * w).sum(), qs[-1:] + ks + vs)
    grads_got = torch.autograd.grad((got * w).sum(), qs[-1:] + ks + vs)
    for a, c in zip(grads_got, grads_want):
        torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-6)
    f32 = [[x.detach().float() for x in xs] for xs in (qs, ks, vs)]
    torch.testing.assert_close(
        unrolled_attention(head, *f32, mask), _reference_attention(*f32, mask), rtol=1e-5, atol=1e-5
    )


def _tied_dir(tmp_path, tokenizer):
    model = tiny_llama(len(tokenizer), seed=4, layers=3)
    model.config.tie_word_embeddings = True
    model.tie_weights()
    out = tmp_path / "tied"
    model.save_pretrained(out, max_shard_size="40KB")  # several files and an index
    tokenizer.save_pretrained(out)
    return out


@pytest.mark.parametrize("which", ["untied", "tied_sharded"])
def test_target_tensors_are_the_models_and_only_they_are_read(which, tiny_pair_dirs, tokenizer, tmp_path):
    path = tiny_pair_dirs[0] if which == "untied" else _tied_dir(tmp_path, tokenizer)
    if which == "tied_sharded":
        assert (path / "model.safetensors.index.json").is_file()
    spec = ModelSpec(path=str(path), device="cpu", dtype="float32")
    loaded = load_model(spec, "target")
    checkpoint = TargetCheckpoint(spec)
    assert checkpoint.fingerprint == loaded.fingerprint
    ids = [7, 0, 3, 4, 5, 30, 12]
    got, want = checkpoint.tensors(ids), from_model(loaded.model, ids)
    assert got.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=0)
    d, v, n = loaded.hidden_size, loaded.model.config.vocab_size, loaded.model.config.num_hidden_layers
    layer = sum(t.numel() for k, t in want.items() if k not in ("embed", "lm_head", "norm"))
    rows = 0 if which == "tied_sharded" else len(ids) * d  # tied: the rows come from the embedding read
    assert checkpoint.bytes_read == 4 * (v * d + d + rows + layer)
    assert checkpoint.bytes_read < checkpoint.bytes_total and n > 1
    only = TargetCheckpoint(spec)
    assert list(only.tensors(None)) == ["embed"] and only.bytes_read == 4 * v * d


@pytest.mark.slow
@pytest.mark.skipif(not (SHARED / "models").is_dir(), reason="../shared/models not present")
def test_gguf_target_tensors_are_transformers_dequantised_ones():
    """The shared SmolLM2 target (Q4_1/Q8_0 GGUF, tied): the tensors, dequantised from the memory map, equal
    the model Transformers loads (query/key rows in its order), read from a third of the file."""
    spec = ModelSpec(
        path=str(SHARED / "models" / "smollm2-135m-instruct"),
        gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
        device="cpu",
        dtype="float32",
    )
    checkpoint = TargetCheckpoint(spec)
    ids = list(range(0, 49152, 97)) + [49151]
    got = checkpoint.tensors(ids)
    loaded = load_model(spec, "target")
    assert checkpoint.fingerprint == loaded.fingerprint
    want = from_model(loaded.model, ids)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=0)
    assert checkpoint.bytes_read / checkpoint.bytes_total < 0.5


def test_a_hub_target_fetches_only_the_shards_holding_its_tensors(tokenizer, tmp_path, monkeypatch):
    """A Hub id (offline, its config in a Hub cache of the test's own; huggingface_hub.hf_hub_download a stand-in
    serving a local sharded checkpoint into that cache): only the index and the shards that hold the embeddings,
    final norm, output layer and last layer are fetched, from the cache alone, at the revision asked for; the
    tensors are the model's and no model is built."""
    import shutil

    import huggingface_hub
    import transformers

    from specheads.runtime import checkpoint_tensors

    model = tiny_llama(len(tokenizer), seed=5, layers=4)
    src = tmp_path / "src"
    model.save_pretrained(src, max_shard_size="20KB")
    where = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]
    repo, commit = "acme/tiny-target", "a" * 40
    cache = tmp_path / "hub"
    snapshot = cache / "models--acme--tiny-target" / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (cache / "models--acme--tiny-target" / "refs").mkdir()
    (cache / "models--acme--tiny-target" / "refs" / "v1").write_text(commit)
    shutil.copy(src / "config.json", snapshot)
    fetched = []

    def download(repo_id, filename, revision=None, local_files_only=False, **kwargs):
        assert (repo_id, revision, local_files_only) == (repo, "v1", True)
        fetched.append(filename)
        shutil.copy(src / filename, snapshot / filename)
        return str(snapshot / filename)

    def refuse(*a, **k):
        raise AssertionError("the whole target was built")

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", download)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", refuse)
    monkeypatch.setattr(checkpoint_tensors, "load_model", refuse)
    checkpoint = TargetCheckpoint(ModelSpec(path=repo, revision="v1", device="cpu", dtype="float32"))
    assert checkpoint.fingerprint.startswith(f"hub:{repo}@")
    ids = [7, 0, 3, 4, 5, 30, 12]
    got, want = checkpoint.tensors(ids), from_model(model, ids)
    assert got.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=0)
    last = f"model.layers.{model.config.num_hidden_layers - 1}."
    needed = {f for name, f in where.items() if name.startswith(last) or not name.startswith("model.layers.")}
    assert fetched[0] == "model.safetensors.index.json" and sorted(fetched[1:]) == sorted(needed)
    assert len(needed) < len(set(where.values()))  # some shards are never fetched


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


def test_eagle_training_never_loads_the_whole_target(drafter_dir, tiny_pair_dirs, tmp_path, monkeypatch):
    import transformers

    def refuse(*a, **k):
        raise AssertionError("the EAGLE task loaded a whole model")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", refuse)
    out = tmp_path / "eagle"
    assert train_main(eagle_args(tiny_pair_dirs, drafter_dir, out)) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert 0 < manifest["target_bytes_read"] < manifest["target_bytes_total"]
    assert manifest["train_data"]["sequences"] == len(PROMPTS)


def _deepspeed_ok() -> bool:
    import importlib.util

    return importlib.util.find_spec("deepspeed") is not None


def draft_args(pair_dirs, data, out, *extra):
    return [
        f"data_dir={data}",
        "head=draft",
        "distill.init=truncate:1",
        f"target.path={pair_dirs[0]}",
        "target.gguf_file=null",
        "draft.gguf_file=null",
        f"output_dir={out}",
        "batch_size=2",
        "grad_accum=1",
        "epochs=2",
        "lr=3e-3",
        "eval_fraction=0.3",
        "patience=2",
        *extra,
    ]


def test_draft_truncation_reads_only_the_tensors_it_copies(drafter_dir, tiny_pair_dirs, tmp_path, monkeypatch):
    """head=draft distill.init=truncate:1 never loads the whole target (a shell without weights gives its config,
    tokenizer and fingerprint): the draft's embeddings, first layer, final norm and output layer are the
    target's tensors, read alone from its checkpoint."""
    import transformers

    from specheads.runtime.target_shell import load_shell
    from specheads.train.distill_model import truncated

    target = load_model(ModelSpec(path=str(tiny_pair_dirs[0]), device="cpu", dtype="float32"), "target").model
    want = {k: v for k, v in target.state_dict().items() if ".layers." not in k or ".layers.0." in k}

    def refuse(*a, **k):
        raise AssertionError("head=draft loaded the whole target")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", refuse)
    out = tmp_path / "draft"
    assert train_main(draft_args(tiny_pair_dirs, drafter_dir, out, "epochs=1")) == 0
    assert json.loads((out / "draft" / "config.json").read_text())["num_hidden_layers"] == 1
    draft = truncated(load_shell(ModelSpec(path=str(tiny_pair_dirs[0]), device="cpu")), 1)
    got = draft.state_dict()
    assert got.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=0)


def _same_drafts(a, b, atol):
    from safetensors.torch import load_file

    a, b = load_file(str(a / "draft" / "model.safetensors")), load_file(str(b / "draft" / "model.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=atol)


@pytest.mark.slow
@pytest.mark.skipif(not _deepspeed_ok(), reason="needs the deepspeed extra (pip install -e '.[deepspeed]')")
@pytest.mark.parametrize("stage", ["deepspeed_zero2", "deepspeed_zero3"])
@pytest.mark.parametrize("head", ["eagle", "draft"])
def test_eagle_and_draft_train_under_deepspeed_zero(head, stage, drafter_dir, tiny_pair_dirs, tmp_path):
    """The shipped launcher config on one CPU process, as the acceptance head's ZeRO test runs it (accelerate
    runs DeepSpeed multi-process only on accelerators): the engine trains the head (ZeRO-3: partitioned,
    gathered for evaluation, export and checkpoints) to the head of the plain loop, and each checkpoint holds
    the rank's optimizer partition."""
    import os
    import subprocess
    import sys
    from importlib.resources import files

    make = eagle_args if head == "eagle" else draft_args
    extra = ("checkpoint_every=2", "threads=1")
    config = files("specheads.recipes") / "accelerate" / f"{stage}.yaml"
    launcher = ["--config_file", str(config), "--num_processes", "1", "--mixed_precision", "no"]
    cmd = [sys.executable, "-m", "accelerate.commands.launch", *launcher, "-m", "specheads.train.cli"]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
    done = subprocess.run(
        [*cmd, *make(tiny_pair_dirs, drafter_dir, tmp_path / "ds", *extra)],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    ckpt = sorted((tmp_path / "ds").glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))[-1]
    step = ckpt.name.split("-")[1]
    assert [p.name for p in ckpt.iterdir() if p.name.startswith(".zero")] == [f".zero-{step}-rank0.safetensors"]
    assert train_main(make(tiny_pair_dirs, drafter_dir, tmp_path / "plain", *extra)) == 0
    if head == "eagle":  # same math, other summation order
        same_heads(tmp_path / "ds", tmp_path / "plain", atol=1e-3)
    else:
        _same_drafts(tmp_path / "ds", tmp_path / "plain", atol=1e-3)


def test_side_rows_read_only_the_asked_rows_across_files(tmp_path):
    """The judge and stop heads' stored rows: spans read from the files they lie in, in the order asked."""
    from safetensors.torch import save_file

    from specheads.train.side_rows import SideRows

    g = torch.Generator().manual_seed(0)
    parts = [torch.randn(n, 4, generator=g).half() for n in (3, 5, 2)]
    rows = SideRows("features")
    for i, p in enumerate(parts):
        save_file({"features": p, "labels": torch.zeros(len(p))}, str(tmp_path / f"c{i}.safetensors"))
        rows.add(tmp_path / f"c{i}.safetensors", len(p))
    whole = torch.cat(parts)
    spans = [(8, 10), (0, 2), (4, 7), (3, 3)]
    assert torch.equal(rows.take(spans), torch.cat([whole[a:b] for a, b in spans]))
    assert len(rows) == 10 and rows.bytes_read == 7 * 4 * 2
    with pytest.raises(IndexError):
        rows.take([(2, 4)])  # across two files
