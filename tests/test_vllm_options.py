"""How vLLM serves for ``engine=vllm`` (``specheads/vllm_config.py``, ``specheads/vllm/options.py``): the ``vllm_*``
settings checked, written into the child's job as JSON and turned into ``LLM(...)``'s arguments there (dtype
``auto`` resolved on the device)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import torch

from specheads.vllm.options import llm_args
from specheads.vllm_config import ServeVllm, job_args, problems


def cfg(target=None, **vllm):
    return SimpleNamespace(
        target=target or SimpleNamespace(dtype="auto"), draft=SimpleNamespace(dtype="auto"), vllm=ServeVllm(**vllm)
    )


def test_the_defaults_are_fp32_and_eager_on_a_cpu():
    assert problems(cfg()) == []
    args = llm_args(json.loads(json.dumps(job_args(cfg()))))
    cuda = torch.cuda.is_available()
    want = "bfloat16" if cuda and torch.cuda.is_bf16_supported() else "float32"
    assert args == {"dtype": want, "enforce_eager": not cuda, "tensor_parallel_size": 1, "pipeline_parallel_size": 1}
    assert llm_args(None) == args  # a job written before these settings


def test_given_settings_reach_llm_as_vllm_names_them():
    given = cfg(
        target=SimpleNamespace(dtype="bfloat16"),
        tensor_parallel=4,
        pipeline_parallel=2,
        executor_backend="ray",
        enforce_eager=False,
    )
    assert llm_args(job_args(given)) == {
        "dtype": "bfloat16",
        "enforce_eager": False,
        "tensor_parallel_size": 4,
        "pipeline_parallel_size": 2,
        "distributed_executor_backend": "ray",
    }


def test_every_bad_setting_is_named():
    bad = cfg(
        tensor_parallel=0,
        pipeline_parallel=-1,
        executor_backend="slurm",
        draft_cache_mb=0.0,
        target=SimpleNamespace(dtype="fp8"),
    )
    said = " | ".join(problems(bad))
    for name in ("vllm.tensor_parallel=0", "vllm.pipeline_parallel=-1", "'slurm'", "vllm.draft_cache_mb=0.0", "'fp8'"):
        assert name in said
