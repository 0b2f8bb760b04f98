"""SpecDec++ benchmark on the shared pair: the whole pipeline, the sweep, and datagen throughput.

    python bench/specdecpp.py                       # recipe specdecpp_smollm2, writes bench/results/specdecpp.json
    python bench/specdecpp.py --ref-prompts 4 eval.num_prompts=4     # a quicker look (any pipeline override)

1. Datagen throughput, side by side on the same prompts: ``heads-datagen`` (batched, one
   teacher-forced pass per model per batch, Parquet chunks) against a reimplementation of the
   reference's five-pass pipeline (each pass a separate loop over prompts at batch 1 with the
   models' own Hugging Face forward and ``generate``, reading the previous pass's JSON file and
   writing its own: target generation, draft distributions and draws, target probabilities,
   labels, examples). Same models, prompts, settings; labelled
   tokens per second each.
2. The recipe's pipeline (datagen -> train -> export -> eval on held-out GSM8K-test and MT-Bench
   prompts): fixed K and SpecDec++ thresholds in one interleaved sweep, the greedy oracle and the
   cost model at the measured forward times.

Prints a table and writes ``bench/results/specdecpp.json`` and ``bench/results/specdecpp_pareto.png``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import tempfile
import time
from pathlib import Path

import torch
from _common import run_info

from specheads.config import load_config
from specheads.datagen.acceptance_labels import teacher_forced_logits
from specheads.datagen.cli import run as datagen_run
from specheads.datagen.config import DatagenConfig
from specheads.decode.api import fit_context, format_prompt
from specheads.pipeline import load_configs
from specheads.pipeline import main as pipeline_main
from specheads.prompts import load_prompt_files
from specheads.shim import context_length, load_pair
from specheads.shim.batching.batch_generate import hf_generate
from specheads.shim.core.sampling import probs_from_logits, sample

ROOT = Path(__file__).resolve().parents[1]


def reference_five_pass(cfg: DatagenConfig, pair, prompts, work: Path) -> dict:
    """The reference's data generation, pass by pass, batch 1, JSON between passes."""
    tok, target, draft = pair.tokenizer, pair.target.model, pair.draft.model
    eos = pair.eos_token_ids
    pad = tok.pad_token_id if tok.pad_token_id is not None else eos[0]
    limit = min(x for x in (context_length(target), context_length(draft), 1 << 30) if x)
    gen = torch.Generator().manual_seed(cfg.seed)
    start = time.perf_counter()
    rows = []
    for i, p in enumerate(prompts):  # pass 1: the target's responses
        ids = fit_context(format_prompt(tok, p, cfg.chat_template), cfg.max_new_tokens, limit)[0]
        seeded = torch.Generator().manual_seed(cfg.seed + i)
        resp = hf_generate(target, [ids], cfg.max_new_tokens, cfg.sampling, seeded, eos, pad)[0]
        rows.append({"prompt_ids": ids, "response": resp})
    (work / "pass1.json").write_text(json.dumps(rows))
    rows = json.loads((work / "pass1.json").read_text())
    for r in rows:  # pass 2: draft distributions over the response, a draw per position
        q_logits = teacher_forced_logits(draft, [r["prompt_ids"] + r["response"]], len(r["prompt_ids"]), pad)[0]
        q_logits = q_logits[: len(r["response"])]
        if cfg.sampling.do_sample:
            q = probs_from_logits(q_logits, cfg.sampling)
            y = sample(q, gen)
        else:
            y = q_logits.argmax(-1)
            q = torch.nn.functional.one_hot(y, q_logits.shape[-1]).float()
        r["draft_token"] = y.tolist()
        r["q_y"] = q.gather(-1, y[:, None]).squeeze(-1).tolist()
    (work / "pass2.json").write_text(json.dumps(rows))
    rows = json.loads((work / "pass2.json").read_text())
    for r in rows:  # pass 3: target probabilities of the draws
        p_logits = teacher_forced_logits(target, [r["prompt_ids"] + r["response"]], len(r["prompt_ids"]), pad)[0]
        p_logits = p_logits[: len(r["response"])]
        if cfg.sampling.do_sample:
            p = probs_from_logits(p_logits, cfg.sampling)
        else:
            p = torch.nn.functional.one_hot(p_logits.argmax(-1), p_logits.shape[-1]).float()
        r["p_y"] = p.gather(-1, torch.tensor(r["draft_token"])[:, None]).squeeze(-1).tolist()
    (work / "pass3.json").write_text(json.dumps(rows))
    rows = json.loads((work / "pass3.json").read_text())
    for r in rows:  # pass 4: labels
        r["label"] = [1.0 if q <= 0 else min(1.0, p / q) for p, q in zip(r["p_y"], r["q_y"])]
    (work / "pass4.json").write_text(json.dumps(rows))
    rows = json.loads((work / "pass4.json").read_text())
    examples = [
        {
            "input_ids": r["prompt_ids"] + r["response"],
            "response_start": len(r["prompt_ids"]),
            "draft_token": r["draft_token"],
            "label": r["label"],
        }
        for r in rows
    ]  # pass 5: examples
    (work / "examples.json").write_text(json.dumps(examples))
    seconds = time.perf_counter() - start
    tokens = sum(len(e["label"]) for e in examples)
    return {
        "labelled_tokens": tokens,
        "seconds": round(seconds, 2),
        "labelled_tokens_per_s": round(tokens / seconds, 2),
    }


