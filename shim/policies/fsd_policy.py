"""Fuzzy speculative decoding (docs/algorithms/fsd.md): accept while the distributions are close."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from specheads.shim.core.divergence import DIVERGENCES, divergence
from specheads.shim.core.sampling import probs_from_logits, sample
from specheads.shim.policies.base import Policy, Round, Verdict, sd_accepts, sd_token, standard_verify
from specheads.shim.policies.settings import UNSET, Check, HeadSpec, K, Settings, bounds, settle
from specheads.shim.policies.specdecpp_policy import SpecDecPP

log = logging.getLogger(__name__)
FSD_RULES = ("paper", "or")
DIV_DISTS = ("raw", "warped")


@dataclass
class FSDSettings(Settings):
    T: float | None = None  # required
    divergence: str = "js"
    k: int = 4
    fsd_top_k: int = 0
    fsd_rule: str = "paper"
    fsd_dist: str = "raw"
    head: str | None = None  # optional acceptance head on FSD labels: it stops the drafting (k_min, k_max)
    k_min: int = 2
    k_max: int = 20
    THRESHOLD = "T"
    HELP = {
        "head": "optional: an acceptance head trained on FSD labels that stops the drafting (k_min, k_max and "
        "the head's threshold then apply instead of k)"
    }
    CHECKS = {
        "T": Check(
            lambda t: t >= 0,
            "FSD threshold {key}={value} must be >= 0",  # also refuses nan
            "{key}={values}: every FSD threshold T must be >= 0",
        ),
        "divergence": Check(
            lambda d: d in DIVERGENCES, f"unknown divergence {{value!r}}; choose one of {list(DIVERGENCES)}"
        ),
        "fsd_top_k": Check(lambda t: t >= 0, "{key}={value} must be >= 0 (0: the whole vocabulary)"),
        "fsd_rule": Check(
            lambda r: r in FSD_RULES, "FSD rule {value!r}: expected paper (Div < T) or or (SD accepts or Div < T)"
        ),
        "fsd_dist": Check(
            lambda d: d in DIV_DISTS,
            "{key}={value!r}: expected raw (unwarped softmax) or warped (after temperature/top-k/top-p)",
        ),
        "k": K,
    }

    def relations(self) -> list[str]:
        out = (
            []
            if self.T is not None
            else [
                ("FSD needs a divergence threshold T: set fsd.T=<value> (>= 0; sweep it with heads-eval fsd.js=[...])")
            ]
        )
        return out + (bounds(self.k_min, self.k_max) if self.head else [])


class FSD(Policy):
    """Fuzzy speculative decoding (docs/algorithms/fsd.md), training-free, not lossless.

    ``k`` candidates are verified in one target pass. Paper rule (default): accept candidate ``y_i``
    while ``Div(p_i, q_i) < T``; at the first rejection emit a token from ``p_i`` itself (greedy: its
    argmax; sampling: a draw from the warped ``p_i``); after ``k`` acceptances the bonus from
    ``p_{k+1}``. ``T = 0`` accepts nothing (target-exact output, every draft wasted). Rule ``or`` (the
    FSD author's later implementation): accept while the SD rule accepts OR ``Div < T``, at the first
    rejection the SD correction (residual; greedy: argmax); ``T = 0`` is SD draw for draw.

    Divergences are in fp32 on ``raw`` distributions (softmax of the unwarped logits, as the public
    FSD code) or ``warped`` ones (after temperature / top-k / top-p: the distributions decoding draws
    from). Greedy decoding warps nothing, so there ``warped`` is ``raw``. Divergences are clamped at 0
    against rounding, so ``T = 0`` never accepts.

    ``fuzzy_only`` counts this prompt's accepted candidates that the strict SD rule would have rejected
    (greedy: ``y_i != argmax p_i``; rule ``or`` with sampling: the round's own SD draw failed), up to the
    first EOS (the engine drops what follows). The paper rule with sampling draws no uniforms, so there it
    adds the expected count ``sum(1 - min(1, p_i(y_i) / q_i(y_i)))``.

    Args:
        threshold: ``T >= 0``; larger accepts more.
        divergence: ``kl`` (KL(p||q)), ``kl_rev`` (KL(q||p)), ``js`` or ``tv``.
        k: candidates per round.
        fsd_top_k: 0 for the full vocabulary, else the target's top ``fsd_top_k`` tokens plus one bucket.
        rule: ``paper`` or ``or``.
        fsd_dist: ``raw`` or ``warped``.
        stopper: optional SpecDec++ policy whose head predicts FSD acceptance from draft states
            (``heads-datagen labels=fsd``, FSD paper section 7.1): it decides when to stop drafting
            (its ``k_max`` replaces ``k``); FSD still verifies.
    """

    name = "fsd"
    lossless = False
    Settings = FSDSettings
    HEAD = HeadSpec("acceptance", "draft", 0.7, required=False)

    def __init__(
        self,
        threshold: float = UNSET,
        divergence: str = UNSET,
        k: int = UNSET,
        fsd_top_k: int = UNSET,
        rule: str = UNSET,
        fsd_dist: str = UNSET,
        stopper: SpecDecPP | None = None,
        *,
        settings: FSDSettings | None = None,
    ):
        given = {"T": threshold, "divergence": divergence, "k": k, "fsd_top_k": fsd_top_k, "fsd_rule": rule}
        s = self.settings = settle(FSDSettings, settings, {**given, "fsd_dist": fsd_dist})
        super().__init__(s.k if stopper is None else stopper.k)  # a stop head's k_max (its settings hold its own)
        self.threshold, self.divergence, self.fsd_top_k = float(s.T), s.divergence, s.fsd_top_k  # type: ignore[arg-type]
        self.rule, self.fsd_dist = s.fsd_rule, s.fsd_dist
        self.stopper = stopper
        if stopper is not None:
            self.draft_hidden = stopper.draft_hidden
        self.fuzzy_only = 0.0
        self._eos: tuple[frozenset, torch.Tensor] | None = None

    @classmethod
    def from_settings(cls, s, pair=None, head=None, costs=None) -> Policy:
        stopper = None
        if head is not None:  # an acceptance head trained on FSD labels stops the drafting (FSD paper section 7.1)
            info = head.metadata.get("fsd")
            if not info:
                log.warning(
                    "%s was not trained on FSD labels (heads-datagen labels=fsd): it predicts SD acceptance, not FSD's",
                    s.head,
                )
            elif (info.get("divergence"), float(info.get("threshold", -1))) != (s.divergence, float(s.T)):
                log.warning(
                    "%s predicts FSD acceptance under %s < %s; this decoding verifies with %s < %s",
                    s.head,
                    info.get("divergence"),
                    info.get("threshold"),
                    s.divergence,
                    s.T,
                )
            position = head.metadata.get("feature", {}).get("position", "own")
            stopper = SpecDecPP(head.module, cls.HEAD.threshold_for(None, head), s.k_min, s.k_max, position=position)
        policy = cls(stopper=stopper, settings=s)
        policy.head_file = s.head
        return policy

    def describe(self) -> dict:
        out = {
            "k": self.k,
            "threshold": self.threshold,
            "divergence": self.divergence,
            "fsd_top_k": self.fsd_top_k,
            "fsd_rule": self.rule,
            "fsd_dist": self.fsd_dist,
        }
        if self.stopper is not None:
            out.update(head=self.head_file, stop_threshold=self.stopper.threshold, k_min=self.stopper.k_min)
        return out

    def reset(self) -> None:
        self.fuzzy_only = 0.0
        if self.stopper is not None:
            self.stopper.reset()

    def counters(self) -> dict[str, float]:
        return {"fuzzy_only": self.fuzzy_only}

    def start_round(self, rnd: Round) -> None:
        if self.stopper is not None:
            self.stopper.start_round(rnd)

    def stop_drafting(self, rnd: Round) -> bool:
        return super().stop_drafting(rnd) if self.stopper is None else self.stopper.stop_drafting(rnd)

    def _emitted(self, rnd: Round, cand: torch.Tensor) -> torch.Tensor:
        """``[n]`` 1 for candidates up to the first EOS among them, 0 after it (the engine cuts those)."""
        if not rnd.eos:
            return torch.ones_like(cand)
        if self._eos is None or self._eos[0] != rnd.eos or self._eos[1].device != cand.device:
            self._eos = (rnd.eos, torch.tensor(sorted(rnd.eos), device=cand.device))
        is_eos = torch.isin(cand, self._eos[1]).long()
        return (is_eos.cumsum(0) - is_eos == 0).long()

    def _divergences(self, rnd: Round, logits: torch.Tensor, p: torch.Tensor | None) -> torch.Tensor:
        """``[n]`` divergences between the target's and the draft's distributions at each candidate."""
        n = rnd.n
        if self.fsd_dist == "warped" and rnd.sampling.do_sample:
            assert p is not None  # sampling: the caller passes the target's warped distribution
            p_div, q_div = p[:n], torch.stack(rnd.q).to(p.device)
        else:  # raw: in greedy mode rnd.q is empty, the draft's logits are always there
            p_div = logits[:n].float().softmax(-1)
            q_div = torch.stack(rnd.draft_logits).to(logits.device).float().softmax(-1)
        return divergence(self.divergence, p_div, q_div, self.fsd_top_k).clamp_min(0)

    def verify(self, rnd: Round, logits: torch.Tensor, hidden: torch.Tensor | None) -> Verdict:
        if rnd.n == 0:  # no room for a candidate: the target's own token
            return standard_verify(rnd, logits)
        cand = rnd.candidates(logits.device)
        if not rnd.sampling.do_sample:
            return self._verify_greedy(rnd, logits, cand)
        p = probs_from_logits(logits, rnd.sampling)  # [n+1, V] warped
        return self._verify_sampled(rnd, p, cand, self._divergences(rnd, logits, p) < self.threshold)

    def _verify_greedy(self, rnd: Round, logits: torch.Tensor, cand: torch.Tensor) -> Verdict:
        n = rnd.n
        fuzzy = self._divergences(rnd, logits, None) < self.threshold
        top = logits.argmax(-1)
        strict = cand == top[:n]
        kept = ((fuzzy | strict) if self.rule == "or" else fuzzy).long().cumprod(0)
        lenient = ((~strict).long() * kept * self._emitted(rnd, cand)).sum()
        m, lenient, *tokens = torch.cat([torch.stack([kept.sum(), lenient]), top]).tolist()  # the one sync
        self.fuzzy_only += lenient
        return Verdict(m, tokens[m])

    def _verify_sampled(self, rnd: Round, p: torch.Tensor, cand: torch.Tensor, fuzzy: torch.Tensor) -> Verdict:
        n = rnd.n
        q = torch.stack(rnd.q).to(p.device)
        emitted = self._emitted(rnd, cand)
        if self.rule == "or":
            strict = sd_accepts(p, q, cand, rnd.generator)  # the draws SD makes, in its order
            kept = (fuzzy | strict).long().cumprod(0)
            m, lenient = torch.stack([kept.sum(), ((~strict).long() * kept * emitted).sum()]).tolist()
            self.fuzzy_only += lenient
            return Verdict(m, sd_token(p, q, m, rnd.generator))
        idx = torch.arange(n, device=p.device)
        py, qy = p[idx, cand], q[idx, cand]
        kept = fuzzy.long().cumprod(0)
        expected = ((1 - (py / qy).clamp(max=1)) * kept * emitted).sum()  # qy > 0: y_i was drawn from q_i
        draws = sample(p, rnd.generator)  # a token from every p_i; the decision does not depend on them
        m, lenient, *tokens = torch.cat(
            [torch.stack([kept.sum().double(), expected.double()]), draws.double()]
        ).tolist()  # the one sync
        self.fuzzy_only += lenient
        return Verdict(int(m), int(tokens[int(m)]))
