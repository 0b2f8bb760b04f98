"""``heads-datagen labels=judge judge.mining=swap engine=vllm``: the target's greedy answers and continuations in vLLM.

Swap mining (:mod:`.mining`) calls the target again after every tried mismatch, with contexts it knows only
then (the prompt, the running response up to the mismatch, the draft's token), so its target calls cannot be
generated up front like the other families' responses. One vLLM process (:mod:`specheads.vllm.serve`) lives
through the run instead: started with the other families' up-front generation, before the Transformers
models load (vLLM gets the GPUs first), with the run's tensor and pipeline parallelism and **prefix caching
on**; each lockstep step of the search sends its contexts as one batch of greedy requests, and every
continuation after a mismatch at position ``j`` reuses the cached blocks of the prompt and ``R[:j]``. The
draft's predictions stay on the Transformers draft. The process ends with the run (:func:`stop`, and at
exit). Greedy continuations are the Transformers engine's tokens, so the search takes the same path and
labels the same mismatches.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import subprocess
import tempfile
from pathlib import Path

from specheads.engines import engine_of
from specheads.errors import UserError

log = logging.getLogger(__name__)
_SERVERS: dict[str, TargetServer] = {}  # this process's server per output directory


class TargetServer:
    """The vLLM child process answering greedy continuation calls; ``stats`` sums its calls."""

    def __init__(self, python: str, header: dict, env: dict):
        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False, encoding="utf-8") as fh:
            json.dump(header, fh)
        self.python = python
        try:
            self.proc = subprocess.Popen(
                [python, "-m", "specheads.vllm.serve", fh.name],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                env=env,
                text=True,
            )
            ready = self._read()
        finally:
            os.unlink(fh.name)
        self.stats = {"calls": 0, "prompt_tokens": 0, "cached_tokens": 0, "generated_tokens": 0, "seconds": 0.0}
        self.stats["startup_seconds"] = ready["startup_seconds"]

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            code = self.proc.wait()
            raise UserError(
                f"vLLM ({self.python}) for judge.mining=swap stopped with exit code {code}; its log is above"
            )
        return json.loads(line)

    def generate(self, contexts: list[list[int]], max_new: int, vocab: int | None = None) -> list[list[int]]:
        """Each context's greedy continuation of at most ``max_new`` tokens, EOS kept (``vocab``: only tokens
        below it)."""
        self.proc.stdin.write(json.dumps({"contexts": contexts, "max_new": max_new, "vocab": vocab}) + "\n")
        self.proc.stdin.flush()
        got = self._read()
        for key in ("prompt_tokens", "cached_tokens", "seconds"):
            self.stats[key] += got[key]
        self.stats["calls"] += 1
        self.stats["generated_tokens"] += sum(map(len, got["outputs"]))
        return got["outputs"]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        s = self.stats
        if s["calls"]:
            log.info(
                "vLLM (judge.mining=swap): %d calls, %d tokens generated in %.1f s, %.0f%% of %d prompt tokens from "
                "the prefix cache",
                s["calls"],
                s["generated_tokens"],
                s["seconds"],
                100 * s["cached_tokens"] / max(s["prompt_tokens"], 1),
                s["prompt_tokens"],
            )


def start(cfg, out: Path, eos: list[int], prompts: list[list[int]], local_rank: int) -> TargetServer:
    """Starts this process's server for the run writing to ``out`` (``prompts``: the token ids of its chunks'
    prompts, which bound the context length), replacing one a failed run left."""
    from specheads.datagen.vllm_logprobs import max_logprobs
    from specheads.decode.vllm_engine import vllm_python
    from specheads.vllm.child import child_environment, parallel_header, target_header

    stop(out)
    python = vllm_python(cfg.vllm.python)
    header = {
        **target_header(cfg),
        **parallel_header(cfg),
        "batch_size": cfg.vllm.max_num_seqs,
        "max_model_len": max(256, max(map(len, prompts), default=0) + cfg.max_new_tokens),
        "max_logprobs": max_logprobs([]),
        "eos": list(eos),
        "seed": cfg.seed,
    }
    server = TargetServer(python, header, child_environment(cfg, python, local_rank))
    _SERVERS[str(Path(out).resolve())] = server
    return server


def server_for(cfg) -> TargetServer | None:
    """The running server of the run writing to ``cfg.output_dir`` (None: an engine of this package's own)."""
    return _SERVERS.get(str(Path(cfg.output_dir).resolve())) if engine_of(cfg).own_python else None


def stop(out: Path) -> None:
    """Ends the server of the run writing to ``out``, if one runs."""
    server = _SERVERS.pop(str(Path(out).resolve()), None)
    if server is not None:
        server.close()


@atexit.register
def _stop_all() -> None:
    for out in list(_SERVERS):
        stop(Path(out))
