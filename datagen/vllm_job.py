"""The job file of the vLLM child that generates heads-datagen's responses, each process's devices, and vLLM's
parallelism settings."""

from __future__ import annotations

import os
from types import SimpleNamespace

from specheads.datagen.labelling import Job
from specheads.errors import UserError


def light_job(cfg) -> Job:
    """A :class:`Job` with the tokenizer, EOS ids and context length the labellers will have, from the
    model directories' tokenizer and config files (no weights: vLLM gets the GPUs first)."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    from specheads.shim import context_length, eos_ids

    def files(spec):
        path, gguf = os.path.expanduser(spec.path), spec.gguf_file
        if path.endswith(".gguf") and gguf is None:
            path, gguf = os.path.dirname(path) or ".", os.path.basename(path)
        kw = {"revision": spec.revision, **({"gguf_file": gguf} if gguf else {})}
        return path, gguf, kw

    path, gguf, kw = files(cfg.target)
    try:
        tok = AutoTokenizer.from_pretrained(
            cfg.target.tokenizer or path,
            revision=cfg.target.revision,
            **({"gguf_file": gguf} if gguf and not cfg.target.tokenizer else {}),
        )
        config = AutoConfig.from_pretrained(path, trust_remote_code=cfg.target.trust_remote_code, **kw)
        try:
            gen = GenerationConfig.from_pretrained(path, **kw)
        except (OSError, ValueError, TypeError):
            gen = GenerationConfig.from_model_config(config)
        limits = [context_length(SimpleNamespace(config=config))]
        if cfg.draft.path:  # loaded whenever it is set (cli._load), so its length counts
            d_path, _, d_kw = files(cfg.draft)
            limits.append(context_length(SimpleNamespace(config=AutoConfig.from_pretrained(d_path, **d_kw))))
    except (OSError, ValueError) as err:
        raise UserError(f"engine=vllm: could not read the models' tokenizer and config: {err}") from err
    eos = eos_ids(SimpleNamespace(generation_config=gen), tok)
    limit = min(x for x in (*limits, 1 << 30) if x)
    return Job(cfg, SimpleNamespace(tokenizer=tok), eos[0] if eos else 0, eos, limit)


def device_slice(local_rank: int, tp: int, visible: list[str]) -> list[str]:
    """The GPUs of local process ``local_rank`` (one data-parallel vLLM on ``tp`` of them)."""
    lo = local_rank * tp
    if lo + tp > len(visible):
        raise UserError(
            f"engine=vllm: local process {local_rank} needs GPUs {lo}..{lo + tp - 1} "
            f"(vllm.tensor_parallel={tp}) but {len(visible)} are visible; start fewer processes"
        )
    return visible[lo : lo + tp]


def parallel_header(cfg) -> dict:
    """The vLLM child's parallelism: ``tensor_parallel``, ``pipeline_parallel`` and ``executor_backend`` (None:
    vLLM's choice, ``mp`` on one node; ``ray`` spans nodes)."""
    return {
        "tensor_parallel": cfg.vllm.tensor_parallel,
        "pipeline_parallel": cfg.vllm.pipeline_parallel,
        "executor_backend": cfg.vllm.executor_backend,
    }


def cpu_binding(workers: int, cores: int) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` for ``workers`` CPU workers (tensor x pipeline parallel) on ``cores`` cores:
    consecutive equal slices, or one core each, shared round robin, when there are fewer cores than workers
    (vLLM's own default binds one NUMA node per worker and refuses more workers than nodes)."""
    if cores < workers:
        return "|".join(str(i % cores) for i in range(workers))
    per = cores // workers
    return "|".join(f"{i * per}-{i * per + per - 1}" if per > 1 else str(i) for i in range(workers))


def target_header(cfg) -> dict:
    """The target as vLLM reads it (``target``: a GGUF file converted once into a Hugging Face directory) and
    its ``dtype`` (``target.dtype``; ``auto``: bf16 on a GPU that has it, fp32 on a CPU)."""
    from specheads.decode.vllm_engine import target_dir
    from specheads.shim import resolve_device, resolve_dtype

    target = target_dir(cfg.target) if cfg.target.gguf_file or os.path.exists(cfg.target.path) else cfg.target.path
    dtype = str(resolve_dtype(cfg.target.dtype, resolve_device(cfg.target.device))).split(".")[-1]
    return {"target": str(target), "dtype": dtype}


def child_environment(cfg, python: str, local_rank: int) -> dict:
    """vLLM's environment (:func:`~specheads.decode.vllm_engine.environment`) with this process's GPUs
    (``tensor x pipeline`` of them; with ``executor_backend=ray``, which spans nodes, every GPU of this node,
    for one process) or, on a CPU with several workers, their cores (``VLLM_CPU_OMP_THREADS_BIND``, unless
    set)."""
    import torch

    from specheads.decode.vllm_engine import environment

    gpu = torch.cuda.is_available()
    env = environment(python, cfg.vllm.threads, gpu)
    workers = cfg.vllm.tensor_parallel * cfg.vllm.pipeline_parallel
    if gpu and cfg.vllm.executor_backend == "ray":  # one vLLM over the Ray cluster: Ray places its workers
        if local_rank > 0:
            raise UserError(
                "engine=vllm with vllm.executor_backend=ray: one vLLM spans the nodes' GPUs; run heads-datagen "
                "as one process (without accelerate launch)"
            )
    elif gpu:
        seen = env.get("CUDA_VISIBLE_DEVICES")
        visible = seen.split(",") if seen else [str(i) for i in range(torch.cuda.device_count())]
        env["CUDA_VISIBLE_DEVICES"] = ",".join(device_slice(local_rank, workers, visible))
    elif workers > 1 and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
        env["VLLM_CPU_OMP_THREADS_BIND"] = cpu_binding(workers, cfg.vllm.threads or os.cpu_count() or 1)
    return env
