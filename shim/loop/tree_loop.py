"""The decoding loop of tree drafting (:class:`~.policies.tree_policy.EagleTree`): an EAGLE head grows a draft tree,
the target verifies it in one pass under a tree attention mask, the longest path it agrees with is kept.

Cache invariant as in :mod:`.engine`: between rounds the target holds ``S[:-1]`` and the head the entries its
target states fed. A round with ``L = len(S) - 1``:

1. the head feeds the target states of the last pass (:meth:`.eagle_drafter.EagleDrafter.feed`), its last state
   scoring ``x_N``; it grows the tree (:func:`grow_tree`), each level one forward whose entries sit after the
   fed ones (the next round's feed cuts them off);
2. the target consumes ``S[-1]`` and the tree's tokens in one pass (:meth:`.model_runner.FusedRunner.forward_tree`):
   ``S[-1]`` at slot ``L``, node ``j`` at ``L + 1 + j``, rotary position ``L + depth``;
3. greedy walk: from ``S[-1]``, the child whose token is the target's argmax, as long as there is one; the
   target's argmax after the last kept node is the round's own token;
4. the target's cache keeps ``S[-1]`` and the kept path, moved to ``L, L + 1, ...``
   (:meth:`.model_runner.FusedRunner.keep`); their states are what the head feeds next round.

The first round (no target states yet) and a round with one token left are a plain target pass.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

from specheads.errors import UserError
from specheads.shim.core.sampling import SamplingConfig
from specheads.shim.core.stats import GenerationStats, count_tokens
from specheads.shim.loop.eagle_drafter import EagleDrafter
from specheads.shim.loop.rounds import Result, commit_round, emit
from specheads.shim.policies import Verdict
from specheads.shim.runners.fused import supports
from specheads.shim.runners.model_runner import make_runner


@dataclass
class DraftTree:
    """A draft tree, parents before children: node ``j``'s target token, parent (-1: the root, i.e. after
    ``S``) and depth (1 = a candidate for ``x_N``)."""

    tokens: list[int]
    parents: list[int]
    depths: list[int]

    def __len__(self) -> int:
        return len(self.tokens)

    def mask(self, prefix: int) -> torch.Tensor:
        """The target pass's attention mask ``[1 + n, prefix + 1 + n]``: row 0 is ``S[-1]`` (slot ``prefix``),
        row ``1 + j`` node ``j``; each sees the cached prefix, ``S[-1]``, its ancestors and itself."""
        n = len(self)
        mask = torch.zeros(1 + n, prefix + 1 + n, dtype=torch.bool)
        mask[:, : prefix + 1] = True
        for j, p in enumerate(self.parents):
            row = 1 + j
            if p >= 0:
                mask[row, prefix + 1 :] = mask[1 + p, prefix + 1 :]
            mask[row, prefix + row] = True
        return mask

    def walk(self, top: list[int]) -> tuple[list[int], int]:
        """The greedy verdict from the target's argmax ``top`` at each pass row (``1 + n``): the kept nodes
        (a path from the root) and the target's token after them."""
        children: dict[tuple[int, int], int] = {}
        for j, (t, p) in enumerate(zip(self.tokens, self.parents)):
            children.setdefault((p, t), j)
        path, cur = [], -1
        while (nxt := children.get((cur, top[1 + cur]))) is not None:
            path.append(nxt)
            cur = nxt
        return path, top[1 + cur]


