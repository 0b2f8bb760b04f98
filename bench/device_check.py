"""Device checks on the CPU: every path of a target split over two virtual GPUs (specheads.runtime.virtual_devices,
tests/device_paths.py) with the number of operations checked, each device fix reverted and caught, every head
family trained by two processes (DDP, DeepSpeed ZeRO-2 and ZeRO-3 over gloo; tests/ddp_runs.py) against one,
and whether bench/gpu_smoke.sh ran on a GPU.

    python bench/device_check.py                     # table; writes bench/results/device_check.json
    python bench/device_check.py --launchers ddp     # the multi-process part with DDP only (quicker)
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "bench")]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "bench/results/device_check.json"))
    ap.add_argument("--launchers", default="ddp,zero2,zero3", help="multi-process launchers ('' for none)")
    args = ap.parse_args(argv)
    import ddp_runs
    import device_paths

    from specheads.runtime.virtual_devices import DeviceMismatch

    work = Path(tempfile.mkdtemp(prefix="device-check-"))
    s = device_paths.build(work / "setup")
    paths = {}
    for name in sorted(device_paths.PATHS):
        t = time.perf_counter()
        try:
            n, ok, err = device_paths.run_path(name, s, work / name), True, None
        except Exception as e:  # a failing path is a result to record
            n, ok, err = 0, False, f"{type(e).__name__}: {str(e)[:200]}"
        paths[name] = {"ops_checked": n, "pass": ok, "seconds": round(time.perf_counter() - t, 1), "error": err}
        print(f"{'PASS' if ok else 'FAIL'}  {name:28s} {n:7d} ops  {paths[name]['seconds']:5.1f} s  {err or ''}")
    caught = {}
    for fix, (patch, name, _) in device_paths.reverts().items():
        with patch:
            try:
                device_paths.run_path(name, s, work / f"revert-{fix}")
                caught[fix] = {"caught": False, "path": name}
            except DeviceMismatch as e:
                caught[fix] = {"caught": True, "path": name, "error": str(e)}
        print(f"revert {fix:30s} caught={caught[fix]['caught']}  {caught[fix].get('error', '')}")
    multi: dict = {}
    launchers = [x for x in args.launchers.split(",") if x]
    pair_dirs = ddp_runs.pair(work / "mp") if launchers else None
    for launcher in launchers:
        for family in ddp_runs.FAMILIES:
            t = time.perf_counter()
            got = ddp_runs.check_family(family, work / "mp", pair_dirs, launcher)
            got["errors"] = [e[-600:] for e in got["errors"]]
            ok = not got["errors"] and got.get("max_abs_diff_ws2_vs_ws1", 1) <= got.get("tolerance", 0)
            ok = ok and got.get("manifests") == 1 and got.get("resumed_after_kill_identical", False)
            multi.setdefault(family, {})[launcher] = {**got, "pass": ok, "seconds": round(time.perf_counter() - t, 1)}
            diff = got.get("max_abs_diff_ws2_vs_ws1")
            print(
                f"{'PASS' if ok else 'FAIL'}  {family:11s} {launcher:6s} world 2 vs 1: max |diff| {diff}  "
                f"manifests {got.get('manifests')}  resumed after kill {got.get('resumed_after_kill_identical')}"
                f"  {'; '.join(got['errors'])[:300]}"
            )
    smoke = ROOT / "bench/results/gpu_smoke.md"
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    result = {
        "commit": commit,
        "cpu": _cpu_model(),
        "paths_passing": sum(p["pass"] for p in paths.values()),
        "paths": len(paths),
        "reverted_fixes_all_caught": all(c["caught"] for c in caught.values()),
        "sanitizer_paths": paths,
        "reverted_fixes_caught": caught,
        "multiprocess": multi or None,
        "multiprocess_all_pass": all(r["pass"] for f in multi.values() for r in f.values()) if multi else None,
        "table": [{"path": k, **{f: v[f] for f in ("ops_checked", "pass", "seconds")}} for k, v in paths.items()],
        "gpu_smoke": {
            "ran_in_this_change": False,
            "why": "no GPU machine was lent to this session (device status: not drawn)",
            "last_record": smoke.read_text().splitlines()[0] if smoke.exists() else None,
        },
    }
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"{sum(p['pass'] for p in paths.values())}/{len(paths)} paths pass -> {args.out}")
    ok = all(p["pass"] for p in paths.values()) and all(c["caught"] for c in caught.values())
    return 0 if ok and result["multiprocess_all_pass"] is not False else 1


def _cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.machine()


if __name__ == "__main__":
    sys.exit(main())
