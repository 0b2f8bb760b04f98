"""Whether Inductor (``torch.compile``) on the CPU cuts the non-GEMM part of a decoding forward, and exactly.

A 1-token fused forward of the shared target spends most of its time in its linear layers (bound by reading the
weights) and the rest in norms, rotary, attention, adds and Python. gpt-fast removes that class of overhead on
GPUs with ``torch.compile``. This compiles the fused decoder stack (``decoder_layers``, the 30 layers, at a
fixed cache position after a 100-token prefix; ``F.linear`` inside, ``SPECHEADS_KERNELS=torch``, since the picker's
routing is Python) with Inductor's default and ``max-autotune-no-cudagraphs`` modes, and times it interleaved
against the same stack eager (``F.linear``) and eager on the picker's kernels (the default path), at 1 and 4
tokens. Exactness: the largest absolute difference of the compiled stack's output from the eager one, in units
of the output's scale.

    python bench/studies/inductor.py          # -> bench/studies/results/inductor.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from specheads.shim.runners import kernels
from specheads.shim.runners.fused import decoder_layers
from specheads.shim.runners.model_runner import FusedRunner
from specheads.shim.runners.models import ModelSpec, load_model

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))  # _common, beside the benchmarks
from _common import run_info, write_result  # noqa: E402

SHARED = Path(os.environ.get("SPECHEADS_SHARED", ROOT.parent / "shared"))
PREFIX = 100


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--modes", default="default,max-autotune-no-cudagraphs")
    ap.add_argument("--out", default=str(ROOT / "bench/studies/results/inductor.json"))
    args = ap.parse_args(argv)
    spec = ModelSpec(
        path=str(SHARED / "models/smollm2-135m-instruct"),
        gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
        dtype="float32",
        device="cpu",
    )
    model = load_model(spec, "target").model
    r = FusedRunner(model, None, None, 512)
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        r.forward(torch.randint(100, 20000, (1, PREFIX), generator=gen), n_logits=0)
    rows, exact, compile_s = [], {}, {}
    for s in (1, 4):
        ids = torch.randint(100, 20000, (1, s), generator=gen)
        with torch.inference_mode():
            x = model.get_input_embeddings()(ids)
        cos, sin = r.cos[PREFIX : PREFIX + s], r.sin[PREFIX : PREFIX + s]
        mask = None if s == 1 else torch.ones(s, PREFIX + s, dtype=torch.bool).tril(PREFIX)

        def stack(x, cos=cos, sin=sin, mask=mask, s=s):
            return decoder_layers(r, x, cos, sin, r.keys, r.values, PREFIX, PREFIX + s, mask, False)

        paths = {"eager_picker": ("auto", stack), "eager_f_linear": ("torch", stack)}
        for mode in [m for m in args.modes.split(",") if m]:
            kernels.set_policy("torch")
            fn = torch.compile(stack, mode=None if mode == "default" else mode, dynamic=False)
            t = time.perf_counter()
            with torch.inference_mode():
                fn(x)
            compile_s[f"{mode}_s{s}"] = round(time.perf_counter() - t, 1)
            paths[f"inductor_{mode}"] = ("torch", fn)
        times = {p: [] for p in paths}
        outs = {}
        with torch.inference_mode():
            for rep in range(args.reps + 2):
                for p, (policy, fn) in paths.items():
                    kernels.set_policy(policy)
                    t = time.perf_counter()
                    y = fn(x)
                    if rep >= 2:
                        times[p].append(time.perf_counter() - t)
                    outs[p] = y
            kernels.set_policy("auto")
        ref = outs["eager_f_linear"]
        scale = ref.abs().max().item()
        for p in paths:
            rows.append({"path": p, "tokens": s, "ms": round(1000 * statistics.median(times[p]), 3)})
            exact[f"{p}_s{s}"] = round((outs[p] - ref).abs().max().item() / scale, 9)
    by = {(x["path"], x["tokens"]): x["ms"] for x in rows}
    print("| path | 1 token (ms) | 4 tokens (ms) | max rel. diff (1 / 4) |\n|---|---|---|---|")
    for p in dict.fromkeys(x["path"] for x in rows):
        print(f"| {p} | {by[(p, 1)]} | {by[(p, 4)]} | {exact[f'{p}_s1']:.2e} / {exact[f'{p}_s4']:.2e} |")
    ratios = {
        f"{p}_over_eager_picker_s{s}": round(by[(p, s)] / by[("eager_picker", s)], 4)
        for p in dict.fromkeys(x["path"] for x in rows)
        for s in (1, 4)
        if p != "eager_picker"
    }
    print(json.dumps(ratios, indent=1))
    result = {
        **run_info(__file__, argv, "fp32, batch 1, decoder stack after a 100-token prefix, interleaved medians"),
        "compile_s": compile_s,
        "max_abs_diff_over_scale": exact,
        "table": rows,
        "ratios": ratios,
    }
    write_result(args.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
