"""The stop plugin inside vLLM (``specheads.vllm.stop_plugin``): each stop rule against vLLM's EAGLE-3 at every fixed K.

    python bench/vllm_stop.py --head runs/lag0-export/head.safetensors --n 8   # c-cost, c-online-cost and h-cost
    python bench/vllm_stop.py --n 2 --max-new 32 --batches 1 --out /tmp/s.json  # a quick look

The ``h-cost`` head (lag 0 on the committed EAGLE head; the committed result's, chosen as the calibrated q):
``heads-datagen recipe=quickstart eagle_rounds.position=previous num_prompts=96 output_dir=runs/lag0-datagen``, then
``heads-train recipe=quickstart data_dir=runs/lag0-datagen 'eagle_stop.signals=[entropy,margin,step]'
eagle_stop.skip=true output_dir=runs/lag0-train`` and ``heads-export recipe=quickstart train_dir=runs/lag0-train
output_dir=runs/lag0-export`` (about 8 minutes on 2 cores).

Run with the project's Python. Under ``--work`` (default ``runs/vllm_stop``) it writes the shared target as a
Hugging Face directory (fp32; vLLM cannot read the GGUF), the committed EAGLE head as a ``heads-export
format=speculators`` directory and the prompts (chat template applied): GSM8K-test, MT-Bench first turns and Alpaca
rows past every training set's (``--offsets``). Then, in vLLM's own virtualenv (``--vllm-python``), one process each:

1. the cost table of vLLM's steps (the plugin's ``profile`` mode, at batch 1 and ``--batches``), unless ``--costs``;
2. vLLM's target alone;
3. vLLM's ``eagle3`` at ``K = --k-max`` with the plugin, its configurations interleaved prompt by prompt (each chunk
   of prompts runs every configuration, in an order rotated from chunk to chunk): ``k1..k<K>`` (every request's
   draft cut at that K: the same draft forwards and verified tokens as ``eagle3`` at that K), ``c-cost``,
   ``c-online-cost`` and, with ``--head``, ``h-cost`` (with ``--gate``, each with the draft gate).

A cell is a prompt set at a batch: batch 1 decodes one request at a time, batch ``B`` (``max_num_seqs``) submits
``B`` prompts at once. Per cell and row: tokens/s (the wall time of ``generate``), vLLM's acceptance, and
``greedy_identical`` against the target alone. ``drafts_match_shim``: every stop row's rounds replayed through the
toolkit's own rule (the policy ``heads-decode`` builds from the same settings, the same cost table) on the EAGLE
head's drafts computed here by :class:`specheads.heads.EagleHead` from the Transformers target's states, fed vLLM's
verdicts and batch sizes; the share of requests whose every round has the length vLLM's plugin chose. ``ceiling``:
the perfect rule on the ``k<K>`` row's recorded drafts (each round keeps exactly its accepted candidates; the same
tokens, so the same steps), priced by the cost table (a step: ``t_d(B)`` per draft step its longest round needs,
``t_t(B, mean kept + 1)``), over the best fixed K priced alike. ``best_stop_vs_best_fixed_k`` and
``learned_vs_best_training_free`` are measured tokens/s ratios; ``measured_over_priced`` per row: its measured
tokens/s over what the cost table prices its recorded steps at (how far the table's prices hold in that cell);
``share_of_ceiling`` = (best stop / best fixed K - 1) / (ceiling - 1). Writes ``bench/results/vllm_stop.json``; a
crashed run resumes from the vLLM processes kept in ``<work>/runs-*.json`` and the cells in their ``.partial``.
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
sys.path.insert(0, str(ROOT / "bench"))
SHARED = Path(os.environ.get("SPECHEADS_SHARED", str(ROOT.parent / "shared")))
SETS = ("gsm8k", "mt_bench", "alpaca")
STOP_ROWS = ("c-cost", "c-online-cost", "h-cost")


# ---- the project's Python -----------------------------------------------------------------------------------


def texts(name: str, offset: int, n: int) -> list[str]:
    d = SHARED / "data"
    if name == "gsm8k":
        rows = [json.loads(x)["question"] for x in (d / "gsm8k/test.jsonl").read_text().splitlines()]
    elif name == "mt_bench":
        rows = [json.loads(x)["turns"][0] for x in (d / "mt_bench/question.jsonl").read_text().splitlines()]
    else:
        rows = [
            (r["instruction"] + ("\n\n" + r["input"] if r["input"] else ""))
            for r in json.loads((d / "alpaca/alpaca_5000.json").read_text())
        ]
    got = rows[offset : offset + n]
    if len(got) < n:
        raise SystemExit(f"{name}: only {len(got)} rows past offset {offset}")
    return got


def prompts(target_dir: Path, sets: list[str], offsets: dict, n: int) -> dict[str, list[list[int]]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(target_dir)
    out = {}
    for s in sets:
        out[s] = []
        for text in texts(s, offsets[s], n):
            ids = tok.apply_chat_template(
                [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
            )
            out[s].append([int(i) for i in (ids["input_ids"] if hasattr(ids, "keys") else ids)])
    return out


def child(args, stage: str, job: dict, work: Path) -> dict:
    """Runs ``stage`` of this script in vLLM's Python with ``job``; its result (kept: a rerun reuses it)."""
    from specheads.decode.vllm_engine import environment

    out = work / f"{job['name']}.json"
    if out.is_file() and not args.fresh:
        return json.loads(out.read_text())
    job = {**job, "out": str(out), "work": str(work)}
    (work / f"{job['name']}.job.json").write_text(json.dumps(job))
    env = environment(args.vllm_python, args.threads)
    cmd = [args.vllm_python, __file__, "--stage", stage, "--job", str(work / f"{job['name']}.job.json")]
    print(f"[vllm_stop] {job['name']}: {' '.join(cmd)}", flush=True)
    code = subprocess.call(cmd, env=env, cwd=str(work))
    if code or not out.is_file():
        raise SystemExit(f"vLLM run {job['name']!r} failed (exit {code}); its log is above")
    return json.loads(out.read_text())


