"""The label families of ``heads-datagen``: ``labels=`` name -> :class:`~.labelling.Labeller`."""

from __future__ import annotations

from specheads.errors import UserError

from .acceptance import AcceptanceLabeller
from .drafter import DrafterLabeller
from .eagle_rounds import EagleRoundsLabeller
from .fsd import FsdLabeller
from .judge import JudgeLabeller
from .labelling import Labeller
from .sprinter import SprinterLabeller

LABELLERS: dict[str, Labeller] = {
    "acceptance": AcceptanceLabeller(),
    "fsd": FsdLabeller(),
    "sprinter": SprinterLabeller(),
    "judge": JudgeLabeller(),
    "drafter": DrafterLabeller(),
    "eagle_rounds": EagleRoundsLabeller(),
}


def labeller(name: str) -> Labeller:
    """The labeller of ``labels=name``; UserError naming the choices for an unknown one."""
    if name not in LABELLERS:
        raise UserError(f"labels={name!r} is not one of {list(LABELLERS)}")
    return LABELLERS[name]
