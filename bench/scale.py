"""Scale: the measurements of "run where the users run", on the shared pair (CPU), into one result file.

    python bench/scale.py                        # every part; writes bench/results/scale.json
    python bench/scale.py --only plan,cuda_tests # some parts, merged into the file already there

Parts (each a module beside this one with ``measure() -> dict``; run alone, each prints its own table):

- ``vllm_vs_hf_labels`` and ``datagen_tokens_per_s``: acceptance labels (greedy, sampled; one family under
  tensor parallelism) from ``bench/scale_vllm_labels.py``, the states of the drafter/EAGLE, judge and SPRINTER
  families from ``bench/scale_vllm_states.py``; vLLM engine against the Transformers engine, same prompts.
- ``eagle_train_peak_rss_4x_over_1x`` and ``eagle_target_bytes_read_over_total``: ``bench/scale_train.py``.
- ``plan``: ``bench/scale_plan.py`` (the 405B and 70B recipes on 8x80 GB, and the refusal).
- ``cuda_tests``: how many tests carry the ``cuda`` marker, and the last ``bench/gpu_smoke.sh`` run on a GPU
  (``bench/results/gpu_smoke.md``).

The parts run one after another (each measures speed or memory: never two at once on 2 cores).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import run_info  # noqa: E402

from specheads.machine import cpu_model  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RESULT = ROOT / "bench" / "results" / "scale.json"
SMOKE = ROOT / "bench" / "results" / "gpu_smoke.md"
PARTS = ("plan", "cuda_tests", "train", "vllm_labels", "vllm_states")


def cuda_tests() -> dict:
    """The tests marked ``cuda`` (collected here, skipped here without a GPU) and the recorded GPU smoke."""
    got = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "--collect-only", "-m", "cuda", "-p", "no:cacheprovider", "tests"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    names = [line for line in got.stdout.splitlines() if "::" in line]
    out: dict = {"count": len(names), "tests": names, "gpu_smoke_ran": False}
    if SMOKE.is_file():
        text = SMOKE.read_text()
        head = re.search(r"(\d+) PASS, (\d+) FAIL, (\d+) SKIP", text)
        gpu = re.search(r"^INFO .*CUDA \S+ (.+?) bf16", text, re.M)
        out.update(
            gpu_smoke_ran=bool(gpu),
            gpu_smoke_gpu=gpu.group(1) if gpu else None,
            gpu_smoke_summary=dict(zip(("pass", "fail", "skip"), map(int, head.groups()))) if head else None,
            gpu_smoke_failed=[step for step, status in latest(text).items() if status == "FAIL"],
            gpu_smoke_record="bench/results/gpu_smoke.md",
        )
    return out


def latest(text: str) -> dict[str, str]:
    """Each smoke step's status in the last run that ran it (the record lists its runs in order)."""
    out: dict[str, str] = {}
    for status, step in re.findall(r"^(PASS|FAIL|SKIP)\s+(\S+)", text, re.M):
        out[step] = status
    return out


def part(name: str) -> dict:
    if name == "cuda_tests":
        return {"cuda_tests": cuda_tests()}
    if name == "plan":
        from scale_plan import measure as plan

        return {"plan": plan()}
    if name == "train":
        from scale_train import measure as train

        return nest(train(), ("eagle_train_peak_rss_4x_over_1x", "eagle_target_bytes_read_over_total"), "eagle_train")
    if name == "vllm_labels":
        from scale_vllm_labels import measure as labels

        return nest(labels(), ("vllm_vs_hf_labels", "datagen_tokens_per_s"), "vllm_labels_setup")
    from scale_vllm_states import measure as states

    return {"vllm_vs_hf_states": states()}


def nest(got: dict, top: tuple[str, ...], rest: str) -> dict:
    """A part's headline keys at the top of the result, the rest of what it measured under ``rest``; the
    ``_stale`` keys (how an earlier version laid them out) are dropped from the file."""
    return {**{k: got[k] for k in top}, rest: {k: v for k, v in got.items() if k not in top}, "_stale": list(got)}


def merge(old: dict, new: dict) -> dict:
    """``new``'s keys over ``old``'s; the two ``vllm_vs_hf_labels`` sources are joined into one entry."""
    new = dict(new)
    stale = set(new.pop("_stale", [])) - set(new)
    out = {k: v for k, v in old.items() if k not in stale}
    for key, value in new.items():
        if key == "vllm_vs_hf_states":
            labels = dict(out.get("vllm_vs_hf_labels") or {})
            labels["states"] = value
            out["vllm_vs_hf_labels"] = labels
        elif key == "vllm_vs_hf_labels" and isinstance(value, dict):
            labels = dict(out.get("vllm_vs_hf_labels") or {})
            labels.update(value)
            out["vllm_vs_hf_labels"] = labels
        else:
            out[key] = value
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default=",".join(PARTS), help=f"comma-separated parts of {', '.join(PARTS)}")
    ap.add_argument("--out", default=str(RESULT))
    args = ap.parse_args(argv)
    names = [n for n in args.only.split(",") if n]
    bad = [n for n in names if n not in PARTS]
    if bad:
        print(f"scale.py: error: unknown part(s) {bad}; choose from {', '.join(PARTS)}", file=sys.stderr)
        return 2
    out_path = Path(args.out)
    result = json.loads(out_path.read_text()) if out_path.is_file() else {}
    seconds = dict(result.get("seconds", {}))
    for name in names:
        start = time.perf_counter()
        print(f"== {name}", flush=True)
        result = merge(result, part(name))
        seconds[name] = round(time.perf_counter() - start, 1)
        result["seconds"] = seconds
        result.update(run_info(__file__, argv, "scale parts in sequence"), cpu=cpu_model())
        out_path.parent.mkdir(parents=True, exist_ok=True)
        out_path.write_text(json.dumps(result, indent=2) + "\n")  # after every part: a crash keeps the rest
    print(f"{'part':<14} {'seconds':>8}")
    for name in names:
        print(f"{name:<14} {seconds[name]:>8}")
    print(f"-> {out_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
