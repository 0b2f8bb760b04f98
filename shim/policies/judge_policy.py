"""Judge decoding (docs/algorithms/judge.md): a head on the target's states accepts candidates SD rejects."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from specheads.heads.judge_head import judge_signal_values
from specheads.shim.core.sampling import probs_from_logits
from specheads.shim.policies.base import Policy, Round, Verdict, sd_accepts, sd_token, standard_verify
from specheads.shim.policies.settings import UNSET, Check, HeadSpec, K, Settings, settle


@dataclass
class JudgeSettings(Settings):
    head: str | None = None  # the exported judge head
    delta: float | None = None  # None: the head's default_threshold, else 0.5
    k: int = 4
    max_gap: float | None = None  # the judge accepts y only where log p(y) >= max log p - max_gap (None: anywhere)
    THRESHOLD = "delta"
    CHECKS = {
        "delta": Check(
            lambda d: 0 <= d <= 1, "{key}={value} must be in [0, 1]", "{key}={values}: every delta must be in [0, 1]"
        ),
        "k": K,
        "max_gap": Check(lambda g: g is None or g >= 0, "{key}={value} must be >= 0 (nats)"),
    }


class Judge(Policy):
    """Judge decoding (docs/algorithms/judge.md), not lossless: verify ``k`` candidates in one
    target pass and accept the longest prefix on which the judge mask ``sigmoid(head(h_j)) > delta``
    OR the SD rule holds; at the first candidate both reject, emit the target's token there
    (greedy: its argmax; sampling: a token from ``norm(max(0, p - q))``, as SD does).

    The head reads the target's last hidden state before the final norm at each candidate's own
    position, from the verification pass itself (no extra forward), and, when it was trained with them
    (its ``signals``), the target's verdict on the candidate from the same pass's logits: log p(y), its gap to
    the target's most likely token, the entropy, y's rank (:func:`~specheads.heads.judge_head.judge_signal_values`).
    ``max_gap`` is a margin floor: the judge may accept y only where log p(y) is within ``max_gap`` nats of the
    target's largest log-probability (0: only the target's own choice, i.e. SD; None: no floor). When every candidate is
    accepted, the target's bonus token follows as in SD, unless the judge accepted the last
    candidate: then the round ends there (its verdict has no token of its own) and the draft
    continues from it. So ``delta = 1`` (the judge never accepts) is SD, draw for draw, and a judge
    that accepts everything is draft-only decoding. ``judge_only`` counts this prompt's accepted
    candidates that the SD rule rejected.

    Args:
        head: module mapping a target state ``[n, d]`` (and its ``signals``, ``[n, s]``) to logits ``[n]``.
        delta: judge threshold in [0, 1]; larger accepts less.
        k: candidates per round.
        max_gap: the margin floor in nats (None: none).
    """

    name = "judge"
    lossless = False
    Settings = JudgeSettings
    HEAD = HeadSpec("judge", "target", 0.5)
    target_hidden = "pre"

    def __init__(
        self,
        head: torch.nn.Module,
        delta: float | None = UNSET,
        k: int = UNSET,
        max_gap: float | None = UNSET,
        *,
        settings: JudgeSettings | None = None,
    ):
        s = settle(JudgeSettings, settings, {"delta": delta, "k": k, "max_gap": max_gap})
        s = self.settings = dataclasses.replace(s, delta=self.HEAD.threshold_for(s.delta, None))  # type: ignore[union-attr]
        super().__init__(s.k)
        self.head, self.delta, self.max_gap = head, s.delta, s.max_gap
        self.signals = tuple(getattr(head, "signals", ()))
        self._dtype = next(head.parameters()).dtype
        self._device = next(head.parameters()).device
        self.judge_only = 0

    @classmethod
    def from_settings(cls, s, pair=None, head=None, costs=None) -> Policy:
        policy = cls(head.module, cls.HEAD.threshold_for(s.delta, head), settings=s)
        policy.head_file = s.head
        return policy

    def describe(self) -> dict:
        return {"head": self.head_file, "delta": self.delta, "k": self.k} | (
            {"max_gap": self.max_gap} if self.max_gap is not None else {}
        )

    def reset(self) -> None:
        self.judge_only = 0

    def counters(self) -> dict[str, float]:
        return {"judge_only": self.judge_only}

    def round_room(self, remaining: int) -> int:
        # A judge that can accept may fill the last slot with a candidate; delta = 1 keeps SD's room.
        return remaining if self.delta < 1 else remaining - 1

    def verify(self, rnd: Round, logits: torch.Tensor, hidden: torch.Tensor | None) -> Verdict:
        n = rnd.n
        if n == 0:
            return standard_verify(rnd, logits)
        cand = rnd.candidates(logits.device)
        assert hidden is not None  # target_hidden is set: the engine passes the target's states
        states = hidden[1 : n + 1].to(self._device, self._dtype)  # the target's states may sit on another GPU
        if self.signals or self.max_gap is not None:
            verdict = judge_signal_values(logits[:n], cand, self.signals + ("gap",))
        if self.signals:
            states = torch.cat([states, verdict[:, :-1].to(self._device, self._dtype)], dim=-1)
        judge = self.head(states).float().reshape(n).sigmoid().to(logits.device) > self.delta
        if self.max_gap is not None:
            judge &= verdict[:, -1].to(judge.device) >= -self.max_gap
        if rnd.sampling.do_sample:
            p = probs_from_logits(logits, rnd.sampling)
            q = torch.stack(rnd.q).to(p.device)
            sd = sd_accepts(p, q, cand, rnd.generator)
        else:
            top = logits.argmax(-1)
            sd = cand == top[:n]
        kept = (judge | sd).long().cumprod(0)
        counts = torch.stack([kept.sum(), ((judge & ~sd).long() * kept).sum(), judge[n - 1].long()])
        if rnd.sampling.do_sample:
            m, judge_only, judged_last = counts.tolist()  # the one sync of the round
        else:
            m, judge_only, judged_last, *tokens = torch.cat([counts, top]).tolist()
        self.judge_only += judge_only
        if m == n and judged_last:
            return Verdict(n, None)
        if not rnd.sampling.do_sample:
            return Verdict(m, tokens[m])
        return Verdict(m, sd_token(p, q, m, rnd.generator))
