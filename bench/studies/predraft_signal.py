"""Is there a signal, before the draft runs, that its next token will be accepted?

For each prompt the target writes its greedy answer; the draft, teacher-forced on it, gives its
greedy agreement at every position. For position ``i + 1`` this reports the AUC of two things known
before the draft forward that proposes it: the target's top probability at position ``i`` and
whether the draft agreed at ``i``; and, for comparison, the target's top probability at ``i + 1``
itself (not known in advance). An AUC near 0.5 means a rule deciding whether to draft at all can
only go by the prompt's recent rounds (``DraftGate``). Greedy, fp32, the draft pruned as our rows.

    python bench/studies/predraft_signal.py          # MT-Bench 40-55, Alpaca 4500-4515, GSM8K-test 600-615

Writes ``bench/studies/results/predraft_signal.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
from sklearn.metrics import roc_auc_score

from specheads.decode.api import format_prompt
from specheads.evaluate.oracle import draft_agreement
from specheads.prompts import load_prompts
from specheads.shim.loop.engine import Engine

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))  # _common, beside the benchmarks
from _common import run_info, shared_pair  # noqa: E402

SHARED = Path(os.environ.get("SPECHEADS_SHARED", ROOT.parent / "shared"))
SETS = {
    "mt_bench": ("data/mt_bench/question.jsonl", 40),
    "alpaca": ("data/alpaca/alpaca_5000.json", 4500),
    "gsm8k": ("data/gsm8k/test.jsonl", 600),
}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=16, help="prompts per set")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--vocab", default=str(ROOT / "runs/specdecpp_draft_quickstart-vocab/vocab.json"))
    ap.add_argument("--draft-top-n", type=int, default=8192)
    ap.add_argument("--out", default=str(ROOT / "bench/studies/results/predraft_signal.json"))
    args = ap.parse_args(argv)
    pair = shared_pair(SHARED, args.vocab, args.draft_top_n)
    engine = Engine(pair.target.model, pair.draft.model, pair.eos_token_ids)
    rows = {}
    print("| set | positions | agreement | AUC target p_max(i) | AUC agreed(i) | AUC target p_max(i+1), not known |")
    print("|---|---|---|---|---|---|")
    for name, (path, offset) in SETS.items():
        feats, labels = [], []
        for p in load_prompts(str(SHARED / path), limit=args.n, offset=offset):
            ids = format_prompt(pair.tokenizer, p)
            out = engine.generate_ar(ids, args.max_new_tokens).tokens
            agree = draft_agreement(pair.draft.model, ids, out)
            with torch.inference_mode():
                logits = pair.target.model(torch.tensor([ids + out])).logits[0, len(ids) - 1 : len(ids) + len(out) - 1]
            pmax = logits.float().softmax(-1).max(-1).values.tolist()
            for i in range(len(out) - 1):
                feats.append((pmax[i], float(agree[i]), pmax[i + 1]))
                labels.append(int(agree[i + 1]))
        cols = list(zip(*feats))
        row = {
            "positions": len(labels),
            "agreement": round(sum(labels) / len(labels), 4),
            "auc_target_pmax_before": round(roc_auc_score(labels, cols[0]), 4),
            "auc_agreed_before": round(roc_auc_score(labels, cols[1]), 4),
            "auc_target_pmax_same_position": round(roc_auc_score(labels, cols[2]), 4),
            "prompts": f"{path} [{offset}:{offset + args.n}]",
        }
        rows[name] = row
        print(
            f"| {name} | {row['positions']} | {row['agreement']} | {row['auc_target_pmax_before']} | "
            f"{row['auc_agreed_before']} | {row['auc_target_pmax_same_position']} |",
            flush=True,
        )
    Path(args.out).write_text(
        json.dumps(
            {
                **run_info(__file__, argv, "fp32, greedy, batch 1"),
                "max_new_tokens": args.max_new_tokens,
                "draft_top_n": args.draft_top_n,
                "sets": rows,
            },
            indent=1,
        )
        + "\n"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