def replay(
    run: dict, prompts_by_set: dict, hd: Path, target_dir: Path, k: int, costs: str, head: str | None, gate: bool
) -> dict:
    """``drafts_match_shim`` per stop row: each request's rounds through the toolkit's rule on the reference drafts
    (:mod:`specheads.vllm.stop_check`)."""
    import torch
    from transformers import AutoModelForCausalLM

    from specheads.export import speculators
    from specheads.vllm.stop_check import reference_rounds, replay
    from specheads.vllm.stop_config import StopSettings, rule_policy

    eagle = speculators.read(hd).module.float().eval()
    meta = json.loads((hd / "config.json").read_text()).get("specheads")
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    refs: dict = {}
    out: dict = {}
    for row in STOP_ROWS:
        same = total = rounds = other = differ = 0
        first_bad = None
        for cell, recs in run["records"].items():
            for rec in recs.get(row, []):
                key = (cell.split("/")[0], rec["prompt"])
                p = prompts_by_set[key[0]][rec["prompt"]]
                if key not in refs:
                    refs[key] = reference_rounds(eagle, target, p + rec["output"], k)
                policy = rule_policy(StopSettings(rule=row, head=head, costs=costs, gate=gate), k, meta)
                got = replay(policy, refs[key], len(p), rec["rounds"], k)
                same += got["match"]
                total += 1
                rounds += len(got["lengths"])
                other += sum(a != b for a, b in zip(got["lengths"], got["vllm"]))
                differ += got["drafts_differ"]
                if not got["match"] and first_bad is None:
                    first_bad = {"cell": cell, "prompt": rec["prompt"], "toolkit": got["lengths"], "vllm": got["vllm"]}
        if total:
            out[row] = {
                "requests": total,
                "requests_matching": same,
                "share": round(same / total, 4),
                "rounds": rounds,
                "rounds_with_other_length": other,
                "rounds_whose_drafts_differ": differ,
                "first_mismatch": first_bad,
            }
    return out


