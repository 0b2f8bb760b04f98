"""Engine benchmark: our AR and SD against Hugging Face ``generate`` on the shared pair.

One process, one run, configurations interleaved prompt by prompt (rotating order) so that
machine noise hits every configuration alike. Greedy, fp32, batch 1.

    python bench/engine.py                      # 32 GSM8K-test prompts + 16 MT-Bench first turns x 128 tokens
    python bench/engine.py --n 8 --max-new-tokens 64 --offset 100 --mtbench-offset 40 --out /tmp/e.json

Our rows run the draft with its output layer pruned to the 8,192 tokens most frequent in the
quickstart corpus (``--draft-top-n``) and the linear kernels measured fastest on this machine;
Hugging Face's rows run the full draft and plain ``F.linear``. ``ours_confidence_cost`` is the
cost-aware confidence stop; ``ours_confidence_cost_gated`` the same rule with the draft gate (rounds
skip drafting while the prompt's recent drafted rounds lose to the target alone). Each row's predicted ms/token comes
from the profiled cost table; the greedy oracle is priced by the same table.

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

from specheads.decode.api import format_prompt, pair_costs
from specheads.evaluate.oracle import draft_agreement, oracle_schedule, predicted_ms_per_token
from specheads.prompts import load_prompts
from specheads.shim import load_pair
from specheads.shim.loop.engine import Engine, GenerationStats
from specheads.shim.policies import ConfidenceStop, StandardSD
from specheads.shim.runners import kernels
from specheads.shim.runners.models import ModelSpec
from specheads.shim.runners.vocab_pruning import prune, read_ranking, subset_from_ranking

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
    toks = out[0, len(ids) :].tolist()
    return toks, GenerationStats(new_tokens=len(toks), wall_time=elapsed)


def _row(name: str, tot: GenerationStats, identical: int, table) -> dict:
    ours = name.startswith("ours")
    pred = predicted_ms_per_token(tot, table) if ours else None
    measured = 1000 * tot.wall_time / tot.new_tokens if tot.new_tokens else None
    return {
        "config": name,
        "tokens": tot.new_tokens,
        "wall_s": round(tot.wall_time, 2),
        "tokens_per_s": round(tot.tokens_per_s, 3),
        "tokens_per_call": round(tot.tokens_per_call, 3) if ours else None,
        "accepted_per_call": round(tot.accepted_per_call, 3) if ours and "ar" not in name else None,
        "verification_rate": round(tot.verification_rate, 3) if ours else None,
        "discard_rate": round(tot.discard_rate, 3) if ours else None,
        "predicted_ms_per_token": round(pred, 3) if pred is not None else None,
        "measured_ms_per_token": round(measured, 3) if measured is not None else None,
        "predicted_over_measured": round(pred / measured, 4) if pred is not None and measured else None,
        "prompts_identical_to_hf_generate": identical,
    }


def run_set(label, pair, engine, table, prompts, mx, configs, reference_name, oracle_k_max):
    """One prompt set: every configuration interleaved, the table, the oracle priced by the cost table."""
    names = list(configs)
    stats, outputs = interleave(configs, prompts, prompts[0][:32])
    reference = outputs[reference_name]
    rows = [
        _row(n, GenerationStats.total(stats[n]), sum(a == b for a, b in zip(outputs[n], reference)), table)
        for n in names
    ]
    # The greedy oracle (SpecDec++ Theorem 4.1) on the target's own outputs, priced by the cost table.
    oracle = GenerationStats(prompts=0)
    with torch.inference_mode():
        for ids, out in zip(prompts, outputs["ours_ar"]):
            agree = draft_agreement(pair.draft.model, ids, out, True, engine.vocab_size)
            oracle = GenerationStats.total([oracle, oracle_schedule(agree, oracle_k_max)])
    o_ms = predicted_ms_per_token(oracle, table)
    oracle_row = {
        "k_max": oracle_k_max,
        "tokens_per_call": round(oracle.tokens_per_call, 3),
        "verification_rate": round(oracle.verification_rate, 4),
        "predicted_ms_per_token": round(o_ms, 3),
        "predicted_tokens_per_s": round(1000 / o_ms, 3),
    }
    lossless = [r for r in rows if r["config"].startswith("ours") and r["config"] not in ("ours_draft", "ours_ar")]
    best = max(lossless, key=lambda r: r["tokens_per_s"])
    ar = next(r for r in rows if r["config"] == "ours_ar")
    cols = [
        "config",
        "tokens",
        "tokens_per_s",
        "tokens_per_call",
        "verification_rate",
        "discard_rate",
        "predicted_ms_per_token",
        "measured_ms_per_token",
        "prompts_identical_to_hf_generate",
    ]
    print(f"\n== {label} ==")
    print(" | ".join(cols))
    for r in rows:
        print(" | ".join("-" if r[c] is None else str(r[c]) for c in cols))
    print(
        f"oracle (k_max {oracle_k_max}) | - | {oracle_row['predicted_tokens_per_s']} predicted | "
        f"{oracle_row['tokens_per_call']} | {oracle_row['verification_rate']} | 0.0 | "
        f"{oracle_row['predicted_ms_per_token']}"
    )
    summary = {
        "best_lossless": best["config"],
        "best_lossless_vs_target_alone": round(best["tokens_per_s"] / ar["tokens_per_s"], 4),
        "best_lossless_vs_oracle_predicted": round(best["tokens_per_s"] / oracle_row["predicted_tokens_per_s"], 4),
    }
    identical = all(outputs[n] == reference for n in names if n.startswith("ours") and n != "ours_draft")
    return rows, oracle_row, summary, identical, outputs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", default=str(SHARED / "data/gsm8k/test.jsonl"))
    ap.add_argument("--n", type=int, default=32)
    ap.add_argument("--offset", type=int, default=0)
    ap.add_argument(
        "--mtbench",
        default=str(SHARED / "data/mt_bench/question.jsonl"),
        help="second set (our rows only): first turns; '' to skip",
    )
    ap.add_argument("--mtbench-n", type=int, default=16)
    ap.add_argument("--mtbench-offset", type=int, default=0)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument(
        "--vocab",
        default=str(ROOT / "runs/specdecpp_draft_quickstart-vocab/vocab.json"),
        help="heads-vocab ranking for the pruned draft of our rows (written by heads-vocab "
        "recipe=specdecpp_draft_quickstart when absent)",
    )
    ap.add_argument("--draft-top-n", type=int, default=8192, help="our rows' draft keeps this many tokens; 0: full")
    ap.add_argument("--oracle-k-max", type=int, default=8)
    ap.add_argument("--out", default=str(ROOT / "bench/results/engine.json"))
    ap.add_argument("--configs", default="", help="comma-separated subset (e.g. ours_ar,hf_generate); default all")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    pair = load_pair(
        ModelSpec(
            path=str(SHARED / "models/smollm2-135m-instruct"), gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf", device="cpu"
        ),
        ModelSpec(path=str(SHARED / "models/smollm2-draft-4l"), device="cpu"),
    )
    full_head = pair.draft.model.get_output_embeddings()
    pruned_head = None
    if args.draft_top_n:
        if not Path(args.vocab).is_file():
            from specheads.datagen.vocab_ranking import main as vocab_main

            vocab_main(["recipe=specdecpp_draft_quickstart", f"output={args.vocab}"])
        prune(
            pair.draft.model,
            subset_from_ranking(
                read_ranking(args.vocab), args.draft_top_n, pair.eos_token_ids, full_head.weight.shape[0]
            ),
            Path(args.vocab).name,
        )
        pruned_head = pair.draft.model.get_output_embeddings()
    engine = Engine(pair.target.model, pair.draft.model, pair.eos_token_ids)
    mx = args.max_new_tokens
    table = pair_costs(pair, max(KS) + 2)  # the draft as our rows run it (pruned)
    print(
        "cost table (ms): t_d", round(table.t_draft_ms, 3), "t_t(1..10)", [round(t, 2) for t in table.t_target_ms[:10]]
    )

    def hf(ids, k=None):  # Hugging Face as it is: its own kernels, the full draft
        pair.draft.model.set_output_embeddings(full_head)
        kernels.set_policy("torch")
        try:
            return hf_run(pair, ids, mx, k)
        finally:
            kernels.set_policy("auto")
            if pruned_head is not None:
                pair.draft.model.set_output_embeddings(pruned_head)

    ours = {
        "ours_ar": lambda ids: engine.generate_ar(ids, mx),
        **{f"ours_sd_k{k}": (lambda ids, k=k: engine.generate(ids, StandardSD(k), mx)) for k in (1, *KS)},
        "ours_confidence_cost": lambda ids: engine.generate(
            ids, ConfidenceStop(k_max=max(KS), stop="cost", costs=table), mx
        ),
        "ours_confidence_cost_gated": lambda ids: engine.generate(
            ids, ConfidenceStop(k_max=max(KS), stop="cost", costs=table, gate=True), mx
        ),
    }
    configs = {"ours_ar": ours["ours_ar"], "hf_generate": lambda ids: hf(ids)}
    for k in (1, *KS):
        configs[f"ours_sd_k{k}"] = ours[f"ours_sd_k{k}"]
        if k in KS:
            configs[f"hf_assisted_k{k}"] = lambda ids, k=k: hf(ids, k)
    configs["ours_confidence_cost"] = ours["ours_confidence_cost"]
    configs["ours_confidence_cost_gated"] = ours["ours_confidence_cost_gated"]
    if args.configs:
        want = args.configs.split(",")
        unknown = set(want) - set(configs)
        if unknown:
            ap.error(f"unknown configs {sorted(unknown)}; choose from {list(configs)}")
        configs = {k: v for k, v in configs.items() if k in want or k in ("ours_ar", "hf_generate")}
    prompts = [format_prompt(pair.tokenizer, p) for p in load_prompts(args.prompts, limit=args.n, offset=args.offset)]
    rows, oracle, summary, identical, _ = run_set(
        "GSM8K", pair, engine, table, prompts, mx, configs, "hf_generate", args.oracle_k_max
    )
    tps = {r["config"]: r["tokens_per_s"] for r in rows}
    pairs = {"ar_vs_hf_generate": ("ours_ar", "hf_generate")}
    pairs.update({f"sd_k{k}_vs_hf_assisted": (f"ours_sd_k{k}", f"hf_assisted_k{k}") for k in KS})
    ratios = {name: round(tps[a] / tps[b], 3) for name, (a, b) in pairs.items() if a in tps and b in tps}
    ratios.update({k: v for k, v in summary.items() if k != "best_lossless"})
    result = {
        **run_info(__file__, argv, "fp32, batch 1, greedy"),
        "prompts": f"{args.prompts} [{args.offset}:{args.offset + len(prompts)}]",
        "max_new_tokens": mx,
        "draft": (
            f"our rows: output layer pruned to {args.draft_top_n} tokens ({args.vocab}); "
            "Hugging Face rows: the full draft and plain F.linear"
        )
        if args.draft_top_n
        else "full draft",
        "cost_table": table.to_dict(),
        "kernels": kernels.describe(),
        "table": rows,
        "oracle": oracle,
        "best_lossless": summary["best_lossless"],
        "greedy_identical_to_hf": identical,
    }
    if args.mtbench:
        mt_prompts = [
            format_prompt(pair.tokenizer, p)
            for p in load_prompts(args.mtbench, limit=args.mtbench_n, offset=args.mtbench_offset)
        ]
        mt_configs = {k: v for k, v in ours.items() if k in configs}
        mt_rows, mt_oracle, mt_summary, mt_identical, _ = run_set(
            "MT-Bench", pair, engine, table, mt_prompts, mx, mt_configs, "ours_ar", args.oracle_k_max
        )
        result["mtbench"] = {
            "prompts": f"{args.mtbench} [{args.mtbench_offset}:{args.mtbench_offset + len(mt_prompts)}]",
            "table": mt_rows,
            "oracle": mt_oracle,
            "best_lossless": mt_summary["best_lossless"],
            "greedy_identical_to_ours_ar": mt_identical,
        }
        ratios["best_lossless_vs_target_alone_mtbench"] = mt_summary["best_lossless_vs_target_alone"]
        ratios["best_lossless_vs_oracle_predicted_mtbench"] = mt_summary["best_lossless_vs_oracle_predicted"]
    result["ratios"] = ratios
    result["note"] = (
        "tokens_per_call = emitted tokens / target calls; predicted_ms_per_token = the profiled cost "
        "table at the row's own draft forwards and target pass sizes (prompt prefill excluded); "
        "measured = wall time / new tokens (prefill and loop overhead included); the oracle stops "
        "exactly before each disagreement of the draft with the target's greedy output (k_max cap)"
    )
    print(json.dumps(ratios, indent=1), "greedy_identical_to_hf:", identical)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
