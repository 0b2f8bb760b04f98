"""Tree drafting with an EAGLE head (EAGLE-2's dynamic draft tree; docs/algorithms/trees.md).

A round grows a tree of continuations instead of one chain: the head's top ``width`` tokens at the root,
then, ``k - 1`` times, the head one forward over the ``width`` best leaves so far (best = largest product of
the head's probabilities along the path) and their top ``width`` children each. The ``nodes`` best of all
drafted tokens (an ancestor always scores at least as high as its descendants, so they form a tree) go to the
target in one pass under a tree attention mask; the longest path whose every token is the target's argmax
after its parent is kept, then the target's token after it. Greedy only: the output is the target's own.
The loop that runs it is :mod:`specheads.shim.loop.tree_loop`.
"""

from __future__ import annotations

from dataclasses import dataclass

from specheads.shim.costs.cost_table import CostTable
from specheads.shim.policies.base import Policy
from specheads.shim.policies.baselines import STOP, cost_problems
from specheads.shim.policies.settings import UNSET, Check, K, Settings, settle


@dataclass
class TreeSettings(Settings):
    k: int = 4
    tree_width: int = 3
    tree_nodes: int = 8
    stop: str = "threshold"
    CHECKS = {
        "k": K,
        "tree_width": Check(lambda w: w >= 1, "{key}={value} must be >= 1 (children per expanded node)"),
        "tree_nodes": Check(lambda n: n >= 1, "{key}={value} must be >= 1 (draft tokens the target verifies)"),
        "stop": STOP,
    }


class EagleTree(Policy):
    """Greedy tree speculative decoding with an EAGLE head (the engine's ``eagle=``); lossless.

    Args:
        k: the tree's depth (longest path, candidates).
        width: children per expanded node and leaves expanded per level.
        nodes: draft tokens per round the target verifies (the tree's size; with ``stop="cost"`` the most).
        stop: ``threshold``: ``k`` levels and ``nodes`` tokens every round (EAGLE-2); ``cost``: per round, the
            size that maximises the expected tokens per ms, ``(1 + sum of the kept tokens' path probabilities) /
            (the round's draft steps + t_t(1 + size))``, from the head's probabilities and the cost table
            ``costs``, and a further level only while it can pay for its step (:meth:`grow_on`).
        costs: the pair's :class:`~..costs.CostTable` with the EAGLE head's step (``stop="cost"``).
    """

    name = "tree"
    Settings = TreeSettings
    tree = True
    models = ("target",)

    def __init__(
        self,
        k: int = UNSET,
        width: int = UNSET,
        nodes: int = UNSET,
        stop: str = UNSET,
        costs: CostTable | None = None,
        *,
        settings: TreeSettings | None = None,
    ):
        given = {"k": k, "tree_width": width, "tree_nodes": nodes, "stop": stop}
        keys = {"tree_width": "width", "tree_nodes": "nodes"}
        s = self.settings = settle(TreeSettings, settings, given, lambda s: cost_problems(s.stop, costs), keys)
        super().__init__(s.k)
        self.width, self.nodes, self.stop, self.costs = s.tree_width, s.tree_nodes, s.stop, costs

    @classmethod
    def from_settings(cls, s, pair=None, head=None, costs=None) -> Policy:
        return cls(costs=costs, settings=s)

    def max_candidates(self) -> int:
        return self.nodes

    def tree_size(self, probs: list[float], levels: int) -> int:
        """How many of the drafted tokens (path probabilities ``probs``, best first; ``levels`` draft forwards
        this round) the target verifies."""
        most = min(self.nodes, len(probs))
        if self.stop != "cost":
            return most
        costs = self.costs
        assert costs is not None  # stop="cost" is checked to come with a table
        drafted = levels * costs.t_draft_ms
        best, size, expected = 0.0, 1, 1.0
        for n in range(1, most + 1):
            expected += probs[n - 1]
            rate = expected / (drafted + costs.t_target(n + 1))
            if rate > best:
                best, size = rate, n
        return size

    def grow_on(self, probs: list[float], frontier: list[float], levels: int) -> bool:
        """Whether to draft one more level (``stop="cost"``): the tokens it could add, at most the path
        probabilities of the ``frontier`` it expands (a node's children share its probability), must be worth
        more than its step at the round's current ms per expected token (best size so far, ``probs`` best
        first, ``levels`` drafted)."""
        costs = self.costs
        if self.stop != "cost" or costs is None:
            return True
        n = self.tree_size(probs, levels)
        expected = 1 + sum(probs[:n])
        ms_per_token = (levels * costs.t_draft_ms + costs.t_target(n + 1)) / expected
        return sum(frontier) * ms_per_token > costs.t_draft_ms