def ceiling_for(recs: dict, table, k: int, fixed: dict) -> dict:
    """The perfect rule on the ``k<K>`` row's rounds over the best fixed K, both priced by ``table`` per step."""

    def price(steps: dict) -> float:
        ms = 0.0
        for rows in steps.values():  # rows: [(kept, batch)]
            b, ns = rows[0][1], [n for n, _ in rows]
            ms += max(ns) * table.t_draft(b) + table.t_target(sum(ns) / len(ns) + 1, b)
        return ms

    def steps_of(rec_list: list, kept) -> tuple[dict, int]:
        steps: dict = {}
        tokens = 0
        for rec in rec_list:
            tokens += len(rec["output"])
            for rnd in rec["rounds"]:
                steps.setdefault(rnd["step"], []).append((kept(rnd), rnd["batch"]))
        return steps, tokens

    priced = {}
    for name in recs:  # every row, priced on its own recorded rounds
        steps, tokens = steps_of(recs[name], lambda rnd: len(rnd["draft"]))
        priced[name] = price(steps) / tokens
    steps, tokens = steps_of(recs[f"k{k}"], lambda rnd: rnd.get("accepted", 0) if rnd.get("verified") else 0)
    perfect = price(steps) / tokens
    best = min(fixed, key=priced.get)
    return {
        "perfect_ms_per_token": round(perfect, 3),
        "best_fixed_k": best,
        "best_fixed_k_ms_per_token": round(priced[best], 3),
        "priced_ms_per_token": {n: round(v, 3) for n, v in priced.items()},
        "vs_best_fixed_k": round(priced[best] / perfect, 4),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--eagle", default=str(ROOT / "recipes/heads/eagle_smollm2.safetensors"))
    ap.add_argument("--head", default=None, help="a lag-0 stop head on that EAGLE head (row h-cost)")
    ap.add_argument("--k-max", type=int, default=6, help="vLLM's num_speculative_tokens; rows k1..k<K>")
    ap.add_argument("--sets", default=",".join(SETS))
    ap.add_argument("--offsets", default="gsm8k=200,mt_bench=40,alpaca=4200", help="first row per set")
    ap.add_argument("--n", type=int, default=6, help="prompts per set at batch 1")
    ap.add_argument("--batches", default="1,16", help="cells: batch 1 and max_num_seqs B (B prompts per set)")
    ap.add_argument("--max-new", type=int, default=128)
    ap.add_argument("--gate", action="store_true", help="the stop rows with the draft gate (the plugin's default: off)")
    ap.add_argument(
        "--rule-max-batch",
        default="1",
        help="the plugin's rule_max_batch: above it the table's best K for everyone (none: the rules at every batch)",
    )
    ap.add_argument("--costs", default=None, help="a cost table of vLLM's steps (default: measured first)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--vllm-python", default="/work/vllm-venv/bin/python")
    ap.add_argument("--work", default=str(ROOT / "runs/vllm_stop"))
    ap.add_argument("--fresh", action="store_true", help="rerun the vLLM processes whose results are kept")
    ap.add_argument("--out", default=str(ROOT / "bench/results/vllm_stop.json"))
    ap.add_argument("--stage", default="main", choices=["main", "profile", "serve"], help=argparse.SUPPRESS)
    ap.add_argument("--job", default="", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.stage != "main":
        return vllm_stage(args.stage, json.loads(Path(args.job).read_text()))
    import vllm_eagle3

    from specheads.shim.costs.cost_table import load_table

    work = Path(args.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    target_dir = work / "target_hf"
    vllm_eagle3.write_target(target_dir)
    hd = vllm_eagle3.head_dir(Path(args.eagle), work, target_dir).resolve()
    sets = [s for s in args.sets.split(",") if s]
    offsets = {k: int(v) for k, v in (x.split("=") for x in args.offsets.split(","))}
    batches = [int(b) for b in args.batches.split(",")]
    k = args.k_max
    by_set = prompts(target_dir, sets, offsets, max(args.n, *batches))
    (work / "prompts.json").write_text(json.dumps(by_set))
    common = {"target": str(target_dir), "eagle": str(hd), "k": k, "max_new": args.max_new, "n": args.n}
    rmb = None if str(args.rule_max_batch).lower() == "none" else int(args.rule_max_batch)
    common |= {"batches": batches, "sets": sets, "max_num_seqs": max(batches), "gate": args.gate, "rule_max_batch": rmb}
    costs = args.costs
    if costs is None:
        sizes = [b for b in (2, 4, 8, 16, 32) if b < max(batches)] + ([max(batches)] if max(batches) > 1 else [])
        child(args, "profile", {"name": f"costs-k{k}", **common, "profile_batches": sizes}, work)
        costs = str(work / f"costs-k{k}.table.json")
    table = load_table(costs)
    rows = [f"k{i}" for i in range(1, k + 1)] + ["c-cost", "c-online-cost"] + (["h-cost"] if args.head else [])
    alone = child(args, "serve", {"name": "runs-target", **common, "rows": ["target"]}, work)
    spec = child(
        args,
        "serve",
        {
            "name": "runs-eagle3",
            **common,
            "rows": rows,
            "costs": costs,
            "head": args.head and str(Path(args.head).resolve()),
        },
        work,
    )
    from _common import run_info, write_result

    result = {
        **run_info(__file__, argv, f"vLLM CPU {spec['vllm']}, fp32, enforce_eager, greedy, K = {k}"),
        "eagle": args.eagle,
        "head": args.head,
        "k_max": k,
        "gate": args.gate,
        "rule_max_batch": rmb,
        "prompts": {"sets": sets, "offsets": offsets, "n_batch1": args.n, "batches": batches},
        "max_new_tokens": args.max_new,
        "costs": costs,
        "cost_table": table.describe(),
        "startup_seconds": {"target": alone["startup_seconds"], "eagle3": spec["startup_seconds"]},
        "cells": {},
    }
    identical = True
    summary = {}
    for cell, cell_rows in spec["cells"].items():
        base = alone["cells"][cell]["target"]
        table_rows = {"target": {"tokens_per_s": base["tokens_per_s"]}}
        for name, r in cell_rows.items():
            same = r["outputs"] == base["outputs"]
            identical &= same
            table_rows[name] = {
                "tokens_per_s": r["tokens_per_s"],
                "vs_target": round(r["tokens_per_s"] / base["tokens_per_s"], 4),
                "greedy_identical": same,
                **r["acceptance"],
            }
        fixed = {n: table_rows[n]["tokens_per_s"] for n in table_rows if n.startswith("k")}
        best_k = max(fixed, key=fixed.get)
        stops = {n: table_rows[n]["tokens_per_s"] for n in STOP_ROWS if n in table_rows}
        best_stop = max(stops, key=stops.get)
        free = {n: v for n, v in stops.items() if n != "h-cost"}
        best_free = max(free, key=free.get)
        ceil = ceiling_for(spec["records"][cell], table, k, [n for n in fixed])
        gain = stops[best_stop] / fixed[best_k]
        summary[cell] = {
            "best_fixed_k": best_k,
            "best_stop": best_stop,
            "best_stop_vs_best_fixed_k": round(gain, 4),
            "ceiling": ceil["vs_best_fixed_k"],
            "share_of_ceiling": round((gain - 1) / (ceil["vs_best_fixed_k"] - 1), 3)
            if ceil["vs_best_fixed_k"] > 1
            else None,
            "best_training_free": best_free,
            "learned_vs_best_training_free": round(stops["h-cost"] / free[best_free], 4) if "h-cost" in stops else None,
        }
        for name, ms in ceil["priced_ms_per_token"].items():  # how well the cost table prices this cell's steps
            table_rows[name]["measured_over_priced"] = round(table_rows[name]["tokens_per_s"] * ms / 1000, 4)
        result["cells"][cell] = {"rows": table_rows, "ceiling": ceil}
    result["greedy_identical"] = identical
    result["summary"] = summary
    largest = max(summary, key=lambda c: summary[c]["ceiling"])
    result["largest_ceiling_cell"] = largest
    head = args.head and str(Path(args.head).resolve())
    result["replay"] = replay(spec, by_set, hd, target_dir, k, costs, head, args.gate)
    result["drafts_match_shim"] = min((r["share"] for r in result["replay"].values()), default=None)
    learned = [s["learned_vs_best_training_free"] for s in summary.values() if s["learned_vs_best_training_free"]]
    result["bars"] = {
        "greedy_identical": identical,
        "drafts_match_shim": result["drafts_match_shim"],
        "best_stop_vs_best_fixed_k_in_largest_ceiling_cell": summary[largest]["best_stop_vs_best_fixed_k"],
        "share_of_ceiling_there": summary[largest]["share_of_ceiling"],
        "best_stop_vs_best_fixed_k_min": min(s["best_stop_vs_best_fixed_k"] for s in summary.values()),
        "learned_vs_best_training_free_min": min(learned) if learned else None,
    }
    write_result(args.out, result)
    print(f"{'cell':<16}{'row':<15}{'tok/s':>8}{'vs tgt':>8}{'accept':>8}  identical")
    for cell, c in result["cells"].items():
        for name, r in c["rows"].items():
            print(
                f"{cell:<16}{name:<15}{r['tokens_per_s']:>8.2f}{r.get('vs_target', 1.0):>8.3f}"
                f"{r.get('acceptance_rate') or 0:>8.3f}  {r.get('greedy_identical', '')}"
            )
    print(json.dumps({"summary": summary, "bars": result["bars"]}, indent=1))
    return 0 if identical else 1


# ---- vLLM's Python --------------------------------------------------------------------------------------------


def vllm_stage(stage: str, job: dict) -> int:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from specheads.vllm import stop_plugin as sp
    from specheads.vllm import stop_tools
    from specheads.vllm.stop_config import speculative_config

    if stage == "profile":
        stop_tools.profile(
            job["target"],
            job["eagle"],
            job["k"],
            job["profile_batches"],
            str(Path(job["work"]) / f"{job['name']}.table.json"),
            dtype="float32",
            enforce_eager=True,
        )
        Path(job["out"]).write_text("{}")
        return 0
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm_eagle3 import _counters  # vLLM's spec-decode counters, read as that benchmark reads them

    from specheads.vllm.stop_check import rounds_of

    by_set = json.loads((Path(job["work"]) / "prompts.json").read_text())
    k, rows = job["k"], job["rows"]
    spec = None
    if rows != ["target"]:
        spec = speculative_config(job["eagle"], k, rule="fixed", fixed_k=k, trace=True)
    t = time.perf_counter()
    llm = LLM(
        model=job["target"],
        dtype="float32",
        max_model_len=2048,
        max_num_seqs=job["max_num_seqs"],
        seed=0,
        enforce_eager=True,
        disable_log_stats=False,
        speculative_config=spec,
    )
    startup = time.perf_counter() - t
    params = SamplingParams(temperature=0.0, max_tokens=job["max_new"])
    llm.generate([TokensPrompt(prompt_token_ids=by_set[job["sets"][0]][0])], params, use_tqdm=False)  # warm-up

    def settings(row: str) -> dict:
        if row.startswith("k"):
            return {"rule": "fixed", "fixed_k": int(row[1:]), "trace": True}
        return {
            "rule": row,
            "costs": job["costs"],
            "head": job.get("head"),
            "gate": job["gate"],
            "rule_max_batch": job.get("rule_max_batch", 1),
            "trace": True,
        }

    partial = Path(job["out"] + ".partial")  # the cells finished before a crash
    kept = json.loads(partial.read_text()) if partial.is_file() else {"cells": {}, "records": {}}
    cells: dict = kept["cells"]
    records: dict = kept["records"]
    chunk_no = 0
    for b in job["batches"]:
        for s in job["sets"]:
            cell = f"{s}/b{b}"
            if cell in cells:
                continue
            n = job["n"] if b == 1 else b
            ps = by_set[s][:n]
            chunks = [ps[i : i + b] for i in range(0, n, b)]
            acc = {r: {"seconds": 0.0, "tokens": 0, "outputs": [], "counters": {}} for r in rows}
            recs: dict = {r: [] for r in rows}
            for ci, chunk in enumerate(chunks):
                order = rows[chunk_no % len(rows) :] + rows[: chunk_no % len(rows)]
                chunk_no += 1
                for row in order:
                    if spec is not None:
                        llm.collective_rpc(sp.configure, args=(settings(row),))
                        llm.collective_rpc(sp.take_trace)
                    before = _counters(llm)
                    t = time.perf_counter()
                    res = llm.generate([TokensPrompt(prompt_token_ids=p) for p in chunk], params, use_tqdm=False)
                    acc[row]["seconds"] += time.perf_counter() - t
                    after = _counters(llm)
                    for key, v in after.items():
                        if not isinstance(v, list):
                            acc[row]["counters"][key] = acc[row]["counters"].get(key, 0) + v - before.get(key, 0)
                    outs = [list(o.outputs[0].token_ids) for o in res]
                    acc[row]["outputs"] += outs
                    acc[row]["tokens"] += sum(len(o) for o in outs)
                    if spec is None:
                        continue
                    trace = next(x for x in llm.collective_rpc(sp.take_trace) if x is not None)["trace"]
                    by_req = rounds_of(trace)
                    for i, o in enumerate(res):
                        rid = o.request_id
                        rounds = next((v for key, v in by_req.items() if key == rid or key.startswith(f"{rid}-")), [])
                        recs[row].append({"prompt": ci * b + i, "output": outs[i], "rounds": rounds})
            cells[cell] = {}
            for row in rows:
                a = acc[row]
                c = a["counters"]
                drafts, drafted = c.get("vllm:spec_decode_num_drafts", 0), c.get("vllm:spec_decode_num_draft_tokens", 0)
                accepted = c.get("vllm:spec_decode_num_accepted_tokens", 0)
                cells[cell][row] = {
                    "tokens_per_s": round(a["tokens"] / a["seconds"], 3),
                    "seconds": round(a["seconds"], 2),
                    "tokens": a["tokens"],
                    "outputs": a["outputs"],
                    "acceptance": {
                        "drafts": drafts,
                        "draft_tokens": drafted,
                        "accepted_tokens": accepted,
                        "acceptance_rate": round(accepted / drafted, 4) if drafted else None,
                        "mean_acceptance_length": round(1 + accepted / drafts, 4) if drafts else None,
                    },
                }
            records[cell] = recs
            partial.write_text(json.dumps({"cells": cells, "records": records}))
            print(
                f"[vllm_stop] {cell}: " + ", ".join(f"{r} {cells[cell][r]['tokens_per_s']}" for r in rows), flush=True
            )
    import vllm

    out = {"vllm": vllm.__version__, "startup_seconds": round(startup, 1), "cells": cells, "records": records}
    tmp = Path(job["out"] + ".tmp")
    tmp.write_text(json.dumps(out))
    tmp.replace(job["out"])
    partial.unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
