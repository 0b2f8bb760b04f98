"""DeepSpeed ZeRO (stages 1-3) under ``accelerate launch``: what the training loop needs of it.

The recipe's batch geometry (and, under ZeRO-3, bucket sizes from the head's width) written into
the engine's config; the head's full weights gathered where ZeRO-3 partitions them; the draft
loaded whole; and each rank's optimizer partition saved into, and restored from, a checkpoint
(``checkpoint.py`` names the files ``.zero-<step>-rank<r>.safetensors`` and checks them on read).
"""

from __future__ import annotations

import json
import os
import warnings
from contextlib import contextmanager
from pathlib import Path

import torch
from accelerate.utils import DistributedType
from safetensors.torch import save_file

from specheads.errors import UserError
from specheads.outputs import fsync
from specheads.train.checkpoint import Checkpoint, zero_partition_path
from specheads.train.optim_state import jsonable, optimizer_state, param_groups, split_state


def enabled(acc) -> bool:
    """Whether this run is a DeepSpeed engine (set by ``accelerate launch`` with a DeepSpeed config)."""
    return acc.distributed_type == DistributedType.DEEPSPEED


def stage(acc) -> int:
    return int(acc.state.deepspeed_plugin.deepspeed_config.get("zero_optimization", {}).get("stage", 0))


def configure(acc, batch_size: int, grad_accum: int, hidden: int) -> bool:
    """Writes the recipe's batch geometry (not the launcher's) into the engine's config, which drives
    DeepSpeed's accumulation; returns whether the head is partitioned (ZeRO-3)."""
    ds_cfg = acc.state.deepspeed_plugin.deepspeed_config
    ds_cfg["train_micro_batch_size_per_gpu"] = batch_size
    ds_cfg["gradient_accumulation_steps"] = grad_accum
    ds_cfg.pop("train_batch_size", None)  # derived by accelerate from the two above
    if ds_cfg.get("gradient_clipping", "auto") == "auto":  # accelerate would fill in 1.0; the plain loop never clips
        ds_cfg["gradient_clipping"] = 0.0
    if stage(acc) != 3:
        return False
    # accelerate fills these "auto" values from model.config, which a head lacks: the same rule from
    # the head's width (its h x h weights are partitioned, biases kept whole)
    zero_cfg = ds_cfg.setdefault("zero_optimization", {})
    h = hidden
    for key, value in (
        ("reduce_bucket_size", h * h),
        ("stage3_prefetch_bucket_size", int(0.9 * h * h)),
        ("stage3_param_persistence_threshold", 10 * h),
    ):
        if zero_cfg.get(key, "auto") == "auto":
            zero_cfg[key] = value
    warnings.filterwarnings(
        "ignore",
        category=FutureWarning,  # DeepSpeed's collectives, once per call
        message=r".*torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)",
    )
    return True


@contextmanager
def full_weights(module, zero3: bool):
    """The head's full parameters inside the block (ZeRO-3 partitions them; collective: every rank enters)."""
    if not zero3:
        yield
        return
    import deepspeed

    with deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None):
        yield


@contextmanager
def unpartitioned(acc):
    """Under ZeRO-3, transformers would build models partitioned (``zero.Init``): a frozen model that
    only computes features (the draft) is loaded whole inside this block."""
    if not enabled(acc) or stage(acc) != 3:
        yield
        return
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    plugin = acc.state.deepspeed_plugin
    unset_hf_deepspeed_config()
    try:
        yield
    finally:
        plugin.set_deepspeed_weakref()


# ---- each rank's optimizer partition in its own file, moved into the checkpoint folder ------------


def _zero(optimizer):
    zero = getattr(optimizer, "optimizer", optimizer)  # accelerate's wrapper -> DeepSpeed's ZeRO optimizer
    if not hasattr(zero, "single_partition_of_fp32_groups") and not hasattr(zero, "fp32_partitioned_groups_flat"):
        raise UserError(
            f"DeepSpeed optimizer {type(zero).__name__} is not a ZeRO optimizer; set zero_stage to 1, "
            "2 or 3 in the accelerate config"
        )
    return zero


def _scaler_state(scaler) -> dict:
    return {
        k: jsonable(v)
        for k, v in vars(scaler).items()
        if isinstance(v, (bool, int, float, str)) or (isinstance(v, torch.Tensor) and v.dim() == 0)
    }


def _set_scaler_state(scaler, saved: dict) -> None:
    for key, val in saved.items():
        old = getattr(scaler, key, None)
        if isinstance(old, torch.Tensor):
            old.fill_(val)
        else:
            setattr(scaler, key, val)


