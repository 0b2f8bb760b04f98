"""Tree drafting with an EAGLE head: the tree pass scores every path as a chain would, the kept path's cache
equals a sequential one, the tree holds the head's best paths, and decoding is the target's own (greedy)."""

from __future__ import annotations

import pytest
import torch
from test_eagle import LAYERS, eagle_head, target_model

from specheads.errors import UserError
from specheads.shim.core.sampling import SamplingConfig
from specheads.shim.core.stats import GenerationStats
from specheads.shim.costs.cost_table import CostTable
from specheads.shim.loop import tree_loop as tree_module
from specheads.shim.loop.eagle_drafter import EagleDrafter
from specheads.shim.loop.engine import Engine
from specheads.shim.loop.tree_loop import DraftTree, grow_tree
from specheads.shim.policies import EagleTree, StandardSD
from specheads.shim.runners import model_runner as kv
from specheads.shim.runners.eagle_cache import EagleCache
from specheads.shim.runners.model_runner import FusedRunner

PREFIX = [1, 7, 3, 12, 5, 9]
# S[-1] = 9; nodes: 0:(4) 1:(8) 2:(4->6) 3:(4->11) 4:(8->6) 5:(4->11->2)
TREE = DraftTree(tokens=[4, 8, 6, 11, 6, 2], parents=[-1, -1, 0, 0, 1, 3], depths=[1, 1, 2, 2, 2, 3])


def paths(tree: DraftTree) -> list[list[int]]:
    out = []
    for j in range(len(tree)):
        path, a = [], j
        while a >= 0:
            path.insert(0, tree.tokens[a])
            a = tree.parents[a]
        out.append(path)
    return out


