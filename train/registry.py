"""The head families ``heads-train`` trains, by ``head=`` name (the exported ``head_type``)."""

from __future__ import annotations

from specheads.errors import UserError
from specheads.train.acceptance_task import AcceptanceTask
from specheads.train.distill_task import DraftTask
from specheads.train.eagle_stop_task import EagleStopTask
from specheads.train.eagle_task import EagleTask
from specheads.train.eagle_verifier_task import EagleVerifierTask
from specheads.train.judge_task import JudgeTask
from specheads.train.task import Task
from specheads.train.verifier_task import VerifierTask

TASKS: dict[str, type[Task]] = {
    "acceptance": AcceptanceTask,
    "verifier": VerifierTask,
    "judge": JudgeTask,
    "eagle": EagleTask,
    "draft": DraftTask,
    "eagle_stop": EagleStopTask,
    "eagle_verifier": EagleVerifierTask,
}
# the algorithms' names, as heads-datagen labels= and heads-decode policy= spell them
ALIASES = {"specdecpp": "acceptance", "sprinter": "verifier"}


def canonical(head: str) -> str:
    """``head`` with an alias resolved to the task's own name."""
    return ALIASES.get(head, head)


def task_type(head: str) -> type[Task]:
    """The task ``head=`` names; UserError for an unknown name."""
    if canonical(head) not in TASKS:
        raise UserError(
            f"head={head!r}: choose acceptance (SpecDec++; alias specdecpp), verifier (SPRINTER; "
            "alias sprinter), judge, eagle, draft, eagle_stop or eagle_verifier"
        )
    return TASKS[canonical(head)]
