"""A plan before a run: ``heads-datagen plan=true`` and ``heads-train plan=true``.

For a recipe and a cluster shape (``nodes``, ``gpus`` per node, ``gpu_memory_gb`` each) the plan prints, per
process, the weights (target, draft, head), activations, KV cache and label buffers, the fullest GPU, the
disk the stored states and labels take, and the time at ``tokens_per_s`` (else the rate an earlier run in
``output_dir`` recorded, else for datagen the bound of reading the target's weights once per decoding step
at ``gpu_bandwidth_gbs``). What cannot fit is refused with one line naming what would (FP8 weights, GPUs
with 141 GB, twice the nodes with pipeline parallelism; for training ZeRO-2/3), each at the largest batch
that fits. Nothing is loaded or downloaded: shapes come from :mod:`specheads.model_shapes`, the arithmetic
from :mod:`specheads.plan.memory`. GB here is 10^9 bytes.
"""

from __future__ import annotations

from specheads.engines import ENGINES, engine_of
from specheads.errors import UserError
from specheads.model_shapes import shape_of
from specheads.plan.inputs import count_prompts, recorded_rate, train_data
from specheads.plan.memory import (
    Memory,
    datagen_disk,
    datagen_memory,
    datagen_rows,
    dtype_bytes,
    eagle_mode,
    train_memory,
)

GB = 1e9
#: Share of each GPU's memory a plan counts on: vLLM's default ``gpu_memory_utilization`` (the rest: the
#: CUDA context, NCCL's buffers, the allocator's fragmentation).
MEMORY_FRACTION = 0.9
LARGE_GPU_GB = 141  # an H200's


def _gb(x: float) -> float:
    return float(f"{x / GB:.6g}")  # six significant digits: a tiny model's figures stay checkable


def _usable(cfg, gpu_memory_gb: float | None = None) -> float:
    return (gpu_memory_gb or cfg.gpu_memory_gb) * MEMORY_FRACTION * GB


def _problems(cfg) -> None:
    bad = [f"{k}={getattr(cfg, k)} must be >= 1" for k in ("nodes", "gpus", "prompt_tokens") if getattr(cfg, k) < 1]
    bad += [
        f"{k}={getattr(cfg, k)} must be > 0" for k in ("gpu_memory_gb", "gpu_bandwidth_gbs") if getattr(cfg, k) <= 0
    ]
    if cfg.tokens_per_s is not None and cfg.tokens_per_s <= 0:
        bad.append(f"tokens_per_s={cfg.tokens_per_s} must be > 0 (or null)")
    if bad:
        raise UserError("plan: " + "; ".join(bad))


def _time(cfg, tokens: int, prompts: int, processes: int, bound: float | None) -> dict:
    rate, source = cfg.tokens_per_s, "given"
    if rate is None:
        per_prompt = recorded_rate(cfg.output_dir)
        if per_prompt:
            rate, source = per_prompt * tokens / max(prompts, 1), f"recorded in {cfg.output_dir}"
        elif bound:
            rate, source = bound, f"bound: the target's weights read once a step at {cfg.gpu_bandwidth_gbs:g} GB/s"
    hours = tokens / (rate * processes) / 3600 if rate else None
    return {"tokens": tokens, "tokens_per_s": rate, "rate_source": source if rate else None, "hours": hours}


def _figures(mem: Memory, usable: float) -> dict:
    return {
        "weights": {k: _gb(v) for k, v in mem.weights.items()},
        "activations": _gb(mem.activations),
        "kv_cache": _gb(mem.kv_cache),
        "label_buffers": _gb(mem.label_buffers),
        "optimizer": _gb(mem.optimizer),
        "total": _gb(mem.total()),
        "gpus_per_process": mem.gpus,
        "fullest_gpu": _gb(mem.fullest_gpu()),
        "usable_per_gpu": _gb(usable),
    }


def _largest_batch(memory, batch: int, usable: float) -> int | None:
    """The largest of ``batch``, ``batch // 2``, ... 1 at which ``memory(batch)`` fits, or None."""
    while batch >= 1:
        if memory(batch).fullest_gpu() <= usable:
            return batch
        batch //= 2
    return None


def _fitting(tries: list, batch: int) -> list[str]:
    """The labels of the ``(label, memory(batch), usable)`` tries that fit, with the batch they fit at."""
    out = []
    for label, memory, usable in tries:
        n = _largest_batch(memory, batch, usable)
        if n:
            out.append(label + ("" if n == batch else f" at batch_size={n}"))
    return out


