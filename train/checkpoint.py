"""Training checkpoints without pickle: tensors in safetensors, everything else in JSON.

A checkpoint is a folder ``checkpoint-<step>/`` holding ``state.safetensors`` (head weights,
optimizer tensors, RNG states) and ``state.json`` (optimizer param groups and scalars,
scheduler state, progress). It is written under a temporary name and renamed, then
``latest`` is replaced atomically: a kill during a save leaves the previous checkpoint intact.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from specheads.outputs import atomic_write_text


def _jsonable(x):
    if isinstance(x, tuple):
        return [_jsonable(v) for v in x]
    if isinstance(x, list):
        return [_jsonable(v) for v in x]
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, torch.Tensor):
        return x.item()
    return x


def save(out_dir: Path, step: int, model: torch.nn.Module, optimizer, scheduler, progress: dict, keep: int = 2) -> Path:
    """Writes ``checkpoint-<step>`` atomically and points ``latest`` at it; keeps the newest ``keep``."""
    tensors = {f"model.{k}": v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    opt = optimizer.state_dict()
    scalars = {}
    for pid, state in opt["state"].items():
        for key, val in state.items():
            if isinstance(val, torch.Tensor) and val.dim() > 0:
                tensors[f"optim.{pid}.{key}"] = val.detach().cpu().contiguous()
            else:
                scalars[f"{pid}.{key}"] = _jsonable(val)
    tensors["rng.torch"] = torch.get_rng_state()
    if torch.cuda.is_available():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"rng.cuda.{i}"] = s
    meta = {"step": step, "progress": progress, "optimizer": {"param_groups": _jsonable(opt["param_groups"]),
                                                             "scalars": scalars},
            "scheduler": _jsonable(scheduler.state_dict()) if scheduler is not None else None}
    final = Path(out_dir) / f"checkpoint-{step}"
    tmp = Path(out_dir) / f".checkpoint-{step}.tmp{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(tensors, str(tmp / "state.safetensors"))
    atomic_write_text(tmp / "state.json", json.dumps(meta, indent=1))
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    atomic_write_text(Path(out_dir) / "latest", final.name + "\n")
    olds = sorted(Path(out_dir).glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))
    for old in olds[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def latest(out_dir: Path) -> Path | None:
    """The checkpoint ``latest`` points at, if any."""
    pointer = Path(out_dir) / "latest"
    if not pointer.is_file():
        return None
    path = Path(out_dir) / pointer.read_text().strip()
    return path if (path / "state.json").is_file() else None


def load(path: Path, model: torch.nn.Module, optimizer, scheduler) -> dict:
    """Restores model, optimizer, scheduler and RNG state in place; returns the saved metadata."""
    meta = json.loads((Path(path) / "state.json").read_text())
    tensors = load_file(str(Path(path) / "state.safetensors"))
    model.load_state_dict({k[len("model."):]: v for k, v in tensors.items() if k.startswith("model.")})
    state: dict = {}
    for name, val in tensors.items():
        if name.startswith("optim."):
            _, pid, key = name.split(".", 2)
            state.setdefault(int(pid), {})[key] = val
    for name, val in meta["optimizer"]["scalars"].items():
        pid, key = name.split(".", 1)
        state.setdefault(int(pid), {})[key] = torch.tensor(val, dtype=torch.float32) if key == "step" else val
    groups = meta["optimizer"]["param_groups"]
    for g in groups:
        if "betas" in g:
            g["betas"] = tuple(g["betas"])
    optimizer.load_state_dict({"state": state, "param_groups": groups})
    if scheduler is not None and meta["scheduler"] is not None:
        scheduler.load_state_dict(meta["scheduler"])
    torch.set_rng_state(tensors["rng.torch"])
    if torch.cuda.is_available():
        states = [tensors[k] for k in sorted(k for k in tensors if k.startswith("rng.cuda."))]
        if states:
            torch.cuda.set_rng_state_all(states)
    return meta
