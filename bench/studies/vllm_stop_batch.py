"""Where the stop plugin loses at batch 16 on the low-acceptance sets: every request cut at 0, 1 or 2 candidates
against ``c-cost`` and ``c-online-cost`` with the draft gate on and off, in one vLLM engine, interleaved.

Run in vLLM's own Python, after ``bench/vllm_stop.py`` wrote its work directory (the target, the EAGLE head, the
prompts and the cost table)::

    OMP_NUM_THREADS=2 VLLM_ENABLE_V1_MULTIPROCESSING=0 LD_PRELOAD=<tcmalloc>:<venv>/lib/libiomp5.so \\
        <vllm-venv>/bin/python bench/studies/vllm_stop_batch.py --sets mt_bench,alpaca

Each set's first 16 prompts go in at once (``max_num_seqs`` 16), 128 new tokens, greedy; each row runs twice, in
opposite orders, and its tokens/s is over both. Writes ``bench/studies/results/vllm_stop_batch.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", default=str(ROOT / "runs/vllm_stop"))
    ap.add_argument("--sets", default="mt_bench,alpaca")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--max-new", type=int, default=128)
    ap.add_argument("--out", default=str(ROOT / "bench/studies/results/vllm_stop_batch.json"))
    args = ap.parse_args(argv)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from specheads.machine import cpu_model
    from specheads.vllm import stop_plugin as sp
    from specheads.vllm.stop_config import speculative_config

    work = Path(args.work)
    costs = str(next(work.glob("costs-k*.table.json")))
    by_set = json.loads((work / "prompts.json").read_text())
    spec = speculative_config(str(work / "eagle3"), 6, rule="fixed", fixed_k=1)
    llm = LLM(model=str(work / "target_hf"), dtype="float32", max_model_len=2048, max_num_seqs=args.batch, seed=0,
              enforce_eager=True, speculative_config=spec)  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=args.max_new)
    rows = {
        "k0": {"rule": "fixed", "fixed_k": 0},
        "k1": {"rule": "fixed", "fixed_k": 1},
        "k2": {"rule": "fixed", "fixed_k": 2},
        "c-cost": {"rule": "c-cost", "costs": costs},
        "c-cost-no-gate": {"rule": "c-cost", "costs": costs, "gate": False},
        "c-online-cost": {"rule": "c-online-cost", "costs": costs},
        "c-online-cost-no-gate": {"rule": "c-online-cost", "costs": costs, "gate": False},
    }
    sets = args.sets.split(",")
    llm.generate([TokensPrompt(prompt_token_ids=by_set[sets[0]][0])], params, use_tqdm=False)  # warm-up
    sums: dict = {}
    for rep in range(2):
        for s in sets:
            prompts = [TokensPrompt(prompt_token_ids=p) for p in by_set[s][: args.batch]]
            for name in list(rows) if rep == 0 else list(rows)[::-1]:
                llm.collective_rpc(sp.configure, args=(rows[name],))
                t = time.perf_counter()
                out = llm.generate(prompts, params, use_tqdm=False)
                acc = sums.setdefault(s, {}).setdefault(name, [0, 0.0])
                acc[0] += sum(len(o.outputs[0].token_ids) for o in out)
                acc[1] += time.perf_counter() - t
    result = {
        "command": "python bench/studies/vllm_stop_batch.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "machine": f"{platform.machine()} {os.cpu_count()} cpus, vLLM {__import__('vllm').__version__} CPU, fp32",
        "cpu": cpu_model(),
        "batch": args.batch,
        "tokens_per_s": {s: {n: round(t / sec, 2) for n, (t, sec) in rs.items()} for s, rs in sums.items()},
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result["tokens_per_s"], indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