def grow_tree(
    drafter: EagleDrafter,
    root: torch.Tensor,
    n: int,
    depth: int,
    width: int,
    nodes,
    stats: GenerationStats,
    grow_on=None,
) -> DraftTree:
    """EAGLE-2's dynamic tree from the head's state ``root`` ``[d]`` (the one that scores ``x_N``; ``n = |S|``).

    Every drafted token scores the sum of the head's log-probabilities along its path. Level 1 is the head's
    top ``width`` at the root; each further level (up to ``depth``) feeds the ``width`` best tokens of the level
    before (one forward: each entry attends to the fed prefix, its ancestors and itself) and drafts their top
    ``width`` children. The ``nodes`` best tokens of all levels form the tree (a parent scores at least as high
    as its children and wins ties, so every chosen token's ancestors are chosen). ``nodes`` may be a callable:
    given the path probabilities of all drafted tokens, best first, and the levels drafted, it returns how many
    to keep (:meth:`~.policies.tree.EagleTree.tree_size`). ``grow_on`` (optional), given those and the path
    probabilities of the tokens the next level would expand, says whether to draft it
    (:meth:`~.policies.tree.EagleTree.grow_on`).
    """
    head, cache, vocab = drafter.head, drafter.cache, drafter.vocab
    dtype = cache.dtype
    lp = torch.log_softmax(head.logits(root).float(), dim=-1)
    val, idx = lp.topk(min(width, lp.shape[-1]))
    scores, toks = val.tolist(), idx.tolist()  # per drafted token: its path score, pruned id, parent, depth
    parents, depths = [-1] * len(toks), [1] * len(toks)
    level = list(range(len(toks)))
    slot: dict[int, int] = {}  # drafted token -> its entry in the head's cache
    states: dict[int, torch.Tensor] = {-1: root}
    fed = cache.length
    for d in range(2, depth + 1):
        grow = sorted(level, key=lambda j: -scores[j])[:width]
        if grow_on is not None and not grow_on(
            sorted((math.exp(x) for x in scores), reverse=True), [math.exp(scores[j]) for j in grow], d - 1
        ):
            break
        base = cache.length
        mask = torch.zeros(len(grow), base + len(grow), dtype=torch.bool)
        mask[:, :fed] = True
        for row, j in enumerate(grow):
            a = parents[j]
            while a >= 0:
                mask[row, slot[a]] = True
                a = parents[a]
            mask[row, base + row] = True
            slot[j] = base + row
        ids = vocab[torch.tensor([toks[j] for j in grow])].to(drafter.device)
        emb = drafter.embed(ids)[None].to(dtype)
        h = torch.stack([states[parents[j]] for j in grow])[None]
        positions = torch.full((len(grow),), n - 3 + d, device=drafter.device)
        count_tokens(stats, "draft", base, len(grow))
        out = cache.forward_tree(emb, h, positions, mask)[0]
        drafter.forwards += 1
        for row, j in enumerate(grow):
            states[j] = out[row]
        lp = torch.log_softmax(head.logits(out).float(), dim=-1)
        val, idx = lp.topk(min(width, lp.shape[-1]), dim=-1)
        level = []
        for row, j in enumerate(grow):
            for v, t in zip(val[row].tolist(), idx[row].tolist()):
                level.append(len(toks))
                scores.append(scores[j] + v)
                toks.append(t)
                parents.append(j)
                depths.append(d)
    best = sorted(range(len(toks)), key=lambda j: (-scores[j], depths[j]))
    if callable(nodes):
        nodes = nodes([math.exp(scores[j]) for j in best], max(depths))
    keep = sorted(best[:nodes], key=lambda j: (depths[j], -scores[j]))
    new = {j: i for i, j in enumerate(keep)}
    ids = vocab[torch.tensor([toks[j] for j in keep])].tolist()
    return DraftTree(ids, [new[parents[j]] if parents[j] >= 0 else -1 for j in keep], [depths[j] for j in keep])


def tree_problems(has_eagle: bool, sampling: SamplingConfig, fused: bool = True) -> list[str]:
    """Why tree drafting cannot run with these settings (empty: it can)."""
    out = []
    if not has_eagle:
        out.append("policy=tree drafts with an EAGLE head: set eagle=<an exported EAGLE head>")
    if sampling.do_sample:
        out.append(
            "policy=tree is greedy only (its tree keeps the head's top tokens, not draws); for sampling use "
            "policy=sd, specdecpp or confidence_stop with the EAGLE head"
        )
    if not fused:
        out.append("policy=tree runs on the fused forward (fused_forward=true)")
    return out


