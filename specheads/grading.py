"""Answer grading shared by the stages: GSM8K-style final numbers, ARC letters and single facts.

``heads-datagen labels=judge`` grades the models' answers to build correct/wrong tuples (its
arithmetic checker, ``datagen/arith.py``, then localises the first false step of a wrong one);
``heads-eval`` grades every configuration's outputs for its accuracy table. A prompt is graded
when it carries a reference: ARC by the first standalone letter A-E of the answer, a fact question
(:mod:`specheads.facts`) by the first sentence of the answer, a numeric reference by the final answer
(the number after ``####``, else the last number in the text). :func:`chance` is what guessing scores.
"""

from __future__ import annotations

import re

from specheads import facts

NUMBER = r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+"  # 1,250 / 3.5 / -.5
_LETTER = re.compile(r"\b([A-E])\b")


def parse_number(text: str) -> float:
    """A written number as a float (thousands commas and ``$`` dropped); ValueError if it is none."""
    return float(text.replace(",", "").replace("$", "").strip())


def final_answer(text: str) -> tuple[str, int, int] | None:
    """The final answer and its span: the number after ``####``, else the last number in the text."""
    marker = text.rfind("####")
    region, base = (text[marker + 4 :], marker + 4) if marker >= 0 else (text, 0)
    nums = list(re.finditer(NUMBER, region))
    if not nums:
        return None
    m = nums[0] if marker >= 0 else nums[-1]
    return m.group().replace(",", ""), base + m.start(), base + m.end()


def final_correct(text: str, reference: str) -> bool:
    """Whether the final answer of ``text`` equals ``reference`` (as numbers, else as written)."""
    fin = final_answer(text)
    if fin is None:
        return False
    try:
        return abs(parse_number(fin[0]) - parse_number(reference)) < 1e-6
    except ValueError:
        return fin[0].strip() == reference.strip()


def grade(prompt, text: str) -> bool | None:
    """Whether ``text`` answers ``prompt`` correctly; None when no grader fits the prompt.

    Args:
        prompt: a :class:`specheads.prompts.Prompt` (its ``reference`` and ``source``).
        text: the answer.
    """
    if prompt.reference is None:
        return None
    if prompt.source == "arc":
        return letter(text) == prompt.reference.strip()
    if prompt.source in ("facts", "extract"):  # graded by naming an accepted answer (specheads.facts)
        return facts.correct(text, prompt.reference.split(facts.SEPARATOR))
    try:
        float(prompt.reference.replace(",", ""))
    except ValueError:
        return None
    return final_correct(text, prompt.reference)


def letter(text: str) -> str | None:
    """The letter an ARC answer chooses: the first standalone A-E, or None."""
    m = _LETTER.search(text)
    return m.group(1) if m else None


def number(text: str) -> str | None:
    """The final number of a GSM8K-style answer (:func:`final_answer`), normalised (``1,250.0`` -> ``1250``; every
    significant digit a float holds, so ``1234567`` and ``1234571`` stay apart)."""
    fin = final_answer(text)
    if fin is None:
        return None
    try:
        return f"{parse_number(fin[0]):.15g}"
    except ValueError:
        return fin[0].strip()


def answer(prompt, text: str) -> str | None:
    """The answer ``grade`` reads from ``text`` (ARC: the letter; numeric: the final number, normalised),
    to compare two outputs' answers; None when there is none or no grader fits the prompt."""
    if grade(prompt, text) is None:
        return None
    if prompt.source in ("facts", "extract"):
        return facts.answer(text, prompt.reference.split(facts.SEPARATOR))
    return letter(text) if prompt.source == "arc" else number(text)


def chance(prompt) -> float:
    """The accuracy of guessing on a graded prompt: one over its number of choices (ARC; four when the row
    does not say), 0 for an open answer (a number, a fact), where no fixed set of answers is there to guess from."""
    if prompt.source == "arc":
        return 1.0 / (prompt.choices or 4)
    return 0.0
