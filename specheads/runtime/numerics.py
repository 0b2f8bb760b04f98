"""The numerics settings that change results in the last bits: set, recorded, checked on resume.

"N processes = 1 process" (datagen) and "resumed = uninterrupted" (datagen, training) hold byte
for byte only when the runs compute the same way: the same threads per process (a CPU matmul
splits its sums by thread count), dtypes, devices, torch version and linear-kernel choice, besides
the same seed and config. :func:`numerics_settings` collects them for a manifest, a chunk footer
or a checkpoint; :func:`check_resume` warns in one line when a resume differs from them.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch

try:  # the decoding shim's linear-kernel choice, where the shim has a kernels module
    from specheads.shim import describe_kernels as kernel_path
except ImportError:
    kernel_path = None

log = logging.getLogger(__name__)


@contextmanager
def use_threads(threads: int | None) -> Iterator[int]:
    """Runs the block with ``threads`` intra-op threads per process (``None``: torch's default).

    The previous count is restored afterwards, so an in-process caller (a test) keeps its own.

    Yields:
        The thread count in force inside the block.
    """
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        yield torch.get_num_threads()
    finally:
        if threads is not None:
            torch.set_num_threads(before)


def _name(value: Any) -> str | None:
    return None if value is None else str(value).removeprefix("torch.")


def device_kind(value: Any) -> str | None:
    """A device as the numerics see it: its type without its index (``cuda:3`` -> ``cuda``), and for a
    GPU visible here its model (``cuda (NVIDIA H100 80GB HBM3)``).

    Which GPU of a node a process runs on changes no result, so one process per GPU records what one
    process records; the GPU's model (its kernels) can change the last bits, so it is kept.
    """
    if value is None:
        return None
    text = _name(value)
    kind = text.split(":", 1)[0]
    if kind == "cuda" and torch.cuda.is_available():
        try:
            return f"cuda ({torch.cuda.get_device_name(torch.device(text))})"
        except (RuntimeError, AssertionError, ValueError):  # an index this process cannot see
            return kind
    return kind


def numerics_settings(processes: int | None, dtypes: Mapping[str, Any], devices: Mapping[str, Any]) -> dict:
    """The settings in force now that decide results bit for bit, as JSON-able values.

    Args:
        processes: The run's process count (``None`` where it is not known).
        dtypes: Role -> dtype, e.g. ``{"target": torch.float32, "draft": torch.float32}``.
        devices: Role -> device, e.g. ``{"target": "cpu", "draft": "cuda:0"}`` (recorded by
            :func:`device_kind`: ``cpu``, ``cuda (<GPU model>)``, never an index).

    Returns:
        ``threads`` (``torch.get_num_threads()``), ``processes``, ``dtypes``, ``devices``,
        ``torch`` (version) and ``kernel_path`` (the shim's ``describe()``, without :data:`HISTORY`;
        ``None`` without the shim's kernels module).
    """
    return without(
        {
            "threads": torch.get_num_threads(),
            "processes": processes,
            "dtypes": {k: _name(v) for k, v in dtypes.items()},
            "devices": {k: device_kind(v) for k, v in devices.items()},
            "torch": torch.__version__,
            "kernel_path": kernel_path() if kernel_path is not None else None,
        }
    )


#: What ``describe()`` tells of what the process has run so far rather than how it computes: the
#: kernel choices made up to now (per shape; the policy and the machine, recorded, decide them from
#: the machine's measured choices). Never recorded (a chunk's footer must not depend on which
#: chunks its process labelled before) nor compared.
HISTORY = ("kernel_path.choices",)


def _skipped(key: str, names: Iterable[str]) -> bool:
    return any(key == n or key.startswith(n + ".") for n in names)


def _flat(record: Mapping[str, Any], prefix: str = "") -> dict:
    out = {}
    for key, value in record.items():
        if isinstance(value, Mapping) and value:
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def without(record: Mapping[str, Any], names: Iterable[str] = ()) -> dict:
    """A copy of ``record`` without the dotted paths ``names`` and without :data:`HISTORY`."""
    names = [*HISTORY, *names]

    def keep(node: Mapping[str, Any], prefix: str) -> dict:
        return {
            k: keep(v, f"{prefix}{k}.") if isinstance(v, Mapping) else v
            for k, v in node.items()
            if not _skipped(f"{prefix}{k}", names)
        }

    return keep(record, "")


def differences(recorded: Mapping[str, Any], current: Mapping[str, Any], ignore: Iterable[str] = ()) -> dict:
    """Setting -> (recorded, current) for each differing setting, as dotted paths (``kernel_path.policy``);
    :data:`HISTORY` and ``ignore`` (dotted paths or their prefixes) left out."""
    names = [*HISTORY, *ignore]
    old, new = _indexless(_flat(recorded)), _indexless(_flat(current))
    keys = [k for k in dict.fromkeys([*old, *new]) if not _skipped(k, names)]
    return {k: (old.get(k), new.get(k)) for k in keys if old.get(k) != new.get(k)}


def _indexless(flat: dict) -> dict:
    """Devices recorded with an index (``cuda:1``, before :func:`device_kind`) compared without it."""
    out = dict(flat)
    for k, v in flat.items():
        indexed = re.fullmatch(r"(\w+):\d+", v) if k.startswith("devices.") and isinstance(v, str) else None
        if indexed:
            out[k] = indexed.group(1)
    return out


def check_resume(
    recorded: Mapping[str, Any] | None, current: Mapping[str, Any], what: str, ignore: Iterable[str] = ()
) -> list[str]:
    """Warns in one line when a resume computes otherwise than the run it continues.

    Args:
        recorded: The settings the earlier run recorded (``None``: it recorded none, nothing to check).
        current: :func:`numerics_settings` of this run.
        what: What recorded them, for the message, e.g. ``"checkpoint runs/t/checkpoint-8"``.
        ignore: Settings (dotted paths) that do not change this output (datagen: ``processes``).

    Returns:
        The names of the settings that differ (empty when none do).
    """
    if not recorded:
        return []
    diff = differences(recorded, current, ignore)
    if diff:
        said = ", ".join(f"{k}={old!r} now {new!r}" for k, (old, new) in diff.items())
        log.warning(
            "resuming with other numerics settings than %s recorded (%s): the outputs will not be "
            "byte-identical to an uninterrupted run; rerun with the recorded settings (e.g. threads=N) "
            "for that",
            what,
            said,
        )
    return list(diff)
