"""Linear-kernel choice: every candidate computes F.linear; choices are measured once per machine
and reused; routing the model's own forward keeps its outputs; autograd stays on F.linear."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from conftest import tiny_llama

from specheads.shim.loop.engine import Engine
from specheads.shim.runners import kernels, smallm
from specheads.shim.runners.fused import unfuse


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
    cands = kernels._candidates(dtype, rows)
    assert "torch:row" in cands and "torch:col" in cands
    assert ("smallm:row" in cands) == (dtype == torch.float32 and rows <= 8 and smallm.available())
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
    assert name == "48x32:float32:nobias:r3:row" and choice in kernels._candidates(torch.float32, 3)
    assert set(saved["times_us"][name]) == set(kernels._candidates(torch.float32, 3))
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
    w = w.clone()  # a weight remembers its own choice: a new one (as in a new process) reads the file
    with torch.inference_mode():
        kernels.linear(x, w)
        kernels.linear(x, w)  # the second call takes the weight's memo
    assert seen == ["torch:col"]
    assert w._specheads_kernel[1][(2, False, torch.get_num_threads(), "auto")][0] == "torch"


def test_a_weight_changed_in_place_is_not_served_from_its_memo(monkeypatch):
    monkeypatch.setattr(kernels, "_choose", lambda *a, **k: "torch:col")  # a column-major copy of a row-major w
    w = torch.randn(24, 16)
    x = torch.randn(3, 16)
    with torch.inference_mode():
        kernels.linear(x, w)
        kernels.linear(x, w)
    with torch.no_grad():
        w.mul_(2.0)  # a training step: the version moves on, every cached layout copy is stale
    with torch.inference_mode():
        torch.testing.assert_close(kernels.linear(x, w), F.linear(x, w), rtol=1e-5, atol=1e-4)


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
    from specheads.shim.policies import StandardSD

    assert engine.generate_ar([1, 7, 9, 11], 16).tokens == want
    assert engine.generate([1, 7, 9, 11], StandardSD(3), 16).tokens == want
    kernels.unroute(target)
    assert "forward" not in target.model.layers[0].mlp.up_proj.__dict__
    unfuse(target)


def test_fused_forward_is_the_default_on_cpu_only(monkeypatch):
    """On CUDA the model's own forward is the default (the fused one measured slower on an H100)."""
    from specheads.shim.runners.fused import use_fused

    model = tiny_llama(40, layers=1)
    assert use_fused(model)
    meta = model.to("meta")  # stands in for a non-CPU device: no GPU here
    monkeypatch.delenv("SPECHEADS_FUSED_CUDA", raising=False)
    assert not use_fused(meta)
    monkeypatch.setenv("SPECHEADS_FUSED_CUDA", "1")
    assert use_fused(meta)


needs_smallm = pytest.mark.skipif(not smallm.available(), reason=f"smallm not built here: {smallm.why_not()}")


@needs_smallm
@pytest.mark.parametrize("rows", range(1, 9))
@pytest.mark.parametrize("shape", [(96, 64), (19, 37), (200, 576), (7, 16)])
def test_smallm_equals_f_linear_for_every_row_count_and_shape(rows, shape):
    """Every row count takes its own unrolled path; odd widths go through the scalar tail and the
    single-weight-row path after the last block of eight."""
    g = torch.Generator().manual_seed(rows * 1000 + shape[0])
    w, b = torch.randn(*shape, generator=g), torch.randn(shape[0], generator=g)
    x = torch.randn(rows, shape[1], generator=g)
    with torch.inference_mode():
        torch.testing.assert_close(smallm.linear(x, w, b), F.linear(x, w, b), rtol=1e-5, atol=1e-4)
        torch.testing.assert_close(smallm.linear(x, w), F.linear(x, w), rtol=1e-5, atol=1e-4)


@needs_smallm
def test_smallm_keeps_leading_dims_and_reads_strided_rows():
    w = torch.randn(40, 32)
    x = torch.randn(1, 6, 64)[..., ::2]  # [1, 6, 32], not contiguous
    with torch.inference_mode():
        got = smallm.linear(x, w)
    assert got.shape == (1, 6, 40)
    torch.testing.assert_close(got, F.linear(x, w), rtol=1e-5, atol=1e-4)


@needs_smallm
def test_smallm_refuses_what_it_does_not_compute():
    with torch.inference_mode():
        with pytest.raises(RuntimeError, match="1 to 8 rows"):
            smallm.linear(torch.randn(9, 16), torch.randn(8, 16))
        with pytest.raises(RuntimeError, match="float32 only"):
            smallm.linear(torch.randn(2, 16, dtype=torch.float64), torch.randn(8, 16, dtype=torch.float64))


@needs_smallm
def test_smallm_is_timed_where_it_can_run_and_only_there():
    assert "smallm:row" in kernels._candidates(torch.float32, 8)
    assert "smallm:row" not in kernels._candidates(torch.float32, 16)
    assert "smallm:row" not in kernels._candidates(torch.bfloat16, 4)
    assert kernels.signature() == "auto+smallm"
    # a column-major weight is given to it row-major (a cached copy), and the result is the same product
    w, x = torch.randn(64, 48).t().contiguous().t(), torch.randn(4, 48)
    with torch.inference_mode():
        torch.testing.assert_close(kernels._run("smallm:row", x, w, None, "col"), F.linear(x, w), rtol=1e-5, atol=1e-4)


def test_smallm_can_be_turned_off(monkeypatch):
    monkeypatch.setenv("SPECHEADS_SMALLM", "0")
    monkeypatch.setattr(smallm, "_state", {})
    assert not smallm.available() and smallm.why_not() == "SPECHEADS_SMALLM=0"
    assert "smallm:row" not in kernels._candidates(torch.float32, 4)
    assert kernels.signature() == "auto"


def test_empty_input_and_a_strided_bias_are_taken_like_f_linear():
    w, b = torch.randn(24, 16), torch.randn(48)[::2]  # a bias that is not contiguous
    with torch.inference_mode():
        for rows in (0, 3):
            x = torch.randn(rows, 16)
            for _ in range(2):  # the first call chooses, the second takes the weight's memo
                torch.testing.assert_close(kernels.linear(x, w, b), F.linear(x, w, b), rtol=1e-5, atol=1e-4)
        if smallm.available():
            torch.testing.assert_close(smallm.linear(x, w, b), F.linear(x, w, b), rtol=1e-5, atol=1e-4)


def test_the_memo_holds_no_reference_to_its_own_weight():
    import gc
    import weakref

    w = torch.randn(24, 16)
    with torch.inference_mode():
        kernels.linear(torch.randn(2, 16), w)
    ref = weakref.ref(w)
    gc.disable()
    try:
        del w
        assert ref() is None  # freed at once, not left to the cycle collector
    finally:
        gc.enable()
