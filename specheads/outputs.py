"""Output directories: atomic writes, the resolved config, a manifest, ``metrics.jsonl``."""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import logging
import os
import platform
import socket
import sys
import tempfile
from importlib import metadata
from pathlib import Path
from typing import Any

from specheads import __version__
from specheads.errors import UserError

logger = logging.getLogger(__name__)

CONFIG_FILE = "config.yaml"
MANIFEST_FILE = "manifest.json"
METRICS_FILE = "metrics.jsonl"


def _jsonable(value: Any) -> Any:
    """``json.dumps`` fallback: paths as str, numpy/torch scalars via ``.item()``."""
    if isinstance(value, Path):
        return str(value)
    if hasattr(value, "item"):
        try:
            return value.item()
        except (TypeError, ValueError):
            pass
    if hasattr(value, "tolist"):
        return value.tolist()
    raise TypeError(f"{type(value).__name__} is not JSON serialisable")


def fsync(path: str | Path) -> None:
    """Flushes a file, or the renames and creations inside a directory, to disk so that a crash of the machine
    keeps them (where the platform can open the path; elsewhere a no-op)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # a filesystem that cannot sync a directory (some network mounts)
        pass
    finally:
        os.close(fd)


def durable_replace(tmp: str | Path, path: str | Path) -> Path:
    """Renames the written temporary file ``tmp`` onto ``path``, durably and in order.

    The file's bytes are fsynced before the rename and its directory after it, so after a crash
    ``path`` is the old file or the whole new one, and whatever is written after this call (e.g. the
    chunk file that marks a side file's chunk done) cannot outlive it.
    """
    with open(tmp, "rb") as handle:
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    fsync(Path(path).parent)
    return Path(path)


def atomic_write_text(path: str | Path, text: str) -> Path:
    """Write ``text`` so that readers see the old file or the whole new one, never a part.

    The text goes to a temporary file in the same directory, is fsynced, then renamed over
    ``path``.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync(path.parent)
    return path


def file_sha256(path: str | Path) -> str:
    """The SHA-256 of a file's bytes (hex), read in blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def atomic_write_json(path: str | Path, obj: Any) -> Path:
    """Write ``obj`` as indented JSON with :func:`atomic_write_text`."""
    text = json.dumps(obj, indent=2, ensure_ascii=False, default=_jsonable) + "\n"
    return atomic_write_text(path, text)


def holds_other_run(path: str | Path, config_yaml: str) -> bool:
    """Whether ``path`` holds the config of a run other than ``config_yaml`` (a run resuming is not one)."""
    config_path = Path(path) / CONFIG_FILE
    return config_path.is_file() and config_path.read_text(encoding="utf-8", errors="replace") != config_yaml


def prepare_output_dir(path: str | Path, config_yaml: str, overwrite: bool = False) -> Path:
    """Create ``path`` and write the run's resolved config into it as ``config.yaml``.

    Rerunning with the same config into the same directory is allowed (resuming). A directory
    holding a different run is refused unless ``overwrite``; then that run's
    ``metrics.jsonl`` and ``manifest.json`` are removed so the new run's do not mix with
    them (other files are left to the CLI that owns them).

    Args:
        path: The output directory.
        config_yaml: The resolved config, e.g. from :func:`specheads.config.to_yaml`.
        overwrite: Replace a different run's config instead of refusing.

    Raises:
        UserError: ``path`` is a file, or holds a different run and ``overwrite`` is false.
    """
    out = Path(path)
    if out.exists() and not out.is_dir():
        raise UserError(f"output_dir {str(out)!r} is a file; choose a directory path")
    out.mkdir(parents=True, exist_ok=True)
    config_path = out / CONFIG_FILE
    if holds_other_run(out, config_yaml):
        if not overwrite:
            raise UserError(
                f"output_dir {str(out)!r} already holds a different run; "
                "choose another output_dir or pass overwrite=true"
            )
        logger.warning("overwriting the run in %s", out)
        for name in (METRICS_FILE, MANIFEST_FILE):
            (out / name).unlink(missing_ok=True)
    atomic_write_text(config_path, config_yaml)
    return out


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def pair_record(pair) -> dict:
    """A loaded pair's models as a manifest names them: ``target`` and ``draft`` (None without a draft), each
    its name and fingerprint."""

    def one(model) -> dict | None:
        return {"name": model.name, "fingerprint": model.fingerprint} if model else None

    return {"target": one(pair.target), "draft": one(pair.draft)}


def write_manifest(directory: str | Path, **fields: Any) -> Path:
    """Write ``manifest.json``: ``fields`` plus version, time, argv and host details.

    Args:
        directory: The output directory.
        **fields: Run facts to record (what was produced, counts, paths ...).

    Returns:
        The manifest's path.
    """
    manifest = {
        **fields,
        "specheads_version": __version__,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "argv": list(sys.argv),
        "python": platform.python_version(),
        "torch": _version("torch"),
        "transformers": _version("transformers"),
        "hostname": socket.gethostname(),
    }
    return atomic_write_json(Path(directory) / MANIFEST_FILE, manifest)


def _cut_torn_line(path: Path) -> None:
    """Cuts an unfinished last line (a crash mid-write) off an append-only JSON-lines file, so that the
    next append starts a line of its own instead of being glued onto the fragment."""
    if not path.is_file() or path.stat().st_size == 0:
        return
    with open(path, "rb+") as fh:
        fh.seek(-1, 2)
        if fh.read(1) == b"\n":
            return
        fh.seek(0)
        data = fh.read()
        fh.truncate(data.rfind(b"\n") + 1)


class MetricsWriter:
    """Appends one JSON object per line to ``<directory>/metrics.jsonl``, flushed each time.

    A torn last line left by a killed run is cut off when the file is opened again.

    Example:
        >>> with MetricsWriter(out) as metrics:  # doctest: +SKIP
        ...     metrics.write(step=10, loss=0.25)
    """

    def __init__(self, directory: str | Path, filename: str = METRICS_FILE) -> None:
        self.path = Path(directory) / filename
        self.path.parent.mkdir(parents=True, exist_ok=True)
        _cut_torn_line(self.path)
        self._handle = self.path.open("a", encoding="utf-8")

    def write(self, record: dict[str, Any] | None = None, **fields: Any) -> None:
        """Append ``record`` merged with ``fields`` as one line."""
        row = {**(record or {}), **fields}
        self._handle.write(json.dumps(row, ensure_ascii=False, default=_jsonable) + "\n")
        self._handle.flush()

    def close(self) -> None:
        """Close the file (idempotent)."""
        if not self._handle.closed:
            self._handle.close()

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_finished_rows(path: str | Path) -> list[dict]:
    """The complete JSON lines of an append-only results file from an interrupted run.

    A torn last line (a crash mid-write) is dropped and cut off the file, so appending resumes
    on a clean line boundary.
    """
    path = Path(path)
    if not path.is_file():
        return []
    rows, good = [], 0
    with open(path, "rb") as fh:
        for line in fh:
            try:
                rows.append(json.loads(line))
            except ValueError:
                break
            good += len(line)
    with open(path, "r+b") as fh:
        fh.truncate(good)
    return rows
