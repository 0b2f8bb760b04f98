"""The committed EAGLE head between this toolkit and the ``speculators`` package (0.9), both ways, on the shared pair.

Run in a virtualenv with ``speculators==0.9.0`` and this package (``--no-deps``; CI's fourth step builds one), on
the target as a Hugging Face directory (``--target-hf``: the GGUF converted once, as ``bench/vllm_stop.py`` leaves it
in its work directory, ``runs/vllm_stop/target_hf``)::

    <venv>/bin/python bench/speculators_round_trip.py --target-hf DIR

1. ``ours_in_speculators``: ``recipes/heads/eagle_smollm2.safetensors`` written as ``heads-export format=speculators``
   does (with the target's embedding), loaded by speculators' own ``Eagle3DraftModel.from_pretrained``, its first
   test-time step's argmax against the toolkit's head at every position of GSM8K-test prompts and the target's
   greedy answers (``agreement``); ``without_embedding``: the same with the directory written without it (what
   ``heads-export`` wrote before 0.4: speculators' loader keeps the embedding as allocated).
2. ``theirs_here``: that model saved by speculators (its ``config.json`` without this toolkit's metadata), read by
   ``specheads.export.speculators.read``: first-step agreement with speculators' forward, and greedy decoding with it
   (``eagle=``, ``sd`` at K = 4) against the target alone (``decodes_exactly``).

Writes ``bench/results/speculators_round_trip.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target-hf", required=True, help="the shared target as a Hugging Face directory")
    ap.add_argument("--head", default=str(ROOT / "recipes/heads/eagle_smollm2.safetensors"))
    ap.add_argument("--prompts", default=str(ROOT.parent / "shared/data/gsm8k/test.jsonl"))
    ap.add_argument("--offset", type=int, default=300)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--max-new", type=int, default=64)
    ap.add_argument("--out", default=str(ROOT / "bench/results/speculators_round_trip.json"))
    args = ap.parse_args(argv)
    from importlib.metadata import version

    import torch
    from _common import run_info, write_result
    from speculators.models.eagle3 import Eagle3DraftModel

    from specheads.decode import generate
    from specheads.export import load_head, speculators
    from specheads.prompts import load_prompt_files
    from specheads.shim import GenerationStats, ModelSpec, load_pair
    from specheads.vllm.stop_check import reference_rounds

    torch.set_grad_enabled(False)
    target_dir = Path(args.target_hf)
    pair = load_pair(ModelSpec(path=str(target_dir), dtype="float32", device="cpu"), None)
    target = pair.target.model
    loaded = load_head(args.head)
    head = loaded.module.float().eval()
    prompts = load_prompt_files(args.prompts, limit=args.n, offset=args.offset)
    alone = generate(pair, prompts, "ar", max_new_tokens=args.max_new)
    from specheads.decode.api import format_prompt

    seqs = [format_prompt(pair.target.tokenizer, p, True) + r.tokens for p, r in zip(prompts, alone)]
    ours = [reference_rounds(head, target, seq, 1)[0][:, 0] for seq in seqs]
    total = sum(o.numel() for o in ours)

    def first_steps(model) -> list:
        """speculators' first test-time step at every position of every sequence, as target ids."""
        out = []
        for seq in seqs:
            ids = torch.tensor([seq])
            hs = target(ids, output_hidden_states=True).hidden_states
            aux = torch.cat([hs[j] for j in head.layer_ids], -1)
            drafts = model(
                hidden_states=aux[:, :-1], input_ids=ids[:, 1:], document_ids=torch.zeros_like(ids[:, 1:]), ttt_steps=1
            )
            out.append(head.vocab_ids[drafts[0][0]])
        return out

    def agree(a: list, b: list) -> float:
        return round(sum(int((x == y).sum()) for x, y in zip(a, b)) / total, 4)

    embed = target.get_input_embeddings().weight.detach()
    work = Path(tempfile.mkdtemp(prefix="spec-rt-"))
    with_embed = speculators.write(work / "ours", head, loaded.metadata, verifier=str(target_dir), embed=embed)
    bare = speculators.write(work / "bare", head, loaded.metadata, verifier=str(target_dir))
    model = Eagle3DraftModel.from_pretrained(str(with_embed)).float().eval()
    theirs = first_steps(model)
    zero = Eagle3DraftModel.from_pretrained(str(bare)).float().eval()
    theirs0 = first_steps(zero)
    saved = work / "theirs"
    model.save_pretrained(saved)
    cfg = json.loads((saved / "config.json").read_text())
    cfg.pop("specheads", None)  # as speculators writes a head of its own
    (saved / "config.json").write_text(json.dumps(cfg))
    head_back = speculators.read(saved).module.float().eval()
    back = [reference_rounds(head_back, target, seq, 1)[0][:, 0] for seq in seqs]
    eagle = generate(pair, prompts, "sd", eagle=str(saved), k=4, max_new_tokens=args.max_new)
    exact = [r.tokens for r in eagle] == [r.tokens for r in alone]
    per_call = GenerationStats.total([r.stats for r in eagle]).tokens_per_call
    result = {
        **run_info(__file__, argv, f"speculators {version('speculators')}"),
        "head": str(Path(args.head).relative_to(ROOT)) if Path(args.head).is_relative_to(ROOT) else args.head,
        "prompts": {
            "file": Path(args.prompts).name,
            "offset": args.offset,
            "n": args.n,
            "max_new_tokens": args.max_new,
        },
        "positions": total,
        "ours_in_speculators": {
            "agreement": agree(theirs, ours),
            "embedding_is_targets": bool(torch.equal(model.embed_tokens.weight, embed)),
        },
        "without_embedding": {"agreement": agree(theirs0, ours)},
        "theirs_here": {
            "agreement_with_speculators_forward": agree(back, theirs),
            "decodes_exactly": exact,
            "tokens_per_target_call": round(per_call, 3),
        },
    }
    print(json.dumps(result, indent=1))
    write_result(args.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
