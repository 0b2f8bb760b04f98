"""Training checkpoints without pickle: tensors in safetensors, everything else in JSON.

A checkpoint is a folder ``checkpoint-<step>/`` holding ``state.safetensors`` (head weights,
optimizer tensors, RNG states), ``state.json`` (optimizer param groups and scalars, scheduler
state, progress: epoch, step, data position inside the epoch, process count, ...; plus the size
and SHA-256 of every other file) and, under DeepSpeed, one ``.zero-<step>-rank<r>.safetensors``
per process (that rank's optimizer partition: ``zero.py``). The folder is written under a
temporary name, fsynced and renamed, then ``latest`` is replaced atomically: a kill during a save
leaves the previous checkpoint and ``latest`` intact (:func:`save`, which keeps the newest two;
:func:`clear` removes them all).

Resuming (:func:`find`) takes the newest checkpoint folder (normally the one ``latest`` names);
when it is damaged (truncated, bad JSON, wrong checksum) the newest older one that reads back
whole, with a warning; when none does it stops with a one-line
:class:`~specheads.errors.UserError`, as it does when the run that wrote it had another
process count.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load as load_bytes
from safetensors.torch import save_file

from specheads.errors import UserError
from specheads.outputs import atomic_write_text, file_sha256, fsync
from specheads.train.optim_state import jsonable, optimizer_state, param_groups, split_state

log = logging.getLogger(__name__)

FORMAT = 2
_NAME = re.compile(r"checkpoint-(\d+)")


def _digest(path: Path) -> dict:
    return {"bytes": path.stat().st_size, "sha256": file_sha256(path)}


def _step(path: Path) -> int:
    return int(_NAME.fullmatch(path.name).group(1))


def save(
    out_dir: Path,
    step: int,
    model: torch.nn.Module,
    optimizer,
    scheduler,
    progress: dict,
    keep: int = 2,
    extra_files: list[Path] = (),
) -> Path:
    """Writes ``checkpoint-<step>`` atomically and points ``latest`` at it; keeps the newest ``keep``.

    ``optimizer=None``: its state is saved elsewhere (DeepSpeed partitions, given as
    ``extra_files``, which are moved into the checkpoint before it appears). ``model`` must hold
    its full weights (gathered under ZeRO-3).
    """
    out_dir = Path(out_dir)
    tensors, seen = {}, set()
    for k, v in model.state_dict().items():
        v = v.detach().cpu().contiguous()
        shared = v.numel() > 0 and v.untyped_storage().data_ptr() in seen  # a tied weight (a draft's output layer)
        seen.add(v.untyped_storage().data_ptr())
        tensors[f"model.{k}"] = v.clone() if shared else v  # safetensors refuses tensors that share memory
    opt = optimizer.state_dict() if optimizer is not None else {"state": {}, "param_groups": []}
    scalars = {}
    split_state(opt["state"], "optim.", tensors, scalars)
    tensors["rng.torch"] = torch.get_rng_state()
    if torch.cuda.is_available():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"rng.cuda.{i}"] = s
    meta = {
        "format": FORMAT,
        "step": step,
        "progress": progress,
        "optimizer": {"param_groups": jsonable(opt["param_groups"]), "scalars": scalars},
        "scheduler": jsonable(scheduler.state_dict()) if scheduler is not None else None,
    }
    for stale in out_dir.glob(".checkpoint-*.tmp*"):  # left by a save that was killed
        shutil.rmtree(stale, ignore_errors=True)
    for stale in out_dir.glob(".zero-*"):
        if not stale.name.startswith(f".zero-{step}-rank") or ".tmp" in stale.name:
            stale.unlink(missing_ok=True)
    final = out_dir / f"checkpoint-{step}"
    tmp = out_dir / f".checkpoint-{step}.tmp{os.getpid()}"
    tmp.mkdir(parents=True)
    save_file(tensors, str(tmp / "state.safetensors"))
    for extra in extra_files:
        os.replace(extra, tmp / Path(extra).name)
    meta["files"] = {}
    for f in sorted(tmp.iterdir()):
        fsync(f)
        meta["files"][f.name] = _digest(f)
    atomic_write_text(tmp / "state.json", json.dumps(meta, indent=1))  # last: its presence means complete
    fsync(tmp)
    if final.exists():  # the same step again (a rerun after a fallback): move the old one out of the way
        old = out_dir / f".checkpoint-{step}.tmp{os.getpid()}-old"
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)
    fsync(out_dir)
    atomic_write_text(out_dir / "latest", final.name + "\n")
    olds = sorted((p for p in out_dir.glob("checkpoint-*") if _NAME.fullmatch(p.name)), key=_step)
    later = [p for p in olds if _step(p) > step]  # left from before a fallback to an older checkpoint
    for old in later + [p for p in olds if p not in later][:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def clear(out_dir: Path) -> None:
    """Removes every checkpoint (and ``latest``) from ``out_dir``: the next run starts over."""
    out_dir = Path(out_dir)
    for path in [*out_dir.glob("checkpoint-*"), *out_dir.glob(".checkpoint-*")]:
        shutil.rmtree(path, ignore_errors=True)
    for path in [*out_dir.glob(".zero-*"), out_dir / "latest"]:
        path.unlink(missing_ok=True)


def candidates(out_dir: Path) -> list[Path]:
    """Checkpoint folders, newest first (one a kill left without its ``latest`` update included: it is
    complete once it has its final name)."""
    return sorted(
        (p for p in Path(out_dir).glob("checkpoint-*") if _NAME.fullmatch(p.name) and p.is_dir()),
        key=_step,
        reverse=True,
    )


@dataclass
class Checkpoint:
    """A checkpoint read back whole: its metadata, its tensors, and this rank's ZeRO partition."""

    path: Path
    meta: dict
    tensors: dict
    zero: dict | None = None
    zero_meta: dict = field(default_factory=dict)

    @property
    def progress(self) -> dict:
        return self.meta["progress"]


