"""The child process of ``heads-datagen engine=vllm``: ``python -m specheads.vllm.jobs JOB``.

It runs in vLLM's own Python (``vllm.python``; it needs vLLM and the standard library only) and is started
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
is flagged (the labeller then skips that prompt as it skips non-finite logits). A request with ``logprobs``
(``k > 0``: the top ``k``; ``-1``: the whole vocabulary) gets, at every response token, the target's raw
log-probabilities of the distribution that token was drawn from (vLLM's ``raw_logprobs``: before
temperature, top-k and top-p), written beside the side file as ``chunk-N.logprobs.safetensors``
(``<key>.ids`` int32 and ``<key>.logp`` fp32 ``[tokens, k + 1]``, padded with id -1 and -inf; the whole
vocabulary: ``<key>.logp`` ``[tokens, V]`` alone). The last line of the run writes ``run.json``: start-up
seconds, generation seconds, tokens.

:func:`start` builds the ``LLM`` from the header for this job and for :mod:`.serve` (swap mining's
continuations): tensor and pipeline parallelism, the executor backend, dtype and prefix caching are the
header's.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time

from specheads.vllm.options import whole_prefill_args

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
    k = req.get("logprobs")
    return SamplingParams(
        max_tokens=req["max_new_tokens"],
        temperature=s["temperature"] if sampled else 0.0,
        top_k=(s["top_k"] or 0) if sampled else 0,
        top_p=s["top_p"] if sampled else 1.0,
        seed=req["seed"] if sampled else None,
        stop_token_ids=list(eos),
        logprobs=0 if k is None else k,
        flat_logprobs=True,  # a few flat lists per request, not a dict per token (the whole vocabulary: V each)
        detokenize=False,
    )


def steps(out) -> list[tuple[list[int], list[float]]]:
    """Per response token, the ids and log-probabilities vLLM returned (empty where it gave none)."""
    lp = out.logprobs
    if lp is None:
        return [([], []) for _ in out.token_ids]
    if hasattr(lp, "start_indices"):  # FlatLogprobs
        return [(lp.token_ids[a:b], lp.logprobs[a:b]) for a, b in zip(lp.start_indices, lp.end_indices)]
    return [(list(d), [v.logprob for v in d.values()]) if d else ([], []) for d in lp]


def finite(out) -> bool:
    """Whether every chosen token's log-probability is finite and none returned is NaN (a token vLLM gave
    nothing for counts as finite)."""
    for (ids, lps), tok in zip(steps(out), out.token_ids):
        if any(math.isnan(v) for v in lps):
            return False
        if tok in ids and not math.isfinite(lps[ids.index(tok)]):
            return False
    return True


def logprob_tensors(key: str, out, k: int, vocab: int) -> dict:
    """A response's log-probabilities as tensors (see the module docstring)."""
    import torch

    rows = steps(out)
    if k < 0:  # the whole vocabulary: dense
        logp = torch.full((len(rows), vocab), float("-inf"))
        for i, (ids, lps) in enumerate(rows):
            logp[i, torch.tensor(ids, dtype=torch.long)] = torch.tensor(lps, dtype=torch.float32)
        return {f"{key}.logp": logp}
    width = max([k + 1, *(len(ids) for ids, _ in rows)])
    ids_t = torch.full((len(rows), width), -1, dtype=torch.int32)
    logp = torch.full((len(rows), width), float("-inf"))
    for i, (ids, lps) in enumerate(rows):
        ids_t[i, : len(ids)] = torch.tensor(ids, dtype=torch.int32)
        logp[i, : len(lps)] = torch.tensor(lps, dtype=torch.float32)
    return {f"{key}.ids": ids_t, f"{key}.logp": logp}


def write_tensors(path: str, tensors: dict, digest: str, vocab: int) -> None:
    """``tensors`` as a safetensors file, atomically (temporary name, fsync, rename)."""
    from safetensors.torch import save_file

    tmp = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.{os.getpid()}.tmp")
    save_file({k: v.contiguous() for k, v in tensors.items()}, tmp, metadata={"digest": digest, "vocab": str(vocab)})
    with open(tmp, "rb") as fh:
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def logprobs_name(chunk: int) -> str:
    return f"chunk-{chunk:06d}.logprobs.safetensors"


def start(header: dict, **extra):
    """vLLM's ``LLM`` for a job header: target, dtype, lengths, parallelism (``tensor_parallel``,
    ``pipeline_parallel``, ``executor_backend``), ``max_logprobs``; ``extra`` goes to ``LLM`` as is."""
    from vllm import LLM

    backend = header.get("executor_backend")
    return LLM(
        model=header["target"],
        dtype=header["dtype"],
        max_model_len=header["max_model_len"],
        max_num_seqs=header["batch_size"],
        tensor_parallel_size=header["tensor_parallel"],
        pipeline_parallel_size=header.get("pipeline_parallel", 1),
        **({"distributed_executor_backend": backend} if backend else {}),
        max_logprobs=header.get("max_logprobs", 20),
        seed=header["seed"],
        enforce_eager=not _has_cuda(),
        **extra,
    )


def whole_prefills(chunks: list[dict], cuda: bool, max_model_len: int) -> dict:
    """:func:`~specheads.vllm.options.whole_prefill_args` for a job's chunks (sampled when any request is)."""
    sampled = any(r["sampling"].get("do_sample") for c in chunks for r in c["requests"])
    return whole_prefill_args(sampled, cuda, max_model_len)


def run(path: str) -> int:
    from vllm.inputs import TokensPrompt

    with open(path, encoding="utf-8") as fh:
        header = json.loads(fh.readline())
        chunks = [json.loads(line) for line in fh if line.strip()]
    t = time.perf_counter()
    llm = start(header, **whole_prefills(chunks, _has_cuda(), header["max_model_len"]))
    vocab = llm.llm_engine.model_config.get_vocab_size()
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
            responses, flags, tensors = {}, {}, {}
            for r in c["requests"]:
                o = next(outs).outputs[0]
                responses[r["key"]] = list(o.token_ids)
                flags[r["key"]] = finite(o)
                tokens += len(o.token_ids)
                if r.get("logprobs") is not None:
                    tensors.update(logprob_tensors(r["key"], o, r["logprobs"], vocab))
            requests += len(c["requests"])
            side = {"chunk": c["chunk"], "digest": c["digest"], "responses": responses, "finite": flags}
            if tensors:  # before the side file, which marks the chunk generated
                path = os.path.join(header["dir"], logprobs_name(c["chunk"]))
                write_tensors(path, tensors, c["digest"], vocab)
                side["logprobs"] = logprobs_name(c["chunk"])
            write_atomic(os.path.join(header["dir"], side_name(c["chunk"])), side)
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