def chain_logits(target, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    runner = FusedRunner(target, aux=LAYERS)
    logits, _ = runner.forward(torch.tensor([ids]), n_logits=1)
    return logits[0], runner.aux_states[-1]


def tree_pass(target) -> tuple[FusedRunner, int, torch.Tensor]:
    """A runner holding ``PREFIX[:-1]`` after one tree pass over ``PREFIX[-1]`` and ``TREE``: (runner, the
    prefix length, the pass's logits)."""
    runner = FusedRunner(target, aux=LAYERS)
    runner.forward(torch.tensor([PREFIX[:-1]]), n_logits=0)
    length = runner.length
    ids = torch.tensor([[PREFIX[-1], *TREE.tokens]])
    positions = torch.tensor([length, *(length + d for d in TREE.depths)])
    return runner, length, runner.forward_tree(ids, positions, TREE.mask(length))


@torch.no_grad()
def test_a_tree_pass_scores_every_path_as_its_chain():
    target = target_model()
    runner, _, logits = tree_pass(target)
    want, state = chain_logits(target, PREFIX)
    torch.testing.assert_close(logits[0], want, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(runner.aux_states[0], state, atol=1e-4, rtol=1e-4)
    for j, path in enumerate(paths(TREE)):
        want, state = chain_logits(target, PREFIX + path)
        torch.testing.assert_close(logits[1 + j], want, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(runner.aux_states[1 + j], state, atol=1e-4, rtol=1e-4)


@torch.no_grad()
def test_keeping_a_path_leaves_the_cache_of_that_chain():
    target = target_model()
    runner, length, _ = tree_pass(target)
    runner.keep(length, [0, 1, 4, 6])  # S[-1], 4, 11, 2
    assert runner.length == length + 4 and runner.aux_states.shape[0] == 4
    logits, _ = runner.forward(torch.tensor([[5]]), n_logits=1)
    want, _ = chain_logits(target, PREFIX + [4, 11, 2, 5])
    torch.testing.assert_close(logits[0], want, atol=1e-4, rtol=1e-4)


def test_the_walk_keeps_the_longest_path_the_target_agrees_with():
    top = [0] * 7
    top[0], top[1], top[4], top[6] = 4, 11, 2, 13  # rows: S[-1], then node j at 1 + j
    assert TREE.walk(top) == ([0, 3, 5], 13)
    top[0] = 8
    top[2] = 7  # node 1 (8) is kept; the target's next token (7) is no child of it
    assert TREE.walk(top) == ([1], 7)
    top[0] = 30
    assert TREE.walk(top) == ([], 30)


def test_the_mask_sees_the_prefix_and_the_ancestors_only():
    m = TREE.mask(3)
    assert m.shape == (7, 10)
    assert m[:, :4].all()  # the cached prefix and S[-1]
    assert m[6, 4:].tolist() == [True, False, False, True, False, True]  # node 5: ancestors 0, 3 and itself
    assert m[5, 4:].tolist() == [False, True, False, False, True, False]


@torch.no_grad()
@pytest.mark.parametrize("depth,width,nodes", [(3, 2, 5), (4, 3, 8), (2, 4, 20)])
def test_the_tree_holds_the_heads_best_tokens_after_each_parent(depth, width, nodes):
    """Every node is among the head's top ``width`` after its path (computed as a chain in a fresh cache), the
    tree is parent-closed and no deeper than ``depth``."""
    target, head = target_model(), eagle_head(ids=list(range(0, 40, 2)) + [3])
    seq = PREFIX
    runner = FusedRunner(target, aux=LAYERS)
    drafter = EagleDrafter(head, target, runner, StandardSD(1), GenerationStats(), None, 64)
    runner.forward(torch.tensor([seq[:-1]]), n_logits=0)
    drafter.commit(seq, [], 0)
    a = drafter.feed(seq)
    tree = grow_tree(drafter, a[0, -1], len(seq), depth, width, nodes, GenerationStats())
    assert len(tree) == min(nodes, width + (depth - 1) * width * width)
    emb = target.get_input_embeddings()
    states = runner.aux_states
    for j, path in enumerate(paths(tree)):
        p = tree.parents[j]
        assert p < j and tree.depths[j] == (1 if p < 0 else tree.depths[p] + 1) <= depth
        cache = EagleCache(head, 64, "cpu", torch.float32)
        h = cache.forward(emb(torch.tensor([seq[1:]])), head.fuse(states)[None])[:, -1:]
        for tok in path[:-1]:
            h = cache.forward(emb(torch.tensor([[tok]])), h)
        best = head.vocab_ids[head.logits(h[0, 0]).topk(width).indices].tolist()
        assert path[-1] in best


@pytest.mark.parametrize("depth,width,nodes", [(3, 2, 5), (4, 3, 8), (1, 4, 4)])
def test_tree_decoding_is_the_targets_greedy_output(depth, width, nodes):
    target = target_model()
    engine = Engine(target, eagle=eagle_head(ids=list(range(0, 40, 2)) + [2, 3]), eos_token_ids=[2])
    accepted = 0
    for prompt, mx in (([1, 4, 9], 24), ([1, 17, 3, 8, 22, 5], 31), ([1], 2), ([1, 6], 1)):
        want = engine.generate_ar(prompt, mx).tokens
        got = engine.generate(prompt, EagleTree(depth, width, nodes), mx)
        assert got.tokens == want
        s = got.stats
        assert s.drafted == s.accepted + s.discarded and s.new_tokens == len(want)
        accepted += s.accepted
    assert accepted > 0  # paths were kept, so the cache moves were exercised


def test_kept_paths_off_the_first_branch_stay_exact(monkeypatch):
    """Trees that hold the target's own continuation behind a decoy at every level (the kept path sits at
    pass rows 2, 4, 6 ...): every round keeps a deep path that is not the tree's first slots."""
    target = target_model()
    engine = Engine(target, eagle=eagle_head(ids=list(range(0, 40, 2)) + [2, 3]), eos_token_ids=[2])
    for prompt, mx in (([1, 4, 9], 24), ([1, 17, 3, 8, 22, 5], 31)):
        want = engine.generate_ar(prompt, mx).tokens

        def grow(drafter, root, n, depth, width, nodes, stats, grow_on=None, want=want, start=len(prompt)):
            tokens, parents, depths, parent = [], [], [], -1
            for d, t in enumerate(want[n - start : n - start + depth], 1):
                tokens += [(t + 1) % 40, t]
                parents += [parent, parent]
                depths += [d, d]
                parent = len(tokens) - 1
            return DraftTree(tokens, parents, depths)

        monkeypatch.setattr(tree_module, "grow_tree", grow)
        got = engine.generate(prompt, EagleTree(3, 2, 6), mx)
        assert got.tokens == want
        assert got.stats.accepted >= len(want) // 2


def test_a_cache_that_keeps_the_wrong_entries_is_caught(monkeypatch):
    """Planted bug: ``keep`` leaves the tree's first slots instead of the kept path's."""

    def keep(self, start, rows):
        self._length = start + len(rows)
        if self.aux_states is not None and self.aux_start == start:
            self.aux_states = self.aux_states[rows]

    monkeypatch.setattr(kv.FusedRunner, "keep", keep)
    with pytest.raises(AssertionError):
        test_kept_paths_off_the_first_branch_stay_exact(monkeypatch)


def test_tree_settings_and_limits_are_user_errors():
    target = target_model()
    with pytest.raises(UserError, match="width=0"):
        EagleTree(3, 0, 8)
    with pytest.raises(UserError, match="EAGLE head"):
        Engine(target).generate([1, 4], EagleTree(), 8)
    engine = Engine(target, eagle=eagle_head())
    with pytest.raises(UserError, match="greedy only"):
        engine.generate([1, 4], EagleTree(), 8, SamplingConfig(do_sample=True, temperature=1.0))


def test_the_cost_aware_size_maximises_expected_tokens_per_ms():
    table = CostTable(t_draft_ms=1.0, t_target_ms=[10.0, 10.5, 11.0, 11.5, 14.0, 20.0, 30.0, 40.0, 50.0])
    tree = EagleTree(4, 3, 8, stop="cost", costs=table)
    probs = [0.9, 0.8, 0.5, 0.3, 0.2, 0.1, 0.05, 0.01]
    rates = [(1 + sum(probs[:n])) / (3.0 + table.t_target(n + 1)) for n in range(1, 9)]
    assert tree.tree_size(probs, 3) == 1 + max(range(8), key=rates.__getitem__) == 3
    assert tree.tree_size([0.01] * 8, 3) == 1  # at least one token
    assert EagleTree(4, 3, 8).tree_size(probs, 3) == 8 and EagleTree(4, 3, 8).tree_size(probs[:5], 3) == 5
    with pytest.raises(UserError, match="cost table"):
        EagleTree(4, 3, 8, stop="cost")
    # a level is drafted while what it can add (the frontier's path probabilities) pays for its step
    ms = (3.0 + table.t_target(4)) / (1 + sum(probs[:3]))
    assert tree.grow_on(probs, [0.5, 0.3], 3) == ((0.5 + 0.3) * ms > 1.0) is True
    assert tree.grow_on(probs, [0.01, 0.005], 3) is False
    assert EagleTree(4, 3, 8).grow_on(probs, [0.0], 3) is True


def test_cost_sized_trees_are_the_targets_greedy_output():
    table = CostTable(t_draft_ms=0.5, t_target_ms=[4 + 0.5 * k for k in range(1, 12)])
    engine = Engine(target_model(), eagle=eagle_head(ids=list(range(0, 40, 2)) + [2, 3]), eos_token_ids=[2])
    sizes = set()
    for prompt in ([1, 4, 9], [1, 17, 3, 8, 22, 5]):
        got = engine.generate(prompt, EagleTree(4, 3, 10, stop="cost", costs=table), 24)
        assert got.tokens == engine.generate_ar(prompt, 24).tokens
        sizes |= set(got.stats.target_pass_sizes)
    assert len(sizes) > 2  # the rounds' trees differ in size