def tree_target_problem(engine) -> str | None:
    """Why the target cannot verify trees (None: it can): trees run on the fused forward only, which needs a
    Llama-family target on one device (a GPU too: the tree's runner uses it there without opting in)."""
    if not engine.fused:
        return "fused_forward=false"
    why = supports(engine.target)
    return None if why is None else f"{why} (trees need a Llama-family target on one device)"


def generate_tree(engine, prompt_ids: list[int], policy, max_new_tokens: int, sampling: SamplingConfig, on_tokens=None):
    """:meth:`.engine.Engine.generate` for a tree policy (see the module's docstring)."""
    problems = tree_problems(engine.eagle is not None, sampling, engine.fused)
    if problems:
        raise UserError("; ".join(problems))
    start = time.perf_counter()
    stats = GenerationStats(prompt_tokens=len(prompt_ids))
    cap = len(prompt_ids) + max_new_tokens + policy.nodes + 2
    runner = make_runner(engine.target, None, engine.vocab_size, cap, engine.fused, engine.eagle.layer_ids, tree=True)
    if not hasattr(runner, "forward_tree"):
        runner.close()
        raise UserError(f"policy=tree runs on the fused forward (fused_forward=true): {tree_target_problem(engine)}")
    drafter = EagleDrafter(engine.eagle, engine.target, runner, policy, stats, None, cap)
    policy.reset()
    seq, out = list(prompt_ids), []  # type: list[int], list[int]
    try:
        while len(out) < max_new_tokens:
            remaining = max_new_tokens - len(out)
            a = drafter.feed(seq) if remaining > 1 else None
            depth = min(policy.k, remaining - 1)
            tree = (
                grow_tree(drafter, a[0, -1], len(seq), depth, policy.width, policy.tree_size, stats, policy.grow_on)
                if a is not None
                else None
            )
            length = runner.length
            if tree is None:
                ids = torch.tensor([seq[length:]], device=runner.device)
                _pass_counts(stats, runner, ids.shape[1])
                logits, _ = runner.forward(ids, n_logits=1)
                path: list[int] = []
                token = int(logits[0].argmax())
            else:
                ids = torch.tensor([[seq[-1], *tree.tokens]], device=runner.device)
                positions = torch.tensor([length, *(length + d for d in tree.depths)], device=runner.device)
                _pass_counts(stats, runner, ids.shape[1])
                logits = runner.forward_tree(ids, positions, tree.mask(length))
                path, token = tree.walk(logits.argmax(-1).tolist())
                runner.keep(length, [0, *(1 + j for j in path)])
            cand = torch.tensor([tree.tokens[j] for j in path] if tree is not None else [], dtype=torch.long)
            new = commit_round(stats, engine.eos, cand, Verdict(len(path), token), remaining)
            if tree is not None:  # the tree's other tokens were drafted and discarded too
                stats.drafted += len(tree) - len(path)
                stats.discarded += len(tree) - len(path)
            policy.end_round(len(tree) if tree is not None else 0, len(path))
            emit(seq, out, new, on_tokens)
            if stats.eos:
                break
            runner.trim(len(seq) - 1)
            drafter.commit(seq, new, min(len(path), len(new)))
    finally:
        runner.close()
    stats.new_tokens = len(out)
    stats.draft_forwards = drafter.forwards
    stats.fold(policy.counters())
    stats.wall_time = time.perf_counter() - start
    return Result(out, stats, policy.trace())


def _pass_counts(stats: GenerationStats, runner, size: int) -> None:
    """Counts one target pass of ``size`` tokens after the cached prefix (as :meth:`.engine.Engine._pass`)."""
    count_tokens(stats, "target", runner.length, size)
    k = size - max(0, stats.prompt_tokens - 1 - runner.length)
    stats.target_pass_sizes[k] = stats.target_pass_sizes.get(k, 0) + 1
    stats.target_calls += 1
