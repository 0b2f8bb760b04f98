"""``specheads.vllm.proposer``: the settings' checks and the proposer behind vLLM's interface, without vLLM (a stand-in
for its config; the run inside vLLM itself is tests/in_vllm/, in vLLM's own virtualenv)."""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from conftest import make_tokenizer, perturbed_copy, tiny_llama

from specheads.errors import UserError
from specheads.export import save_head
from specheads.heads import AcceptanceHead
from specheads.shim.core.sampling import SamplingConfig
from specheads.shim.runners.models import ModelSpec, load_model
from specheads.vllm import proposer as sv

VOCAB = len(make_tokenizer())


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm_pair")
    tok = make_tokenizer()
    target = tiny_llama(len(tok), seed=0)
    models = {
        "draft": perturbed_copy(target, scale=0.2),
        "other": tiny_llama(len(tok), seed=5),
        "wide": tiny_llama(len(tok) + 8, seed=6),
    }
    for name, model in models.items():
        model.save_pretrained(root / name)
        tok.save_pretrained(root / name)
    return root


def head_for(root, draft: str):
    loaded = load_model(ModelSpec(path=str(root / draft), device="cpu"), "draft")
    torch.manual_seed(0)
    head = AcceptanceHead(32, depth=1)
    return str(
        save_head(
            root / f"head-{draft}.safetensors",
            head,
            "acceptance",
            {
                "head_config": head.config(),
                "hidden_size": 32,
                "feature": {"model": "draft", "state": "post", "layer": -1},
                "draft": {"name": loaded.name, "fingerprint": loaded.fingerprint},
                "target": {"name": "tiny", "fingerprint": "unknown"},
                "sampling": SamplingConfig().to_dict(),
                "default_threshold": 0.6,
            },
        )
    )


def vllm_config(spec: dict | None, k: int = 4, vocab: int = VOCAB, seqs: int = 3, max_len: int = 64, dtype=None):
    """A stand-in for vLLM's config as the proposer reads it; ``spec``: the dict given to ``LLM`` (its settings go
    where vLLM's ``SpeculativeConfig`` keeps them: ``draft_load_config`` as a ``LoadConfig``-like object)."""
    load = (spec or {}).get("draft_load_config")
    return SimpleNamespace(
        speculative_config=SimpleNamespace(
            num_speculative_tokens=k, draft_load_config=SimpleNamespace(**load) if load is not None else None
        ),
        device_config=SimpleNamespace(device="cpu"),
        model_config=SimpleNamespace(get_vocab_size=lambda: vocab, max_model_len=max_len, dtype=dtype or torch.float32),
        scheduler_config=SimpleNamespace(max_num_seqs=seqs),
    )


def test_speculative_config_carries_the_settings_to_the_workers(dirs):
    """The settings travel inside the dict given to LLM (vLLM sends its config to every worker, on any node), as
    JSON, and nothing is put in the environment."""
    before = dict(os.environ)
    spec = sv.speculative_config(str(dirs / "draft"), policy="specdecpp", head=head_for(dirs, "draft"), k_max=5)
    assert {k: spec[k] for k in ("method", "model", "num_speculative_tokens")} == {
        "method": "custom_class",
        "model": "specheads.vllm.proposer.Proposer",
        "num_speculative_tokens": 5,
    }
    settings = spec["draft_load_config"]["model_loader_extra_config"]["specheads"]
    assert json.loads(json.dumps(settings)) == settings and settings["head"].endswith("head-draft.safetensors")
    assert dict(os.environ) == before
    proposer = sv.Proposer(vllm_config(spec, k=5))
    assert proposer.core.policies[0].name == "specdecpp" and proposer.core.policies[0].threshold == 0.6


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"policy": "specdecpp"}, "needs head="),
        ({"policy": "tli"}, "choose one of"),
        ({"k_max": 0}, "k_max=0"),
        ({"stop": "cost"}, "needs costs="),
        ({"threshold": 1.5}, "in [0, 1]"),
        ({"draft": "/nowhere"}, "not a local"),
        ({"head": "x.safetensors"}, "does not exist"),
        ({"dtype": "fp8"}, "dtype='fp8'"),
        ({"cache_mb": 0}, "cache_mb=0"),
    ],
)
def test_bad_settings_are_one_line_errors(dirs, kwargs, message):
    with pytest.raises(UserError, match=message.replace("[", r"\[").replace("]", r"\]")) as err:
        sv.speculative_config(**{"draft": str(dirs / "draft"), **kwargs})
    assert len(str(err.value).splitlines()) == 1


