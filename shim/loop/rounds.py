"""What a round leaves behind, shared by the decoding loops (:mod:`.engine`'s chain, :mod:`.tree`'s draft
tree): the round's new tokens committed and counted, and one prompt's output."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specheads.shim.core.stats import GenerationStats
from specheads.shim.policies import Verdict


@dataclass
class Result:
    """One prompt's completion: the new token ids, their stats, the policy's trace (:meth:`Policy.trace`: its
    record of its decisions) and, filled in by :class:`~specheads.decode.api.Decoder`, the text and how many
    prompt tokens were cut to fit the context. The one result type of every decoding loop and of the API."""

    tokens: list[int]
    stats: GenerationStats
    trace: dict = field(default_factory=dict)
    text: str = ""
    truncated_prompt_tokens: int = 0


def commit_round(
    stats: GenerationStats, eos: frozenset[int], cand: torch.Tensor, verdict: Verdict, remaining: int
) -> list[int]:
    """The round's new tokens (kept candidates, then the verdict's token) up to the first EOS and at most
    ``remaining``; counts the round."""
    m, n = verdict.accepted, cand.shape[0]
    new = (cand[:m].tolist() if m else []) + ([verdict.token] if verdict.token is not None else [])
    for i, t in enumerate(new):  # stop after the first EOS
        if t in eos:
            new = new[: i + 1]
            stats.eos = 1
            break
    new = new[:remaining]
    kept = min(m, len(new))
    stats.rounds += 1
    stats.drafted += n
    stats.accepted += kept
    stats.discarded += n - kept
    return new


def emit(seq: list[int], out: list[int], new: list[int], on_tokens) -> None:
    """Adds a round's new tokens to the sequence and the output, and streams them to ``on_tokens``."""
    seq.extend(new)
    out.extend(new)
    if on_tokens is not None:
        on_tokens(new)
