"""The vLLM child that hands ``heads-datagen engine=vllm`` the target's hidden states of given sequences.

``python -m specheads.vllm.states_child HEADER REPLY_FD`` runs in vLLM's own Python (vLLM, torch and the standard
library only). ``HEADER`` is a JSON file: what :func:`specheads.vllm.jobs.start` reads (the target's Hugging Face
directory, dtype, ``max_model_len``, ``batch_size``, tensor and pipeline parallelism, executor backend, seed,
``max_logprobs``: the most prompt log-probabilities a request may ask), ``layers`` (increasing: ``i`` is the
residual stream entering decoder layer ``i``, ``n`` the last layer's output before the final norm) and, on a
GPU, ``gpu_memory_utilization``. vLLM starts once
(``LLM`` with its ``extract_hidden_states`` speculative method and :class:`~specheads.vllm.states.StatesConnector`),
so tensor and pipeline parallelism are vLLM's own.

Then each line on stdin is a request: ``{"dir": folder, "seqs": [[token ids], ...], "top_k": k}``. One
``generate`` call runs every sequence as a prompt (one token sampled, never fed back): the connector writes
``dir/<i>.safetensors`` (``states``: ``[len(seq), len(layers), hidden]``) in the step that computes the
sequence's last token; with ``k > 0`` this process adds ``dir/<i>.top.safetensors`` (``ids`` int32 and
``logp`` fp32, ``[len(seq) - 1, k]``: at position ``p``, the ``k`` most likely tokens of the distribution
token ``p`` was drawn from, vLLM's raw log-probabilities). The reply, one JSON line on the file descriptor
``REPLY_FD`` (vLLM logs to stdout): ``{"sequences": n, "tokens": t, "seconds": s}``; the first reply, before
any request, carries ``startup_seconds``. An empty line or the end of stdin ends the process.
"""

from __future__ import annotations

import json
import os
import sys
import time

CONNECTOR = {
    "kv_connector": "StatesConnector",
    "kv_connector_module_path": "specheads.vllm.states",
    "kv_role": "kv_producer",
}


def start(header: dict):
    """vLLM (:func:`specheads.vllm.jobs.start`: target, dtype, lengths, parallelism) with the hidden-states
    method at ``header["layers"]`` and the connector that writes them."""
    from specheads.vllm.jobs import start as start_llm

    gpu = header.get("gpu_memory_utilization")
    return start_llm(
        header,
        skip_tokenizer_init=True,
        enable_prefix_caching=False,  # every state from this request's own forward, as the Transformers engine's
        speculative_config={
            "method": "extract_hidden_states",
            "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": list(header["layers"])}},
        },
        kv_transfer_config=CONNECTOR,
        **({"gpu_memory_utilization": gpu} if gpu else {}),
    )


def top_rows(prompt_logprobs, k: int):
    """``(ids, logp)`` ``[T - 1, k]`` from vLLM's prompt log-probabilities (position 0 has none): the ``k``
    best entries of each position by vLLM's rank (the token that stands there is added when outside them)."""
    import torch

    ids, logp = [], []
    for step in prompt_logprobs[1:]:
        best = sorted(step.items(), key=lambda kv: (kv[1].rank, -kv[1].logprob))[:k]
        ids.append([t for t, _ in best])
        logp.append([lp.logprob for _, lp in best])
    return torch.tensor(ids, dtype=torch.int32).reshape(-1, k), torch.tensor(logp, dtype=torch.float32).reshape(-1, k)


def serve(llm, request: dict) -> dict:
    """Runs one request's sequences; the connector writes their states, this process their top-k."""
    from safetensors.torch import save_file
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from specheads.vllm.states import PATH_KEY

    folder, k = request["dir"], int(request.get("top_k", 0))
    params = [
        SamplingParams(
            max_tokens=1,
            temperature=0.0,
            detokenize=False,
            prompt_logprobs=k or None,
            extra_args={"kv_transfer_params": {PATH_KEY: os.path.join(folder, f"{i}.safetensors")}},
        )
        for i in range(len(request["seqs"]))
    ]
    t = time.perf_counter()
    outs = llm.generate([TokensPrompt(prompt_token_ids=s) for s in request["seqs"]], params, use_tqdm=False)
    seconds = time.perf_counter() - t
    if k:
        for i, out in enumerate(outs):
            ids, logp = top_rows(out.prompt_logprobs, k)
            tmp = os.path.join(folder, f".{i}.top.tmp")
            save_file({"ids": ids, "logp": logp}, tmp)
            os.replace(tmp, os.path.join(folder, f"{i}.top.safetensors"))
    return {"sequences": len(outs), "tokens": sum(len(s) for s in request["seqs"]), "seconds": seconds}


def run(header_path: str, reply_fd: int) -> int:
    with open(header_path, encoding="utf-8") as fh:
        header = json.load(fh)
    reply = os.fdopen(reply_fd, "w", encoding="utf-8")
    t = time.perf_counter()
    llm = start(header)
    reply.write(json.dumps({"startup_seconds": time.perf_counter() - t}) + "\n")
    reply.flush()
    for line in sys.stdin:
        if not line.strip():
            break
        reply.write(json.dumps(serve(llm, json.loads(line))) + "\n")
        reply.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(run(sys.argv[1], int(sys.argv[2])))
