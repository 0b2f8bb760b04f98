"""A cost table measured in vLLM's own engine, for the proposer's cost-aware rule (``stop=cost``).

vLLM's step is not this package's forward: it schedules, samples, runs its rejection sampler and its own
kernels, so the proposer prices rounds with what vLLM's steps cost, measured in vLLM. The measurement runs
vLLM with :class:`specheads.vllm.profile.Profiler` as its ``custom_class`` proposer: a proposer that drafts with the
real draft but
offers every row the same number of candidates ``n``, cycling ``0, 1, .., k_max`` from one step to the next,
and times

* the wall time between one ``propose`` returning and the next one starting: vLLM's step that verified the
  previous call's candidates, a target pass of ``n + 1`` tokens per row at that call's batch size ``B``
  (``t_t(B, n + 1)``); kept only when the next call holds the same rows, each grown by at most ``n + 1``
  tokens (no request joined, finished or was preempted in between);
* each draft forward that fed every row one token: ``t_d(B)``.

The job decodes ``B`` prompts of ``prefix_tokens`` random tokens at once for each batch size (1 and
``batches``), ``steps`` tokens each; each price is a median. Run in vLLM's Python:
``python -m specheads.vllm.profile JOB`` (:func:`vllm_cost_table` prepares and starts it, and caches the
table under ``$SPECHEADS_CACHE/costs/vllm-<key>.json``, the key a hash of the target, the draft, its
vocabulary and dtype, ``k_max``, the batch sizes, the machine, the threads, vLLM's Python and how vLLM serves:
dtype, parallelism, eager mode).
"""

from __future__ import annotations

import json
import statistics
import subprocess
import time
from pathlib import Path

from specheads.errors import UserError

PREFIX_TOKENS = 100
STEPS = 160


def table_from_samples(samples: dict[str, list[float]], batches: list[int], k_max: int) -> dict:
    """The cost-table fields from the profiler's samples: medians; a size without samples takes its neighbour's."""

    def prices(b: int) -> tuple[float, list[float]]:
        t_t, last = [], None
        for k in range(1, k_max + 2):
            got = samples.get(f"t_t {b} {k}")
            last = statistics.median(got) if got else last
            t_t.append(last)
        known = [t for t in t_t if t is not None]
        if not known:
            raise UserError(f"the vLLM cost profile has no step timed at batch {b}; re-run with profile=refresh")
        t_t = [known[0] if t is None else t for t in t_t]
        d = samples.get(f"t_d {b}")
        return (statistics.median(d) if d else None), t_t

    t_d1, t_t1 = prices(1)
    if t_d1 is None:
        raise UserError("the vLLM cost profile timed no draft forward at batch 1; re-run with profile=refresh")
    more = [prices(b) for b in batches]
    return {
        "t_draft_ms": t_d1,
        "t_target_ms": t_t1,
        "batches": list(batches),
        "t_draft_batch_ms": [t_d1 if d is None else d for d, _ in more],
        "t_target_batch_ms": [t for _, t in more],
    }


def vllm_cost_table(
    settings: dict,
    target: Path,
    python: str,
    env: dict,
    batches: list[int],
    profile: str = "auto",
    steps: int = STEPS,
    serving: dict | None = None,
) -> str:
    """The path of the cost table of vLLM's engine for the proposer ``settings`` (``speculative_config``'s
    arguments): a given JSON (``profile`` a path), the cached one (``auto``), or measured now (``refresh``, or
    none cached) in a vLLM child process with ``python`` and ``env``, vLLM serving as ``serving`` says
    (:func:`specheads.vllm_config.job_args`: dtype, parallelism, eager mode)."""
    from specheads.machine import cache_dir, cpu_model, settings_key
    from specheads.outputs import atomic_write_json
    from specheads.shim import file_digest

    if profile not in ("auto", "refresh"):
        if not Path(profile).is_file():
            raise UserError(f"profile={profile!r} is not a cost-table JSON file (or auto / refresh)")
        return profile
    import hashlib

    draft = Path(settings["draft"])
    weights = sorted(draft.glob("*.safetensors"))
    fingerprint = {
        "target": target.name,
        "draft": [file_digest(hashlib.sha256(), w).hexdigest()[:16] for w in weights],
        "vocab_file": settings.get("vocab_file"),
        "vocab_top_n": settings.get("vocab_top_n"),
        "k_max": settings["k_max"],
        "batches": batches,
        "machine": cpu_model(),
        "threads": env.get("OMP_NUM_THREADS"),
        "python": python,
        "steps": steps,
        "serving": serving,
        "draft_dtype": settings.get("dtype", "auto"),
    }
    path = cache_dir("costs") / f"vllm-{settings_key(fingerprint)}.json"
    if profile == "auto" and path.is_file():
        return str(path)
    work = path.with_suffix(".work")
    work.mkdir(parents=True, exist_ok=True)
    job, out = work / "job.json", work / "samples.json"
    out.unlink(missing_ok=True)
    prof = {**settings, "policy": "sd", "head": None, "stop": "threshold", "costs": None, "threshold": None}
    job.write_text(
        json.dumps(
            {
                "settings": prof,
                "target": str(target),
                "batches": batches,
                "steps": steps,
                "prefix_tokens": PREFIX_TOKENS,
                "out": str(out),
                "serving": serving,
            }
        )
    )
    print(
        f"[specheads] pricing vLLM's steps (batch 1, {batches}; up to {settings['k_max']} candidates) -> {path}",
        flush=True,
    )
    code = subprocess.call([python, "-m", "specheads.vllm.profile", str(job)], env=env)
    if code or not out.is_file():
        raise UserError(f"the vLLM cost profile ({python}) failed with exit code {code}; its log is above")
    res = json.loads(out.read_text())
    table = table_from_samples(res["samples"], batches, settings["k_max"])
    atomic_write_json(
        path,
        {
            **table,
            "machine": cpu_model(),
            "torch": res["torch"],
            "threads": int(env.get("OMP_NUM_THREADS") or 0),
            "target_runner": f"vllm {res['vllm']}",
            "draft_runner": "specheads proposer",
            "target_fingerprint": target.name,
            "prefix_tokens": PREFIX_TOKENS,
            "reps": steps,
            "samples": res["samples"],
            "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
        },
    )
    return str(path)
