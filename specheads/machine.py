"""What this machine is, and where per-machine measurements are cached.

Kernel choices (:mod:`specheads.shim.runners.kernels`) and step-cost tables
(:mod:`specheads.shim.costs.cost_table`) are measured once per machine and settings and reused.
They live under ``$SPECHEADS_CACHE`` (default ``~/.cache/specheads``) as small JSON files,
written atomically and under a file lock so that several processes starting together measure
once and then agree.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import platform
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterator

import torch


def cache_dir(sub: str = "") -> Path:
    """``$SPECHEADS_CACHE/<sub>`` (default ``~/.cache/specheads/<sub>``), created on demand."""
    root = os.environ.get("SPECHEADS_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "specheads")
    path = Path(root) / sub if sub else Path(root)
    path.mkdir(parents=True, exist_ok=True)
    return path


def _cpuinfo(field: str) -> str | None:
    """The first ``field`` of ``/proc/cpuinfo`` (None where there is no such file or field)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith(field):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


@lru_cache(maxsize=1)
def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``; ``platform.processor()`` elsewhere)."""
    return _cpuinfo("model name") or platform.processor() or platform.machine()


@lru_cache(maxsize=1)
def cpu_flags() -> str:
    """The CPU's feature flags (``/proc/cpuinfo``; empty elsewhere): what ``-march=native`` compiles for."""
    return _cpuinfo("flags") or ""


@lru_cache(maxsize=1)
def _libraries() -> str:
    """Math-library versions of this torch build (MKL, oneDNN, CPU capability), one string."""
    show = torch.__config__.show()
    keep = [
        ln.strip()
        for ln in show.splitlines()
        if any(k in ln for k in ("Math Kernel Library", "MKL-DNN", "oneDNN", "CPU capability", "OpenBLAS"))
    ]
    return " | ".join(keep)


def machine_info(device: str | torch.device = "cpu") -> dict[str, Any]:
    """The facts that change which kernel is fastest and what a forward costs."""
    dev = torch.device(device)
    info: dict[str, Any] = {"torch": torch.__version__, "device": dev.type}
    if dev.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(dev)
    else:
        info.update(cpu=cpu_model(), cores=os.cpu_count(), threads=torch.get_num_threads(), libraries=_libraries())
    return info


def settings_key(obj: Any) -> str:
    """A short stable hash of a JSON-able object (cache file names)."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    """An exclusive advisory lock on ``path.lock`` for the duration of the block."""
    lock = path.with_suffix(path.suffix + ".lock")
    with open(lock, "a+") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def read_json(path: Path) -> dict | None:
    """The JSON object in ``path``, or None when it is missing or unreadable (then it is re-measured)."""
    try:
        with open(path, encoding="utf-8") as fh:
            obj = json.load(fh)
        return obj if isinstance(obj, dict) else None
    except (OSError, ValueError):
        return None
