"""Whether a graded source can tell a lossy policy's accuracy loss at all: the target alone against chance.

Where the target alone scores at chance (a random ARC letter scores one in four), a policy that changes
every answer loses no accuracy, so its accuracy drop says nothing. Per graded source, :func:`competence`
reports the target's accuracy with its 95% interval next to the chance level
(:func:`specheads.grading.chance`: one over the number of choices, 0 for an open answer) and calls the
source ``informative`` when the interval's lower bound clears chance by at least ``margin`` (10 points by
default): a target a few points above chance has only those few points to lose, so a one-point bound on
the drop would hardly constrain anything. ``select=max_drop`` counts only informative sources; answer
agreement with the target (``max_disagree``) counts on every graded source.
"""

from __future__ import annotations

from specheads.evaluate.intervals import mean_interval
from specheads.grading import chance

MARGIN = 0.1


def competence(prompts, correct: list[int | None], margin: float = MARGIN) -> dict:
    """Per graded source: the target alone's accuracy, its interval, the chance level and ``informative``.

    Args:
        prompts: the sweep's prompts (their ``source`` and what :func:`~specheads.grading.chance` reads).
        correct: the target alone's 0/1 per prompt (None where no grader fits).
        margin: how far above chance the accuracy's lower bound must be.
    """
    by: dict[str, list[int]] = {}
    guess: dict[str, list[float]] = {}
    for p, c in zip(prompts, correct):
        if c is not None:
            by.setdefault(p.source, []).append(c)
            guess.setdefault(p.source, []).append(chance(p))
    out = {}
    for src, ok in by.items():
        a = mean_interval(ok)
        level = sum(guess[src]) / len(guess[src])
        informative = a["low"] - level >= margin
        out[src] = {
            "target_accuracy": round(a["value"], 4),
            "target_accuracy_low": round(a["low"], 4),
            "target_accuracy_high": round(a["high"], 4),
            "prompts": len(ok),
            "chance": round(level, 4),
            "margin": margin,
            "informative": informative,
        }
        if not informative:
            out[src]["note"] = (
                f"not informative: the target's accuracy lower bound {a['low']:.3f} is not {margin} above chance "
                f"{level:.3f}; accuracy-drop figures here say nothing about quality"
            )
    return out


def describe(block: dict) -> list[str]:
    """The ``competence`` section as text lines."""
    lines = []
    for src, c in block.items():
        lines.append(
            f"competence {src}: target {c['target_accuracy']} [{c['target_accuracy_low']}, "
            f"{c['target_accuracy_high']}] ({c['prompts']} prompts), chance {c['chance']}: "
            + ("informative" if c["informative"] else "NOT informative (accuracy drops here are not used)")
        )
    return lines
