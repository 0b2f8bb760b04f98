"""The child process of ``heads-datagen engine=vllm``: ``python -m specheads.vllm_jobs JOB``.

It runs in vLLM's own Python (``vllm_python``; it needs vLLM and the standard library only) and is started
once per run by :mod:`.vllm_responses`, which wrote ``JOB``: a JSON header line (the target's Hugging Face
directory, dtype, ``max_num_seqs``, tensor-parallel size, the EOS ids, the folder of the side files) and
then one line per chunk still to generate (its number, the digest its side file must carry, its requests:
token-id prompt, sampling settings, seed, budget).

vLLM starts once (``LLM``, then a two-token warm-up), then generates the chunks in groups of at least
:data:`GROUP_BATCHES` batches
(one ``generate`` call each: continuous batching inside a group), and writes each chunk's side file
atomically (temporary name, fsync, rename) as soon as its group is done, so a killed run loses only the
group in flight. Every request stops at an EOS id (kept, as the Transformers engine keeps it) or after
its budget; it also asks for its chosen tokens' log-probabilities, and a response with a non-finite one
is flagged (the labeller then skips that prompt as it skips non-finite logits). The last line of the run
writes ``run.json``: start-up seconds, generation seconds, tokens.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time

GROUP_BATCHES = 8  # a generate() call holds at least this many batches of requests


def write_atomic(path: str, obj) -> None:
    tmp = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.{os.getpid()}.tmp")
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(obj, fh)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def side_name(chunk: int) -> str:
    return f"chunk-{chunk:06d}.json"


def params(req: dict, eos: list[int]):
    """vLLM's ``SamplingParams`` of one request (greedy: temperature 0, no seed)."""
    from vllm import SamplingParams

    s = req["sampling"]
    sampled = bool(s["do_sample"])
    return SamplingParams(
        max_tokens=req["max_new_tokens"],
        temperature=s["temperature"] if sampled else 0.0,
        top_k=(s["top_k"] or 0) if sampled else 0,
        top_p=s["top_p"] if sampled else 1.0,
        seed=req["seed"] if sampled else None,
        stop_token_ids=list(eos),
        logprobs=0,
        detokenize=False,
    )


def finite(out) -> bool:
    """Whether every chosen token's log-probability is finite (None: vLLM gave none; taken as finite)."""
    for step, tok in zip(out.logprobs or [], out.token_ids):
        lp = step.get(tok) if step else None
        if lp is not None and not math.isfinite(lp.logprob):
            return False
    return True


def run(path: str) -> int:
    from vllm import LLM
    from vllm.inputs import TokensPrompt

    with open(path, encoding="utf-8") as fh:
        header = json.loads(fh.readline())
        chunks = [json.loads(line) for line in fh if line.strip()]
    cuda = _has_cuda()
    t = time.perf_counter()
    llm = LLM(
        model=header["target"],
        dtype=header["dtype"],
        max_model_len=header["max_model_len"],
        max_num_seqs=header["batch_size"],
        tensor_parallel_size=header["tensor_parallel"],
        seed=header["seed"],
        enforce_eager=not cuda,
    )
    first = next((c["requests"][0] for c in chunks if c["requests"]), None)
    if first is not None:  # warm-up (kernels built on first use): part of the start-up, not of generation
        llm.generate(
            [TokensPrompt(prompt_token_ids=first["prompt"])],
            params({**first, "max_new_tokens": 2}, header["eos"]),
            use_tqdm=False,
        )
    startup = time.perf_counter() - t
    seconds, tokens, requests = 0.0, 0, 0
    group_size = GROUP_BATCHES * header["batch_size"]
    i = 0
    while i < len(chunks):
        group = [chunks[i]]
        while sum(len(c["requests"]) for c in group) < group_size and i + len(group) < len(chunks):
            group.append(chunks[i + len(group)])
        i += len(group)
        reqs = [r for c in group for r in c["requests"]]
        t = time.perf_counter()
        res = (
            llm.generate(
                [TokensPrompt(prompt_token_ids=r["prompt"]) for r in reqs],
                [params(r, header["eos"]) for r in reqs],
                use_tqdm=False,
            )
            if reqs
            else []
        )
        seconds += time.perf_counter() - t
        outs = iter(res)
        for c in group:
            responses, flags = {}, {}
            for r in c["requests"]:
                o = next(outs).outputs[0]
                responses[r["key"]] = list(o.token_ids)
                flags[r["key"]] = finite(o)
                tokens += len(o.token_ids)
            requests += len(c["requests"])
            write_atomic(
                os.path.join(header["dir"], side_name(c["chunk"])),
                {"chunk": c["chunk"], "digest": c["digest"], "responses": responses, "finite": flags},
            )
        print(
            f"vllm_jobs: {requests} responses, {tokens} tokens, {tokens / max(seconds, 1e-9):.1f} tokens/s",
            file=sys.stderr,
            flush=True,
        )
    write_atomic(
        os.path.join(header["dir"], "run.json"),
        {"startup_seconds": startup, "seconds": seconds, "tokens": tokens, "requests": requests},
    )
    return 0


def _has_cuda() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except ImportError:
        return False


if __name__ == "__main__":
    raise SystemExit(run(sys.argv[1]))
