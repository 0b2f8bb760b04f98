"""TLI and SLEM (ALGORITHMS.md section 5): speculative decoding with a draft in another vocabulary.

Both are lossless and emit the target's token ids. What crosses the vocabularies (the draft's tokens
mapped by string, or its text re-tokenised) is the drafting side, :mod:`specheads.export.shim.hetero`;
here is what each method verifies with. Both draft ``k`` draft tokens per round.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..sampling import probs_from_logits, sample
from .base import Policy, Round, Verdict, standard_verify
from .settings import Check, Settings


@dataclass
class HeteroSettings(Settings):
    k: int = 2
    lookbehind: int = 8  # committed tokens a re-tokenisation window may cover
    CHECKS = {"k": Check(lambda k: k >= 1, "{key}={value} must be >= 1 (draft tokens per round)"),
              "lookbehind": Check(lambda n: n >= 1, "{key}={value} must be >= 1")}


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

    def __init__(self, k: int = 2, lookbehind: int = 8):
        HeteroSettings(k, lookbehind).check()
        super().__init__(k)
        self.lookbehind = lookbehind

    @classmethod
    def from_settings(cls, s, pair=None, head=None, costs=None) -> Policy:
        return cls(s.k, s.lookbehind)

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
