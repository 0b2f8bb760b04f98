"""Tree drafting with an EAGLE head (EAGLE-2's dynamic draft tree; ALGORITHMS.md section 0, greedy SD).

A round grows a tree of continuations instead of one chain: the head's top ``width`` tokens at the root,
then, ``k - 1`` times, the head one forward over the ``width`` best leaves so far (best = largest product of
the head's probabilities along the path) and their top ``width`` children each. The ``nodes`` best of all
drafted tokens (an ancestor always scores at least as high as its descendants, so they form a tree) go to the
target in one pass under a tree attention mask; the longest path whose every token is the target's argmax
after its parent is kept, then the target's token after it. Greedy only: the output is the target's own.
The loop that runs it is :mod:`specheads.export.shim.tree`.
"""

from __future__ import annotations

from dataclasses import dataclass

from .base import Policy
from .settings import Check, K, Settings


@dataclass
class TreeSettings(Settings):
    k: int = 4
    tree_width: int = 3
    tree_nodes: int = 8
    CHECKS = {"k": K,
              "tree_width": Check(lambda w: w >= 1, "{key}={value} must be >= 1 (children per expanded node)"),
              "tree_nodes": Check(lambda n: n >= 1, "{key}={value} must be >= 1 (draft tokens the target verifies)")}


class EagleTree(Policy):
    """Greedy tree speculative decoding with an EAGLE head (the engine's ``eagle=``); lossless.

    Args:
        k: the tree's depth (longest path, candidates).
        width: children per expanded node and leaves expanded per level.
        nodes: draft tokens per round the target verifies (the tree's size).
    """

    name = "tree"
    Settings = TreeSettings
    tree = True
    models = ("target",)

    def __init__(self, k: int = 4, width: int = 3, nodes: int = 8):
        TreeSettings(k, width, nodes).check(keys={"tree_width": "width", "tree_nodes": "nodes"})
        super().__init__(k)
        self.width, self.nodes = width, nodes

    @classmethod
    def from_settings(cls, s, pair=None, head=None, costs=None) -> Policy:
        return cls(s.k, s.tree_width, s.tree_nodes)

    def describe(self) -> dict:
        return {"k": self.k, "tree_width": self.width, "tree_nodes": self.nodes}

    def max_candidates(self) -> int:
        return self.nodes
