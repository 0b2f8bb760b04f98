"""Stop rules inside vLLM (``specheads.vllm.proposer``'s custom_class proposer) against vLLM's own ``draft_model``
and its target alone, at batch 1 and batch 16.

    python bench/vllm_proposer.py --head runs/specdecpp_draft_quickstart-export/head.safetensors \\
        --vocab-file runs/specdecpp_draft_quickstart-vocab/vocab.json --vocab-top-n 8192

Run with the project's Python. It prepares, under ``--work`` (default ``runs/vllm_bench``), the GGUF target as a
Hugging Face directory (as ``bench/vllm_eagle3.py``) and the prompts as token ids (chat template: ``--gsm8k``
GSM8K-test questions and ``--mt-bench`` MT-Bench first turns from ``--offset``). Then, for each batch size, it
runs every configuration in a fresh vLLM process (vLLM's own virtualenv, ``--vllm-python``, with this package
installed there with ``--no-deps``): the target alone, ``draft_model`` at each ``--ks`` and the proposer with
``confidence_stop`` (``--tau``) and, with ``--head``, SpecDec++ (the head's threshold), both at ``--k-max``.
The prompts are split into ``--blocks`` blocks; the configurations take turns block by block, in rotated order,
so that a slow spell of the machine does not fall on one configuration. Greedy, ``--max-new`` tokens, all of a
block's prompts submitted at once with ``max_num_seqs`` = the batch size.

Per configuration and batch size: tokens/s (tokens over the ``generate`` calls' wall time), tokens per target
call (target alone: 1; ``draft_model``: tokens over vLLM's drafts plus one prefill per request; the proposer:
tokens over the rows it was asked for, one per target pass of a request), vLLM's spec-decode counters, the proposer's
own
counters and its share of the wall time, and ``greedy_identical`` against the target alone at that batch size.
With ``--cost`` (default) the proposer also runs its cost-aware rule (``confidence_stop`` and, with ``--head``,
SpecDec++; the draft gate on) on a cost table of vLLM's own steps at batch 1 and powers of two up to the largest
batch size (``specheads.decode.vllm_costs``: measured once in vLLM, cached). ``--ours-batch B`` (default 8) also
decodes the same prompts in our own batched engine (target alone, SD, the batch-priced cost rule, and on the
``--eagle`` head), and ``--datagen`` copies ``bench/vllm_datagen.py``'s generation ratio into the ratios.

Writes ``bench/results/vllm.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("SPECHEADS_SHARED", str(ROOT.parent / "shared")))


def prepare(args, work: Path) -> list[dict]:
    sys.path.insert(0, str(ROOT / "bench"))
    from transformers import AutoTokenizer
    from vllm_eagle3 import write_target

    write_target(work / "target_hf")
    tok = AutoTokenizer.from_pretrained(work / "target_hf")
    rows = [
        ("gsm8k", json.loads(line)["question"])
        for line in (SHARED / "data/gsm8k/test.jsonl").read_text().splitlines()[args.offset : args.offset + args.gsm8k]
    ]
    rows += [
        ("mt_bench", json.loads(line)["turns"][0])
        for line in (SHARED / "data/mt_bench/question.jsonl")
        .read_text()
        .splitlines()[args.offset : args.offset + args.mt_bench]
    ]
    out = []
    for source, text in rows:
        ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
        ids = ids["input_ids"] if hasattr(ids, "keys") else ids
        out.append({"source": source, "ids": [int(i) for i in ids]})
    return out


def configs(args) -> dict[str, dict]:
    out = {"target": {}}
    for k in args.ks:
        out[f"draft_model_k{k}"] = {"method": "draft_model", "model": args.draft, "num_speculative_tokens": k}
    if args.schedule:  # the anchor: vLLM's own K by batch size (inclusive ranges), e.g. "1-2:2,3-8:1,9-256:0"
        sched = [
            [int(r.split("-")[0]), int(r.split("-")[1].split(":")[0]), int(r.split(":")[1])]
            for r in args.schedule.split(",")
        ]
        out["draft_model_schedule"] = {
            "method": "draft_model",
            "model": args.draft,
            "num_speculative_tokens": max(e[2] for e in sched),
            "num_speculative_tokens_per_batch_size": sched,
        }
    common = {"draft": args.draft, "k_max": args.k_max, "vocab_file": args.vocab_file, "vocab_top_n": args.vocab_top_n}
    out[f"proposer_confidence_{args.tau}"] = {
        "specheads": {**common, "policy": "confidence_stop", "threshold": args.tau}
    }
    if args.head:
        out["proposer_specdecpp"] = {"specheads": {**common, "policy": "specdecpp", "head": args.head}}
    if args.costs:  # the cost-aware rule on vLLM's measured steps, with the draft gate (its default)
        out["proposer_confidence_cost"] = {
            "specheads": {**common, "policy": "confidence_stop", "stop": "cost", "costs": args.costs}
        }
        if args.head:
            out["proposer_specdecpp_cost"] = {
                "specheads": {**common, "policy": "specdecpp", "head": args.head, "stop": "cost", "costs": args.costs}
            }
    return out


def ours(args) -> dict:
    """Our own batched engine on the same prompts at ``--ours-batch`` rows: the target alone, SD at K = 1, 2, the
    cost-aware confidence rule with the draft gate priced at the batch (cost table with batch sizes), and with
    ``--eagle`` SD and that rule on the EAGLE head; one pass each, in turn, in this process."""
    import time as clock

    from _common import shared_pair

    from specheads.decode.api import Decoder, load_eagle, pair_costs
    from specheads.prompts import load_prompts
    from specheads.shim.policies import ConfidenceStop, StandardSD, TargetOnly

    pair = shared_pair(SHARED, args.vocab_file, args.vocab_top_n or 0)
    prompts = load_prompts(str(SHARED / "data/gsm8k/test.jsonl"), limit=args.gsm8k, offset=args.offset) + load_prompts(
        str(SHARED / "data/mt_bench/question.jsonl"), limit=args.mt_bench, offset=args.offset
    )
    items, b = list(enumerate(prompts)), args.ours_batch
    costs = pair_costs(pair, args.k_max + 2, batch_size=b)
    policies = {
        "ar": (TargetOnly(), None),
        "sd_k1": (StandardSD(1), None),
        "sd_k2": (StandardSD(2), None),
        "confidence_cost": (ConfidenceStop(k_max=args.k_max, stop="cost", costs=costs, gate=True), None),
    }
    if args.eagle:
        eagle = load_eagle(args.eagle, pair)
        ecosts = pair_costs(pair, args.k_max + 2, eagle=eagle, batch_size=b)
        policies.update(
            {
                "eagle_k2": (StandardSD(2), eagle),
                "eagle_k3": (StandardSD(3), eagle),
                "eagle_confidence_cost": (
                    ConfidenceStop(k_max=args.k_max, stop="cost", costs=ecosts, gate=True),
                    eagle,
                ),
            }
        )
    skip = set(args.ours_skip.split(","))
    decoders = {n: Decoder(pair, p, args.max_new, eagle=e) for n, (p, e) in policies.items() if n not in skip}
    for d in decoders.values():  # warm-up: kernel choice for each row count, allocations
        dict(d.decode_many(items[:b], b))
    rows, outputs = {}, {}
    for name, d in decoders.items():
        start = clock.perf_counter()
        res = dict(d.decode_many(items, b))
        seconds = clock.perf_counter() - start
        tokens = sum(len(r.tokens) for r in res.values())
        outputs[name] = [res[i].tokens for i in range(len(items))]
        rows[name] = {
            "tokens": tokens,
            "seconds": round(seconds, 2),
            "tokens_per_s": round(tokens / seconds, 3),
            "tokens_per_call": round(tokens / sum(r.stats.target_calls for r in res.values()), 4),
            "undrafted_rounds": sum(r.stats.undrafted_rounds for r in res.values()),
        }
        print(f"[ours b{b}] {name}: {rows[name]['tokens_per_s']} tokens/s", flush=True)
    for name in rows:
        rows[name]["greedy_identical"] = outputs[name] == outputs["ar"]
    return {"batch_size": b, "cost_table": costs.describe(), "rows": rows}


def vllm_costs(args, work: Path) -> str:
    """The cost table of vLLM's steps for the proposer's draft, vocabulary and k_max, at batch 1 and the powers of
    two up to the largest batch size (measured once, cached: ``specheads.decode.vllm_costs``)."""
    from specheads.decode.vllm_costs import vllm_cost_table
    from specheads.decode.vllm_engine import environment
    from specheads.shim.costs.cost_profile import batch_sizes

    settings = {
        "draft": args.draft,
        "k_max": args.k_max,
        "vocab_file": args.vocab_file,
        "vocab_top_n": args.vocab_top_n,
    }
    top = max(int(b) for b in args.batch_sizes.split(","))
    return vllm_cost_table(
        settings,
        work / "target_hf",
        args.vllm_python,
        environment(args.vllm_python, args.threads),
        list(batch_sizes(top)),
        args.profile,
    )


def run_one(args, work: Path, name: str, spec: dict, batch: int, block: int) -> dict:
    from specheads.decode.vllm_engine import environment

    env = environment(args.vllm_python, args.threads)
    out = work / f"out-{name}-b{batch}-{block}.json"
    out.unlink(missing_ok=True)
    job = work / "job.json"
    job.write_text(
        json.dumps(
            {
                "spec": spec,
                "batch": batch,
                "block": block,
                "blocks": args.blocks,
                "max_new": args.max_new,
                "out": str(out),
            }
        )
    )
    print(f"[vllm bench] {name} batch {batch} block {block}", flush=True)
    code = subprocess.call([args.vllm_python, __file__, "--stage", "vllm", "--work", str(work)], env=env)
    if code or not out.is_file():
        raise SystemExit(f"vLLM run {name} (batch {batch}, block {block}) failed (exit {code}); its log is above")
    return json.loads(out.read_text())


def summarise(name: str, parts: list[dict], base: list[dict] | None, n_prompts: int) -> dict:
    from specheads.decode.vllm_engine import speed

    tokens = sum(p["tokens"] for p in parts)
    seconds = sum(p["seconds"] for p in parts)
    outputs = [o for p in sorted(parts, key=lambda p: p["block"]) for o in p["outputs"]]
    counters, prop = {}, {}
    for p in parts:
        for k, v in p.get("counters", {}).items():
            counters[k] = counters.get(k, 0) + (v or 0)
        for k, v in (p.get("proposer") or {}).items():
            prop[k] = prop.get(k, 0) + v
    row = {
        "tokens": tokens,
        "seconds": round(seconds, 2),
        **speed(name == "target", tokens, seconds, counters, prop or None, n_prompts),
    }
    if name == "draft_model_schedule" and (row.get("tokens_per_call") or 0) > 8:  # K = 0 steps are not counted
        row["tokens_per_call"] = None
    row["greedy_identical"] = base is None or outputs == base
    row["outputs"] = outputs
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--draft", default=str(SHARED / "models/smollm2-draft-4l"))
    ap.add_argument("--head", default=None, help="an exported SpecDec++ head on --draft (adds proposer_specdecpp)")
    ap.add_argument("--vocab-file", default=None, help="the heads-vocab ranking the head's draft was pruned with")
    ap.add_argument("--vocab-top-n", type=int, default=None)
    ap.add_argument("--ks", default="1,2", help="draft_model's num_speculative_tokens")
    ap.add_argument("--k-max", type=int, default=4, help="the proposer's most candidates per round")
    ap.add_argument("--tau", type=float, default=0.5, help="confidence_stop's threshold")
    ap.add_argument("--batch-sizes", default="1,16")
    ap.add_argument(
        "--schedule",
        default="1-2:2,3-8:1,9-256:0",
        help="draft_model with vLLM's num_speculative_tokens_per_batch_size, as START-END:K,... ('': none)",
    )
    ap.add_argument("--skip", default="", help="configurations to leave out, comma-separated names")
    ap.add_argument("--ours-skip", default="", help="our engine's rows to leave out, comma-separated names")
    ap.add_argument(
        "--no-cost",
        dest="cost",
        action="store_false",
        help="leave out the cost-aware proposer rows (and the cost profile of vLLM's steps)",
    )
    ap.add_argument("--profile", default="auto", help="vLLM cost table: auto (cached), refresh, or a JSON path")
    ap.add_argument("--ours-batch", type=int, default=8, help="our own batched engine's rows (0: skip that part)")
    ap.add_argument(
        "--eagle",
        default=str(ROOT / "recipes/heads/eagle_smollm2.safetensors"),
        help="an EAGLE head for our engine's rows ('' : none)",
    )
    ap.add_argument(
        "--datagen",
        default=str(ROOT / "bench/results/vllm_datagen.json"),
        help="bench/vllm_datagen.py's result: its ratio is copied into the ratios",
    )
    ap.add_argument("--gsm8k", type=int, default=32)
    ap.add_argument("--mt-bench", type=int, default=16)
    ap.add_argument("--offset", type=int, default=0)
    ap.add_argument("--max-new", type=int, default=128)
    ap.add_argument("--blocks", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--work", default=str(ROOT / "runs/vllm_bench"))
    ap.add_argument("--vllm-python", default="/work/vllm-venv/bin/python")
    ap.add_argument("--out", default=str(ROOT / "bench/results/vllm.json"))
    ap.add_argument("--stage", default="prepare", choices=["prepare", "vllm"], help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    work = Path(args.work).resolve()
    if args.stage == "vllm":
        return vllm_stage(work)
    sys.path.insert(0, str(ROOT / "bench"))
    args.ks = [int(k) for k in args.ks.split(",") if k]
    args.draft = str(Path(args.draft).resolve())
    args.head = str(Path(args.head).resolve()) if args.head else None
    args.vocab_file = str(Path(args.vocab_file).resolve()) if args.vocab_file else None
    work.mkdir(parents=True, exist_ok=True)
    prompts = prepare(args, work)
    (work / "prompts.json").write_text(json.dumps(prompts))
    args.costs = vllm_costs(args, work) if args.cost else None
    table = configs(args)
    if args.skip:
        table = {n: c for n, c in table.items() if n not in args.skip.split(",")}
    names = list(table)
    results = {}
    for batch in (int(b) for b in args.batch_sizes.split(",")):
        parts = {n: [] for n in names}
        for block in range(args.blocks):
            order = names[block % len(names) :] + names[: block % len(names)]
            for name in order:
                try:
                    parts[name].append(run_one(args, work, name, table[name], batch, block))
                except SystemExit as err:  # the anchor row is vLLM's feature: its failure is reported, not fatal
                    if name != "draft_model_schedule":
                        raise
                    print(f"[vllm bench] {name} failed: {err}", flush=True)
        failed = [n for n in names if not parts[n]]
        for n in failed:
            parts.pop(n)
        base = summarise("target", parts["target"], None, len(prompts))
        rows = {n: summarise(n, parts[n], base["outputs"], len(prompts)) for n in parts}
        for r in rows.values():
            r.pop("outputs")
        results[f"b{batch}"] = rows
    engine_rows = ours(args) if args.ours_batch else None
    ratios = {}
    for key, rows in results.items():
        best_k = max((n for n in rows if n.startswith("draft_model_k")), key=lambda n: rows[n]["tokens_per_s"])
        best_p = max((n for n in rows if n.startswith("proposer")), key=lambda n: rows[n]["tokens_per_s"])
        best = max((n for n in rows if n != "target"), key=lambda n: rows[n]["tokens_per_s"])
        ratios[f"proposer_vs_vllm_best_fixed_k_{key}"] = round(
            rows[best_p]["tokens_per_s"] / rows[best_k]["tokens_per_s"], 4
        )
        ratios[f"best_lossless_vs_vllm_target_{key}"] = round(
            max(rows[best]["tokens_per_s"], 0) / rows["target"]["tokens_per_s"], 4
        )
        ratios[f"best_{key}"] = best
    if engine_rows:
        r = engine_rows["rows"]
        best = max((n for n in r if n != "ar" and r[n]["greedy_identical"]), key=lambda n: r[n]["tokens_per_s"])
        ratios[f"ours_batched_best_lossless_vs_ours_batched_ar_b{args.ours_batch}"] = round(
            r[best]["tokens_per_s"] / r["ar"]["tokens_per_s"], 4
        )
        ratios[f"ours_batched_best_b{args.ours_batch}"] = best
    if args.datagen and Path(args.datagen).is_file():
        dg = json.loads(Path(args.datagen).read_text())
        key = "datagen_generation_vllm_vs_hf_tokens_per_s"
        ratios[key] = dg.get(key, dg.get("ratios", {}).get(key))
    from _common import run_info

    result = {
        **run_info(__file__, argv, f"vLLM CPU, fp32, greedy, enforce_eager, {args.threads} threads"),
        "prompts": {"gsm8k": args.gsm8k, "mt_bench": args.mt_bench, "offset": args.offset},
        "max_new_tokens": args.max_new,
        "blocks": args.blocks,
        "configs": table,
        "results": results,
        "greedy_identical": all(r["greedy_identical"] for rows in results.values() for r in rows.values())
        and all(r["greedy_identical"] for r in (engine_rows or {"rows": {}})["rows"].values()),
        "ours_batched": engine_rows,
        "vllm_cost_table": args.costs,
        "ratios": ratios,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print("batch | config | tokens/s | tokens/call | acceptance | propose share | greedy identical")
    for key, rows in results.items():
        for n, r in rows.items():
            print(
                f"{key} | {n} | {r['tokens_per_s']} | {r['tokens_per_call']} | {r.get('acceptance_rate')} | "
                f"{r.get('propose_share_of_wall_time')} | {r['greedy_identical']}"
            )
    for n, r in (engine_rows or {"rows": {}})["rows"].items():
        print(
            f"ours b{args.ours_batch} | {n} | {r['tokens_per_s']} | {r['tokens_per_call']} | - | - | "
            f"{r['greedy_identical']}"
        )
    print(json.dumps(ratios, indent=1))
    return 0 if result["greedy_identical"] else 1


# ---- a vLLM process: one configuration, one batch size, one block of prompts -------------------------------


def vllm_stage(work: Path) -> int:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from specheads.vllm.proposer import _proposer_stats

    job = json.loads((work / "job.json").read_text())
    spec = job["spec"]
    if "specheads" in spec:
        from specheads.vllm.proposer import speculative_config

        spec = speculative_config(**spec["specheads"])
    llm = LLM(
        model=str(work / "target_hf"),
        dtype="float32",
        max_model_len=2048,
        max_num_seqs=job["batch"],
        seed=0,
        enforce_eager=True,
        disable_log_stats=False,
        speculative_config=spec or None,
    )
    prompts = json.loads((work / "prompts.json").read_text())
    size = -(-len(prompts) // job["blocks"])
    mine = prompts[job["block"] * size : (job["block"] + 1) * size]
    params = SamplingParams(temperature=0.0, max_tokens=job["max_new"])
    llm.generate(
        [TokensPrompt(prompt_token_ids=prompts[0]["ids"])],
        SamplingParams(temperature=0.0, max_tokens=8),
        use_tqdm=False,
    )  # warm-up

    def counters():
        return {
            m.name: m.value
            for m in llm.get_metrics()
            if m.name.startswith("vllm:spec_decode") and isinstance(getattr(m, "value", None), (int, float))
        }

    proposer = "specheads" in job["spec"]
    before, p0 = counters(), (llm.collective_rpc(_proposer_stats)[0] if proposer else None)
    t = time.perf_counter()
    res = llm.generate([TokensPrompt(prompt_token_ids=p["ids"]) for p in mine], params, use_tqdm=False)
    seconds = time.perf_counter() - t
    outputs = [list(r.outputs[0].token_ids) for r in res]
    out = {
        "block": job["block"],
        "tokens": sum(map(len, outputs)),
        "seconds": seconds,
        "outputs": outputs,
        "counters": {k: v - before.get(k, 0) for k, v in counters().items()},
    }
    if proposer:
        p1 = llm.collective_rpc(_proposer_stats)[0]
        out["proposer"] = {k: p1[k] - p0[k] for k in p1}
    Path(job["out"]).write_text(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
