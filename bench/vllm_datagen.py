"""Datagen's generation stage: the target's responses with the Transformers engine against ``engine=vllm``.

    python bench/vllm_datagen.py                      # 32 Alpaca + 32 GSM8K-train prompts, 128 tokens, greedy, batch 32
    python bench/vllm_datagen.py --alpaca 512 --gsm8k 512 --hf-prompts 128 --vllm-batches 512,1024   # larger batches

Run with the project's Python. The same prompts (the target's chat template, cut as ``heads-datagen`` cuts
them: ``Job.prompt_ids``) go through

* the Transformers engine: ``datagen.acceptance_labels.generate_responses`` batch by batch (``--batch`` prompts at
  once, the fused batched forward on a Llama-family target, recording the logits as datagen does), in this process
  with ``--threads`` torch threads;
* vLLM: ``datagen.vllm_responses.generate_up_front``, the step of ``heads-datagen engine=vllm`` that writes a run's
  responses before any Transformers model loads (its requests, the vLLM child process ``specheads.vllm.jobs`` in
  vLLM's own virtualenv: ``--vllm-python``, default ``$SPECHEADS_VLLM_PYTHON`` or this Python when it imports
  vLLM; ``vllm.max_num_seqs`` = ``--vllm-batch``, ``vllm.threads`` = ``--threads``), all prompts as one chunk.

tokens/s is generated tokens over the generation's wall time; vLLM's start-up (``LLM()``: loading, KV-cache
allocation) is reported apart and not counted. Greedy outputs are compared prompt by prompt. Writes ``--out``
(default ``bench/results/vllm_datagen.json``) with ``datagen_generation_vllm_vs_hf_tokens_per_s``;
``--vllm-batches`` adds ``vllm_by_batch`` (tokens/s per ``max_num_seqs``, each a vLLM run of its own on the same
prompts), ``vllm_best_batch`` and its ratio to the Transformers engine.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("SPECHEADS_SHARED", str(ROOT.parent / "shared")))


def prompts(args) -> list:
    from specheads.prompts import iter_prompt_files

    out = list(iter_prompt_files(str(SHARED / "data/alpaca/alpaca_5000.json"), limit=args.alpaca, offset=args.offset))
    return out + list(iter_prompt_files(str(SHARED / "data/gsm8k/train.jsonl"), limit=args.gsm8k, offset=args.offset))


def transformers_stage(job, ids: list[list[int]], args) -> dict:
    import torch

    from specheads.datagen.acceptance_labels import generate_responses
    from specheads.shim.core.sampling import SamplingConfig

    model = job.pair.target.model
    generate_responses(model, ids[:2], 8, SamplingConfig(), 0, job.pad, job.eos)  # warm-up (kernels, allocator)
    outputs, seconds = [], 0.0
    for b in range(0, len(ids), args.batch):
        t = time.perf_counter()
        got, _ = generate_responses(model, ids[b : b + args.batch], args.max_new, SamplingConfig(), b, job.pad, job.eos)
        seconds += time.perf_counter() - t
        outputs += got
    tokens = sum(map(len, outputs))
    return {
        "tokens": tokens,
        "seconds": round(seconds, 3),
        "tokens_per_s": round(tokens / seconds, 2),
        "threads": torch.get_num_threads(),
        "outputs": outputs,
    }


def vllm_stage(cfg, items: list, batch: int) -> dict:
    """``items`` through ``heads-datagen engine=vllm``'s generation step, as one chunk, with ``max_num_seqs=batch``."""
    from specheads.datagen.vllm_responses import generate_up_front, side_path

    with tempfile.TemporaryDirectory() as work:
        run_cfg = dataclasses.replace(
            cfg, output_dir=work, vllm=dataclasses.replace(cfg.vllm, max_num_seqs=batch), chunk_size=len(items)
        )
        t = time.perf_counter()
        run = generate_up_front(run_cfg, Path(work), [(0, items)])
        wall = time.perf_counter() - t
        side = json.loads(side_path(Path(work), 0).read_text())
    outputs = [side["responses"][str(cfg.offset + i)] for i in range(len(items))]  # keyed by run-wide index
    return {
        "tokens": run["tokens"],
        "seconds": round(run["seconds"], 3),
        "tokens_per_s": round(run["tokens"] / run["seconds"], 2),
        "startup_s": round(run["startup_seconds"], 1),
        "child_wall_s": round(wall, 1),
        "outputs": outputs,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=str(SHARED / "models/smollm2-135m-instruct"))
    ap.add_argument("--gguf-file", default="SmolLM2-135M-Instruct.Q4_1.gguf", help="'' for a Hugging Face directory")
    ap.add_argument("--alpaca", type=int, default=32)
    ap.add_argument("--gsm8k", type=int, default=32)
    ap.add_argument("--offset", type=int, default=0)
    ap.add_argument("--max-new", type=int, default=128)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument(
        "--vllm-batch",
        type=int,
        default=256,
        help="vLLM's max_num_seqs (heads-datagen engine=vllm's vllm.max_num_seqs)",
    )
    ap.add_argument(
        "--vllm-batches",
        default="",
        help="more max_num_seqs values timed on the same prompts, each in its own vLLM run (e.g. 512,1024)",
    )
    ap.add_argument(
        "--hf-prompts", type=int, default=0, help="time the Transformers engine on the first N prompts only (0: all)"
    )
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--vllm-python",
        default=os.environ.get("SPECHEADS_VLLM_PYTHON"),
        help="vLLM's python (default: $SPECHEADS_VLLM_PYTHON, else this one when it imports vLLM)",
    )
    ap.add_argument("--out", default=str(ROOT / "bench/results/vllm_datagen.json"))
    args = ap.parse_args(argv)

    import torch

    from specheads.datagen.cli import _load
    from specheads.datagen.config import DatagenConfig
    from specheads.datagen.engines import runtime_of
    from specheads.datagen.registry import labeller
    from specheads.shim.runners.models import ModelSpec
    from specheads.vllm_config import DatagenVllm

    torch.set_num_threads(args.threads)
    cfg = DatagenConfig(
        target=ModelSpec(path=args.target, gguf_file=args.gguf_file or None, device="cpu"),
        labels="drafter",
        max_new_tokens=args.max_new,
        batch_size=args.batch,
        engine="vllm",
        vllm=DatagenVllm(python=args.vllm_python, threads=args.threads),
    )
    # the Transformers engine's stage needs the whole target: load it as engine=specheads would
    hf_cfg = dataclasses.replace(cfg, engine="specheads")
    job = _load(hf_cfg, labeller(hf_cfg.labels), runtime_of(hf_cfg))
    items = prompts(args)
    ids = job.prompt_ids(items)
    n_hf = args.hf_prompts or len(ids)
    hf = transformers_stage(job, ids[:n_hf], args)
    vl = vllm_stage(cfg, items, args.vllm_batch)
    base = vl.pop("outputs")
    same = sum(a == b for a, b in zip(hf.pop("outputs"), base))
    by_batch = {str(args.vllm_batch): {k: vl[k] for k in ("tokens_per_s", "seconds", "startup_s")}}
    for b in [int(x) for x in filter(None, args.vllm_batches.split(","))]:
        got = vllm_stage(cfg, items, b)
        row = {k: got[k] for k in ("tokens_per_s", "seconds", "startup_s")}
        by_batch[str(b)] = {**row, "greedy_identical_to_first": sum(a == c for a, c in zip(base, got["outputs"]))}
    sys.path.insert(0, str(ROOT / "bench"))
    from _common import run_info, write_result

    ratio = round(vl["tokens_per_s"] / hf["tokens_per_s"], 3)
    result = {
        **run_info(__file__, argv, f"fp32, greedy, {args.threads} threads (torch and vLLM's OMP)"),
        "target": f"{args.target}/{args.gguf_file}" if args.gguf_file else args.target,
        "prompts": {"alpaca": args.alpaca, "gsm8k_train": args.gsm8k, "offset": args.offset},
        "max_new_tokens": args.max_new,
        "batch_size": args.batch,
        "transformers": hf,
        "vllm": vl,
        "greedy_identical_prompts": f"{same}/{n_hf}",
        "datagen_generation_vllm_vs_hf_tokens_per_s": ratio,
        "vllm_by_batch": by_batch,
    }
    if len(by_batch) > 1:
        best = max(by_batch, key=lambda b: by_batch[b]["tokens_per_s"])
        result["vllm_best_batch"] = int(best)
        result["vllm_best_batch_vs_hf_tokens_per_s"] = round(by_batch[best]["tokens_per_s"] / hf["tokens_per_s"], 3)
    write_result(args.out, result)
    print("engine | tokens | seconds | tokens/s | start-up s")
    print(f"transformers (datagen's generate_responses) | {hf['tokens']} | {hf['seconds']} | {hf['tokens_per_s']} | -")
    print(
        f"vllm (heads-datagen engine=vllm) | {vl['tokens']} | {vl['seconds']} | {vl['tokens_per_s']} | "
        f"{vl['startup_s']}"
    )
    for b, row in by_batch.items():
        print(f"vllm max_num_seqs {b} | - | {row['seconds']} | {row['tokens_per_s']} | {row['startup_s']}")
    print(f"vLLM / Transformers tokens/s: {ratio}; greedy outputs identical on {same}/{n_hf} prompts")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