def save_partition(out_dir: Path, step: int, optimizer, rank: int, world: int) -> Path:
    """This rank's fp32 master partition, its optimizer moments (tensors) and the rest (JSON in the
    file's header), written atomically. ZeRO-3's state comes from the optimizer's own
    ``state_dict()`` (fp32 partitioned flat groups + the inner optimizer's state)."""
    zero = _zero(optimizer)
    tensors, scalars = {}, {}
    header = {"world": str(world), "rank": str(rank)}
    if hasattr(zero, "fp32_partitioned_groups_flat"):  # stage 3
        from deepspeed.checkpoint.constants import FP32_FLAT_GROUPS, LOSS_SCALER, OPTIMIZER_STATE_DICT

        sd = zero.state_dict()
        for i, part in enumerate(sd[FP32_FLAT_GROUPS]):
            tensors[f"fp32.{i}"] = part.detach().cpu().contiguous()
        inner = sd[OPTIMIZER_STATE_DICT]
        split_state(inner["state"], "state.", tensors, scalars)
        header["stage"] = "3"
        header["zero3"] = json.dumps(
            {
                "param_groups": jsonable(inner["param_groups"]),
                "loss_scaler": _scaler_state(sd[LOSS_SCALER]),
                "dynamic_loss_scale": jsonable(sd["dynamic_loss_scale"]),
                "overflow": jsonable(sd["overflow"]),
            }
        )
    else:  # stages 1-2
        parts = zero.single_partition_of_fp32_groups
        for i, part in enumerate(parts):
            tensors[f"fp32.{i}"] = part.detach().cpu().contiguous()
        split_state({i: zero.optimizer.state.get(part, {}) for i, part in enumerate(parts)}, "state.", tensors, scalars)
        header["stage"] = "2"
        if getattr(zero, "loss_scaler", None) is not None:
            header["loss_scaler"] = json.dumps(_scaler_state(zero.loss_scaler))
    header["scalars"] = json.dumps(scalars)
    path = zero_partition_path(out_dir, step, rank)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    save_file(tensors, str(tmp), metadata=header)
    fsync(tmp)
    os.replace(tmp, path)
    return path


def load_partition(ckpt: Checkpoint, optimizer, rank: int, world: int) -> None:
    """Restores this rank's partition (read by :func:`.checkpoint.read` with ``zero=True``; same process count)."""
    zero = _zero(optimizer)
    meta, tensors = ckpt.zero_meta, ckpt.zero
    if int(meta["world"]) != world:
        raise UserError(
            f"checkpoint {ckpt.path} was written by {meta['world']} DeepSpeed processes, this run has "
            f"{world}; resume with num_processes={meta['world']}"
        )
    stage3 = hasattr(zero, "fp32_partitioned_groups_flat")
    if stage3 != (meta.get("stage") == "3"):
        raise UserError(
            f"checkpoint {ckpt.path} was written under ZeRO stage {meta.get('stage', '1-2')}; resume "
            "with the same zero_stage in the accelerate config"
        )
    scalars = json.loads(meta["scalars"])
    if stage3:
        _load_zero3(zero, tensors, scalars, json.loads(meta["zero3"]), world)
        return
    if "loss_scaler" in meta:
        _set_scaler_state(zero.loss_scaler, json.loads(meta["loss_scaler"]))
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


def _load_zero3(zero, tensors: dict, scalars: dict, extra: dict, world: int) -> None:
    """Hands the saved partition to the stage-3 optimizer's own ``load_state_dict`` (which also
    copies the fp32 masters into the working-precision partitions), bracketed like DeepSpeed's
    ``load_checkpoint`` (parameters partitioned before, persistent ones gathered after)."""
    from deepspeed.checkpoint.constants import FP32_FLAT_GROUPS, LOSS_SCALER, OPTIMIZER_STATE_DICT

    _set_scaler_state(zero.loss_scaler, extra["loss_scaler"])
    groups = [tensors[f"fp32.{i}"] for i in range(len(zero.fp32_partitioned_groups_flat))]
    state = optimizer_state(tensors, scalars, prefix="state.")
    sd = {
        OPTIMIZER_STATE_DICT: {"state": state, "param_groups": param_groups(extra["param_groups"])},
        FP32_FLAT_GROUPS: groups,
        LOSS_SCALER: zero.loss_scaler,
        "dynamic_loss_scale": extra["dynamic_loss_scale"],
        "overflow": extra["overflow"],
    }
    zero.checkpoint_event_prologue()
    zero.load_state_dict([sd] * world, load_optimizer_states=True, load_from_fp32_weights=True)
    zero.checkpoint_event_epilogue()
