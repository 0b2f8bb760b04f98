"""The vLLM process that answers swap mining's target calls: ``python -m specheads.vllm.serve HEADER``.

Started once per run by :mod:`specheads.datagen.vllm_mining` in vLLM's own Python (vLLM and the standard
library only). ``HEADER`` is the JSON header of :func:`.jobs.start` (target, dtype, lengths, parallelism,
EOS ids). vLLM starts with prefix caching on: a search's continuations all start with the prompt and the
running response, so each one prefills only what its cached blocks do not hold.

Protocol, one JSON line each way on stdin and stdout (vLLM's own output goes to stderr): first ``{"ready":
true, "startup_seconds": s}``; then for each call ``{"contexts": [[ids]], "max_new": n, "vocab": V or null}``
the answer ``{"outputs": [[ids]], "prompt_tokens": n, "cached_tokens": n, "seconds": s}``: each context's
greedy continuation (EOS kept, as the Transformers engine keeps it; ``vocab``: only tokens below it, when the
draft's vocabulary is smaller). End of input ends the process.
"""

from __future__ import annotations

import json
import os
import sys
import time


def answer(llm, call: dict, eos: list[int]) -> dict:
    """One call's greedy continuations (see the module docstring)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    vocab = call.get("vocab")
    params = SamplingParams(
        max_tokens=call["max_new"],
        temperature=0.0,
        stop_token_ids=list(eos),
        detokenize=False,
        **({"allowed_token_ids": list(range(vocab))} if vocab else {}),
    )
    t = time.perf_counter()
    res = llm.generate([TokensPrompt(prompt_token_ids=c) for c in call["contexts"]], params, use_tqdm=False)
    return {
        "outputs": [list(r.outputs[0].token_ids) for r in res],
        "prompt_tokens": sum(len(c) for c in call["contexts"]),
        "cached_tokens": sum(r.num_cached_tokens or 0 for r in res),
        "seconds": time.perf_counter() - t,
    }


def serve(path: str) -> int:
    reply = os.fdopen(os.dup(1), "w", encoding="utf-8")  # the answers' channel: stdout as it was given
    os.dup2(2, 1)  # everything else printed (vLLM's log, its workers') goes to stderr
    sys.stdout = sys.stderr
    from specheads.vllm.jobs import start

    with open(path, encoding="utf-8") as fh:
        header = json.load(fh)
    t = time.perf_counter()
    llm = start(header, enable_prefix_caching=True)
    reply.write(json.dumps({"ready": True, "startup_seconds": time.perf_counter() - t}) + "\n")
    reply.flush()
    for line in sys.stdin:
        if line.strip():
            reply.write(json.dumps(answer(llm, json.loads(line), header["eos"])) + "\n")
            reply.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(serve(sys.argv[1]))
