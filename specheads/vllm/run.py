"""The child process of ``heads-decode engine=vllm`` and ``heads-eval engine=vllm`` (:mod:`specheads.decode.vllm_engine`
writes the job and starts it in vLLM's Python): ``python -m specheads.vllm.run JOB``.

The job file holds the target's Hugging Face directory, the prompts as token ids, the batch size (vLLM's
``max_num_seqs``), the sampling settings, the speculative method (none, vLLM's ``draft_model``, or the
:mod:`specheads.vllm.proposer` proposer's settings) and how vLLM serves (:mod:`specheads.vllm.options`: dtype,
parallelism, eager mode). The child starts ``LLM`` once, decodes every prompt in one ``generate`` call and writes
the completions, the wall times, vLLM's spec-decode counters and the proposer's counts.
"""

from __future__ import annotations

import json

from specheads.vllm.options import llm_args, whole_prefill_args
from specheads.vllm.proposer import _proposer_stats, first_stats, speculative_config


def run_job(path: str) -> int:
    """Decodes a job file's prompts (token ids) with vLLM and writes the result file it names."""
    import time

    import torch
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    job = json.loads(open(path, encoding="utf-8").read())
    spec = job["speculative"]
    proposer = bool(spec and "specheads" in spec)
    if proposer:
        spec = speculative_config(**spec["specheads"])
    longest = max(max(len(p) for p in job["prompts"]) + job["max_new_tokens"], 256)
    sampled = (job["sampling"].get("temperature") or 0) > 0
    t = time.perf_counter()
    llm = LLM(
        model=job["target"],
        max_model_len=longest,
        max_num_seqs=job["batch_size"],
        seed=job["seed"],
        disable_log_stats=False,
        speculative_config=spec or None,
        **llm_args(job.get("serving")),
        **whole_prefill_args(sampled, torch.cuda.is_available(), longest),
    )
    startup = time.perf_counter() - t
    sampling = job["sampling"]
    params = [
        SamplingParams(max_tokens=job["max_new_tokens"], seed=job["seed"] + i, **sampling)
        for i in range(len(job["prompts"]))
    ]

    def counters() -> dict:
        return {
            m.name: m.value
            for m in llm.get_metrics()
            if m.name.startswith("vllm:spec_decode") and isinstance(getattr(m, "value", None), (int, float))
        }

    before = counters()
    t = time.perf_counter()
    res = llm.generate([TokensPrompt(prompt_token_ids=p) for p in job["prompts"]], params, use_tqdm=False)
    seconds = time.perf_counter() - t
    out = {
        "outputs": [list(r.outputs[0].token_ids) for r in res],
        "seconds": seconds,
        "startup_seconds": startup,
        "counters": {k: v - before.get(k, 0) for k, v in counters().items()},
    }
    if proposer:
        out["proposer"] = first_stats(llm.collective_rpc(_proposer_stats))
    with open(job["out"], "w", encoding="utf-8") as fh:
        json.dump(out, fh)
    return 0


if __name__ == "__main__":
    import sys

    raise SystemExit(run_job(sys.argv[1]))
