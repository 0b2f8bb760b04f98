"""Greedy outputs of every decoding policy on the shared pair, to check a refactor changed nothing.

Runs ``heads-decode`` in this process once per configuration (greedy, fp32, the draft pruned as
recipe ``specdecpp_draft_quickstart`` prunes it) over held-out prompts and records every completion's tokens
and its decisions (target calls, drafted and accepted candidates, rounds). With ``--reference FILE`` (the same
script run on an older checkout) it compares them and fails (exit 1) on any difference.

    git worktree add /tmp/old OLD_COMMIT && pip install --no-deps --target /tmp/oldpkg /tmp/old
    cp bench/greedy_identity.py /tmp/old/bench/ && cd /tmp/old
    PYTHONPATH=/tmp/oldpkg python bench/greedy_identity.py --out /tmp/ref.json --heads /tmp/heads   # before
    python bench/greedy_identity.py --reference /tmp/ref.json --heads /tmp/heads                     # after

(an editable install maps the folders to ``specheads.*``: the old tree is installed as a plain package beside
it and put first on the path). The configurations are written in the spelling of 0.2.

Every policy runs, the lossy ones included (top-K verification, FSD, SPRINTER, the judge): greedy, their
decisions do not depend on timing, so their outputs must not change either. The EAGLE rows draft with the
committed ``recipes/heads/eagle_smollm2.safetensors``; the heads the other policies read are seeded, untrained
ones for the shared pair (``--heads DIR`` writes them once; both checkouts must read the same files): what is
compared is the decoding around a head, not the head. Writes ``bench/results/greedy_identity.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
import time
from pathlib import Path

from _common import run_info

ROOT = Path(__file__).resolve().parents[1]
SHARED = os.environ.get("SPECHEADS_SHARED", str(ROOT.parent / "shared"))
PROMPTS = [(f"{SHARED}/data/gsm8k/test.jsonl", 900, 4), (f"{SHARED}/data/mt_bench/question.jsonl", 70, 4)]


EAGLE = ROOT / "recipes/heads/eagle_smollm2.safetensors"


def make_heads(out: Path) -> dict[str, str]:
    """Seeded, untrained heads for the shared pair (SpecDec++ on the draft and on the EAGLE head, SPRINTER, the
    judge), written once into ``out``: their files, by name. Made from the draft's config and the EAGLE head's
    header alone, so that any checkout can read them."""
    import torch
    from safetensors import safe_open

    with safe_open(str(EAGLE), framework="pt") as f:
        eagle = json.loads(f.metadata()["specheads"])
    draft_d = json.loads(Path(f"{SHARED}/models/smollm2-draft-4l/config.json").read_text())["hidden_size"]
    target_d = eagle["hidden_size"]
    files = {n: out / f"{n}.safetensors" for n in ("specdecpp", "eagle_stop", "sprinter", "judge")}
    if all(f.is_file() for f in files.values()):
        return {n: str(f) for n, f in files.items()}
    from specheads.export.package import save_head
    from specheads.heads import AcceptanceHead, JudgeHead, VerifierHead

    greedy = {"do_sample": False, "temperature": 1.0, "top_k": 0, "top_p": 1.0}
    on_draft = {"model": "draft", "state": "post", "layer": -1, "position": "own"}
    on_eagle = {"model": "eagle", "state": "post", "layer": -1, "position": "own"}
    on_eagle["eagle"] = {"file": str(EAGLE), "tensors_sha256": eagle["tensors_sha256"]}
    made = {
        "specdecpp": (AcceptanceHead(draft_d, depth=1), "acceptance", draft_d, on_draft, 0.6),
        "eagle_stop": (AcceptanceHead(target_d, depth=1, confidence=True), "acceptance", target_d, on_eagle, 0.5),
        "sprinter": (VerifierHead(draft_d, depth=0), "verifier", draft_d, {**on_draft, "position": "previous"}, 0.5),
        "judge": (JudgeHead(target_d, depth=0), "judge", target_d, {"model": "target", "state": "pre"}, 0.5),
    }
    for seed, (name, (head, kind, d, feature, threshold)) in enumerate(made.items()):
        torch.manual_seed(seed)
        head.apply(lambda m: m.reset_parameters() if hasattr(m, "reset_parameters") else None)
        meta = {"head_config": head.config(), "hidden_size": d, "feature": feature, "sampling": greedy}
        save_head(files[name], head, kind, {**meta, "default_threshold": threshold})
    return {n: str(f) for n, f in files.items()}


def configs(heads: dict[str, str]) -> dict[str, list[str]]:
    """Each configuration's heads-decode arguments, in the spelling of 0.2 (``<policy>.<setting>=``)."""
    own = ["specdecpp.k_min=1", "specdecpp.k_max=6"]
    eagle, on_eagle = f"eagle={EAGLE}", f"specdecpp.head={heads['eagle_stop']}"
    return {
        "ar": ["policy=ar"],
        "sd_k1": ["policy=sd", "sd.k=1"],
        "sd_k3": ["policy=sd", "sd.k=3"],
        "confidence_stop": ["policy=confidence_stop", "confidence_stop.k_max=6"],
        "confidence_stop_cost": ["policy=confidence_stop", "confidence_stop.stop=cost", "confidence_stop.k_max=6"],
        "topk_verify": ["policy=topk_verify", "topk_verify.k=3", "topk_verify.verify_top_k=2"],
        "fsd_js": ["policy=fsd", "fsd.k=3", "fsd.T=0.3", "fsd.divergence=js"],
        "fsd_kl_or": ["policy=fsd", "fsd.k=3", "fsd.T=0.5", "fsd.divergence=kl", "fsd.fsd_rule=or"],
        "specdecpp": ["policy=specdecpp", f"specdecpp.head={heads['specdecpp']}", *own],
        "specdecpp_cost": ["policy=specdecpp", f"specdecpp.head={heads['specdecpp']}", "specdecpp.stop=cost", *own],
        "sprinter": ["policy=sprinter", f"sprinter.head={heads['sprinter']}", "sprinter.max_run=8"],
        "judge": ["policy=judge", f"judge.head={heads['judge']}", "judge.k=3"],
        "eagle_sd": ["policy=sd", "sd.k=4", eagle],
        "eagle_stop": ["policy=specdecpp", on_eagle, *own, eagle],
        "eagle_stop_cost": ["policy=specdecpp", on_eagle, "specdecpp.stop=cost", *own, eagle],
        "eagle_tree": ["policy=tree", "tree.k=3", "tree.tree_width=2", "tree.tree_nodes=4", eagle],
        "eagle_tree_cost": ["policy=tree", "tree.k=4", "tree.tree_nodes=8", "tree.stop=cost", eagle],
        "sd_batched": ["policy=sd", "sd.k=3", "batch_size=2"],
    }


