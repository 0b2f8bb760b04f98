"""Who runs the target: this package's own model (``engine=specheads``) or vLLM (``engine=vllm``).

A run's engine is looked up here, once (:func:`engine_of`); the rest of the package asks the :class:`TargetEngine` it
gets what the engine does, never its name. The stages' own behaviour per engine sits beside them
(``datagen/engines.py``: where responses and states come from; ``evaluate``'s and ``heads-decode``'s vLLM runs).
"""

from __future__ import annotations

from dataclasses import dataclass

from specheads.errors import UserError


@dataclass(frozen=True)
class TargetEngine:
    """What a target engine does, as the stages and the planner need to know it.

    Attributes:
        name: the ``engine=`` value.
        own_python: runs in processes of its own Python (vLLM's virtualenv): ``heads-eval`` and ``heads-decode``
            hand it the whole run; ``heads-datagen`` has it generate every response up front, before the
            package's models load (a process's chunks are fixed then).
        holds_target: keeps the target's weights itself, so the package's own target loads only what a label
            family still needs of it (often its config alone), and the planner counts the engine's copy.
        splits_nodes: can spread the target's layers over more nodes (pipeline parallelism) without
            ``target.device_map``.
    """

    name: str
    own_python: bool
    holds_target: bool
    splits_nodes: bool


ENGINES = {
    e.name: e
    for e in (
        TargetEngine("specheads", own_python=False, holds_target=False, splits_nodes=False),
        TargetEngine("vllm", own_python=True, holds_target=True, splits_nodes=True),
    )
}


def engine_of(cfg) -> TargetEngine:
    """The engine a config (any with an ``engine`` field) names; a one-line error for an unknown one."""
    try:
        return ENGINES[cfg.engine]
    except KeyError:
        raise UserError(f"engine={cfg.engine!r}: choose {' or '.join(ENGINES)}") from None