class Damaged(UserError):
    """A checkpoint folder that does not read back whole."""


def _read_file(path: Path, files: dict) -> tuple[dict, dict]:
    """A safetensors file's tensors and metadata, checked against the size and hash ``state.json`` recorded."""
    from safetensors import safe_open

    if not path.is_file():
        raise Damaged(f"{path} is missing")
    data = path.read_bytes()
    want = files.get(path.name)
    if want is not None:
        if len(data) != want["bytes"]:
            raise Damaged(f"{path} holds {len(data)} bytes, {want['bytes']} were written (truncated?)")
        if hashlib.sha256(data).hexdigest() != want["sha256"]:
            raise Damaged(f"{path} does not match the SHA-256 recorded when it was written")
    try:
        tensors = load_bytes(data)
        with safe_open(str(path), framework="pt") as f:  # the header's own metadata
            meta = f.metadata() or {}
    except Exception as exc:  # safetensors raises its own error types
        raise Damaged(f"{path} is not a readable safetensors file ({str(exc).splitlines()[0][:200]})") from None
    return tensors, meta


def read(path: Path, rank: int = 0, zero: bool = False, world: int | None = None) -> Checkpoint:
    """Reads a checkpoint folder whole (and this rank's ZeRO partition with ``zero``); raises :class:`Damaged`,
    or :class:`UserError` when it was written by a run with another process count than ``world``."""
    path = Path(path)
    try:
        meta = json.loads((path / "state.json").read_text())
        int(meta["step"]), int(meta["progress"]["step"]), dict(meta["optimizer"])  # the keys a resume reads
    except FileNotFoundError:
        raise Damaged(f"{path / 'state.json'} is missing") from None
    except (ValueError, KeyError, TypeError) as exc:
        raise Damaged(f"{path / 'state.json'} is not a checkpoint's JSON ({type(exc).__name__}: {exc})") from None
    saved = meta["progress"].get("world")
    if world is not None and saved is not None and saved != world:
        raise UserError(
            f"{path} was written by a run with {saved} processes, this one has {world}; resume "
            f"with the same count (accelerate launch --num_processes {saved} ...), or start a new "
            "run in another output_dir"
        )
    files = meta.get("files", {})
    tensors, _ = _read_file(path / "state.safetensors", files)
    if "rng.torch" not in tensors:
        raise Damaged(f"{path / 'state.safetensors'} holds no RNG state")
    ckpt = Checkpoint(path, meta, tensors)
    if not zero and any(n.startswith(".zero-") for n in files):
        raise UserError(
            f"{path} was written under DeepSpeed (its optimizer state is in per-process partitions); "
            "resume with the same accelerate config, or start a new run in another output_dir"
        )
    if zero:
        name = zero_partition_path(Path("."), int(meta["step"]), rank).name
        if not (path / name).is_file() and not any(n.startswith(".zero-") for n in files):
            raise UserError(
                f"{path} holds no DeepSpeed optimizer partitions (it was written without DeepSpeed); "
                "resume without DeepSpeed, or start a new run in another output_dir"
            )
        ckpt.zero, ckpt.zero_meta = _read_file(path / name, files)
    return ckpt