def ours(recipe: str, prompts_per_file: int, work: Path) -> dict:
    """heads-datagen on the same prompts; timed over its labelling work (the per-chunk seconds in
    its metrics.jsonl), like the baseline, which is timed after its models are loaded."""
    cfg = load_config(
        DatagenConfig,
        "datagen",
        [f"recipe={recipe}", f"num_prompts={prompts_per_file}", f"output_dir={work / 'ours'}", "overwrite=true"],
    )
    datagen_run(cfg)
    rows = [json.loads(x) for x in (work / "ours" / "metrics.jsonl").read_text().splitlines() if x.strip()]
    seconds = sum(r["seconds"] for r in rows)
    tokens = sum(r["labelled_tokens"] for r in rows)
    return {
        "labelled_tokens": tokens,
        "seconds": round(seconds, 2),
        "labelled_tokens_per_s": round(tokens / seconds, 2),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", default="specdecpp_smollm2")
    ap.add_argument(
        "--ref-prompts", type=int, default=16, help="prompts per datagen file for the throughput comparison"
    )
    ap.add_argument("--out", default=str(ROOT / "bench/results/specdecpp.json"))
    ap.add_argument("--skip-datagen-compare", action="store_true")
    args, overrides = ap.parse_known_args(argv)
    pipe_args = [f"recipe={args.recipe}", *overrides]
    _, cfgs = load_configs(pipe_args)  # fail fast on a bad override
    result = run_info(__file__, argv, "fp32, batch 1 decoding")
    if not args.skip_datagen_compare:
        with tempfile.TemporaryDirectory() as tmp:
            work = Path(tmp)
            dg = cfgs["datagen"]
            prompts = load_prompt_files(dg.prompts, limit=args.ref_prompts, offset=dg.offset)
            mine = ours(args.recipe, args.ref_prompts, work)
            # Both sides of the comparison run the full draft (``ours`` reads the datagen section alone, without
            # the pipeline's vocab stage): the comparison is about the data pipeline, not the draft's cost.
            full_draft = dataclasses.replace(dg.draft, vocab_file=None, vocab_top_n=None)
            pair = load_pair(dg.target, full_draft, same_vocab=True)
            ref = reference_five_pass(dg, pair, prompts, work)
            del pair
        result["datagen"] = {"prompts": len(prompts), "ours": mine, "reference_five_pass": ref}
        print(
            f"datagen on {len(prompts)} prompts: ours {mine['labelled_tokens_per_s']} labelled tok/s, "
            f"reference five-pass {ref['labelled_tokens_per_s']} labelled tok/s",
            flush=True,
        )
    code = pipeline_main(pipe_args)
    if code:
        return code
    sweep = json.loads((Path(cfgs["eval"].output_dir) / "sweep.json").read_text())
    png = Path(args.out).with_name(Path(args.out).stem + "_pareto.png")
    shutil.copyfile(sweep["pareto_png"], png)
    ratios = dict(sweep["ratios"])
    if "datagen" in result:
        d = result["datagen"]
        ratios["datagen_vs_reference"] = round(
            d["ours"]["labelled_tokens_per_s"] / d["reference_five_pass"]["labelled_tokens_per_s"], 3
        )
    result.update(
        {
            "prompts": sweep["prompts"],
            "num_prompts": sweep["num_prompts"],
            "max_new_tokens": sweep["max_new_tokens"],
            "sampling": sweep["sampling"],
            "head": sweep.get("head"),
            "eval_binary_kl": (sweep.get("head") or {}).get("eval_binary_kl"),
            "t_target_ms": sweep["t_target_ms"],
            "t_draft_ms": sweep["t_draft_ms"],
            "cost_table": sweep.get("cost_table"),
            "table": sweep["table"],
            "oracle": sweep.get("oracle"),
            "perfect_head": sweep.get("perfect_head"),
            "best_fixed_k": sweep.get("best_fixed_k"),
            "best_threshold": sweep.get("best_threshold"),
            "best_stop_rule": sweep.get("best_stop_rule"),
            "best_lossless": sweep.get("best_lossless"),
            "below_fixed_k_curve": sweep.get("below_fixed_k_curve"),
            "ratios": ratios,
            "pareto_dominates": sweep.get("pareto_dominates"),
            "pareto_png": str(png.relative_to(ROOT)) if png.is_relative_to(ROOT) else str(png),
            "note": "tokens_per_call = emitted tokens / target calls; model_cost_ms_per_token = predicted_ms_per_token "
            "= (t_d*N_draft + sum_k t_t(k)*count_k)/N at the profiled cost_table over each row's target pass "
            "sizes (prefill left out), beside measured_ms_per_token = wall time / N; t_target_ms, t_draft_ms = "
            "the baselines' wall time per forward; h-cost = SpecDec++ with the cost-aware stop rule; "
            "oracle_gain_fraction = (cost(best K) - cost(SpecDec++)) "
            "/ (cost(best K) - cost(oracle)); perfect_head = the SpecDec++ stopping rule with a head that "
            "knows every disagreement (drafts at least k_min, sees a candidate only once drawn): "
            "perfect_head_cost_gain_vs_best_fixed_k bounds what any head can gain here",
        }
    )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(
        json.dumps(
            {
                "ratios": ratios,
                "pareto_dominates": result["pareto_dominates"],
                "eval_binary_kl": result["eval_binary_kl"],
            }
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
