"""Forward-cost table: ms per forward over 1..8 (and 16, 32) new tokens, target and draft, each path.

A CPU decoding step at batch 1 is bound by reading the weights, so a verification pass over a
few tokens should cost about what one token costs. This measures it on the shared pair, after a
100-token prefix (KV cache), fp32, with the project's runners:

* ``fused``: the fused forward with the linear kernels measured fastest on this machine (the
  default decoding path on CPU; :mod:`specheads.shim.runners.kernels`);
* ``fused_library``: the same forward with the kernels measured fastest among the libraries' only (the
  picker without the ``smallm`` kernel built here: :mod:`specheads.shim.runners.smallm`);
* ``fused_torch``: the same forward with ``F.linear`` on the stored weights (the fused path
  before kernel selection);
* ``model``: the model's own (Hugging Face) forward with its linears routed through the kernels;
* ``model_torch``: the model's own forward, plain.

and the draft's one-token forward with its output layer pruned to the most frequent tokens
(``heads-vocab`` ranking of the recipe's corpus) against the full 49,152-token layer. All
configurations are interleaved repetition by repetition; each figure is a median.

    python bench/forward_cost.py                 # writes bench/results/forward_cost.json
    python bench/forward_cost.py --out bench/results/forward_cost_xeon.json   # on an Intel Xeon
    python bench/forward_cost.py --reps 10 --out /tmp/fc.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch
from _common import run_info

from specheads.shim.runners import kernels, smallm
from specheads.shim.runners.model_runner import FusedRunner, ModelRunner
from specheads.shim.runners.models import ModelSpec, load_model
from specheads.shim.runners.vocab_pruning import prune, read_ranking, subset_from_ranking

ROOT = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("SPECHEADS_SHARED", ROOT.parent / "shared"))
SIZES = (1, 2, 3, 4, 5, 6, 7, 8, 16, 32)
PATHS = ("fused", "fused_library", "fused_torch", "model", "model_torch")


def _policy(path: str) -> str:
    return "torch" if path.endswith("_torch") else "library" if path.endswith("_library") else "auto"


def _runner(path: str, model):
    return (FusedRunner if path.startswith("fused") else ModelRunner)(model, None, None, 512)


def _time(runner, policy: str, prefix: torch.Tensor, ids: torch.Tensor) -> float:
    kernels.set_policy(policy)
    try:
        runner.trim(prefix.shape[1])
        t = time.perf_counter()
        runner.forward(ids, n_logits=ids.shape[1])
        return time.perf_counter() - t
    finally:
        kernels.set_policy("auto")


def measure(models: dict, reps: int, sizes=SIZES) -> list[dict]:
    """Median ms per forward for every (model, path, size), interleaved.

    ``models`` maps a name to two copies of the model, ``(for the fused paths, for the model's own
    forward)``: fusing rebinds the weights in place, which would change what "the model's own
    forward" reads."""
    gen = torch.Generator().manual_seed(0)
    prefix = torch.randint(100, 20000, (1, 100), generator=gen)
    new = torch.randint(100, 20000, (1, max(sizes)), generator=gen)
    runners = {}
    with torch.inference_mode():
        for name, (fused_copy, own_copy) in models.items():
            for path in PATHS:
                model = fused_copy if path.startswith("fused") else own_copy
                kernels.set_policy(_policy(path))
                kernels.prepare(model, rows=sizes)
                kernels.set_policy("auto")
                r = _runner(path, model)
                r.forward(prefix, n_logits=1)
                for s in sizes:  # warm-up
                    _time(r, _policy(path), prefix, new[:, :s])
                runners[(name, path)] = r
        times = {(n, p, s): [] for (n, p) in runners for s in sizes}
        for rep in range(reps):
            for (name, path), r in runners.items():
                for s in sizes:
                    times[(name, path, s)].append(_time(r, _policy(path), prefix, new[:, :s]))
    return [
        {"model": n, "path": p, "tokens": s, "ms": round(1000 * statistics.median(v), 3)}
        for (n, p, s), v in times.items()
    ]


def gemm_stack(model, reps: int, sizes=range(1, 9)) -> list[dict]:
    """ms for every decoder layer's four projections (the fused target's own weights, in decoding order, so
    each weight comes from memory) through each linear-kernel candidate, at 1-8 rows, interleaved: where a
    library kernel's cost jumps with the row count, and whether ``smallm`` stays flat."""
    from specheads.shim.runners.fused import fused_weights

    weights = [w for layer in fused_weights(model).layers for w in (layer[1], layer[3], layer[6], layer[7])]
    cands = kernels._candidates(torch.float32, 1)
    gen = torch.Generator().manual_seed(2)
    xs = {m: {w.shape[1]: torch.randn(m, w.shape[1], generator=gen) for w in weights} for m in sizes}
    times = {(c, m): [] for c in cands for m in sizes}
    with torch.inference_mode():
        for rep in range(reps + 1):  # the first round builds the layout copies, and is dropped
            for m in sizes:
                for c in cands:
                    t = time.perf_counter()
                    for w in weights:
                        kernels._run(c, xs[m][w.shape[1]], w, None)
                    if rep:
                        times[(c, m)].append(time.perf_counter() - t)
    return [{"kernel": c, "rows": m, "ms": round(1000 * statistics.median(v), 3)} for (c, m), v in times.items()]