def find(
    out_dir: Path, world: int, rank: int = 0, zero: bool = False, any_rank: Callable[[bool], bool] = lambda bad: bad
) -> Checkpoint | None:
    """The checkpoint to resume from: the newest that reads back whole.

    ``any_rank(bad)`` tells whether some process found its copy damaged (every process must take
    the same checkpoint; each reads its own ZeRO partition). ``None`` when there is no checkpoint.
    Raises :class:`UserError` when every checkpoint is damaged, or the run that wrote it had
    another number of processes than ``world``.
    """
    out_dir = Path(out_dir)
    found = candidates(out_dir)
    problems = []
    pointer = out_dir / "latest"
    if pointer.is_file() and not (out_dir / pointer.read_text(errors="replace").strip()).is_dir():
        problems.append(f"'latest' names {pointer.read_text(errors='replace').strip()!r}, which is missing")
    for path in found:
        try:
            ckpt, err = read(path, rank, zero, world), None
        except Damaged as exc:
            ckpt, err = None, exc
        if any_rank(err is not None):
            problems.append(str(err) if err is not None else f"{path}: another process found its partition damaged")
            log.warning("%s; trying an older checkpoint", problems[-1])
            continue
        if problems:
            log.warning("resuming from %s, an older checkpoint", path)
        return ckpt
    if problems:
        raise UserError(
            f"no checkpoint in {out_dir} reads back whole ({problems[0]}); delete its checkpoint-* "
            "folders and 'latest' to start the run over, or train into another output_dir"
        )
    return None


def restore(ckpt: Checkpoint, model: torch.nn.Module, optimizer, scheduler) -> dict:
    """Restores model, optimizer (unless ``None``), scheduler and RNG state in place; returns the progress."""
    try:
        model.load_state_dict({k[len("model.") :]: v for k, v in ckpt.tensors.items() if k.startswith("model.")})
    except RuntimeError as exc:
        raise UserError(
            f"{ckpt.path} does not fit this head ({str(exc).splitlines()[0][:200]}); start a new run "
            "in another output_dir"
        ) from None
    if optimizer is not None:
        _load_optimizer(optimizer, ckpt.tensors, ckpt.meta)
    if scheduler is not None and ckpt.meta["scheduler"] is not None:
        scheduler.load_state_dict(ckpt.meta["scheduler"])
        # the learning rate the next step uses (optimizer.load_state_dict restores it; a DeepSpeed
        # optimizer, restored from its partitions, starts from the freshly built one's)
        for group, lr in zip(scheduler.optimizer.param_groups, scheduler.get_last_lr()):
            group["lr"] = lr
    torch.set_rng_state(ckpt.tensors["rng.torch"])
    if torch.cuda.is_available():
        states = [
            ckpt.tensors[k]
            for k in sorted(
                (k for k in ckpt.tensors if k.startswith("rng.cuda.")), key=lambda k: int(k.rsplit(".", 1)[1])
            )
        ]
        if len(states) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(states)
    return ckpt.progress


def _load_optimizer(optimizer, tensors: dict, meta: dict) -> None:
    state = optimizer_state(tensors, meta["optimizer"]["scalars"])
    optimizer.load_state_dict({"state": state, "param_groups": param_groups(meta["optimizer"]["param_groups"])})


def zero_partition_path(out_dir: Path, step: int, rank: int) -> Path:
    """Where a DeepSpeed rank's optimizer partition is written (``zero.py``), then moved into the checkpoint."""
    return Path(out_dir) / f".zero-{step}-rank{rank}.safetensors"
