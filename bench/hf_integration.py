"""A specheads head inside Hugging Face ``generate`` on the shared pair, against Transformers' own schedules.

    python bench/hf_integration.py                 # 16 held-out prompts x 96 tokens, greedy, one interleaved run
    python bench/hf_integration.py --n 4 --max-new-tokens 32 --out /tmp/h.json

The SpecDec++ head of recipe ``specdecpp_draft_quickstart``, the draft-based quickstart (its vocab, datagen,
train and export stages are run first when ``runs/specdecpp_draft_quickstart-export/head.safetensors`` is
absent; the draft's output layer pruned as that recipe prunes it) decodes held-out prompts (GSM8K-test
and MT-Bench first turns, greedy, fp32, batch 1) five ways, one prompt at a time, the configurations in
rotating order per prompt so that drift hits each alike:

* ``hf_target``: ``target.generate`` alone (the reference output);
* ``hf_dynamic``: ``generate(assistant_model=draft)`` with Transformers' defaults (dynamic speculation:
  ``num_assistant_tokens`` 20, drafting stops below ``assistant_confidence_threshold`` 0.4, which it
  re-fits online);
* ``hf_constant_k``: ``generate(assistant_model=draft)`` with a constant ``--k`` candidates per round;
* ``hf_head``: ``generate(assistant_model=draft, custom_generate=specheads.hf.Assistant(draft, head))``;
* ``shim_head``: the specheads decoding shim with the same head (``policy=specdecpp``).

Tokens/s (new tokens over wall time, summed over prompts), target calls (forwards of the target model;
the shim's own count) and new tokens per target call, and whether every output equals ``hf_target``'s.
Prints a table and writes ``bench/results/hf_integration.json`` with ``"ratios": {"hf_with_head_vs_hf_dynamic",
"shim_vs_hf_with_head"}`` (tokens/s).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
from _common import run_info, shared_pair

from specheads.decode.api import Decoder, format_prompt
from specheads.decode.policy_factory import make_policy
from specheads.export import load_head
from specheads.hf import Assistant
from specheads.prompts import load_prompts

ROOT = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("SPECHEADS_SHARED", ROOT.parent / "shared"))
RECIPE = "specdecpp_draft_quickstart"
CONFIGS = ("hf_target", "hf_dynamic", "hf_constant_k", "hf_head", "shim_head")


def ensure_head(path: Path) -> None:
    """Trains and exports the recipe's head when it is absent (every stage resumes)."""
    if path.is_file():
        return
    from specheads.pipeline import main as pipeline

    print(f"{path} not found: running heads-pipeline recipe={RECIPE} up to export", file=sys.stderr, flush=True)
    if pipeline([f"recipe={RECIPE}", "pipeline.stages=[vocab,datagen,train,export]"]) != 0:
        raise SystemExit(f"heads-pipeline recipe={RECIPE} failed")


