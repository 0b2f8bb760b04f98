"""Greedy outputs of every decoding policy on the shared pair, to check a refactor changed nothing.

Runs ``heads-decode`` in this process once per configuration (greedy, fp32, the draft pruned as
recipe ``specdecpp_draft_quickstart`` prunes it) over held-out prompts and records every completion's tokens.
With ``--reference FILE`` (the same script run on an older checkout) it compares token for token
and fails (exit 1) on any difference.

    git worktree add /tmp/old OLD_COMMIT && pip install --no-deps --target /tmp/oldpkg /tmp/old
    cd /tmp/old && PYTHONPATH=/tmp/oldpkg python bench/greedy_identity.py --out /tmp/ref.json   # before
    python bench/greedy_identity.py --reference /tmp/ref.json                                  # after

(an editable install maps the folders to ``specheads.*``: the old tree is installed as a plain package beside
it and put first on the path). The configurations are written in the spelling of 0.2; ``--old-spelling``
passes them as the flat settings an older ``heads-decode`` reads.

The SpecDec++ rows need an exported acceptance head for the pruned draft (``--head``, default the
draft-based quickstart pipeline's ``runs/specdecpp_draft_quickstart-export/head.safetensors``); without one
they are skipped.
Lossy policies (top-K verification, FSD) are included: greedy, their decisions do not depend on
timing, so their outputs must not change either. Writes ``bench/results/greedy_identity.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import run_info

ROOT = Path(__file__).resolve().parents[1]
SHARED = os.environ.get("SPECHEADS_SHARED", str(ROOT.parent / "shared"))
PROMPTS = [(f"{SHARED}/data/gsm8k/test.jsonl", 900, 4), (f"{SHARED}/data/mt_bench/question.jsonl", 70, 4)]


def configs(head: str | None) -> dict[str, list[str]]:
    """Each configuration's heads-decode arguments, in the spelling of 0.2 (``<policy>.<setting>=``); an older
    checkout that lacks it reads the same settings with :func:`old_spelling`."""
    out = {
        "ar": ["policy=ar"],
        "sd_k1": ["policy=sd", "sd.k=1"],
        "sd_k3": ["policy=sd", "sd.k=3"],
        "confidence_stop": ["policy=confidence_stop", "confidence_stop.k_max=6"],
        "confidence_stop_cost": ["policy=confidence_stop", "confidence_stop.stop=cost", "confidence_stop.k_max=6"],
        "topk_verify": ["policy=topk_verify", "topk_verify.k=3", "topk_verify.verify_top_k=2"],
        "fsd_js": ["policy=fsd", "fsd.k=3", "fsd.T=0.3", "fsd.divergence=js"],
        "fsd_kl_or": ["policy=fsd", "fsd.k=3", "fsd.T=0.5", "fsd.divergence=kl", "fsd.fsd_rule=or"],
    }
    if head:
        own = ["specdecpp.k_min=1", "specdecpp.k_max=6"]
        out.update(
            {
                "specdecpp": ["policy=specdecpp", f"specdecpp.head={head}", *own],
                "specdecpp_cost": ["policy=specdecpp", f"specdecpp.head={head}", "specdecpp.stop=cost", *own],
            }
        )
    return out


def old_spelling(args: list[str]) -> list[str]:
    """The flat spelling before 0.2 of the same arguments (``sd.k=1`` -> ``k=1``)."""
    return [a.split(".", 1)[1] if not a.startswith("policy=") and "." in a.split("=", 1)[0] else a for a in args]


def run(head: str | None, max_new: int, old: bool = False) -> dict[str, list[list[int]]]:
    from specheads.export.decode_cli import main

    vocab = ROOT / "runs/specdecpp_draft_quickstart-vocab/vocab.json"
    if not vocab.is_file():
        from specheads.datagen.vocab_ranking import main as vocab_main

        vocab_main(["recipe=specdecpp_draft_quickstart", f"output={vocab}"])
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, extra in configs(head).items():
            tokens = []
            for i, (path, offset, n) in enumerate(PROMPTS):
                out = Path(tmp) / f"{name}-{i}"
                argv = [
                    "recipe=quickstart",
                    f"prompts={path}",
                    f"offset={offset}",
                    f"num_prompts={n}",
                    f"max_new_tokens={max_new}",
                    f"output_dir={out}",
                    f"draft.vocab_file={vocab}",
                    "draft.vocab_top_n=8192",
                    *(old_spelling(extra) if old else extra),
                ]
                start = time.perf_counter()
                rc = main(argv)
                if rc:
                    raise SystemExit(f"heads-decode {' '.join(argv)} exited {rc}")
                rows = [json.loads(line) for line in (out / "outputs.jsonl").read_text().splitlines() if line]
                tokens += [r["tokens"] for r in rows]
                print(f"{name} set {i}: {len(rows)} prompts, {time.perf_counter() - start:.1f} s", flush=True)
            results[name] = tokens
    return results


def commit() -> str | None:
    """The checkout's commit (what a later run compares against), None outside a git checkout."""
    try:
        return subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--head", default=str(ROOT / "runs/specdecpp_draft_quickstart-export/head.safetensors"))
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--reference", default="", help="outputs of an older checkout to compare with")
    ap.add_argument("--out", default=str(ROOT / "bench/results/greedy_identity.json"))
    ap.add_argument("--old-spelling", action="store_true", help="the flat settings before 0.2 (an older checkout)")
    args = ap.parse_args(argv)
    head = args.head if args.head and Path(args.head).is_file() else None
    if head is None:
        print(f"no head at {args.head}: SpecDec++ rows skipped", file=sys.stderr)
    outputs = run(head, args.max_new_tokens, args.old_spelling)
    report = {
        **run_info(__file__, argv, "fp32, greedy, batch 1"),
        "commit": commit(),
        "prompts": [f"{p} [{o}:{o + n}]" for p, o, n in PROMPTS],
        "max_new_tokens": args.max_new_tokens,
        "outputs": outputs,
    }
    status = 0
    if args.reference:
        ref = json.loads(Path(args.reference).read_text())
        report["reference"] = {k: ref[k] for k in ("command", "commit") if k in ref}
        same = {name: ref["outputs"].get(name) == toks for name, toks in outputs.items() if name in ref["outputs"]}
        report["identical_to_reference"] = same
        missing = sorted(set(ref["outputs"]) - set(outputs))
        print("| config | identical to reference |\n|---|---|")
        for name, ok in same.items():
            print(f"| {name} | {ok} |")
        if missing:
            print("not run here:", missing)
        status = 0 if all(same.values()) and not missing else 1
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    return status


if __name__ == "__main__":
    raise SystemExit(main())
