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

from specheads.errors import UserError
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


def save(out_dir: Path, step: int, model: torch.nn.Module, optimizer, scheduler, progress: dict, keep: int = 2,
         extra_files: list[Path] = ()) -> Path:
    """Writes ``checkpoint-<step>`` atomically and points ``latest`` at it; keeps the newest ``keep``.

    ``optimizer=None``: its state is saved elsewhere (DeepSpeed partitions, given as
    ``extra_files``, which are moved into the checkpoint before it appears).
    """
    tensors = {f"model.{k}": v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    opt = optimizer.state_dict() if optimizer is not None else {"state": {}, "param_groups": []}
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
    for extra in extra_files:
        os.replace(extra, tmp / Path(extra).name)
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
    if optimizer is not None:
        _load_optimizer(optimizer, tensors, meta)
    if scheduler is not None and meta["scheduler"] is not None:
        scheduler.load_state_dict(meta["scheduler"])
    torch.set_rng_state(tensors["rng.torch"])
    if torch.cuda.is_available():
        states = [tensors[k] for k in sorted(k for k in tensors if k.startswith("rng.cuda."))]
        if states:
            torch.cuda.set_rng_state_all(states)
    return meta


def _load_optimizer(optimizer, tensors: dict, meta: dict) -> None:
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


# ---- DeepSpeed ZeRO (stages 1-2): each rank's optimizer partition in its own file ------------------

def zero_partition_path(out_dir: Path, step: int, rank: int) -> Path:
    return Path(out_dir) / f".zero-{step}-rank{rank}.safetensors"


def _zero(optimizer):
    zero = getattr(optimizer, "optimizer", optimizer)  # accelerate's wrapper -> DeepSpeed's ZeRO optimizer
    if not hasattr(zero, "single_partition_of_fp32_groups"):
        raise UserError("DeepSpeed checkpoints support ZeRO stages 1 and 2; set zero_stage to 1 or 2 in the "
                        "accelerate config (the head is small: stage 3 saves nothing)")
    return zero


def save_zero_partition(out_dir: Path, step: int, optimizer, rank: int, world: int) -> Path:
    """This rank's fp32 master partition and its Adam moments (tensors), written atomically."""
    zero = _zero(optimizer)
    tensors, scalars = {}, {}
    for i, part in enumerate(zero.single_partition_of_fp32_groups):
        tensors[f"fp32.{i}"] = part.detach().cpu().contiguous()
        for key, val in zero.optimizer.state.get(part, {}).items():
            if isinstance(val, torch.Tensor) and val.dim() > 0:
                tensors[f"state.{i}.{key}"] = val.detach().cpu().contiguous()
            else:
                scalars[f"{i}.{key}"] = _jsonable(val)
    path = zero_partition_path(out_dir, step, rank)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    save_file(tensors, str(tmp), metadata={"world": str(world), "rank": str(rank), "scalars": json.dumps(scalars)})
    os.replace(tmp, path)
    return path


def load_zero_partition(path: Path, optimizer, rank: int, world: int) -> None:
    """Restores this rank's partition (same number of processes as when it was saved)."""
    from safetensors import safe_open

    zero = _zero(optimizer)
    file = Path(path) / zero_partition_path(Path("."), int(Path(path).name.split("-")[1]), rank).name
    if not file.is_file():
        raise UserError(f"{file} is missing: this DeepSpeed checkpoint was written by fewer processes; "
                        f"resume with the same num_processes")
    with safe_open(str(file), framework="pt") as f:
        meta = f.metadata()
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    if int(meta["world"]) != world:
        raise UserError(f"checkpoint {path} was written by {meta['world']} DeepSpeed processes, this run has "
                        f"{world}; resume with num_processes={meta['world']}")
    scalars = json.loads(meta["scalars"])
    with torch.no_grad():
        for i, part in enumerate(zero.single_partition_of_fp32_groups):
            part.copy_(tensors[f"fp32.{i}"].to(part.device))
            st = {k.split(".", 2)[2]: v.to(part.device) for k, v in tensors.items() if k.startswith(f"state.{i}.")}
            for name, val in scalars.items():
                gi, key = name.split(".", 1)
                if int(gi) == i:
                    st[key] = torch.tensor(val, dtype=torch.float32) if key == "step" else val
            zero.optimizer.state[part] = st
    # The model's own weights were restored from the checkpoint before prepare(): they are the
    # master weights of the same step (rounded to the working precision).
