"""vLLM's side of ``engine=vllm``: the ``LLM(...)`` arguments its child process builds from the job file
(:func:`llm_args`, from :func:`specheads.vllm_config.job_args`) and the proposer's memory. The settings themselves
are :mod:`specheads.vllm_config`.
"""

from __future__ import annotations

from specheads.errors import UserError


def llm_args(job: dict | None) -> dict:
    """``LLM(...)``'s keyword arguments in vLLM's process, from :func:`job_args`'s dict (None: the defaults):
    ``auto`` dtype resolved here, where the device is known; eager on a CPU unless told otherwise."""
    import torch

    from specheads.shim import resolve_dtype

    job = dict(job or {})
    cuda = torch.cuda.is_available()
    eager = job.get("enforce_eager")
    out = {
        "dtype": str(resolve_dtype(job.get("dtype") or "auto", "cuda" if cuda else "cpu")).removeprefix("torch."),
        "enforce_eager": (not cuda) if eager is None else bool(eager),
        "tensor_parallel_size": int(job.get("tensor_parallel_size") or 1),
        "pipeline_parallel_size": int(job.get("pipeline_parallel_size") or 1),
    }
    if job.get("distributed_executor_backend"):
        out["distributed_executor_backend"] = job["distributed_executor_backend"]
    return out


def whole_prefill_args(sampled: bool, cuda: bool, max_model_len: int) -> dict:
    """``LLM`` arguments that keep every prefill whole when seeded sampled requests run on a CPU: vLLM rewinds a
    request's generator by its offset after a partial prefill's discarded sample, which a CPU generator does not
    have (``RuntimeError: CPU Generator does not use offset`` once a step's token budget splits a prompt); without
    chunked prefill no sample is discarded (vLLM's CPU platform does the same for MLA models)."""
    if cuda or not sampled:
        return {}
    return {"enable_chunked_prefill": False, "max_num_batched_tokens": max(max_model_len, 2048)}


def cache_tokens(cache_mb: float | None, per_token: int, slots: int, max_len: int, device: str) -> int:
    """Tokens of the proposer's draft cache: ``cache_mb`` MiB' worth, or (None) enough for every one of ``slots``
    rows at ``max_len`` tokens; refused (one line) when that is more than the device's free memory."""
    from specheads.shim import RowProposer

    tokens = int(cache_mb * 2**20) // per_token if cache_mb else RowProposer.tokens_for(max_len, slots)
    free = free_memory(device)
    if free is not None and tokens * per_token > free:
        given = f"cache_mb={cache_mb}" if cache_mb else f"max_num_seqs={slots} rows of max_model_len={max_len} tokens"
        raise UserError(
            f"the proposer's draft cache for {given} needs {tokens * per_token / 2**30:.2f} GiB and "
            f"{device} has {free / 2**30:.2f} GiB free: set cache_mb (heads-decode, heads-eval: "
            "vllm.draft_cache_mb) to what it may take; longer requests then draft from their latest tokens"
        )
    return tokens


def free_memory(device: str) -> int | None:
    """Free bytes on ``device`` (a CUDA device's, or the machine's available memory), None where unknown."""
    import torch

    if device.startswith("cuda") and torch.cuda.is_available():
        return int(torch.cuda.mem_get_info(torch.device(device))[0])
    try:
        with open("/proc/meminfo", encoding="ascii") as fh:
            line = next(x for x in fh if x.startswith("MemAvailable:"))
        return int(line.split()[1]) * 1024
    except (OSError, StopIteration, ValueError):
        return None
