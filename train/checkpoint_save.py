"""Writing a training checkpoint: every file fsynced, digests in its manifest, the older ones cleared."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from specheads.outputs import atomic_write_text, file_sha256, fsync
from specheads.train.optim_state import jsonable, split_state

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
