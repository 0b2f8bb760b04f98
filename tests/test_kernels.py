"""Linear-kernel choice: every candidate computes F.linear; choices are measured once per machine
and reused; routing the model's own forward keeps its outputs; autograd stays on F.linear."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from conftest import tiny_llama

from specheads.export.shim.loop.engine import Engine
from specheads.export.shim.runners import kernels
from specheads.export.shim.runners.fused import unfuse


@pytest.fixture(autouse=True)
def _fresh(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECHEADS_CACHE", str(tmp_path))
    monkeypatch.setattr(kernels, "_choices", {})
    monkeypatch.setattr(kernels, "_used", {})
    yield
    kernels.set_policy("auto")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 40])
def test_every_candidate_equals_f_linear(dtype, rows):
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(96, 64, generator=g).to(dtype)
    b = torch.randn(96, generator=g).to(dtype)
    x = torch.randn(1, rows, 64, generator=g).to(dtype)
    want = F.linear(x.float(), w.float(), b.float())
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    cands = kernels._candidates(dtype)
    assert "torch:row" in cands and "torch:col" in cands
    with torch.inference_mode():
        for c in cands:
            got = kernels._run(c, x, w, b)
            assert got.shape == want.shape and got.dtype == dtype
            torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol * 8, msg=c)
        for w_layout in (w, w.t().contiguous().t()):
            torch.testing.assert_close(kernels.linear(x, w_layout, b).float(), want, rtol=tol, atol=tol * 8)


def test_choice_is_measured_once_then_read_from_the_machine_file(monkeypatch, tmp_path):
    w, x = torch.randn(48, 32), torch.randn(3, 32)
    with torch.inference_mode():
        kernels.linear(x, w)
    files = list((tmp_path / "kernels").glob("*.json"))
    assert len(files) == 1
    saved = json.loads(files[0].read_text())
    ((name, choice),) = saved["choices"].items()
    assert name == "48x32:float32:nobias:r3:row" and choice in kernels._candidates(torch.float32)
    assert set(saved["times_us"][name]) == set(kernels._candidates(torch.float32))
    assert saved["machine"]["threads"] == torch.get_num_threads()
    # A new process (empty memo) reads the file: no timing.
    monkeypatch.setattr(kernels, "_choices", {})
    monkeypatch.setattr(kernels, "_time", lambda *a, **k: pytest.fail("re-measured a cached shape"))
    with torch.inference_mode():
        kernels.linear(torch.randn(3, 32), w)
    assert kernels.describe()["choices"] == {name: choice}


def test_a_forced_choice_is_used(monkeypatch, tmp_path):
    w, x = torch.randn(48, 32), torch.randn(2, 32)
    with torch.inference_mode():
        kernels.linear(x, w)
    path = next((tmp_path / "kernels").glob("*.json"))
    saved = json.loads(path.read_text())
    saved["choices"] = {k: "torch:col" for k in saved["choices"]}
    path.write_text(json.dumps(saved))
    monkeypatch.setattr(kernels, "_choices", {})
    seen = []
    run = kernels._run
    monkeypatch.setattr(kernels, "_run", lambda c, *a: seen.append(c) or run(c, *a))
    with torch.inference_mode():
        kernels.linear(x, w)
    assert seen == ["torch:col"]


def test_autograd_and_other_devices_stay_on_f_linear(monkeypatch):
    monkeypatch.setattr(kernels, "_run", lambda *a: pytest.fail("kernel path under autograd"))
    w = torch.randn(8, 4, requires_grad=True)
    y = kernels.linear(torch.randn(2, 4), w)
    y.sum().backward()
    assert w.grad is not None


def test_bad_policy_is_a_user_error():
    with pytest.raises(Exception, match="kernels='fast'"):
        kernels.set_policy("fast")


@pytest.mark.parametrize("policy", ["auto", "torch", "onednn"])
@pytest.mark.parametrize("fused", [True, False])
def test_greedy_outputs_unchanged_under_every_policy(policy, fused):
    target = tiny_llama(60, seed=4, layers=2)
    draft = tiny_llama(60, seed=5, layers=1)
    with torch.no_grad():
        want = target.generate(torch.tensor([[1, 7, 9, 11]]), max_new_tokens=16, do_sample=False, pad_token_id=2)[
            0, 4:
        ].tolist()
    kernels.set_policy(policy)
    kernels.route(target)
    kernels.route(draft)
    engine = Engine(target, draft, eos_token_ids=[], fused=fused)
    from specheads.export.shim.policies import StandardSD

    assert engine.generate_ar([1, 7, 9, 11], 16).tokens == want
    assert engine.generate([1, 7, 9, 11], StandardSD(3), 16).tokens == want
    kernels.unroute(target)
    assert "forward" not in target.model.layers[0].mlp.up_proj.__dict__
    unfuse(target)


def test_fused_forward_is_the_default_on_cpu_only(monkeypatch):
    """On CUDA the model's own forward is the default (the fused one measured slower on an H100)."""
    from specheads.export.shim.runners.fused import use_fused

    model = tiny_llama(40, layers=1)
    assert use_fused(model)
    meta = model.to("meta")  # stands in for a non-CPU device: no GPU here
    monkeypatch.delenv("SPECHEADS_FUSED_CUDA", raising=False)
    assert not use_fused(meta)
    monkeypatch.setenv("SPECHEADS_FUSED_CUDA", "1")
    assert use_fused(meta)
