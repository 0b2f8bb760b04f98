"""Training-free estimates of a candidate's acceptance, for the stop rules of :class:`~.baselines.ConfidenceStop`.

Each reads the drafter's logits at the candidate (``[V]``, raw: before temperature) and gives ``beta``, the
chance that the candidate is accepted given that every earlier one of its round was:

* ``q``: ``q(y)``, the drafter's probability of its own candidate (Hugging Face's
  ``assistant_confidence_threshold``);
* ``entropy``: AdaEDL's entropy bound (Agrawal et al. 2024), ``max(0, 1 - sqrt(gamma * H(q)))`` with ``H`` in
  nats: a lower bound on the acceptance of a distribution that far from a point mass, training-free and
  meaningful under sampling, where ``q(y)`` of a drawn token says little;
* ``online``: a logistic model on ``z = logit(max q)``, ``sigmoid(w z + b)``, fitted while decoding from each
  verified round's outcomes (the estimator vLLM's adaptive verification uses). It starts at ``w = 1, b = 0``,
  which is ``max q`` itself, and takes one step of gradient descent on the log-loss per observed candidate:
  the accepted ones (label 1) and the first rejected one (label 0); candidates after a rejection are never
  observed, as the estimate is conditional on the earlier ones being accepted. It learns per prompt (each
  prompt starts again from ``max q``), so that a prompt's rounds are the same in any batch and any order;
  vLLM's keeps one model for every request.
"""

from __future__ import annotations

import math

import torch

from specheads.heads.acceptance_head import entropy

ESTIMATES = ("q", "entropy", "online")
_Z_CLIP = 12.0  # logit(max q) of a near point mass: bounded so that one outcome cannot swing w without limit


def features(logits: torch.Tensor, token: int) -> tuple[float, float, float]:
    """``(q(y), logit(max q), H(q))`` of a drafter's raw logits ``[V]`` and its candidate ``token``: one sync."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    q_y, top, ent = torch.stack([logp[token], logp.max(), entropy(logp)]).tolist()
    p_top = math.exp(top)
    z = math.log(p_top) - math.log1p(-p_top) if p_top < 1.0 else _Z_CLIP
    return math.exp(q_y), max(-_Z_CLIP, min(_Z_CLIP, z)), max(ent, 0.0)


def entropy_bound(entropy: float, gamma: float) -> float:
    """AdaEDL's acceptance bound ``max(0, 1 - sqrt(gamma * H))``."""
    return max(0.0, 1.0 - math.sqrt(gamma * entropy))


class OnlineLogistic:
    """``P(accept) = sigmoid(w * z + b)`` on ``z = logit(max q)``, learnt from verified rounds (module docstring).

    Args:
        lr: the gradient step per observed candidate.
    """

    def __init__(self, lr: float = 0.1):
        if not lr > 0:
            raise ValueError(f"online estimate: lr={lr} must be > 0")
        self.lr = lr
        self.reset()

    def reset(self) -> None:
        """Back to ``max q`` (``w = 1, b = 0``)."""
        self.w, self.b, self.seen = 1.0, 0.0, 0

    def predict(self, z: float) -> float:
        x = self.w * z + self.b
        return 1.0 / (1.0 + math.exp(-x)) if x >= 0 else math.exp(x) / (1.0 + math.exp(x))

    def observe(self, zs: list[float], accepted: int) -> None:
        """A verified round whose candidates had features ``zs`` (in order) and kept the first ``accepted``."""
        for i, z in enumerate(zs[: accepted + 1]):
            err = self.predict(z) - (1.0 if i < accepted else 0.0)  # d log-loss / d (w z + b)
            self.w -= self.lr * err * z
            self.b -= self.lr * err
            self.seen += 1
