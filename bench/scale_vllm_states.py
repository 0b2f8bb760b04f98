"""The target's hidden states through vLLM against the Transformers engine, per family, on the shared pair.

    python bench/scale_vllm_states.py                 # 8 prompts per family, greedy, fp32, 2 threads (~10 min)

Run with the project's Python (vLLM in its own virtualenv: ``--vllm-python``). For each family that takes the
target's states (drafter, the EAGLE head's data; judge; SPRINTER), ``heads-datagen`` runs twice on the same
prompts with its quickstart recipe (``eagle_smollm2``, ``judge_quickstart``, ``sprinter_quickstart``, shortened):
``engine=specheads`` (the Transformers target generates and gives its states) and ``engine=vllm`` (vLLM generates
the responses, then gives the states: :mod:`specheads.datagen.vllm_states`; no Transformers target pass).

Per family:

* ``labels_equal``: every row of the two runs equal (token ids, labels, positions; SPRINTER's ``p``-derived
  floats to 1e-4 relative, and its accept labels ``q <= lambda * p`` at every lambda exactly); the drafter's
  top-k ids equal and their log-probabilities to 1e-4;
* ``states_max_rel``: the states themselves in fp32, not as stored (fp16): every sequence the ``engine=vllm``
  run labelled goes through one more states child (all families' layers at once) and through the Transformers
  target's own forward; the largest ``||vLLM - HF|| / ||HF||`` over positions and layers (drafter: the stream
  entering its layers; judge and SPRINTER: the last layer's output before the final norm);
* ``tokens_per_s``: labelled tokens over each run's wall time, vLLM's start-ups included (``vllm_startup_s``:
  the states child's, apart);
* ``tp_states_max_rel`` (drafter): the same figure for one sequence through a states child on ``--tp``
  tensor-parallel workers (3 on the shared target's 9 heads; on 2 cores the workers share them).

``measure()`` returns the figures; as a script it prints a table and writes ``--out``
(default ``bench/results/scale_vllm_states.json``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("SPECHEADS_SHARED", str(ROOT.parent / "shared")))
os.environ["SPECHEADS_SHARED"] = str(SHARED)  # the recipes' model and prompt paths, from any directory
sys.path.insert(0, str(ROOT / "bench"))
from _common import rows, run_datagen  # noqa: E402

FAMILIES = {  # recipe and the overrides that keep each run to a minute or two on 2 cores
    "drafter": ("eagle_smollm2", ["max_new_tokens=40", "drafter.top_k=8"]),
    "judge": ("judge_quickstart", ["max_new_tokens=112", "judge.answer_samples=0", "judge.answer_models=[target]"]),
    "sprinter": ("sprinter_quickstart", ["max_new_tokens=32"]),  # its two prompt files: prompts from each
}


def same_rows(family: str, a: list[dict], b: list[dict], lambdas: list[float]) -> tuple[bool, float]:
    """Whether two runs' rows are equal (floats: 1e-4 relative; SPRINTER's accept labels exactly) and the
    largest relative difference of a float column."""
    worst, equal = 0.0, len(a) == len(b)
    for x, y in zip(a, b):
        for key in x:
            if family == "sprinter" and key in ("p_token", "ratio", "tv"):
                for u, v in zip(x[key], y[key]):
                    if math.isfinite(u) or math.isfinite(v):
                        worst = max(worst, abs(u - v) / max(abs(u), 1e-12))
                equal &= len(x[key]) == len(y[key])
            else:
                equal &= x[key] == y[key]
        if family == "sprinter":
            equal &= all(
                (q <= lam * p) == (q <= lam * pv)
                for lam in lambdas
                for q, p, pv in zip(x["q_token"], x["p_token"], y["p_token"])
            )
    return equal and worst <= 1e-4, worst


def drafter_tops(ours: Path, theirs: Path) -> tuple[bool, float]:
    import torch

    from specheads.dataset import DrafterChunkFiles

    equal, worst = True, 0.0
    for c in range(len(list((ours / "data").glob("chunk-*.parquet")))):
        s, t = DrafterChunkFiles(ours, c).load(), DrafterChunkFiles(theirs, c).load()
        equal &= torch.equal(s["top_ids"], t["top_ids"]) and torch.equal(s["offsets"], t["offsets"])
        worst = max(worst, float((s["top_logp"] - t["top_logp"]).abs().max())) if s["top_logp"].numel() else worst
    return equal and worst <= 1e-4, worst


def states_max_rel(server, model, seqs: list[list[int]], layers: list[int]) -> float:
    """The largest per-position relative difference of vLLM's states from the Transformers target's (fp32)."""
    import torch

    from specheads.shim import HiddenCapture

    n, worst = model.config.num_hidden_layers, 0.0
    for seq, (st, _) in zip(seqs, server.states(seqs, layers)):
        with torch.inference_mode(), HiddenCapture(model) as cap:
            out = model(torch.tensor([seq]), output_hidden_states=True)
        hf = torch.stack([cap.pre[0] if i == n else out.hidden_states[i][0] for i in layers], 1).float()
        worst = max(worst, float(((st.float() - hf).norm(dim=-1) / hf.norm(dim=-1).clamp_min(1e-12)).max()))
    return worst


def measure(prompts: int = 8, threads: int = 2, vllm_python: str = "/work/vllm-venv/bin/python", tp: int = 3) -> dict:
    """Per family: labels equal, states' largest relative difference (fp32) and tokens/s of each engine; with
    ``tp``, the drafter's first sequence again through a states child on ``tp`` tensor-parallel workers."""
    import torch

    from specheads.config import load_config
    from specheads.datagen.cli import _load
    from specheads.datagen.config import DatagenConfig
    from specheads.datagen.drafter import layers_for
    from specheads.vllm.child import StatesServer

    torch.set_num_threads(threads)
    common = ["offset=0", f"threads={threads}", f"vllm.threads={threads}"]
    results, runs = {}, {}
    with tempfile.TemporaryDirectory(prefix="scale-vllm-states-") as tmp:
        for family, (recipe, extra) in FAMILIES.items():
            n = prompts // 2 if family == "sprinter" else prompts
            args = [*common, f"num_prompts={n}", *extra, f"chunk_size={prompts}", f"batch_size={prompts}"]
            got = {}
            for engine in ("specheads", "vllm"):
                out = Path(tmp) / f"{family}-{engine}"
                vllm = ["engine=vllm", f"vllm.python={vllm_python}"] if engine == "vllm" else []
                seconds, manifest = run_datagen(recipe, [*args, *vllm], out)
                got[engine] = {"seconds": round(seconds, 1), "labelled_tokens": manifest["labelled_tokens"], "out": out}
            cfg = load_config(DatagenConfig, "datagen", [f"recipe={recipe}", *args])
            equal, worst = same_rows(
                family, rows(got["specheads"]["out"]), rows(got["vllm"]["out"]), cfg.sprinter.lambdas
            )
            entry = {"labels_equal": equal, "float_labels_max_rel": worst}
            if family == "drafter":
                tops_equal, tops_worst = drafter_tops(got["specheads"]["out"], got["vllm"]["out"])
                entry.update(labels_equal=equal and tops_equal, top_logp_max_abs=tops_worst)
            for engine, g in got.items():
                entry[f"{engine}_tokens_per_s"] = round(g["labelled_tokens"] / g["seconds"], 2)
                entry[f"{engine}_seconds"] = g["seconds"]
                entry["labelled_tokens"] = g["labelled_tokens"]
            results[family], runs[family] = entry, (cfg, got["vllm"]["out"])
        cfg = runs["drafter"][0]
        cfg.vllm.python, cfg.output_dir = vllm_python, tmp
        job = _load(cfg, needs_draft=False)
        model = job.pair.target.model
        drafter_layers = layers_for(cfg, model)
        server = StatesServer(cfg, job.limit)
        try:
            server.states([[1, 2]], sorted({*drafter_layers, model.config.num_hidden_layers}))  # starts the child
            for family, (_, out) in runs.items():
                seqs = [r["input_ids"] for r in rows(out)]
                layers = drafter_layers if family == "drafter" else [model.config.num_hidden_layers]
                results[family]["states_layers"] = layers
                results[family]["states_sequences"] = len(seqs)
                results[family]["states_max_rel"] = states_max_rel(server, model, seqs, layers)
            startup = round(server.startup_seconds, 1)
        finally:
            server.close()
        if tp > 1:  # on a CPU the workers share its cores (vllm_job.cpu_binding): slow, so one sequence only
            cfg.vllm.tensor_parallel = tp
            server = StatesServer(cfg, job.limit)
            try:
                seqs = [r["input_ids"] for r in rows(runs["drafter"][1])][:1]
                results["drafter"]["tp_states_max_rel"] = states_max_rel(server, model, seqs, drafter_layers)
                results["drafter"]["tp"] = tp
            finally:
                server.close()
    for entry in results.values():
        entry["vllm_startup_s"] = startup
        entry["states_within_1e-3"] = entry["states_max_rel"] < 1e-3
    table = [{"family": f, **{k: v for k, v in e.items() if not isinstance(v, list)}} for f, e in results.items()]
    return {"prompts_per_family": prompts, "threads": threads, "families": results, "table": table}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=8, help="prompts per family (a multiple of 4: SPRINTER)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--vllm-python", default="/work/vllm-venv/bin/python")
    ap.add_argument("--tp", type=int, default=3, help="tensor-parallel workers of the extra states check (<2: none)")
    ap.add_argument("--out", default=str(ROOT / "bench/results/scale_vllm_states.json"))
    args = ap.parse_args(argv)
    t = time.perf_counter()
    got = measure(args.prompts, args.threads, args.vllm_python, args.tp)
    sys.path.insert(0, str(ROOT / "bench"))
    from _common import run_info

    result = {
        **run_info(__file__, argv, f"fp32, greedy, {args.threads} threads (torch and vLLM's OMP)"),
        **got,
        "seconds": round(time.perf_counter() - t, 1),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print("family | labels equal | states max rel (fp32) | HF tok/s | vLLM tok/s | labelled tokens")
    for family, e in got["families"].items():
        print(
            f"{family} | {e['labels_equal']} | {e['states_max_rel']:.2e} | {e['specheads_tokens_per_s']} | "
            f"{e['vllm_tokens_per_s']} | {e['labelled_tokens']}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
