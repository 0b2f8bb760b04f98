"""``heads-eval engine=vllm``: the sweep's same-vocabulary rows decoded by vLLM, side by side.

Rows, named as in a ``engine=specheads`` sweep: ``ar`` (vLLM's target alone), ``k<K>`` for every ``ks`` (vLLM's own
``draft_model`` at ``num_speculative_tokens = K``), and through the :mod:`specheads.vllm.proposer` proposer at
``k_max``:
``h<h>`` for every ``thresholds`` and ``h-cost`` (with ``head=``: SpecDec++), ``c<tau>`` for every ``confidence``
and ``c-cost`` (``confidence_stop``); the ``-cost`` rows (``cost_stop=true``) price rounds with a cost table of
vLLM's own steps at batch 1 and the batch sizes up to ``batch_size`` (:mod:`specheads.decode.vllm_costs`, measured
once and cached). Each row is one vLLM process (:func:`specheads.decode.vllm_engine.decode`: the GGUF target
converted once, vLLM's CPU environment set) over every prompt with ``max_num_seqs = batch_size``; rows already in
``rows.jsonl`` are kept (a crashed sweep resumes). Per row: tokens/s over ``generate``'s wall time, tokens per
target call and acceptance from vLLM's spec-decode counters (the proposer's: the rows it was asked for), the
proposer's share of the wall time, and ``greedy_identical`` against ``ar``. Lossy policies, EAGLE heads, trees and
the oracle run on ``engine=specheads``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from pathlib import Path
from types import SimpleNamespace

from specheads.errors import UserError
from specheads.vllm_config import problems as serving_problems

log = logging.getLogger(__name__)
UNSUPPORTED = {  # what engine=vllm does not sweep, by the name a user writes
    "rows": lambda c: c.rows,
    "sprinter.head": lambda c: c.sprinter.head,
    "judge.head": lambda c: c.judge.head,
    "judge.heads": lambda c: c.judge.heads,
    "eagle": lambda c: c.eagle,
    "trees": lambda c: c.trees,
    "topk.ks": lambda c: c.topk.ks,
    "fsd": lambda c: c.fsd.swept(),
    "hetero.methods": lambda c: c.hetero.methods,
}


def problems(cfg) -> list[str]:
    """What ``engine=vllm`` cannot sweep in this config."""
    given = [k for k, set_in in UNSUPPORTED.items() if set_in(cfg)]
    out = (
        [
            f"engine=vllm sweeps ar, ks, thresholds/h-cost (head=) and confidence/c-cost rows; {', '.join(given)} "
            "run on engine=specheads"
        ]
        if given
        else []
    )
    if not cfg.draft.path:
        out.append("engine=vllm needs draft.path (vLLM's draft_model and the proposer draft with it)")
    return out + serving_problems(cfg)


def rows(cfg) -> dict[str, dict]:
    """Row name -> the policy and its settings (``heads-decode engine=vllm``'s) that decode it."""
    out = {"ar": {"policy": "ar"}}
    out.update({f"k{k}": {"policy": "sd", "k": k} for k in cfg.ks})
    stop = {"head": cfg.head, "k_min": cfg.k_min, "k_max": cfg.k_max}
    if cfg.head:
        out.update({f"h{h}": {"policy": "specdecpp", **stop, "h": h} for h in cfg.thresholds})
        if cfg.cost_stop:
            out["h-cost"] = {"policy": "specdecpp", **stop, "stop": "cost"}
    out.update(
        {f"c{t}": {"policy": "confidence_stop", "tau": t, "k_max": cfg.confidence.k_max} for t in cfg.confidence.taus}
    )
    if cfg.cost_stop and cfg.confidence.taus:
        out["c-cost"] = {"policy": "confidence_stop", "stop": "cost", "k_max": cfg.confidence.k_max}
    return out


def deploy(cfg, summary: dict[str, dict]) -> dict | None:
    """The rule to deploy, as an ``engine=specheads`` sweep names it (:func:`specheads.evaluate.report.deploy`): the
    fastest row that speculates with the target alone's greedy tokens (any row, sampled), its policy and settings,
    its ratio to the best fixed K. No intervals: each row is one timed ``generate`` over every prompt."""
    from specheads.evaluate.report import row_kind

    specs = rows(cfg)
    ok = {n: r for n, r in summary.items() if n != "ar" and r.get("greedy_identical") is not False}
    if not ok:
        return None
    best = max(ok, key=lambda n: ok[n]["tokens_per_s"])
    out = {
        "config": best,
        "kind": row_kind(best),
        "tokens_per_s": ok[best]["tokens_per_s"],
        "tokens_per_s_interval": None,
        "policy": specs[best]["policy"],
        "settings": {k: v for k, v in specs[best].items() if k != "policy"},
        "regime": {
            "engine": "vllm",
            "batch_size": cfg.batch_size,
            "sampling": cfg.sampling.to_dict(),
            "max_new_tokens": cfg.max_new_tokens,
            "eagle": None,
            "prompts": cfg.prompts,
        },
    }
    fixed = [n for n in ok if row_kind(n) == "fixed_k"]
    if fixed and out["kind"] != "fixed_k":
        against = max(fixed, key=lambda n: ok[n]["tokens_per_s"])
        value = ok[best]["tokens_per_s"] / ok[against]["tokens_per_s"] if ok[against]["tokens_per_s"] else None
        out["vs_best_fixed_k"] = {"value": value and round(value, 4), "low": None, "high": None, "against": against}
    out["within_noise_of_fixed_k"] = None
    return out


def row_config(cfg, row: dict, python: str):
    """The run settings and the policy settings :mod:`specheads.decode.vllm_engine` reads, for one row."""
    from specheads.decode.policy_factory import settings_for

    values = {k: v for k, v in row.items() if k != "policy"}
    run = SimpleNamespace(
        policy=row["policy"],
        target=cfg.target,
        draft=cfg.draft,
        max_new_tokens=cfg.max_new_tokens,
        batch_size=cfg.batch_size,
        seed=cfg.seed,
        sampling=cfg.sampling,
        vllm=dataclasses.replace(cfg.vllm, python=python),
        profile=cfg.profile,
    )
    return run, settings_for(row["policy"], **values)


def run(cfg, prompts, out: Path, prog: str) -> int:
    """Decodes every row with vLLM, writes ``rows.jsonl``, ``sweep.json``, ``metrics.jsonl``, the manifest."""
    from transformers import AutoTokenizer

    from specheads.decode.api import format_prompt
    from specheads.decode.vllm_engine import costs_for, decode, speed, target_dir, vllm_python
    from specheads.outputs import MetricsWriter, atomic_write_json, write_manifest

    bad = problems(cfg)
    if bad:
        raise UserError("; ".join(bad))
    python = vllm_python(cfg.vllm.python)
    started = time.time()
    target = target_dir(cfg.target)
    tok = AutoTokenizer.from_pretrained(target)
    ids = [format_prompt(tok, p, cfg.chat_template) for p in prompts]
    done_file = out / "rows.jsonl"
    done = {r["name"]: r for r in map(json.loads, done_file.read_text().splitlines())} if done_file.is_file() else {}
    table = {}
    for name, settings in rows(cfg).items():
        if name in done:
            table[name] = done[name]
            continue
        rc, own = row_config(cfg, settings, python)
        log.info("engine=vllm row %s", name)
        res = decode(rc, own, ids, target, out / "vllm" / name, costs_for(rc, own, target))
        tokens = sum(map(len, res["outputs"]))
        row = {
            "name": name,
            **settings,
            "new_tokens": tokens,
            "seconds": round(res["seconds"], 3),
            "startup_s": round(res["startup_seconds"], 1),
            "outputs": res["outputs"],
            **speed(name == "ar", tokens, res["seconds"], res.get("counters", {}), res.get("proposer"), len(ids)),
        }
        with open(done_file, "a", encoding="utf-8") as fh:
            fh.write(json.dumps(row) + "\n")
        table[name] = row
    base = table["ar"]
    summary = {}
    with MetricsWriter(out) as metrics:
        for name, row in table.items():
            keep = {k: v for k, v in row.items() if k not in ("outputs", "spec_decode", "proposer")}
            keep["greedy_identical"] = row["outputs"] == base["outputs"] if not cfg.sampling.do_sample else None
            keep["speedup_vs_ar"] = (
                round(row["tokens_per_s"] / base["tokens_per_s"], 4) if base["tokens_per_s"] else None
            )
            summary[name] = keep
            metrics.write(keep)
    result = {"engine": "vllm", "batch_size": cfg.batch_size, "prompts": len(ids), "rows": summary}
    choice = deploy(cfg, summary)
    if choice is not None:
        result["deploy"] = choice
        print(f"to deploy ({choice['kind']}): {choice['config']}, {choice['tokens_per_s']} tokens/s")
    atomic_write_json(out / "sweep.json", result)
    write_manifest(
        out,
        command=prog,
        engine="vllm",
        prompts_file=cfg.prompts,
        num_prompts=len(ids),
        target={"name": str(target)},
        draft={"name": cfg.draft.path},
        sampling=cfg.sampling.to_dict(),
        seed=cfg.seed,
        vllm_python=python,
        wall_time_s=round(time.time() - started, 3),
    )
    print(f"{prog} engine=vllm, batch_size={cfg.batch_size}, {len(ids)} prompts")
    print(f"{'row':<10} {'tokens/s':>9} {'x ar':>6} {'tok/call':>9} {'accept':>7} {'propose':>8}  greedy=ar")
    for name, r in summary.items():
        print(
            f"{name:<10} {r['tokens_per_s']:>9.2f} {r['speedup_vs_ar'] or 0:>6.3f} {r['tokens_per_call'] or 0:>9.3f} "
            f"{r.get('acceptance_rate') or 0:>7.3f} {r.get('propose_share_of_wall_time') or 0:>8.3f}  "
            f"{r['greedy_identical']}"
        )
    return 0
