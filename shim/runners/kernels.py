"""Which matrix-multiply kernel runs a linear layer with few rows: chosen by timing, on this machine.

On a CPU, decoding at batch 1 is bound by reading the weights, so a forward over 2-8 tokens
(a verification pass) should cost about what one token costs. Whether it does depends on the
kernel the library picks for a small row count, and that differs between CPUs and library
builds: on one 2-core AMD EPYC with MKL 2024.2 / oneDNN 3.12, ``F.linear`` on a 3072x576
weight took 2-4x longer for 2-8 rows than for one, while oneDNN's linear
(``torch.ops.mkldnn._linear_pointwise``, the kernel inductor emits for frozen CPU linears) stayed
within 1.5x. No fixed table is right everywhere, so the choice is measured:

* candidates: ``F.linear`` and oneDNN's linear (CPU, fp32/bf16), each on the weight stored
  row-major and column-major (a column-major copy is made on first need); and for float32 at 1 to 8 rows
  ``smallm`` (:mod:`.smallm`, built on this machine), which keeps a 4-row pass near the cost of one row where
  the libraries do not (on one Intel Xeon, 2 threads: MKL's ``F.linear`` over the target's 30 layers of
  projections 16.8 / 17.4 / 19.2 / 29.0 ms at 1-4 rows, ``smallm`` 16.4 / 17.5 / 18.3 / 18.9 ms;
  ``gemm_stack`` in ``bench/results/forward_cost_xeon.json``);
* for each weight shape, dtype and row-count bucket (1..8, 16, 32, 64, 256), the candidates are
  timed on random data of that shape (interleaved, best of several rounds; each round runs over copies of
  the weight that together exceed the core's caches, as a decoding forward's weights do) the first time that
  shape is used, and the winner is kept in ``$SPECHEADS_CACHE/kernels/<machine>.json``;
  the machine key covers the CPU model, torch and its math libraries, and the thread count;
* the file is written under a lock, so several processes starting together measure once and
  use the same choice (their outputs then agree bit for bit).

Every candidate computes the same product; results agree with ``F.linear`` to float rounding
(tested), so greedy outputs are unchanged up to near-ties. Under autograd (a weight or input
that requires grad) and on GPUs, ``F.linear`` is always used.

Policy (``SPECHEADS_KERNELS`` or :func:`set_policy`): ``auto`` (measured, the default), ``library`` (measured,
among the library kernels only: the picker before ``smallm``, for comparisons), ``torch``
(always ``F.linear`` on the stored weight), ``onednn`` (always oneDNN where it applies; for tests).
"""

from __future__ import annotations

import logging
import os
import time
import types
from pathlib import Path

import torch
import torch.nn.functional as F

from specheads.errors import UserError
from specheads.machine import cache_dir, locked, machine_info, read_json, settings_key
from specheads.outputs import atomic_write_json
from specheads.shim.runners import smallm

log = logging.getLogger(__name__)

POLICIES = ("auto", "library", "torch", "onednn")
BUCKETS = (1, 2, 3, 4, 5, 6, 7, 8, 16, 32, 64, 256)
_BUCKET_OF = [0] + [next(b for b in BUCKETS if b >= r) for r in range(1, BUCKETS[-1] + 1)]
#: A candidate that needs a copy of the weight in the other layout must be this much faster.
COPY_MARGIN = 0.9
#: Any other candidate must be this much faster than ``F.linear`` on the stored weight (a tie stays on it).
SWITCH_MARGIN = 0.95
COLD_BYTES, MAX_COPIES = 48 << 20, 64  # candidates are timed on copies of a weight this large together
TIMING = "cold-2"  # bumped when the way candidates are timed changes (old choices files are then not read)

_policy = os.environ.get("SPECHEADS_KERNELS", "auto")
_choices: dict[tuple, str] = {}  # (out, in, dtype, bias, bucket, threads, layout, own) -> "kernel:layout"
_used: dict[str, str] = {}  # readable key -> choice, for describe()


def set_policy(name: str) -> None:
    """``auto`` | ``library`` | ``torch`` | ``onednn``; see the module docstring."""
    global _policy
    if name not in POLICIES:
        raise UserError(f"kernels={name!r} is not one of {list(POLICIES)}")
    _policy = name


def policy() -> str:
    return _policy


def signature() -> str:
    """The policy and, under ``auto``, whether ``smallm`` is a candidate (cost tables are keyed by it)."""
    return f"{_policy}+smallm" if _policy == "auto" and smallm.available() else _policy


def _onednn_ok(dtype: torch.dtype) -> bool:
    if not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.float32:
        return True
    return dtype == torch.bfloat16 and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def _layout_of(w: torch.Tensor) -> str:
    if w.is_contiguous():
        return "row"
    return "col" if w.t().is_contiguous() else "other"