class Calls:
    """Counts the forwards of a model (a pre-hook on its top module)."""

    def __init__(self, model):
        self.n = 0
        self.handle = model.register_forward_pre_hook(self._hook)

    def _hook(self, module, args):
        self.n += 1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=16, help="prompts (half GSM8K-test, half MT-Bench)")
    ap.add_argument("--offset", type=int, default=900, help="first GSM8K-test row")
    ap.add_argument("--mtbench-offset", type=int, default=64, help="first MT-Bench row")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--k", type=int, default=4, help="hf_constant_k's candidates per round")
    ap.add_argument("--head", default=str(ROOT / f"runs/{RECIPE}-export/head.safetensors"))
    ap.add_argument("--vocab", default=str(ROOT / f"runs/{RECIPE}-vocab/vocab.json"))
    ap.add_argument("--draft-top-n", type=int, default=8192, help="as the recipe prunes the draft")
    ap.add_argument("--out", default=str(ROOT / "bench/results/hf_integration.json"))
    args = ap.parse_args(argv)
    head_path = Path(args.head)
    if head_path == ROOT / f"runs/{RECIPE}-export/head.safetensors":
        ensure_head(head_path)
    pair = shared_pair(SHARED, args.vocab, args.draft_top_n)
    target, draft, tok = pair.target.model, pair.draft.model, pair.tokenizer
    head = load_head(head_path, pair=pair)
    half = args.n // 2
    prompts = load_prompts(str(SHARED / "data/gsm8k/test.jsonl"), limit=half, offset=args.offset) + load_prompts(
        str(SHARED / "data/mt_bench/question.jsonl"), limit=args.n - half, offset=args.mtbench_offset
    )
    eos = pair.eos_token_ids
    common = dict(
        max_new_tokens=args.max_new_tokens, do_sample=False, pad_token_id=tok.pad_token_id or eos[0], eos_token_id=eos
    )
    assistant = Assistant(draft, head_path, k_min=1, k_max=20)  # the recipe's bounds, as the shim's below
    shim = Decoder(pair, make_policy("specdecpp", pair, head=str(head_path), k_min=1, k_max=20), args.max_new_tokens)
    keys = ("num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold")
    dynamic = {k: getattr(draft.generation_config, k, None) for k in keys}  # None: Transformers' default applies
    from transformers.utils import is_sklearn_available

    refit = is_sklearn_available()  # Transformers re-fits the dynamic threshold online only with scikit-learn

    def hf(ids, mode):
        x = torch.tensor([ids])
        cfg = draft.generation_config
        cfg.num_assistant_tokens, cfg.num_assistant_tokens_schedule = (
            dynamic["num_assistant_tokens"],
            dynamic["num_assistant_tokens_schedule"],
        )
        cfg.assistant_confidence_threshold = dynamic["assistant_confidence_threshold"]
        if mode == "hf_target":
            return target.generate(x, **common)
        if mode == "hf_constant_k":
            cfg.num_assistant_tokens, cfg.num_assistant_tokens_schedule = args.k, "constant"
            cfg.assistant_confidence_threshold = 0.0
        if mode == "hf_head":
            return target.generate(x, assistant_model=draft, custom_generate=assistant, **common)
        return target.generate(x, assistant_model=draft, **common)

    calls = Calls(target)
    totals = {c: {"tokens": 0, "seconds": 0.0, "target_calls": 0} for c in CONFIGS}
    outputs: dict[str, list] = {c: [] for c in CONFIGS}
    warm = format_prompt(tok, prompts[0])
    for c in CONFIGS[:-1]:  # warm-up: kernels, allocations
        hf(warm, c)
    shim.engine.generate(warm, shim.policy, args.max_new_tokens, shim.sampling, shim.generator)
    with torch.inference_mode():
        for i, prompt in enumerate(prompts):
            ids = format_prompt(tok, prompt)
            order = CONFIGS[i % len(CONFIGS) :] + CONFIGS[: i % len(CONFIGS)]
            for c in order:
                before = calls.n
                start = time.perf_counter()
                if c == "shim_head":  # the same token ids as Transformers gets: no (de)tokenising timed
                    g = shim.engine.generate(ids, shim.policy, args.max_new_tokens, shim.sampling, shim.generator)
                    new, n_calls = list(g.tokens), g.stats.target_calls
                else:
                    out = hf(ids, c)
                    new, n_calls = out[0, len(ids) :].tolist(), calls.n - before
                seconds = time.perf_counter() - start
                totals[c]["tokens"] += len(new)
                totals[c]["seconds"] += seconds
                totals[c]["target_calls"] += n_calls
                outputs[c].append(new)
            print(
                f"prompt {i + 1}/{len(prompts)}: "
                + ", ".join(f"{c} {totals[c]['tokens'] / totals[c]['seconds']:.1f}" for c in CONFIGS)
                + " tok/s",
                file=sys.stderr,
                flush=True,
            )
    table = []
    for c in CONFIGS:
        t = totals[c]
        table.append(
            {
                "config": c,
                "tokens": t["tokens"],
                "seconds": round(t["seconds"], 3),
                "tokens_per_s": round(t["tokens"] / t["seconds"], 3),
                "target_calls": t["target_calls"],
                "tokens_per_target_call": round(t["tokens"] / t["target_calls"], 4) if t["target_calls"] else None,
                "identical_to_hf_target": outputs[c] == outputs["hf_target"],
            }
        )
    by = {r["config"]: r for r in table}
    result = {
        **run_info(__file__, argv, "fp32, greedy, batch 1"),
        "prompts": f"{half} GSM8K-test (offset {args.offset}) + {args.n - half} MT-Bench "
        f"(offset {args.mtbench_offset})",
        "max_new_tokens": args.max_new_tokens,
        "head": str(head_path),
        "head_threshold": head.threshold,
        "hf_constant_k": args.k,
        "hf_dynamic_settings": dynamic,
        "hf_dynamic_threshold_refit": refit,
        "draft_top_n": args.draft_top_n,
        "table": table,
        "all_identical": all(r["identical_to_hf_target"] for r in table),
        "ratios": {
            "hf_with_head_vs_hf_dynamic": round(by["hf_head"]["tokens_per_s"] / by["hf_dynamic"]["tokens_per_s"], 4),
            "shim_vs_hf_with_head": round(by["shim_head"]["tokens_per_s"] / by["hf_head"]["tokens_per_s"], 4),
            "hf_with_head_vs_hf_target": round(by["hf_head"]["tokens_per_s"] / by["hf_target"]["tokens_per_s"], 4),
        },
    }
    result["hf_with_head_at_least_hf_dynamic"] = result["ratios"]["hf_with_head_vs_hf_dynamic"] >= 1.0
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    cols = ("config", "tokens_per_s", "target_calls", "tokens_per_target_call", "identical_to_hf_target")
    print(" | ".join(cols))
    for r in table:
        print(" | ".join(str(r[c]) for c in cols))
    print(json.dumps(result["ratios"]), "hf_with_head_at_least_hf_dynamic:", result["hf_with_head_at_least_hf_dynamic"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
