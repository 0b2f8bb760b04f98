"""The row proposer's matching of vLLM's batch rows to its cache slots, at B rows of L tokens (no draft forward).

Every slot holds a running request's cache, as after a step; the rows then come back shuffled, each grown by its
accepted candidates and one token. Times :meth:`RowProposer._assign` (prefix hashes, a dictionary lookup, one exact
check per row) and, for scale, the pairwise comparisons the matching before it made (a common prefix for every row
with every slot, twice), and counts the row-slot comparisons each makes.

    python bench/studies/row_matching.py                  # B = 256, L = 2000 (the issue's figure), 5 repeats
    python bench/studies/row_matching.py --rows 64 --length 500
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import numpy as np
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from specheads.shim.batching.row_proposer import RowProposer, common_prefix
from specheads.shim.policies import StandardSD


def state(rows: int, length: int, seed: int = 0):
    """A proposer whose slots hold ``rows`` requests of ``length`` tokens, and those requests one step later."""
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)
    proposer = RowProposer(LlamaForCausalLM(cfg).eval(), StandardSD(4), rows, capacity=8)
    rng = np.random.default_rng(seed)
    system = rng.integers(3, 512, size=length // 4)  # a shared system prompt
    nxt = []
    for s in range(rows):
        seq = np.concatenate([system, rng.integers(3, 512, size=length - len(system))])
        cand = [int(t) for t in rng.integers(3, 512, size=4)]
        proposer.held[s], proposer.seen[s], proposer.offered[s] = seq[:-1], seq, cand
        proposer.key[s] = (len(seq), int(proposer.hasher.of(seq)[-1]))
        accepted = int(rng.integers(0, 5))
        nxt.append(np.concatenate([seq, cand[:accepted], [7]]))
    order = list(range(rows))
    random.Random(seed).shuffle(order)
    return proposer, {row: nxt[j] for row, j in enumerate(order)}


def pairwise(proposer, rows) -> int:
    """The earlier matching's comparisons: every row with every slot's cache and last sequence."""
    n = 0
    for seq in rows.values():
        for s in range(len(proposer.held)):
            common_prefix(seq, proposer.held[s])
            v = proposer.seen[s]
            if len(seq) >= len(v):
                common_prefix(seq, v)
            n += 2
    return n


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--length", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    ours, theirs, compared, pairs = [], [], 0, 0
    for r in range(args.repeats):
        proposer, rows = state(args.rows, args.length, seed=r)
        t = time.perf_counter()
        slot_of, _ = proposer._assign(rows)
        ours.append(time.perf_counter() - t)
        compared = proposer.stats["compared"]
        assert all(np.array_equal(rows[i][: len(proposer.seen[s])], proposer.seen[s]) for i, s in slot_of.items())
        proposer, rows = state(args.rows, args.length, seed=r)
        t = time.perf_counter()
        pairs = pairwise(proposer, rows)
        theirs.append(time.perf_counter() - t)
    print(
        f"B={args.rows} L={args.length}: matching {statistics.median(ours) * 1000:.1f} ms, {compared} comparisons "
        f"(every row found its slot); pairwise {statistics.median(theirs) * 1000:.1f} ms, {pairs} comparisons "
        f"(medians of {args.repeats}, torch {torch.__version__}, {torch.get_num_threads()} threads)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
