"""The label families of ``heads-datagen``: ``labels=`` name -> :class:`~.labelling.Labeller`."""

from __future__ import annotations

from specheads.datagen.acceptance_labels import AcceptanceLabeller
from specheads.datagen.drafter import DrafterLabeller
from specheads.datagen.eagle_rounds import EagleRoundsLabeller
from specheads.datagen.fsd_labels import FsdLabeller
from specheads.datagen.judge_labels import JudgeLabeller
from specheads.datagen.labelling import Labeller
from specheads.datagen.passages import PassagesLabeller
from specheads.datagen.self_prompts import PromptsLabeller
from specheads.datagen.sprinter_labels import SprinterLabeller
from specheads.errors import UserError

LABELLERS: dict[str, Labeller] = {
    "acceptance": AcceptanceLabeller(),
    "fsd": FsdLabeller(),
    "sprinter": SprinterLabeller(),
    "judge": JudgeLabeller(),
    "drafter": DrafterLabeller(),
    "eagle_rounds": EagleRoundsLabeller(),
    "prompts": PromptsLabeller(),
    "passages": PassagesLabeller(),
}


def labeller(name: str) -> Labeller:
    """The labeller of ``labels=name``; UserError naming the choices for an unknown one."""
    if name not in LABELLERS:
        raise UserError(f"labels={name!r} is not one of {list(LABELLERS)}")
    return LABELLERS[name]
