"""First-use timing inside a timed decode: a ``heads-eval`` sweep's first prompt against its later ones, with a
fresh kernel cache, this checkout (its decoders take their kernel choices when built) against an older one.

    pip install --no-deps --target /tmp/oldpkg OLD_CHECKOUT && python bench/warm_start.py --old-package /tmp/oldpkg

Each side runs ``heads-eval`` (the shared pair, SD at K=1 and 2, the target alone) on prompts it has not seen in a
subprocess of its own with ``SPECHEADS_CACHE`` pointed at an empty folder, so every kernel choice and cost table is
taken for the first time there. Reported per row: the first prompt's ms/token and the median of the later prompts'
(``first_over_later``: 1 when no first-use cost falls inside the timings). Writes ``bench/results/warm_start.json``.
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
        f"prompts={SHARED}/data/gsm8k/test.jsonl",
        "offset=1200",
        f"num_prompts={prompts}",
        "max_new_tokens=48",
        "ks=[1,2]",
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
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--out", default=str(ROOT / "bench/results/warm_start.json"))
    args = ap.parse_args(argv)
    table = []
    for side, package in (("this checkout", None), ("older checkout", args.old_package)):
        with tempfile.TemporaryDirectory() as tmp:
            for name, ms in sweep(package, args.prompts, Path(tmp)).items():
                later = statistics.median(ms[1:])
                row = {"side": side, "row": name, "first_ms_per_token": round(ms[0], 2)}
                row.update(later_ms_per_token=round(later, 2), first_over_later=round(ms[0] / later, 3))
                table.append(row)
    print("| side | row | first ms/token | later ms/token (median) | first / later |\n|---|---|---|---|---|")
    for r in table:
        cells = (r["side"], r["row"], r["first_ms_per_token"], r["later_ms_per_token"], r["first_over_later"])
        print("| " + " | ".join(map(str, cells)) + " |")
    mine = [r["first_over_later"] for r in table if r["side"] == "this checkout"]
    old = [r["first_over_later"] for r in table if r["side"] == "older checkout"]
    result = {
        **run_info(__file__, argv, "fp32, greedy, batch 1, a fresh SPECHEADS_CACHE per side"),
        "prompts": f"GSM8K test [1200:{1200 + args.prompts}], 48 new tokens",
        "worst_first_over_later": {"this_checkout": max(mine), "older_checkout": max(old)},
        "table": table,
    }
    write_result(args.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