def test_start_up_mistakes_are_one_line_errors(dirs):
    with pytest.raises(UserError, match="no settings"):  # a hand-written dict without them
        sv.Proposer(vllm_config({"method": "custom_class", "model": sv.CLASS_PATH, "num_speculative_tokens": 4}))
    spec = sv.speculative_config(str(dirs / "draft"), policy="specdecpp", head=head_for(dirs, "other"), k_max=4)
    with pytest.raises(UserError, match="fingerprint"):  # a head trained on another draft
        sv.Proposer(vllm_config(spec))
    with pytest.raises(UserError, match="vocabulary"):
        sv.Proposer(vllm_config(sv.speculative_config(str(dirs / "wide"), k_max=4)))
    spec = sv.speculative_config(str(dirs / "draft"), k_max=4)
    with pytest.raises(UserError, match="num_speculative_tokens=3"):
        sv.Proposer(vllm_config(spec, k=3))
    spec["draft_load_config"]["model_loader_extra_config"]["specheads"]["colour"] = "red"
    with pytest.raises(UserError, match="colour"):  # settings of another specheads version
        sv.Proposer(vllm_config(spec))


def test_the_drafts_dtype_follows_the_target_unless_given(dirs):
    spec = sv.speculative_config(str(dirs / "draft"), k_max=4)
    assert sv.Proposer(vllm_config(spec, dtype=torch.bfloat16)).core.runner.dtype == torch.bfloat16
    spec = sv.speculative_config(str(dirs / "draft"), k_max=4, dtype="float32")
    assert sv.Proposer(vllm_config(spec, dtype=torch.bfloat16)).core.runner.dtype == torch.float32


def test_the_draft_cache_is_allocated_within_its_budget(dirs):
    """cache_mb sets the buffer allocated at start-up (its share per row); without it every row holds
    max_model_len tokens; a budget too small for the candidates is refused in one line."""
    per_token = 2 * 2 * 2 * 8 * 4  # keys and values, 2 layers, 2 KV heads of 8 dims, fp32 (tiny_llama)
    spec = sv.speculative_config(str(dirs / "draft"), k_max=4, cache_mb=0.1)
    core = sv.Proposer(vllm_config(spec, seqs=4, max_len=512)).core
    assert core.runner.fixed and core.runner.capacity == int(0.1 * 2**20) // per_token // 4
    assert sum(k.numel() * k.element_size() * 2 for k in core.runner.keys) <= 0.1 * 2**20
    default = sv.Proposer(vllm_config(sv.speculative_config(str(dirs / "draft"), k_max=4), seqs=4, max_len=512))
    assert default.core.window >= 512
    spec = sv.speculative_config(str(dirs / "draft"), k_max=4, cache_mb=0.005)
    with pytest.raises(UserError, match="cache_mb=0.005") as err:
        sv.Proposer(vllm_config(spec, seqs=64))
    assert len(str(err.value).splitlines()) == 1


def test_propose_reads_vllms_rows(dirs):
    """Rows without sampled tokens (a prefill in progress) or at the length limit get no candidates; the
    others are cut to the room left; the sequence is ``token_ids_cpu[row, :num_tokens_no_spec[row]]``."""
    proposer = sv.Proposer(vllm_config(sv.speculative_config(str(dirs / "draft"), policy="sd", k_max=4), max_len=12))
    ids = np.zeros((3, 12), dtype=np.int64)
    ids[0, :5], ids[1, :3], ids[2, :12] = [1, 5, 9, 13, 7], [1, 4, 8], np.arange(1, 13)
    out = proposer.propose([[7], [], [12]], np.array([5, 3, 12]), ids)
    assert [len(c) for c in out] == [4, 0, 0]
    ids[0, 5:] = np.arange(20, 27)
    out = proposer.propose([[26]], np.array([11]), ids[:1])
    assert len(out[0]) == 0  # 11 tokens of 12: no room for a candidate and the target's own token
    assert proposer.stats["calls"] == 2 and proposer.stats["rows"] == 2


def test_the_profiler_reads_its_clock_after_the_gpus_queued_work(monkeypatch):
    """On CUDA a forward returns before its kernels finish: every clock the vLLM cost profiler reads (a draft
    forward's start and end, a step's) comes after a synchronize of the draft's device."""
    from specheads.vllm import profile

    events = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: events.append(("sync", str(device))))
    monkeypatch.setattr(profile.time, "perf_counter", lambda: events.append(("clock", None)) or float(len(events)))
    p = profile.Profiler.__new__(profile.Profiler)
    p.core = SimpleNamespace(runner=SimpleNamespace(device=torch.device("cuda", 1)))
    p._clock()
    p.core.runner.device = torch.device("cpu")  # a CPU runs eagerly: nothing to wait for
    p._clock()
    assert events == [("sync", "cuda:1"), ("clock", None), ("clock", None)]