def pruned_draft(draft, ranking_path: str, tops: list[int], reps: int) -> list[dict]:
    """The draft's one-token fused forward with the full and pruned output layers, interleaved."""
    ranking = read_ranking(ranking_path)
    rows = draft.get_output_embeddings().weight.shape[0]
    gen = torch.Generator().manual_seed(1)
    prefix = torch.randint(100, 20000, (1, 100), generator=gen)
    tok = torch.randint(100, 20000, (1, 1), generator=gen)
    configs = {"full": None, **{f"top{n}": n for n in tops}}
    times = {c: [] for c in configs}
    full_head = draft.get_output_embeddings()
    heads = {}
    with torch.inference_mode():
        for c, n in configs.items():  # one output layer per configuration, built (and its rows copied) once
            if n is not None:
                prune(draft, subset_from_ranking(ranking, n, [2], rows))
                heads[c] = draft.get_output_embeddings()
                heads[c].rows()
                kernels.prepare(draft, rows=(1,))
                draft.set_output_embeddings(full_head)
            else:
                heads[c] = full_head
        r = FusedRunner(draft, None, None, 512)
        r.forward(prefix, n_logits=1)
        for rep in range(reps + 3):
            for c in configs:
                draft.set_output_embeddings(heads[c])
                r.trim(100)
                t = time.perf_counter()
                r.forward(tok, n_logits=1)
                times[c].append(time.perf_counter() - t)
        draft.set_output_embeddings(full_head)
    coverage = ranking.get("coverage", {})
    return [
        {
            "draft_output_layer": c,
            "tokens": n or rows,
            "ms": round(1000 * statistics.median(v[3:]), 3),
            "corpus_coverage": coverage.get(str(n)) if n else 1.0,
        }
        for c, (n, v) in ((c, (configs[c], times[c])) for c in configs)
    ]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument(
        "--vocab",
        default=str(ROOT / "runs/specdecpp_draft_quickstart-vocab/vocab.json"),
        help="heads-vocab ranking (heads-vocab recipe=specdecpp_draft_quickstart writes it)",
    )
    ap.add_argument("--tops", default="8192,16384")
    ap.add_argument("--out", default=str(ROOT / "bench/results/forward_cost.json"))
    args = ap.parse_args(argv)
    if not Path(args.vocab).is_file():
        from specheads.datagen.vocab_ranking import main as vocab_main

        vocab_main(["recipe=specdecpp_draft_quickstart", f"output={args.vocab}"])
    specs = {
        "target": ModelSpec(
            path=str(SHARED / "models/smollm2-135m-instruct"),
            gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
            dtype="float32",
            device="cpu",
        ),
        "draft": ModelSpec(path=str(SHARED / "models/smollm2-draft-4l"), dtype="float32", device="cpu"),
    }
    models = {n: (load_model(s, n).model, load_model(s, n).model) for n, s in specs.items()}
    table = measure(models, args.reps)
    stack = gemm_stack(models["target"][0], args.reps)
    prune_rows = pruned_draft(models["draft"][0], args.vocab, [int(x) for x in args.tops.split(",")], args.reps)

    def ms(model, path, s):
        return next(r["ms"] for r in table if r["model"] == model and r["path"] == path and r["tokens"] == s)

    print("| model | path | " + " | ".join(str(s) for s in SIZES) + " |")
    print("|---|---|" + "---|" * len(SIZES))
    for model in ("target", "draft"):
        for path in PATHS:
            print(f"| {model} | {path} | " + " | ".join(f"{ms(model, path, s):.1f}" for s in SIZES) + " |")
    cands = list(dict.fromkeys(r["kernel"] for r in stack))
    print("\n| target's projections, 30 layers: kernel | " + " | ".join(f"{m} rows" for m in range(1, 9)) + " |")
    print("|---|" + "---|" * 8)
    for c in cands:
        print(f"| {c} | " + " | ".join(f"{r['ms']:.1f}" for r in stack if r["kernel"] == c) + " |")
    print("\n| draft output layer | tokens | ms (1-token forward) | corpus coverage |\n|---|---|---|---|")
    for r in prune_rows:
        print(f"| {r['draft_output_layer']} | {r['tokens']} | {r['ms']:.2f} | {r['corpus_coverage']} |")
    full = prune_rows[0]["ms"]
    ratios = {
        "target_t2_over_t1": round(ms("target", "fused", 2) / ms("target", "fused", 1), 4),
        "target_t4_over_t1": round(ms("target", "fused", 4) / ms("target", "fused", 1), 4),
        "target_library_t4_over_t1": round(ms("target", "fused_library", 4) / ms("target", "fused_library", 1), 4),
        "target_t4_over_library_t4": round(ms("target", "fused", 4) / ms("target", "fused_library", 4), 4),
        "target_t8_over_t1": round(ms("target", "fused", 8) / ms("target", "fused", 1), 4),
        "draft_t4_over_t1": round(ms("draft", "fused", 4) / ms("draft", "fused", 1), 4),
        "draft_pruned_over_full": round(prune_rows[1]["ms"] / full, 4),
        "target_t1_over_fused_torch_t1": round(ms("target", "fused", 1) / ms("target", "fused_torch", 1), 4),
        "target_model_t4_over_t1": round(ms("target", "model", 4) / ms("target", "model", 1), 4),
    }
    print("\n" + json.dumps(ratios, indent=1))
    out = {
        **run_info(__file__, argv, "fp32, batch 1, 100-token prefix, median of interleaved repetitions"),
        "smallm": smallm.available() or smallm.why_not(),
        "kernels": kernels.describe(),
        "table": table,
        "gemm_stack": stack,
        "draft_pruning": prune_rows,
        "ratios": ratios,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
