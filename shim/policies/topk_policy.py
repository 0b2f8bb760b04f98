"""Top-K verification (docs/algorithms/topk.md): a training-free lossy baseline, and relaxed acceptance."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specheads.shim.core.sampling import probs_from_logits, sample
from specheads.shim.policies.base import Policy, Round, Verdict
from specheads.shim.policies.settings import UNSET, Check, K, Settings, settle


@dataclass
class TopKSettings(Settings):
    k: int = 4
    verify_top_k: int = 2
    verify_delta: float | None = None  # relaxed acceptance: y also within this many nats of the top token
    CHECKS = {
        "k": K,
        "verify_top_k": Check(lambda t: t >= 1, "{key}={value} must be >= 1"),
        "verify_delta": Check(lambda d: d is None or d >= 0, "{key}={value} must be >= 0 (nats)"),
    }


class TopKVerify(Policy):
    """Top-K verification (docs/algorithms/topk.md), a training-free baseline, not lossless: accept
    candidate ``y_i`` while it is among the target's ``top_k`` most likely tokens at its position; at
    the first candidate that is not, emit the target's token there (greedy: argmax; sampling: a draw
    from ``p_i``); after ``k`` accepted candidates the bonus from ``p_{k+1}``. ``top_k = 1`` is greedy SD.

    With ``delta`` it is relaxed acceptance (what TensorRT-LLM ships for MTP drafts in a reasoning model's
    thinking phase): ``y_i`` must also lie within ``delta`` nats of the target's most likely token,
    ``log p(y_i) >= max log p - delta``, so a flat distribution accepts any of its top K and a peaked one only
    its choice.

    Args:
        k: candidates per round.
        top_k: how many of the target's most likely tokens count as acceptable.
        delta: the relaxed-acceptance margin in nats (None: top-K alone).
    """

    name = "topk_verify"
    lossless = False
    Settings = TopKSettings

    def __init__(
        self, k: int = UNSET, top_k: int = UNSET, delta: float | None = UNSET, *, settings: TopKSettings | None = None
    ):
        given = {"k": k, "verify_top_k": top_k, "verify_delta": delta}
        keys = {"verify_top_k": "top_k", "verify_delta": "delta"}
        s = self.settings = settle(TopKSettings, settings, given, keys=keys)
        super().__init__(s.k)
        self.top_k, self.delta = s.verify_top_k, s.verify_delta

    @classmethod
    def from_settings(cls, s, pair=None, head=None, costs=None) -> Policy:
        return cls(settings=s)

    def describe(self) -> dict:
        return {"k": self.k, "verify_top_k": self.top_k} | (
            {"verify_delta": self.delta} if self.delta is not None else {}
        )

    def verify(self, rnd: Round, logits: torch.Tensor, hidden: torch.Tensor | None) -> Verdict:
        n = rnd.n
        cand = rnd.candidates(logits.device)
        top = logits[:n].topk(min(self.top_k, logits.shape[-1]), dim=-1)
        ok = (top.indices == cand[:, None]).any(-1)
        if self.delta is not None:  # log p differences are logit differences: one normaliser per row
            mine = logits[:n].gather(-1, cand[:, None]).squeeze(-1)
            ok &= mine.float() >= top.values[:, 0].float() - self.delta
        matched = ok.long().cumprod(0).sum()
        if rnd.sampling.do_sample:
            m = int(matched)
            return Verdict(m, int(sample(probs_from_logits(logits[m], rnd.sampling), rnd.generator)))
        m, *tokens = torch.cat([matched.view(1), logits.argmax(-1)]).tolist()  # one sync
        return Verdict(m, tokens[m])
