"""First-use timing inside a timed decode: each prompt of a ``heads-eval`` sweep against the row's median, with a
fresh kernel cache, this checkout (its decoders take their kernel choices when built) against an older one.

    pip install --no-deps --target /tmp/oldpkg OLD_CHECKOUT && python bench/warm_start.py --old-package /tmp/oldpkg

Each side runs ``heads-eval`` (the shared pair, SD at K=1, 2 and 4, the target alone, the draft alone) on MT-Bench
questions of very different lengths (so that prompts meet new prefill sizes as the sweep goes) in a subprocess of
its own with ``SPECHEADS_CACHE`` pointed at an empty folder, so every kernel choice and cost table is taken for the
first time there. The sweep's own warm-up decodes a few tokens of the first prompt per row; a pass size that only a
later prompt meets was timed inside that prompt's decode. Reported per row: the first prompt's ms/token, the slowest
prompt's and the median (``worst_over_median``: about 1 when no first-use cost falls inside the timings). Writes
``bench/results/warm_start.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from _common import run_info, write_result

ROOT = Path(__file__).resolve().parents[1]
SHARED = os.environ.get("SPECHEADS_SHARED", str(ROOT.parent / "shared"))


def sweep(package: str | None, prompts: int, out: Path) -> dict:
    """One heads-eval run in a fresh process and kernel cache; per row, each prompt's ms/token in order."""
    env = {**os.environ, "SPECHEADS_CACHE": str(out / "cache"), "SPECHEADS_SHARED": SHARED}
    if package:
        env["PYTHONPATH"] = package  # before the editable install: the older checkout's package
    args = [
        "recipe=judge_quickstart",
        f"prompts={SHARED}/data/mt_bench/question.jsonl",
        "offset=40",
        f"num_prompts={prompts}",
        "max_new_tokens=48",
        "ks=[1,2,4]",
        "judge.head=null",
        "judge.deltas=[]",
        "topk.ks=[]",
        "accuracy=false",
        "oracle=false",
        "fidelity=false",
        f"output_dir={out / 'eval'}",
    ]
    code = "import sys; from specheads.evaluate.cli import main; raise SystemExit(main(sys.argv[1:]))"
    subprocess.run([sys.executable, "-c", code, *args], env=env, check=True, capture_output=True, text=True)
    rows: dict[str, list[float]] = {}
    for line in (out / "eval/rows.jsonl").read_text().splitlines():
        r = json.loads(line)
        if r.get("new_tokens"):
            rows.setdefault(r["config"], []).append((r["index"], 1000 * r["wall_time"] / r["new_tokens"]))
    return {name: [ms for _, ms in sorted(v)] for name, v in rows.items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--old-package", required=True, help="an older checkout installed as a plain package")
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--out", default=str(ROOT / "bench/results/warm_start.json"))
    args = ap.parse_args(argv)
    table = []
    for side, package in (("this checkout", None), ("older checkout", args.old_package)):
        with tempfile.TemporaryDirectory() as tmp:
            for name, ms in sweep(package, args.prompts, Path(tmp)).items():
                mid = statistics.median(ms)
                row = {"side": side, "row": name, "first_ms_per_token": round(ms[0], 2)}
                row.update(worst_ms_per_token=round(max(ms), 2), median_ms_per_token=round(mid, 2))
                row.update(worst_over_median=round(max(ms) / mid, 3), ms_per_token=[round(x, 2) for x in ms])
                table.append(row)
    print("| side | row | first ms/token | slowest | median | slowest / median |\n|---|---|---|---|---|---|")
    for r in table:
        cells = (r["side"], r["row"], r["first_ms_per_token"], r["worst_ms_per_token"], r["median_ms_per_token"])
        print("| " + " | ".join(map(str, (*cells, r["worst_over_median"]))) + " |")
    mine = [r["worst_over_median"] for r in table if r["side"] == "this checkout"]
    old = [r["worst_over_median"] for r in table if r["side"] == "older checkout"]
    result = {
        **run_info(__file__, argv, "fp32, greedy, batch 1, a fresh SPECHEADS_CACHE per side"),
        "prompts": f"MT-Bench [40:{40 + args.prompts}], 48 new tokens",
        "worst_over_median": {"this_checkout": max(mine), "older_checkout": max(old)},
        "table": table,
    }
    write_result(args.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