DECISIONS = ("target_calls", "drafted", "accepted", "rounds", "verifier_calls")


def run(heads: dict[str, str], max_new: int, partial: Path) -> tuple[dict, dict]:
    """Each configuration's tokens and decisions per completion; each finished configuration is kept in ``partial``
    at once, and a rerun after a failure starts from the configurations it does not hold."""
    try:  # a checkout before 0.3 (the decode front under export/); an editable install would also find the new one
        from specheads.export.decode_cli import main
    except ImportError:
        from specheads.decode.decode_cli import main

    vocab = ROOT / "runs/specdecpp_draft_quickstart-vocab/vocab.json"
    if not vocab.is_file():
        from specheads.datagen.vocab_ranking import main as vocab_main

        vocab_main(["recipe=specdecpp_draft_quickstart", f"output={vocab}"])
    kept = json.loads(partial.read_text()) if partial.is_file() else {"outputs": {}, "decisions": {}}
    results, decisions = kept["outputs"], kept["decisions"]
    with tempfile.TemporaryDirectory() as tmp:
        for name, extra in configs(heads).items():
            if name in results:
                continue
            tokens, made = [], []
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
                    *extra,
                ]
                start = time.perf_counter()
                rc = main(argv)
                if rc:
                    raise SystemExit(f"heads-decode {' '.join(argv)} exited {rc}")
                rows = [json.loads(line) for line in (out / "outputs.jsonl").read_text().splitlines() if line]
                rows.sort(key=lambda r: r["index"])
                tokens += [r["tokens"] for r in rows]
                made += [[r["stats"].get(k, 0) for k in DECISIONS] for r in rows]
                print(f"{name} set {i}: {len(rows)} prompts, {time.perf_counter() - start:.1f} s", flush=True)
            results[name], decisions[name] = tokens, made
            partial.write_text(json.dumps({"outputs": results, "decisions": decisions}))
    partial.unlink()
    return results, decisions


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
    ap.add_argument("--heads", default=str(ROOT / "runs/greedy-identity-heads"), help="where the seeded heads are")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--reference", default="", help="outputs of an older checkout to compare with")
    ap.add_argument("--out", default=str(ROOT / "bench/results/greedy_identity.json"))
    args = ap.parse_args(argv)
    heads = make_heads(Path(args.heads))
    outputs, decisions = run(heads, args.max_new_tokens, Path(args.out + ".partial"))
    report = {
        **run_info(__file__, argv, "fp32, greedy, batch 1"),
        "commit": commit(),
        "prompts": [f"{p} [{o}:{o + n}]" for p, o, n in PROMPTS],
        "max_new_tokens": args.max_new_tokens,
        "decisions_columns": list(DECISIONS),
        "outputs": outputs,
        "decisions": decisions,
    }
    status = 0
    if args.reference:
        ref = json.loads(Path(args.reference).read_text())
        report["reference"] = {k: ref[k] for k in ("command", "commit") if k in ref}
        same = {
            name: ref["outputs"][name] == toks and ref.get("decisions", {}).get(name) == decisions[name]
            for name, toks in outputs.items()
            if name in ref["outputs"]
        }
        report["identical_to_reference"] = same
        missing = sorted(set(ref["outputs"]) - set(outputs))
        print("| config | tokens and decisions identical to reference |\n|---|---|")
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
