"""Optimizer state without pickle: tensors for safetensors, everything else as JSON, and back."""

from __future__ import annotations

import torch


def jsonable(x):
    """``x`` with tensors as numbers and tuples as lists (what ``json`` writes)."""
    if isinstance(x, (tuple, list)):
        return [jsonable(v) for v in x]
    if isinstance(x, dict):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, torch.Tensor):
        return x.item()
    return x


def split_state(state: dict, prefix: str, tensors: dict, scalars: dict) -> None:
    """Per-parameter optimizer state: tensors under ``<prefix><id>.<key>``, the scalars (as JSON) under
    ``<id>.<key>``."""
    for pid, entries in state.items():
        for key, val in entries.items():
            if isinstance(val, torch.Tensor) and val.dim() > 0:
                tensors[f"{prefix}{pid}.{key}"] = val.detach().cpu().contiguous()
            else:
                scalars[f"{pid}.{key}"] = jsonable(val)


def optimizer_state(tensors: dict, scalars: dict, prefix: str = "optim.") -> dict:
    """The per-parameter optimizer state :func:`split_state` wrote, put back together."""
    state: dict = {}
    for name, val in tensors.items():
        if name.startswith(prefix):
            _, pid, key = name.split(".", 2)
            state.setdefault(int(pid), {})[key] = val
    for name, val in scalars.items():
        pid, key = name.split(".", 1)
        state.setdefault(int(pid), {})[key] = torch.tensor(val, dtype=torch.float32) if key == "step" else val
    return state


def param_groups(groups: list) -> list:
    """Optimizer param groups read from JSON, with ``betas`` a tuple again."""
    for g in groups:
        if "betas" in g:
            g["betas"] = tuple(g["betas"])
    return groups