def _datagen_alternatives(cfg, span: int) -> list[str]:
    usable = _usable(cfg)
    tries = [
        (
            "FP8 weights (target.load_in_8bit=true, or vLLM's quantization=fp8)",
            lambda n: datagen_memory(cfg, n, fp8=True, span=span),
            usable,
        )
    ]
    if cfg.gpu_memory_gb < LARGE_GPU_GB:
        tries.append(
            (
                f"{cfg.gpus}x{LARGE_GPU_GB} GB GPUs per node (gpu_memory_gb={LARGE_GPU_GB})",
                lambda n: datagen_memory(cfg, n, span=span),
                _usable(cfg, LARGE_GPU_GB),
            )
        )
    if span > 1 or engine_of(cfg).splits_nodes:
        nodes = 2 * cfg.nodes
        tries.append(
            (
                f"{nodes} nodes with pipeline parallelism (the target over {nodes * cfg.gpus} GPUs; engine=vllm "
                f"nodes={nodes})",
                lambda n: datagen_memory(cfg, n, span=2 * span),
                usable,
            )
        )
    return _fitting(tries, cfg.batch_size)


def datagen_plan(cfg) -> dict:
    """The plan of a ``heads-datagen`` run (its resolved DatagenConfig), as plain data."""
    _problems(cfg)
    span = cfg.gpus if cfg.target.device_map else 1  # device_map: one process per node owns its GPUs
    mem, usable = datagen_memory(cfg, cfg.batch_size, span=span), _usable(cfg)
    prompts, how = count_prompts(cfg)
    rows = datagen_rows(cfg, prompts)
    target = shape_of(cfg.target, "target").params() * dtype_bytes(cfg.target)  # vLLM's copy, or this process's
    out = {"cli": "heads-datagen", "what": f"labels={cfg.labels}", "engine": cfg.engine}
    processes = cfg.nodes if span > 1 else cfg.nodes * cfg.gpus
    fits = mem.fullest_gpu() <= usable
    if engine_of(cfg).holds_target:  # vLLM generates first, the target over vllm.tensor_parallel GPUs per process
        tp = max(cfg.vllm.tensor_parallel, 1) * max(cfg.vllm.pipeline_parallel, 1)
        out["vllm_weights_per_gpu"] = _gb(target / tp)
        processes = max(cfg.nodes * cfg.gpus // tp, 1)
        fits = fits and target / tp <= usable
        batch, bandwidth = cfg.vllm.max_num_seqs, tp * cfg.gpu_bandwidth_gbs * GB
    else:  # under device_map the target's GPUs run one after another: one GPU's bandwidth at a time
        batch, bandwidth = (1 if cfg.labels == "eagle_rounds" else cfg.batch_size), cfg.gpu_bandwidth_gbs * GB
    out |= {
        "processes": processes,
        "cluster": _cluster(cfg),
        "per_process_gb": _figures(mem, usable),
        "disk_gb": {k: _gb(v) for k, v in datagen_disk(cfg, rows).items()},
        "rows": rows | {"counted": how},
        "time": _time(cfg, rows["target_tokens"], prompts, processes, batch * bandwidth / (target + mem.kv_cache)),
        "assumptions": {
            "batch_size": cfg.batch_size,
            "prompt_tokens": cfg.prompt_tokens,
            "max_new_tokens": cfg.max_new_tokens,
        },
        "fits": fits,
    }
    return out | _refusal(out, mem, cfg, [] if fits else _datagen_alternatives(cfg, span))


def _cluster(cfg) -> dict:
    return {"nodes": cfg.nodes, "gpus": cfg.gpus, "gpu_memory_gb": cfg.gpu_memory_gb}


def _refusal(out: dict, mem: Memory, cfg, alternatives: list[str]) -> dict:
    if out["fits"]:
        return {"refusal": None, "would_fit": []}
    fig = out["per_process_gb"]
    parts = {f"{k} weights": v for k, v in mem.weights.items()} | {
        "optimizer state": mem.optimizer,
        "activations": mem.activations,
        "label buffers": mem.label_buffers,
        "KV cache": mem.kv_cache,
    }
    big = max(parts, key=parts.get)
    where = f" over {mem.gpus} GPUs" if big == "target weights" and mem.gpus > 1 else ""
    line = (
        f"plan: {out['cli']} {out['what']} does not fit {cfg.nodes} node(s) x {cfg.gpus} x {cfg.gpu_memory_gb:g} "
        f"GB: its fullest GPU needs {fig['fullest_gpu']:.1f} GB of {fig['usable_per_gpu']:.1f} GB usable "
        f"({big} {parts[big] / GB:.1f} GB{where}"
    )
    if "vllm_weights_per_gpu" in out:
        line += f"; vLLM's target weights {out['vllm_weights_per_gpu']:.1f} GB per GPU"
    line += "); " + (
        ("would fit: " + "; ".join(alternatives))
        if alternatives
        else "nothing the plan tries fits (FP8, 141 GB GPUs, twice the nodes, ZeRO); plan a larger cluster"
    )
    return {"refusal": line, "would_fit": alternatives}


def _train_alternatives(cfg, data: dict, world: int) -> list[str]:
    b, tries = cfg.batch_size, []
    for zero in (0, 2, 3):
        label = (
            f"DeepSpeed ZeRO-{zero} (accelerate launch --config_file recipes/accelerate/deepspeed_zero{zero}.yaml)"
            if zero
            else "DDP"
        )
        tries.append((label, lambda n, z=zero: train_memory(cfg, data, world, z, batch=n), _usable(cfg)))
    if cfg.gpu_memory_gb < LARGE_GPU_GB:
        tries.append(
            (
                f"{cfg.gpus}x{LARGE_GPU_GB} GB GPUs per node (gpu_memory_gb={LARGE_GPU_GB})",
                lambda n: train_memory(cfg, data, world, batch=n),
                _usable(cfg, LARGE_GPU_GB),
            )
        )
    return _fitting(tries, b)


def _eagle(cfg, data: dict) -> dict:
    """An EAGLE run's states: the mode, what makes them, and the disk each mode takes for this data."""
    mode = eagle_mode(cfg, data)
    target = shape_of(cfg.target, "target")
    positions = data["prompts"] * data["sequence_tokens"]
    offline = positions * len(data.get("layers") or [0] * 3) * target.hidden * 2
    ids = positions * 4 + data["labelled_tokens"] * (data.get("top_k", 0) * 8 + 4)  # ids, top-k ids and log-probs
    disk = {"offline": offline + ids, "online": ids, "hybrid": min(offline, cfg.eagle.cache_gb * GB) + ids}
    return {"mode": mode, "engine": None if mode == "offline" else cfg.eagle.engine, "disk_gb": disk}


def _disk_refusal(cfg, out: dict, eagle: dict) -> str | None:
    """One line when the EAGLE run's disk (``disk_gb``) cannot hold what its mode stores, naming the modes that fit."""
    need = eagle["disk_gb"][eagle["mode"]]
    if cfg.disk_gb is None or need <= cfg.disk_gb * GB:
        return None
    fit = [f"eagle.states={m} ({_gb(v):.4g} GB)" for m, v in eagle["disk_gb"].items() if v <= cfg.disk_gb * GB]
    return (
        f"plan: heads-train {out['what']} eagle.states={eagle['mode']} stores {_gb(need):.4g} GB, more than disk_gb="
        f"{cfg.disk_gb:g}; " + ("would fit: " + "; ".join(fit) if fit else "no mode fits: give the run more disk")
    )


def train_plan(cfg) -> dict:
    """The plan of a ``heads-train`` run (its resolved TrainConfig), one process per GPU (an online EAGLE run on
    vLLM: one per vLLM engine), as plain data."""
    _problems(cfg)
    data = train_data(cfg)
    world, usable = cfg.nodes * cfg.gpus, _usable(cfg)
    eagle = _eagle(cfg, data) if cfg.head == "eagle" else None
    if eagle and eagle["engine"] and ENGINES[eagle["engine"]].holds_target:  # a process per vLLM engine
        world = max(world // (cfg.vllm.tensor_parallel * cfg.vllm.pipeline_parallel), 1)
    mem = train_memory(cfg, data, world)
    out = {
        "cli": "heads-train",
        "what": f"head={cfg.head}",
        "processes": world,
        "cluster": _cluster(cfg),
        "per_process_gb": _figures(mem, usable),
        "disk_gb": {"states": _gb(data["states"])},
        "rows": {k: data[k] for k in ("prompts", "labelled_tokens")},
        "time": _time(cfg, cfg.epochs * data["labelled_tokens"], cfg.epochs * data["prompts"], world, None),
        "assumptions": {"batch_size": cfg.batch_size, "sequence_tokens": data["sequence_tokens"], "epochs": cfg.epochs},
        "fits": mem.fullest_gpu() <= usable,
    }
    out = out | _refusal(out, mem, cfg, [] if out["fits"] else _train_alternatives(cfg, data, world))
    if eagle:
        out["eagle"] = eagle | {"disk_gb": {k: _gb(v) for k, v in eagle["disk_gb"].items()}}
        out["disk_gb"]["states"] = _gb(eagle["disk_gb"][eagle["mode"]])
        disk = _disk_refusal(cfg, out, eagle)
        if disk:
            out["fits"], out["refusal"] = False, disk if out["refusal"] is None else f"{out['refusal']}; {disk}"
    return out


def format_plan(plan: dict) -> str:
    """The plan as the CLIs print it (GB)."""
    c, fig, t, w = plan["cluster"], plan["per_process_gb"], plan["time"], plan["per_process_gb"]["weights"]
    gpus = fig["gpus_per_process"]
    share = f" ({w['target'] / gpus:.1f} per GPU)" if gpus > 1 else ""
    lines = [
        f"{plan['cli']} plan: {plan['what']} on {c['nodes']} node(s) x {c['gpus']} GPUs x {c['gpu_memory_gb']:g} GB: "
        f"{plan['processes']} process(es), each on {gpus} GPU(s)",
        "per process, GB:",
        f"  weights         target {w['target']:.1f}{share}, draft {w['draft']:.1f}, head {w['head']:.3f}",
        f"  activations     {fig['activations']:.1f}",
        f"  KV cache        {fig['kv_cache']:.1f}",
        f"  label buffers   {fig['label_buffers']:.1f}",
    ]
    if fig["optimizer"]:
        lines.append(f"  optimizer       {fig['optimizer']:.1f} (fp32 gradients and Adam moments)")
    tail = f"fullest GPU {fig['fullest_gpu']:.1f} of {fig['usable_per_gpu']:.1f} usable"
    lines.append(f"  total           {fig['total']:.1f}; {tail}")
    if "vllm_weights_per_gpu" in plan:
        lines.append(f"  vLLM           target weights {plan['vllm_weights_per_gpu']:.1f} per GPU")
    lines.append("disk, GB: " + ", ".join(f"{k} {v:.2f}" for k, v in plan["disk_gb"].items()))
    if "eagle" in plan:
        e = plan["eagle"]
        lines.append(
            f"eagle states: {e['mode']}"
            + (f" from engine {e['engine']}" if e["engine"] else "")
            + "; disk by mode, GB: "
            + ", ".join(f"{k} {v:.4g}" for k, v in e["disk_gb"].items())
        )
    lines.append(f"data: {plan['rows']['prompts']} prompts, at most {plan['rows']['labelled_tokens']} labelled tokens")
    if t["hours"] is None:
        lines.append(f"time: {t['tokens']} tokens; no rate: pass tokens_per_s=N (one process's tokens per second)")
    else:
        lines.append(
            f"time: {t['tokens']} tokens at {t['tokens_per_s']:.4g} tokens/s per process ({t['rate_source']}): "
            f"{t['hours']:.3g} h"
        )
    lines.append("assumes: " + ", ".join(f"{k}={v}" for k, v in plan["assumptions"].items()))
    lines.append("fits" if plan["fits"] else "does not fit")
    return "\n".join(lines)


def _build(section: str, cfg) -> dict:
    return datagen_plan(cfg) if section == "datagen" else train_plan(cfg)


def run_plan(section: str, cfg) -> int:
    """What ``plan=true`` does at the start of ``heads-datagen`` (``section="datagen"``) and ``heads-train``
    (``"train"``): prints the plan; exit code 0 when it fits.

    Raises:
        UserError: one line saying what does not fit and what would (the CLI exits with code 2).
    """
    plan = _build(section, cfg)
    print(format_plan(plan), flush=True)
    if not plan["fits"]:
        raise UserError(plan["refusal"])
    return 0


def plan_figures(cli: str, recipe: str, overrides: list[str] | None = None) -> dict:
    """The plan of ``cli`` (``heads-datagen``/``datagen`` or ``heads-train``/``train``) for ``recipe`` with
    ``key=value`` overrides, as plain JSON-able data: per-process figures in GB, ``fits``, ``refusal`` (one
    line, or None) and ``would_fit``. A plan that does not fit is returned, not raised."""
    from specheads.config import load_config, schema_for

    section = cli.removeprefix("heads-")
    if section not in ("datagen", "train"):
        raise UserError(f"plan: cli={cli!r}; choose heads-datagen or heads-train")
    cfg = load_config(schema_for(section), section, [f"recipe={recipe}", *(overrides or [])])
    return {"recipe": recipe, **_build(section, cfg)}
