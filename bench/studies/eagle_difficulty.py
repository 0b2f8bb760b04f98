"""Why an EAGLE head accepts less on one prompt set than another: its first draft step against the target's
greedy token, binned by the target's own confidence.

    python bench/studies/eagle_difficulty.py --eagle recipes/heads/eagle_smollm2.safetensors --mtbench-n 80

For each set (GSM8K-test, MT-Bench first turns, held-out Alpaca rows) the target writes its greedy response
(128 new tokens, batch 1, the chat template; the shim's target-alone decoding, as ``draft_head.py``'s ``ar``
row). One teacher-forced pass over prompt + response then gives, at every response position, the target's
greedy token and its probability ``p_top1``; the head's first draft step at that position
(``datagen.mining.eagle_predict``: the target's states up to the position, the head's causal pass over them, as
the drafter's cache fills) gives its token. Positions are binned by ``p_top1`` (``--bins``); each bin reports
its share of the set's positions and the head's agreement there.

Two figures split a gap between sets into its causes. ``agreement_at_mix_of[A]`` of set B is B's per-bin
agreement weighted by A's bin shares: what B's agreement would be if its text were as confident as A's. If
MT-Bench at GSM8K's mix comes close to GSM8K's agreement, the head is as good on MT-Bench's text as on GSM8K's
at equal confidence, and the gap is the target's text (more positions where the target itself hesitates); if
not, the head has learnt MT-Bench's kind of text less well. MT-Bench rows also report per category.

Each set also reports ``outside_vocab_share``, the share of the target's greedy tokens outside the head's pruned
output layer (no draft step can propose them), and ``agreement_in_vocab``. ``--ranking DIR,...`` (``labels=drafter``
outputs) counts the target's response tokens there and adds the share outside the top N of that count for a few N:
what a larger output layer would reach.

No timing: the figures do not depend on the CPU. Writes ``bench/studies/results/eagle_difficulty.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

from specheads.datagen.mining import eagle_predict
from specheads.decode.api import format_prompt, load_eagle
from specheads.prompts import load_prompts
from specheads.shim.loop.engine import Engine

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))  # _common, beside the benchmarks
from _common import run_info, shared_pair  # noqa: E402

SHARED = Path(os.environ.get("SPECHEADS_SHARED", str(ROOT.parent / "shared")))


@torch.inference_mode()
def score(model, predict, ids: list[int], response: list[int]) -> tuple[list[float], list[bool], list[int]]:
    """Per response position: the target's ``p_top1``, whether the head's first step gives its greedy token, and
    that token."""
    seq = ids + response
    logits = model(input_ids=torch.tensor([seq], device=model.device), use_cache=False).logits[0].float()
    positions = list(range(len(ids), len(seq)))
    probs = logits[[p - 1 for p in positions]].softmax(-1)
    p_top1, greedy = probs.max(-1)
    head = predict([seq], [positions])[0]
    return p_top1.tolist(), [h == g for h, g in zip(head, greedy.tolist())], greedy.tolist()


def ranking(dirs: str) -> list[int]:
    """Token ids by their count in the responses of ``labels=drafter`` output directories, most frequent first."""
    from collections import Counter

    import pyarrow.parquet as pq

    from specheads.dataset import chunk_files

    counts = Counter()
    for d in [x for x in dirs.split(",") if x]:
        files = chunk_files(Path(d))
        if not files:
            raise SystemExit(f"--ranking {d}: no datagen chunks there")
        for f in files:
            for row in pq.read_table(str(f), columns=["input_ids", "response_start"]).to_pylist():
                counts.update(row["input_ids"][row["response_start"] :])
    return [t for t, _ in counts.most_common()]


def vocab_figures(tokens: list[int], agree: list[bool], vocab: set[int], ranked: list[int] | None) -> dict:
    """The share of ``tokens`` outside the head's vocabulary, the agreement inside it, and (``ranked``) the share
    outside the top N of the ranking for a few N."""
    inside = [a for t, a in zip(tokens, agree) if t in vocab]
    out = {
        "outside_vocab_share": round(1 - len(inside) / len(tokens), 4) if tokens else None,
        "agreement_in_vocab": round(sum(inside) / len(inside), 4) if inside else None,
    }
    if ranked is not None and tokens:
        tops = {n: set(ranked[:n]) for n in SIZES}
        out["outside_top_n_share"] = {n: round(sum(t not in tops[n] for t in tokens) / len(tokens), 4) for n in SIZES}
    return out


SIZES = (8192, 16384, 24576, 32768)


def summarise(p: list[float], agree: list[bool], edges: list[float]) -> dict:
    """Shares and agreement per ``p_top1`` bin (``[edges[i], edges[i + 1])``, the last one closed)."""
    n = len(p)
    bins = []
    for lo, hi in zip(edges[:-1], edges[1:]):
        idx = [i for i, x in enumerate(p) if lo <= x < hi or (hi == edges[-1] and x == hi)]
        bins.append(
            {
                "p_top1": [lo, hi],
                "positions": len(idx),
                "share": round(len(idx) / n, 4) if n else None,
                "agreement": round(sum(agree[i] for i in idx) / len(idx), 4) if idx else None,
            }
        )
    return {
        "positions": n,
        "agreement": round(sum(agree) / n, 4) if n else None,
        "mean_p_top1": round(sum(p) / n, 4) if n else None,
        "bins": bins,
    }


def at_mix(of: dict, mix: dict) -> float | None:
    """``of``'s per-bin agreement weighted by ``mix``'s bin shares (bins empty in ``of`` but not in ``mix``: None)."""
    total = 0.0
    for a, m in zip(of["bins"], mix["bins"]):
        if m["share"]:
            if a["agreement"] is None:
                return None
            total += a["agreement"] * m["share"]
    return round(total, 4)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--eagle", default=str(ROOT / "recipes/heads/eagle_smollm2.safetensors"))
    ap.add_argument("--gsm8k-n", type=int, default=32)
    ap.add_argument("--mtbench-n", type=int, default=80)
    ap.add_argument("--alpaca-n", type=int, default=16)
    ap.add_argument("--alpaca-offset", type=int, default=4000)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--bins", default="0,0.3,0.5,0.7,0.9,1", help="p_top1 bin edges, from 0 to 1")
    ap.add_argument("--ranking", default="", help="labels=drafter output dirs, comma-separated: coverage at top N")
    ap.add_argument("--out", default=str(ROOT / "bench/studies/results/eagle_difficulty.json"))
    args = ap.parse_args(argv)
    edges = [float(x) for x in args.bins.split(",")]
    if edges[0] != 0 or edges[-1] != 1 or edges != sorted(edges) or len(set(edges)) != len(edges):
        ap.error(f"--bins {args.bins!r}: increasing edges from 0 to 1")
    if not Path(args.eagle).is_file():
        ap.error(f"--eagle {args.eagle}: no such file")
    torch.manual_seed(0)
    pair = shared_pair(SHARED, "", 0)
    eagle = load_eagle(args.eagle, pair)
    model, tok = pair.target.model, pair.tokenizer
    engine = Engine(model, eos_token_ids=pair.eos_token_ids)  # the benchmarks' greedy target-alone decoding
    vocab, ranked = set(eagle.module.vocab_ids.tolist()), ranking(args.ranking) if args.ranking else None
    predict = eagle_predict(model, eagle.module, tok.pad_token_id if tok.pad_token_id is not None else 0)
    mt_file = SHARED / "data/mt_bench/question.jsonl"
    categories = [json.loads(line).get("category", "") for line in mt_file.read_text().splitlines() if line.strip()]
    sets = {
        "gsm8k": load_prompts(str(SHARED / "data/gsm8k/test.jsonl"), limit=args.gsm8k_n),
        "mtbench": load_prompts(str(mt_file), limit=args.mtbench_n),
        "alpaca": load_prompts(
            str(SHARED / "data/alpaca/alpaca_5000.json"), limit=args.alpaca_n, offset=args.alpaca_offset
        ),
    }
    results, per_category = {}, {}
    for label, prompts in sets.items():
        ps, ag, gs = [], [], []
        for i, prompt in enumerate(prompts):
            ids = format_prompt(tok, prompt)
            p, a, g = score(model, predict, ids, engine.generate_ar(ids, args.max_new_tokens).tokens)
            ps += p
            ag += a
            gs += g
            if label == "mtbench":
                cat = per_category.setdefault(categories[i], ([], []))
                cat[0].extend(p)
                cat[1].extend(a)
            print(f"{label} {i + 1}/{len(prompts)}", file=sys.stderr)
        results[label] = summarise(ps, ag, edges) | vocab_figures(gs, ag, vocab, ranked)
    mix = {
        b: {a: at_mix(results[b], results[a]) for a in results if a != b} for b in results
    }  # mix[B][A]: B's agreement at A's confidence mix
    for b in results:
        results[b]["agreement_at_mix_of"] = mix[b]
    result = {
        **run_info(__file__, argv, "fp32, batch 1, greedy, teacher-forced first draft step"),
        "eagle_head": args.eagle,
        "ranking": args.ranking or None,
        "max_new_tokens": args.max_new_tokens,
        "prompts": {
            "gsm8k": f"test[0:{args.gsm8k_n}]",
            "mtbench": f"first turns [0:{args.mtbench_n}]",
            "alpaca": f"alpaca_5000[{args.alpaca_offset}:{args.alpaca_offset + args.alpaca_n}]",
        },
        "sets": results,
        "mtbench_categories": {c: summarise(p, a, edges) for c, (p, a) in per_category.items()},
    }
    print("set | positions | agreement | mean p_top1 | " + " | ".join(f"share/agree p<{hi}" for hi in edges[1:]))
    for label, r in results.items():
        cells = " | ".join(f"{b['share']}/{b['agreement']}" for b in r["bins"])
        print(f"{label} | {r['positions']} | {r['agreement']} | {r['mean_p_top1']} | {cells}")
        print(
            f"  outside the head's vocabulary {r['outside_vocab_share']}, agreement inside it "
            f"{r['agreement_in_vocab']}, outside the top N {r.get('outside_top_n_share')}"
        )
    print("agreement at another set's confidence mix:", json.dumps(mix))
    for c, r in result["mtbench_categories"].items():
        print(f"mtbench/{c} | {r['positions']} | {r['agreement']} | {r['mean_p_top1']}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
