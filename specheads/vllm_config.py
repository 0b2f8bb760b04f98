"""How vLLM serves the target for ``engine=vllm`` (``heads-decode``, ``heads-eval``, ``heads-datagen``): the ``vllm``
section of their configs (:class:`ServeVllm`; ``heads-datagen``'s is :class:`DatagenVllm`), checked here, and the
settings that go into vLLM's child's job file as plain JSON (:func:`job_args`; read back there by
:func:`specheads.vllm.options.llm_args`), so that the child needs nothing of this package's configuration.

The dtype is the target's own setting (``target.dtype``; ``auto``: bf16 on a GPU that supports it, fp32 on a CPU);
the proposer's draft follows ``draft.dtype`` (``auto``: the dtype vLLM runs the target in).
"""

from __future__ import annotations

from dataclasses import dataclass, field

BACKENDS = ("mp", "ray", "uni", "external_launcher")
DTYPES = ("auto", "float32", "bfloat16", "float16")


def _help(text: str) -> dict:
    return {"help": text}


@dataclass
class VllmConfig:
    """How vLLM runs the target for ``engine=vllm`` (recipe section ``vllm``: ``vllm.tensor_parallel=8``)."""

    python: str | None = field(
        default=None, metadata=_help("the python of vLLM's virtualenv (default: this one, when it has vLLM)")
    )
    threads: int | None = field(
        default=None, metadata=_help("OMP_NUM_THREADS for vLLM on a CPU (default: the machine's cores)")
    )
    tensor_parallel: int = field(
        default=1,
        metadata=_help(
            "GPUs vLLM splits each layer of the target over (its tensor_parallel_size; the target's attention "
            "heads must divide by it)"
        ),
    )
    pipeline_parallel: int = field(
        default=1,
        metadata=_help(
            "stages vLLM splits the target's layers into (its pipeline_parallel_size, e.g. one per node); vLLM "
            "uses tensor_parallel x pipeline_parallel GPUs"
        ),
    )
    executor_backend: str | None = field(
        default=None,
        metadata=_help(
            "vLLM's distributed_executor_backend: mp (one node) | ray (several nodes: start the Ray cluster "
            "first) | uni | external_launcher; null: vLLM's choice"
        ),
    )

    def problems(self) -> list[str]:
        """What is wrong with these settings, one line each (names as the user writes them)."""
        out = [
            f"vllm.{name}={getattr(self, name)} must be >= 1"
            for name in ("tensor_parallel", "pipeline_parallel")
            if getattr(self, name) < 1
        ]
        if self.executor_backend is not None and self.executor_backend not in BACKENDS:
            out.append(f"vllm.executor_backend={self.executor_backend!r}; choose one of {list(BACKENDS)} or null")
        if self.threads is not None and self.threads < 1:
            out.append(f"vllm.threads={self.threads} must be >= 1 (or null: the machine's cores)")
        return out


@dataclass
class ServeVllm(VllmConfig):
    """``heads-decode`` / ``heads-eval`` with ``engine=vllm``: vLLM decodes, the specheads proposer drafts."""

    enforce_eager: bool | None = field(
        default=None, metadata=_help("true: no CUDA graphs; null: eager on a CPU, CUDA graphs on a GPU")
    )
    draft_cache_mb: float | None = field(
        default=None,
        metadata=_help(
            "the specheads proposer's draft KV cache in MiB per vLLM worker, allocated at start-up inside vLLM's "
            "memory profile (a request longer than its share drafts from its latest tokens); null: room for "
            "every row at max_model_len"
        ),
    )

    def problems(self) -> list[str]:
        out = super().problems()
        if self.draft_cache_mb is not None and not self.draft_cache_mb > 0:
            out.append(f"vllm.draft_cache_mb={self.draft_cache_mb} must be > 0 (or null)")
        return out


@dataclass
class DatagenVllm(VllmConfig):
    """``heads-datagen engine=vllm``: vLLM generates the responses (and, by family, states and continuations)."""

    max_num_seqs: int = field(
        default=256,
        metadata=_help(
            "requests vLLM runs at once (its max_num_seqs; vLLM schedules them, batch_size does not apply to "
            "its generation)"
        ),
    )
    logprobs: bool = field(
        default=True,
        metadata=_help(
            "sampled acceptance: the target's log-probabilities come from vLLM (the top sampling.top_k per "
            "token, or the whole vocabulary without top-k: exact either way) and no Transformers target pass "
            "runs; false: the Transformers target scores vLLM's responses"
        ),
    )

    def problems(self) -> list[str]:
        out = super().problems()
        if self.max_num_seqs < 1:
            out.append(f"vllm.max_num_seqs={self.max_num_seqs} must be >= 1")
        return out


def problems(cfg) -> list[str]:
    """What is wrong with ``cfg.vllm`` and ``target.dtype`` / ``draft.dtype`` for vLLM, one line each."""
    out = cfg.vllm.problems()
    for role in ("target", "draft"):
        dtype = getattr(getattr(cfg, role, None), "dtype", "auto")
        if dtype not in DTYPES:
            out.append(f"{role}.dtype={dtype!r}; engine=vllm takes one of {list(DTYPES)}")
    return out


def job_args(cfg) -> dict:
    """The serving settings the child reads (:func:`llm_args`), as JSON."""
    return {
        "dtype": cfg.target.dtype,
        "tensor_parallel_size": cfg.vllm.tensor_parallel,
        "pipeline_parallel_size": cfg.vllm.pipeline_parallel,
        "distributed_executor_backend": cfg.vllm.executor_backend,
        "enforce_eager": cfg.vllm.enforce_eager,
    }
