"""The ``smallm`` linear kernel: float32 ``y = x @ w.T + b`` for 1 to 8 rows, built on this machine.

On an Intel Xeon (AVX-512, 2 threads), over the target's 30 layers of projections, the fastest library kernel
``kernels.py`` can pick ran a verification pass's 4 rows at 1.38x the best one-row cost (MKL's ``F.linear``
1.73x: it jumps at 4 rows), although 4 rows read the same weights and a forward is bound by reading them.
``smallm.cpp`` reads each weight row once and multiplies it into every input row while it is in registers,
eight weight rows at a time with a prefetch ahead on each: 1.15x at 4 rows, 1.5x at 8 (``gemm_stack`` in
``bench/results/forward_cost_xeon.json``). It is one more candidate for the picker, timed against the others per
machine, shape and row count; it never replaces them unmeasured.

It is compiled once per machine (about 10 s; ``-O3 -march=native``, OpenMP through ATen's ``parallel_for``, so
it shares torch's threads) with the compiler torch's C++ extensions use, into ``$SPECHEADS_BUILD`` (default
``~/.cache/specheads/build``; not under ``$SPECHEADS_CACHE``, so a test's private cache does not rebuild it),
in a folder named by a hash of the source, torch's version and the CPU. Without a compiler, off x86, or with
``SPECHEADS_SMALLM=0``, :func:`available` is False (logged once) and the picker has one candidate fewer.
"""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path

import torch

from specheads.machine import cpu_flags, cpu_model, locked

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("smallm.cpp")
MAX_ROWS = 8
_state: dict[str, object] = {}  # "ok": bool, "why": str


def build_dir() -> Path:
    """``$SPECHEADS_BUILD`` or ``~/.cache/specheads/build``, created on demand."""
    root = Path(os.environ.get("SPECHEADS_BUILD") or Path.home() / ".cache" / "specheads" / "build")
    root.mkdir(parents=True, exist_ok=True)
    return root


def _name() -> str:
    h = hashlib.sha256()
    for part in (SOURCE.read_bytes(), torch.__version__.encode(), cpu_model().encode(), cpu_flags().encode()):
        h.update(part)
    return f"specheads_smallm_{h.hexdigest()[:12]}"


def _load() -> None:
    if os.environ.get("SPECHEADS_SMALLM", "1") == "0":
        raise RuntimeError("SPECHEADS_SMALLM=0")
    import platform

    if platform.machine() not in ("x86_64", "AMD64"):
        raise RuntimeError(f"built for x86-64 only, this is {platform.machine()}")
    from torch.utils import cpp_extension

    name = _name()
    where = build_dir() / name
    where.mkdir(parents=True, exist_ok=True)
    with locked(where / "build"):  # several processes starting together build once
        # torch's own baton file: left behind by a build that was killed, it would make every later load wait
        # forever; no other process can be building while we hold our lock
        (where / "lock").unlink(missing_ok=True)
        cpp_extension.load(
            name=name,
            sources=[str(SOURCE)],
            extra_cflags=["-O3", "-march=native", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
            build_directory=str(where),
            is_python_module=False,
            verbose=False,
        )
    torch.ops.specheads_smallm.linear  # noqa: B018  # raises if the library did not register the op


def available() -> bool:
    """Whether the kernel is built and loaded in this process (builds it on first call)."""
    if "ok" not in _state:
        try:
            _load()
            _state["ok"] = True
        except Exception as exc:  # no compiler, no headers, a failed build: one candidate fewer
            text = str(exc).strip()
            _state.update(ok=False, why=text.splitlines()[-1][:300] if text else repr(exc))
            log.warning("the smallm kernel is not available here (%s); the library kernels remain", _state["why"])
    return bool(_state["ok"])


def why_not() -> str | None:
    """Why :func:`available` is False (None when it is available or not yet asked)."""
    return None if _state.get("ok", True) else str(_state.get("why"))


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, w, b)`` for float32 CPU tensors with 1 to 8 rows (``x [..., K]``, ``w [N, K]`` row-major)."""
    rows = x.reshape(-1, x.shape[-1])
    if not rows.is_contiguous():
        rows = rows.contiguous()
    out = torch.ops.specheads_smallm.linear(rows, w, b.contiguous() if b is not None else None)
    return out.view(*x.shape[:-1], w.shape[0])
