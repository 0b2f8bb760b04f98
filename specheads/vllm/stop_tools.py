"""The stop plugin's tools (:mod:`specheads.vllm.stop_plugin`): the cost table of vLLM's own steps it prices rounds
with, and its command line.

    python -m specheads.vllm.stop_tools config eagle=DIR k=6 rule=c-cost costs=FILE     # the speculative_config
    python -m specheads.vllm.stop_tools profile target=DIR eagle=DIR k=6 batches=2,4,8,16 out=FILE  # vLLM's Python
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from specheads.vllm.stop_config import speculative_config
from specheads.vllm.stop_plugin import take_trace


def table_from_samples(samples: dict[str, list[float]], k: int, batches: list[int]) -> dict:
    """The cost-table fields from the profile's samples (medians). A round of ``n >= 1`` candidates costs vLLM's
    first draft pass (it also draws ``y_1``), ``n - 1`` draft steps and a target step over ``n + 1`` tokens per
    request; ``round_ms(n) = n t_d + t_t(n + 1)``, so ``t_t(1)`` holds the first pass and ``t_t(k >= 2)`` the
    first pass less one draft step."""
    import statistics

    def med(key: str) -> float | None:
        got = samples.get(key)
        return statistics.median(got) if got else None

    def prices(b: int) -> tuple[float, list[float]]:
        first, step = med(f"t_first {b}"), med(f"t_d {b}")
        if first is None or step is None:
            raise ValueError(f"the stop plugin's profile timed no draft pass at batch {b}: decode longer (steps=)")
        out, last = [], None
        for n in range(1, k + 2):
            t = med(f"t_t {b} {n}")
            last = t if t is not None else last
            out.append(last)
        known = [t for t in out if t is not None]
        if not known:
            raise ValueError(f"the stop plugin's profile timed no target step at batch {b}: decode longer (steps=)")
        out = [known[0] if t is None else t for t in out]
        return step, [t + first - (step if n >= 2 else 0.0) for n, t in enumerate(out, start=1)]

    t_d1, t_t1 = prices(1)
    more = [prices(b) for b in batches]
    return {
        "t_draft_ms": t_d1,
        "t_target_ms": t_t1,
        "batches": list(batches),
        "t_draft_batch_ms": [d for d, _ in more],
        "t_target_batch_ms": [t for _, t in more],
    }


def profile(
    target: str, eagle: str, k: int, batches: list[int], out: str, steps: int = 160, prefix: int = 100, **llm_kw
) -> dict:
    """Measures the cost table of vLLM's steps for ``eagle`` on ``target`` at up to ``k`` candidates (batch 1 and
    ``batches``) and writes it to ``out``; run in vLLM's Python (``python -m specheads.vllm.stop_tools profile``)."""
    import random

    import torch
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from specheads.machine import cpu_model

    sizes = [1, *batches]
    llm = LLM(
        model=target,
        max_model_len=prefix + steps + k + 64,
        max_num_seqs=max(sizes),
        seed=0,
        speculative_config=speculative_config(eagle, k, profile=True),
        **llm_kw,
    )
    vocab = llm.get_tokenizer().vocab_size
    rng = random.Random(0)
    params = SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True)
    llm.generate([TokensPrompt(prompt_token_ids=[5] * prefix)], SamplingParams(max_tokens=8), use_tqdm=False)
    llm.collective_rpc(take_trace)  # the warm-up's samples dropped
    samples: dict[str, list[float]] = {}
    for b in sizes:
        prompts = [TokensPrompt(prompt_token_ids=[rng.randrange(3, vocab) for _ in range(prefix)]) for _ in range(b)]
        llm.generate(prompts, params, use_tqdm=False)
        got = next(r for r in llm.collective_rpc(take_trace) if r is not None)
        for key, v in got["samples"].items():
            samples.setdefault(key, []).extend(v)
    table = {
        **table_from_samples(samples, k, list(batches)),
        "machine": cpu_model(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "target_runner": f"vllm {vllm.__version__}",
        "draft_runner": "vllm eagle3 (specheads stop plugin)",
        "target_fingerprint": Path(target).name,
        "draft_fingerprint": str(
            (json.loads(Path(eagle, "config.json").read_text()).get("specheads") or {}).get(
                "tensors_sha256", Path(eagle).name
            )
        ),
        "prefix_tokens": prefix,
        "reps": steps,
        "samples": samples,
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(str(out) + ".tmp")
    tmp.write_text(json.dumps(table, indent=1))
    tmp.replace(out)
    return table


def _value(v: str):
    low = v.lower()
    if low in ("true", "false"):
        return low == "true"
    if low in ("null", "none"):
        return None
    try:
        return int(v)
    except ValueError:
        return v


def main(argv: list[str] | None = None) -> int:
    """The stop plugin's two commands (``key=value`` arguments):

    python -m specheads.vllm.stop_tools config eagle=DIR k=6 rule=c-cost costs=FILE [head=FILE gate=true k_min=1]
        prints the ``speculative_config`` JSON for ``LLM(...)`` or ``vllm serve --speculative-config``;
    python -m specheads.vllm.stop_tools profile target=DIR eagle=DIR k=6 batches=2,4,8,16 out=FILE
        [steps=160 dtype=auto enforce_eager=true] (in vLLM's Python) measures the cost table the rules read.
    """
    import sys

    from specheads.errors import UserError

    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(main.__doc__)
        return 0 if args else 2
    command, rest = args[0], args[1:]
    bad = [a for a in rest if "=" not in a]
    if command not in ("config", "profile") or bad:
        print(f"stop_plugin: expected config|profile and key=value arguments; got {' '.join(bad) or command}",
              file=sys.stderr)  # fmt: skip
        return 2
    kv = {k: v for k, v in (a.split("=", 1) for a in rest)}
    need = ("eagle", "k") if command == "config" else ("target", "eagle", "k", "out")
    missing = [k for k in need if k not in kv]
    if missing:
        print(f"stop_plugin {command}: missing {', '.join(missing)}", file=sys.stderr)
        return 2
    try:
        if command == "config":
            eagle, k = kv.pop("eagle"), int(kv.pop("k"))
            print(json.dumps(speculative_config(eagle, k, **{key: _value(v) for key, v in kv.items()})))
            return 0
        batches = [int(b) for b in kv.get("batches", "").split(",") if b]
        extra = {"dtype": kv.get("dtype", "auto"), "enforce_eager": kv.get("enforce_eager", "true") == "true"}
        t = profile(kv["target"], kv["eagle"], int(kv["k"]), batches, kv["out"], int(kv.get("steps", 160)), **extra)
    except (UserError, ValueError) as e:
        print(f"stop_plugin {command}: {e}", file=sys.stderr)
        return 2
    print(f"cost table -> {kv['out']}: t_d {t['t_draft_ms']:.3g} ms, t_t(k) {[round(x, 3) for x in t['t_target_ms']]}")
    return 0


if __name__ == "__main__":
    import os

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    raise SystemExit(main())
