"""The child side of :mod:`specheads.decode.vllm_costs` (run in vLLM's Python): :class:`Profiler`, a ``custom_class``
proposer that prices vLLM's own steps, and the job that drives it (``python -m specheads.vllm.profile JOB``).

The profiler drafts with the real draft but offers every row the same number of candidates ``n``, cycling
``0, 1, .., k_max`` from one step to the next. It keeps the wall time from one ``propose`` returning to the next one
starting (vLLM's step that verified ``n + 1`` tokens per row at that batch size; kept only when the next call holds
the same rows, each grown by at most ``n + 1`` tokens) and the time of every draft forward that fed each row one
token. The job decodes ``B`` prompts of ``prefix_tokens`` random tokens at once for each batch size.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path


def _proposer_base():
    from specheads.vllm.proposer import Proposer

    return Proposer


class Profiler(_proposer_base()):
    """vLLM's ``custom_class`` proposer that prices vLLM's steps (see the module docstring)."""

    def __init__(self, vllm_config):
        super().__init__(vllm_config)
        self.samples: dict[str, list[float]] = {}  # "t_t B k" / "t_d B" -> ms
        self._last: tuple | None = None  # (end time, rows, their lengths, n) of the previous call
        runner = self.core.runner
        forward = runner.forward

        def timed(tokens, n_logits):
            start = self._clock()
            out = forward(tokens, n_logits)
            if all(len(t) == 1 for t in tokens.values()):
                self.samples.setdefault(f"t_d {len(tokens)}", []).append(1000 * (self._clock() - start))
            return out

        runner.forward = timed

    def _clock(self) -> float:
        """The time once the device's queued kernels are done (CUDA runs them after the call returns)."""
        from specheads.shim import sync_device

        sync_device(self.core.runner.device)
        return time.perf_counter()

    def propose(self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings=None, **_):
        start = self._clock()
        rows = [i for i, s in enumerate(sampled_token_ids) if s]
        lengths = [int(num_tokens_no_spec[i]) for i in rows]
        if self._last is not None:
            end, before, before_len, n = self._last
            if rows == before and all(0 < a - b <= n + 1 for a, b in zip(lengths, before_len)):
                self.samples.setdefault(f"t_t {len(rows)} {n + 1}", []).append(1000 * (start - end))
        n = self.core.calls % (self.settings.k_max + 1)
        seqs = {i: token_ids_cpu[i, :m] for i, m in zip(rows, lengths) if m < self.max_len}
        out = self.core.propose(seqs, {i: n for i in seqs})
        self._last = (self._clock(), rows, lengths, n)
        return [out.get(i, []) for i in range(len(sampled_token_ids))]


def _profiler_samples(worker) -> dict | None:
    drafter = getattr(worker.model_runner, "drafter", None)  # only the last pipeline stage has one
    return dict(drafter.samples) if drafter is not None else None


def run_job(path: str) -> int:
    """The child: prices vLLM's steps and writes the samples (``python -m specheads.vllm.profile JOB``)."""
    import random

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from specheads.vllm.options import llm_args
    from specheads.vllm.proposer import first_stats, speculative_config

    job = json.loads(Path(path).read_text(encoding="utf-8"))
    spec = speculative_config(**job["settings"])
    spec["model"] = "specheads.vllm.profile.Profiler"
    sizes, prefix = [1, *job["batches"]], job["prefix_tokens"]
    llm = LLM(
        model=job["target"],
        max_model_len=prefix + job["steps"] + 64,
        max_num_seqs=max(sizes),
        seed=0,
        speculative_config=spec,
        **llm_args(job.get("serving")),
    )
    vocab = llm.get_tokenizer().vocab_size
    rng = random.Random(0)
    params = SamplingParams(max_tokens=job["steps"], temperature=0.0, ignore_eos=True)
    for b in sizes:
        prompts = [TokensPrompt(prompt_token_ids=[rng.randrange(3, vocab) for _ in range(prefix)]) for _ in range(b)]
        llm.generate(prompts, params, use_tqdm=False)
    Path(job["out"]).write_text(
        json.dumps(
            {
                "samples": first_stats(llm.collective_rpc(_profiler_samples)),
                "vllm": __import__("vllm").__version__,
                "torch": __import__("torch").__version__,
            }
        )
    )
    return 0


if __name__ == "__main__":
    import sys

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    raise SystemExit(run_job(sys.argv[1]))
