"""SPRINTER (docs/algorithms/sprinter.md): a learned verifier approves candidates one at a time."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from specheads.shim.policies.base import Policy, Round, Verdict, standard_verify
from specheads.shim.policies.settings import UNSET, Check, HeadSpec, Settings, settle

FEATURES = ("previous", "previous+embedding", "current")


@dataclass
class SprinterSettings(Settings):
    head: str | None = None  # the exported verifier head
    eta: float | None = None  # None: the head's default_threshold, else 0.5
    max_run: int | None = 20  # None: no cap
    THRESHOLD = "eta"
    CHECKS = {
        "eta": Check(
            lambda e: 0 <= e <= 1, "{key}={value} must be in [0, 1]", "{key}={values}: every eta must be in [0, 1]"
        ),
        "max_run": Check(lambda m: m >= 0, "{key}={value} must be >= 0 (or null for no cap)"),
    }


class Sprinter(Policy):
    """SPRINTER approximate verification (docs/algorithms/sprinter.md), not lossless.

    One candidate at a time: the verifier scores the newest candidate ``y_n`` from the draft state
    that produced ``q_n`` (``feature="previous"``), that state concatenated with ``y_n``'s input
    embedding (``"previous+embedding"``), or the state after consuming ``y_n``
    (``"current"``, available one draft forward later, so the candidate drafted meanwhile is
    discarded if ``y_n`` is not approved). A score ``>= eta`` keeps ``y_n`` for good and drafting
    goes on; otherwise the round ends and one target pass judges ``y_n`` with the SD rule
    (accept with probability ``min(1, p/q)``, else a token from ``norm(max(0, p - q))``; greedy:
    accept iff ``y_n == argmax p``), emitting the target's next token after an acceptance (free
    in the same pass, exact). After ``max_run`` approved candidates the next one goes to the target
    unscored. A round whose candidates were all approved (an approved EOS, or the length limit)
    ends without a target call. The round's state (``rnd.state``) is how many leading candidates
    the verifier approved.

    With a verifier that approves exactly the tokens with ``q(y) <= p(y)`` the output follows the
    target distribution; with one that approves everything (and no cap) it is draft-only sampling.

    Args:
        head: module mapping a feature ``[d]`` (``[2d]`` with the embedding) to a logit.
        eta: approval threshold on ``sigmoid(logit)``.
        max_run: cap on consecutive approved candidates (None: no cap).
        feature: ``previous``, ``previous+embedding`` or ``current``.
        embedding: the draft's input embedding module (``previous+embedding`` only).
    """

    name = "sprinter"
    lossless = False
    Settings = SprinterSettings
    HEAD = HeadSpec("verifier", "draft", 0.5)
    draft_hidden = "post"
    may_skip_target = True
    FEATURES = FEATURES

    def __init__(
        self,
        head: torch.nn.Module,
        eta: float | None = UNSET,
        max_run: int | None = UNSET,
        feature: str = "previous",
        embedding: torch.nn.Module | None = None,
        *,
        settings: SprinterSettings | None = None,
    ):
        bad = [] if feature in FEATURES else [f"verifier feature {feature!r}: expected one of {list(FEATURES)}"]
        if feature == "previous+embedding" and embedding is None:
            bad.append("feature previous+embedding needs the draft's input embedding")
        s = settle(SprinterSettings, settings, {"eta": eta, "max_run": max_run}, lambda _: bad)
        s = self.settings = dataclasses.replace(s, eta=self.HEAD.threshold_for(s.eta, None))  # type: ignore[union-attr]
        max_run = s.max_run
        super().__init__(1 << 30 if max_run is None else max_run + 1 + (feature == "current"))
        self.head, self.eta, self.max_run, self.feature, self.embedding = head, s.eta, max_run, feature, embedding
        # the head's device: a split target's states may come out on another GPU
        self._device = next((p.device for p in head.parameters()), None) if isinstance(head, torch.nn.Module) else None
        self.lag = 1 if feature == "current" else 0
        self.verifier_calls = 0  # this prompt's
        self.decisions: list[tuple[int, int, bool]] = []  # this prompt's (position, token, approved)

    @classmethod
    def from_settings(cls, s, pair=None, head=None, costs=None) -> Policy:
        feature = head.metadata.get("feature", {}).get("position", "previous")
        embedding = pair.draft.model.get_input_embeddings() if feature == "previous+embedding" else None
        policy = cls(head.module, cls.HEAD.threshold_for(s.eta, head), feature=feature, embedding=embedding, settings=s)
        policy.head_file = s.head
        return policy

    def describe(self) -> dict:
        return {"head": self.head_file, "eta": self.eta, "max_run": self.max_run, "feature": self.feature}

    def reset(self) -> None:
        self.verifier_calls = 0
        self.decisions = []

    def start_round(self, rnd: Round) -> None:
        rnd.state = 0  # leading candidates of the round approved by the verifier

    def counters(self) -> dict[str, float]:
        return {"verifier_calls": self.verifier_calls}

    def trace(self) -> dict:
        return {"decisions": [list(d) for d in self.decisions]}

    def _score(self, rnd: Round, j: int) -> float:
        """Verifier probability for candidate ``j`` (0-based) of the round."""
        if self.feature == "current":
            x = rnd.draft_hidden[j + 1]  # returned with y_{j+2}: the state after consuming y_{j+1}
        else:
            x = rnd.draft_hidden[j]  # returned with y_{j+1}: the state that produced q_{j+1}
            if self.embedding is not None:
                x = torch.cat([x, self.embedding(rnd.tokens[j].view(1))[0].to(x.dtype)])
        self.verifier_calls += 1
        x = x.to(self._device)
        return float(torch.sigmoid(self.head(x).float()).reshape(()))

    def stop_drafting(self, rnd: Round) -> bool:
        n = rnd.n
        j = n - 1 - self.lag  # the candidate the newest state can score
        if self.max_run is not None and rnd.state >= self.max_run:
            return True  # cap: the next unapproved candidate goes to the target
        if j < 0:
            return False
        approved = self._score(rnd, j) >= self.eta
        # Every scored candidate sits right after the committed sequence: its prefix is the
        # output's prefix, so a teacher-forced pass over the output can judge the decision later.
        token = int(rnd.tokens[j])
        self.decisions.append((rnd.position + j, token, approved))
        if not approved:
            return True
        rnd.state = j + 1
        return token in rnd.eos

    def needs_target(self, rnd: Round) -> bool:
        approved = rnd.state
        return approved < rnd.n and not (approved and int(rnd.tokens[approved - 1]) in rnd.eos)

    def verify(self, rnd: Round, logits: torch.Tensor, hidden: torch.Tensor | None) -> Verdict:
        j = rnd.state  # the first candidate the verifier did not approve: the target judges it
        if rnd.n == 0:  # nothing drafted (an EAGLE head without target states yet): the target's own token
            return standard_verify(rnd, logits)
        if j >= rnd.n:
            raise RuntimeError("verify called on a round whose candidates were all approved")
        one = dataclasses.replace(
            rnd,
            tokens=rnd.tokens[j : j + 1],
            q=rnd.q[j : j + 1],
            draft_logits=rnd.draft_logits[j : j + 1],
            draft_hidden=rnd.draft_hidden[j : j + 1],
        )
        v = standard_verify(one, logits[j : j + 2])
        return Verdict(j + v.accepted, v.token)