def _stamp(w: torch.Tensor) -> tuple:
    """Identifies the weight's current contents (inference tensors cannot change in place)."""
    return w.data_ptr(), (0 if w.is_inference() else w._version)


def _in_layout(w: torch.Tensor, layout: str, stored: str | None = None) -> torch.Tensor:
    """``w`` stored ``layout`` (row- or column-major): itself, or a cached copy (``stored``: ``w``'s own
    layout when the caller knows it)."""
    if (stored or _layout_of(w)) == layout:
        return w
    hit = getattr(w, "_specheads_layouts", None)  # copies live as long as the weight itself
    if hit is not None and hit[0] == _stamp(w) and layout in hit[1]:
        return hit[1][layout]
    with torch.inference_mode(False), torch.no_grad():
        copy = w.detach().contiguous() if layout == "row" else w.detach().t().contiguous().t()
    store = hit[1] if hit is not None and hit[0] == _stamp(w) else {}
    store[layout] = copy
    w._specheads_layouts = (_stamp(w), store)  # type: ignore[attr-defined]  # our cache, on the weight
    return copy


def _run(
    choice: str, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, stored: str | None = None
) -> torch.Tensor:
    kernel, layout = choice.split(":")
    return _call(kernel, x, _in_layout(w, layout, stored), b)


