"""Engine benchmark: our AR and SD against Hugging Face ``generate`` on the shared pair.

One process, one run, configurations interleaved prompt by prompt (rotating order) so that
machine noise hits every configuration alike. Greedy, fp32, batch 1.

    python bench/engine.py                      # 32 GSM8K-test prompts x 128 new tokens
    python bench/engine.py --n 8 --max-new-tokens 64 --offset 100 --out /tmp/e.json

Prints a table and writes ``bench/results/engine.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

from _common import interleave, run_info
from specheads.export import format_prompt, load_pair
from specheads.export.shim.engine import Engine, GenerationStats
from specheads.export.shim.models import ModelSpec
from specheads.export.shim.policies import StandardSD
from specheads.prompts import load_prompts

ROOT = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("SPECHEADS_SHARED", ROOT.parent / "shared"))
KS = (2, 4, 6, 8)


def hf_run(pair, ids, max_new, k=None):
    """HF generate (target alone, or assisted with a constant K and no confidence cut)."""
    kwargs = {"max_new_tokens": max_new, "do_sample": False, "pad_token_id": pair.eos_token_ids[0]}
    if k is not None:
        gc = pair.draft.model.generation_config
        gc.num_assistant_tokens, gc.num_assistant_tokens_schedule = k, "constant"
        gc.assistant_confidence_threshold = 0.0
        kwargs["assistant_model"] = pair.draft.model
    x = torch.tensor([ids])
    start = time.perf_counter()
    with torch.inference_mode():
        out = pair.target.model.generate(x, attention_mask=torch.ones_like(x), **kwargs)
    elapsed = time.perf_counter() - start
    toks = out[0, len(ids):].tolist()
    return toks, GenerationStats(new_tokens=len(toks), wall_time=elapsed)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", default=str(SHARED / "data/gsm8k/test.jsonl"))
    ap.add_argument("--n", type=int, default=32)
    ap.add_argument("--offset", type=int, default=0)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--out", default=str(ROOT / "bench/results/engine.json"))
    ap.add_argument("--configs", default="", help="comma-separated subset (e.g. ours_ar,hf_generate); default all")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    pair = load_pair(ModelSpec(path=str(SHARED / "models/smollm2-135m-instruct"),
                               gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf", device="cpu"),
                     ModelSpec(path=str(SHARED / "models/smollm2-draft-4l"), device="cpu"))
    engine = Engine(pair.target.model, pair.draft.model, pair.eos_token_ids)
    prompts = [format_prompt(pair.tokenizer, p) for p in load_prompts(args.prompts, limit=args.n, offset=args.offset)]
    mx = args.max_new_tokens
    configs = {"ours_ar": lambda ids: engine.generate_ar(ids, mx), "hf_generate": lambda ids: hf_run(pair, ids, mx)}
    for k in KS:
        configs[f"ours_sd_k{k}"] = lambda ids, k=k: engine.generate(ids, StandardSD(k), mx)
        configs[f"hf_assisted_k{k}"] = lambda ids, k=k: hf_run(pair, ids, mx, k)
    if args.configs:
        unknown = set(args.configs.split(",")) - set(configs)
        if unknown:
            ap.error(f"unknown configs {sorted(unknown)}; choose from {list(configs)}")
        configs = {k: v for k, v in configs.items() if k in args.configs.split(",")}
    names = list(configs)
    stats, outputs = interleave(configs, prompts, prompts[0][:32])
    if "hf_generate" not in outputs:
        outputs["hf_generate"] = [hf_run(pair, ids, mx)[0] for ids in prompts]
    reference = outputs["hf_generate"]
    table = []
    for name in names:
        tot = GenerationStats.total(stats[name])
        ours = name.startswith("ours")
        table.append({
            "config": name, "tokens": tot.new_tokens, "wall_s": round(tot.wall_time, 2),
            "tokens_per_s": round(tot.tokens_per_s, 3),
            "tokens_per_call": round(tot.tokens_per_call, 3) if ours else None,
            "accepted_per_call": round(tot.accepted_per_call, 3) if ours and "sd" in name else None,
            "verification_rate": round(tot.verification_rate, 3) if ours else None,
            "discard_rate": round(tot.discard_rate, 3) if ours else None,
            "prompts_identical_to_hf_generate": sum(a == b for a, b in zip(outputs[name], reference)),
        })
    tps = {r["config"]: r["tokens_per_s"] for r in table}
    pairs = {"ar_vs_hf_generate": ("ours_ar", "hf_generate")}
    pairs.update({f"sd_k{k}_vs_hf_assisted": (f"ours_sd_k{k}", f"hf_assisted_k{k}") for k in KS})
    ratios = {name: round(tps[a] / tps[b], 3) for name, (a, b) in pairs.items() if a in tps and b in tps}
    ours_names = [n for n in names if n.startswith("ours")]
    identical = all(outputs[n] == reference for n in ours_names)
    cols = ["config", "tokens", "wall_s", "tokens_per_s", "tokens_per_call", "accepted_per_call",
            "verification_rate", "discard_rate", "prompts_identical_to_hf_generate"]
    print(" | ".join(cols))
    for r in table:
        print(" | ".join("-" if r[c] is None else str(r[c]) for c in cols))
    print(json.dumps(ratios), "greedy_identical_to_hf:", identical)
    result = {
        **run_info(__file__, argv, "fp32, batch 1, greedy"),
        "prompts": f"{args.prompts} [{args.offset}:{args.offset + len(prompts)}]",
        "max_new_tokens": mx,
        "table": table,
        "ratios": ratios,
        "greedy_identical_to_hf": identical,
        "note": "tokens_per_call = emitted tokens / target calls; accepted_per_call = accepted drafts / target calls",
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
