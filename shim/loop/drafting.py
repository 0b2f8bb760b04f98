"""Drawing a candidate from the drafter's scores and adding it to the round (every drafter shares it)."""

from __future__ import annotations

import torch

from specheads.shim.core.sampling import SamplingConfig, probs_from_logits, sample
from specheads.shim.policies import Policy, Round


def pick_token(logits: torch.Tensor, sampling: SamplingConfig, generator) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Next token (0-dim) from logits ``[V]`` and, when sampling, the warped distribution."""
    if not sampling.do_sample:
        return logits.argmax(-1), None
    q = probs_from_logits(logits, sampling)
    return sample(q, generator), q


def take_candidate(rnd: Round, policy: Policy, logits: torch.Tensor, hidden: torch.Tensor | None, generator) -> bool:
    """Draws the next candidate from the draft's logits ``[V]`` and adds it to the round (with its
    distribution and the draft state returned with it); True while drafting goes on: below the round's
    limit and until the policy stops."""
    tok, q = pick_token(logits, rnd.sampling, generator)
    rnd.tokens.append(tok)
    rnd.draft_logits.append(logits)
    if q is not None:
        rnd.q.append(q)
    if hidden is not None:
        rnd.draft_hidden.append(hidden)
    if rnd.n >= rnd.limit:
        if policy.may_skip_target:  # it may still keep the last candidate without a target call
            policy.stop_drafting(rnd)
        return False
    return not policy.stop_drafting(rnd)