def _call(kernel: str, x: torch.Tensor, wl: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """``kernel`` (``torch``, ``onednn`` or ``smallm``) on the weight already in its layout."""
    if kernel == "torch":
        return F.linear(x, wl, b)
    if kernel == "smallm":
        return smallm.linear(x, wl, b)
    return torch.ops.mkldnn._linear_pointwise(x, wl, b, "none", [], "")


def _smallm_ok(dtype: torch.dtype, rows: int) -> bool:
    return dtype == torch.float32 and 1 <= rows <= smallm.MAX_ROWS and smallm.available()


def _candidates(dtype: torch.dtype, rows: int = 1, own: bool = True) -> list[str]:
    """The kernels timed for ``dtype`` at ``rows`` rows (``own=False``: the library kernels only)."""
    kernels = ["torch"] + (["onednn"] if _onednn_ok(dtype) else [])
    mine = ["smallm:row"] if own and _smallm_ok(dtype, rows) else []
    return [f"{k}:{lay}" for k in kernels for lay in ("row", "col")] + mine


def _time(choices: list[str], rows: int, out: int, inp: int, dtype: torch.dtype, bias: bool) -> dict[str, float]:
    """Seconds per call of each candidate, best of interleaved rounds on random data.

    Each round calls the candidate once on every one of several copies of the weight, together at least
    :data:`COLD_BYTES`, so that no call finds its weight in the core's caches: a decoding forward streams
    weights far larger than the caches, and a kernel that wins on a cache-resident weight (compute-bound)
    can lose on a streamed one (bound by reading it), and the other way round."""
    gen = torch.Generator().manual_seed(0)
    size = out * inp * torch.empty((), dtype=dtype).element_size()
    copies = max(1, min(MAX_COPIES, -(-COLD_BYTES // size)))
    ws = [torch.empty(out, inp, dtype=torch.float32).uniform_(-1, 1, generator=gen).to(dtype) for _ in range(copies)]
    x = torch.randn(rows, inp, generator=gen).to(dtype)
    b = torch.randn(out, generator=gen).to(dtype) if bias else None
    with torch.inference_mode():
        for c in choices:  # warm-up (also builds the layout copies)
            for w in ws:
                _run(c, x, w, b)
        reps = max(1, -(-8 // copies))  # at least 8 calls per timing
        best = {c: float("inf") for c in choices}
        for _ in range(5):
            for c in choices:
                t = time.perf_counter()
                for _ in range(reps):
                    for w in ws:
                        _run(c, x, w, b)
                best[c] = min(best[c], (time.perf_counter() - t) / (reps * copies))
    return best


def _file(own: bool = True) -> Path:
    """The machine's choices file: keyed by the machine and by whether ``smallm`` is among the candidates."""
    info = {**machine_info("cpu"), "smallm": own and smallm.available(), "timing": TIMING}
    return cache_dir("kernels") / f"{settings_key(info)}.json"


def _choose(out: int, inp: int, dtype: torch.dtype, bias: bool, bucket: int, stored: str, own: bool = True) -> str:
    """The measured best candidate for this shape and bucket (read from the machine's file, or timed)."""
    name = f"{out}x{inp}:{str(dtype).replace('torch.', '')}:{'bias' if bias else 'nobias'}:r{bucket}:{stored}"
    path = _file(own)
    with locked(path):
        saved = read_json(path) or {}
        choice = saved.get("choices", {}).get(name)
        if choice is None:
            cands = _candidates(dtype, bucket, own)
            times = _time(cands, bucket, out, inp, dtype, bias)
            in_place = {c: t for c, t in times.items() if c.endswith(":" + stored)} or times
            best_own = min(in_place, key=lambda c: in_place[c])
            best_any = min(times, key=lambda c: times[c])
            choice = best_any if times[best_any] < COPY_MARGIN * times[best_own] else best_own
            default = f"torch:{stored}"
            if default in times and times[choice] > SWITCH_MARGIN * times[default]:
                choice = default  # within noise of F.linear on the stored weight: keep it
            saved.setdefault("machine", machine_info("cpu"))
            saved.setdefault("choices", {})[name] = choice
            saved.setdefault("times_us", {})[name] = {c: round(t * 1e6, 2) for c, t in times.items()}
            atomic_write_json(path, saved)
            log.info(
                "kernel for %s: %s (%s)",
                name,
                choice,
                ", ".join(f"{c} {t * 1e6:.0f} us" for c, t in sorted(times.items(), key=lambda kv: kv[1])),
            )
    _used[name if own else name + ":library"] = choice
    return choice


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, w, b)`` through the kernel chosen for this shape and row count.

    A weight remembers its choices (``w._specheads_kernel``: its stamp, then per row bucket, bias, thread
    count and policy the kernel and the weight's copy in that kernel's layout, None for the weight itself),
    so a call after the first costs one attribute read and one dict lookup on top of the kernel."""
    if (
        _policy == "torch"
        or x.device.type != "cpu"
        or x.dtype != w.dtype
        or (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad))
    ):
        return F.linear(x, w, b)
    if _policy == "onednn":
        return _run("onednn:row", x, w, b) if _onednn_ok(w.dtype) else F.linear(x, w, b)
    if not x.numel():
        return F.linear(x, w, b)
    rows = x.numel() // x.shape[-1]
    bucket = _BUCKET_OF[min(rows, BUCKETS[-1])]
    fast = (bucket, b is not None, torch.get_num_threads(), _policy)
    memo = getattr(w, "_specheads_kernel", None)
    stamp = _stamp(w)
    if memo is not None and memo[0] == stamp:
        hit = memo[1].get(fast)
        if hit is not None:
            kernel, copy = hit
            return _call(kernel, x, w if copy is None else copy, b)
    stored = _layout_of(w)
    key = (w.shape[0], w.shape[1], w.dtype, b is not None, bucket, fast[2], stored, _policy == "auto")
    choice = _choices.get(key)
    if choice is None:
        choice = _choices[key] = _choose(key[0], key[1], key[2], key[3], key[4], stored, key[7])
    out = _run(choice, x, w, b, stored)
    kernel, layout = choice.split(":")
    table = memo[1] if memo is not None and memo[0] == stamp else {}
    wl = _in_layout(w, layout, stored)
    table[fast] = (kernel, None if wl is w else wl)  # never the weight itself: no reference cycle keeps it alive
    w._specheads_kernel = (stamp, table)  # type: ignore[attr-defined]  # our memo, on the weight
    return out


def prepare(model: torch.nn.Module, rows=BUCKETS) -> None:
    """Measures (or reads) the choice for every linear shape of ``model`` at these row counts (default: every
    bucket, so every pass size, prefill and batch) now, so that no timing happens inside a decode being measured."""
    prepare_weights([(m.weight, m.bias) for m in model.modules() if isinstance(m, torch.nn.Linear)], rows)


def prepare_weights(weights, rows=BUCKETS) -> None:
    """:func:`prepare` for ``(weight, bias)`` pairs (a fused forward's concatenated projections)."""
    if _policy not in ("auto", "library"):
        return
    with torch.inference_mode():
        seen = set()
        for w, bias in weights:
            if w.device.type != "cpu":
                continue
            for r in rows:
                key = (tuple(w.shape), w.dtype, bias is not None, _BUCKET_OF[min(r, BUCKETS[-1])], _layout_of(w))
                if key not in seen:
                    seen.add(key)
                    linear(torch.zeros(r, w.shape[1], dtype=w.dtype), w, bias)


def _linear_forward(self, x):
    return linear(x, self.weight, self.bias)


def route(model: torch.nn.Module) -> torch.nn.Module:
    """Sends every ``nn.Linear`` of ``model`` on the CPU through :func:`linear` (the model's own
    forward then benefits too); idempotent; :func:`unroute` undoes it."""
    for mod in model.modules():
        if type(mod) is torch.nn.Linear and "forward" not in mod.__dict__:
            mod.forward = types.MethodType(_linear_forward, mod)  # type: ignore[method-assign]
    return model


def unroute(model: torch.nn.Module) -> None:
    for mod in model.modules():
        if type(mod) is torch.nn.Linear and "forward" in mod.__dict__:
            del mod.forward


def describe() -> dict:
    """The kernel policy and the choices made so far in this process (for manifests)."""
    return {"policy": _policy, "machine": machine_info("cpu"), "choices": dict(sorted(_used.items()))}
