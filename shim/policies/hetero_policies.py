"""TLI and SLEM (docs/algorithms/hetero.md): speculative decoding with a draft in another vocabulary.

Both are lossless and emit the target's token ids. What crosses the vocabularies (the draft's tokens
mapped by string, or its text re-tokenised) is the drafting side, :mod:`specheads.shim.vocab.hetero_loop`;
here is what each method verifies with. Both draft ``k`` draft tokens per round.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specheads.shim.core.sampling import probs_from_logits, sample
from specheads.shim.policies.base import Policy, Round, Verdict, standard_verify
from specheads.shim.policies.settings import UNSET, Check, Settings, settle


@dataclass
class HeteroSettings(Settings):
    k: int = 4
    lookbehind: int = 8  # committed tokens a re-tokenisation window may cover
    CHECKS = {
        "k": Check(lambda k: k >= 1, "{key}={value} must be >= 1 (draft tokens per round)"),
        "lookbehind": Check(lambda n: n >= 1, "{key}={value} must be >= 1"),
    }


class TLI(Policy):
    """Token-level intersection: the draft's warped distribution restricted to the tokens whose string
    the target also has, renormalised (``q'``), drafts candidates mapped to target ids; the standard
    rule verifies them with ``q'`` in the ratio and the residual. Greedy: the draft's argmax over the
    intersection, kept while it equals the target's argmax.

    Args:
        k: draft tokens per round.
        lookbehind: committed tokens a re-tokenisation window may cover.
    """

    name = "tli"
    bridge = "tli"
    Settings = HeteroSettings

    def __init__(self, k: int = UNSET, lookbehind: int = UNSET, *, settings: HeteroSettings | None = None):
        s = self.settings = settle(HeteroSettings, settings, {"k": k, "lookbehind": lookbehind})
        super().__init__(s.k)
        self.lookbehind = s.lookbehind

    @classmethod
    def from_settings(cls, s, pair=None, head=None, costs=None) -> Policy:
        return cls(settings=s)

    def describe(self) -> dict:
        return {"k": self.k}


class SLEM(TLI):
    """String-level exact match: the draft drafts freely, its text is re-tokenised with the target's
    tokenizer, and the target keeps those candidates while they equal its own greedy (or sampled) tokens."""

    name = "slem"
    bridge = "slem"

    def verify(self, rnd: Round, logits: torch.Tensor, hidden: torch.Tensor | None) -> Verdict:
        if not rnd.sampling.do_sample:
            return standard_verify(rnd, logits)
        cand = rnd.candidates().tolist()
        draws = sample(probs_from_logits(logits, rnd.sampling), rnd.generator).tolist()  # the target's own tokens
        m = next((i for i, (c, d) in enumerate(zip(cand, draws)) if c != d), len(cand))
        return Verdict(m, draws[m])


@dataclass
class SLRSSettings(HeteroSettings):
    k: int = 4  # most target tokens per round (steps chained while a step's draft string is exactly its token)
    lookahead: int = 0  # the most draft tokens per step; 0: the pair's n_max (never cuts the early stop)
    budget: int = 64  # most prefix-tree nodes per step's psi; a larger tree falls back for that step
    CHECKS = {
        **HeteroSettings.CHECKS,
        "lookahead": Check(lambda n: n >= 0, "{key}={value} must be >= 0 (0: the pair's n_max)"),
        "budget": Check(lambda b: b >= 1, "{key}={value} must be >= 1 (tree nodes per step)"),
    }


class SLRS(TLI):
    """String-level rejection sampling (:mod:`specheads.shim.vocab.slrs`): each step drafts draft tokens until
    the first target token of their string is determined, proposes it, and the target accepts it with
    ``min(1, p/psi)`` where ``psi`` is the exact probability that the drafting proposes it (else samples
    ``norm(max(0, p - psi))``). Steps chain within a round while a step's string is exactly its target token.
    Greedy: exact match, the target's own greedy output.

    Args:
        k: most target tokens per round.
        lookbehind: committed tokens a re-tokenisation window may cover.
        lookahead: most draft tokens per step; 0 for the pair's ``n_max``.
        budget: most prefix-tree nodes (draft positions evaluated) per step to compute ``psi`` (one draft
            forward per tree level on the fused CPU forward, one per node otherwise); above it the step falls
            back to the target's own token (counted as ``slrs_fallbacks``).
    """

    name = "slrs"
    bridge = "slrs"
    Settings = SLRSSettings

    def __init__(
        self,
        k: int = UNSET,
        lookbehind: int = UNSET,
        lookahead: int = UNSET,
        budget: int = UNSET,
        *,
        settings: SLRSSettings | None = None,
    ):
        given = {"k": k, "lookbehind": lookbehind, "lookahead": lookahead, "budget": budget}
        s = self.settings = settle(SLRSSettings, settings, given)
        Policy.__init__(self, s.k)
        self.lookbehind, self.lookahead, self.budget = s.lookbehind, s.lookahead, s.budget
        self.warned_untruncated = False  # untruncated sampling is warned about once per policy
        self.reset()

    @classmethod
    def from_settings(cls, s, pair=None, head=None, costs=None) -> Policy:
        return cls(settings=s)

    def reset(self) -> None:
        self.events = {
            "slrs_steps": 0,
            "slrs_fallbacks": 0,
            "slrs_psi_seconds": 0.0,
            "slrs_tree_forwards": 0,
            "slrs_tree_nodes": 0,
            "slrs_empty": 0,
        }

    def counters(self) -> dict[str, float]:
        return dict(self.events)

    def describe(self) -> dict:
        return {"k": self.k, "lookahead": self.lookahead, "budget": self.budget}
