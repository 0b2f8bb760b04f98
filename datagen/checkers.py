"""Answer checkers of swap mining (``heads-datagen labels=judge judge.mining=swap``): the final answer a response
gives, so that two responses to one prompt can be compared (a swapped-in draft token is *important* when
the answer changes).

A checker is a callable ``(prompt, response_text) -> answer`` (any value comparable with ``==``; None when
the response gives none). ``prompt`` is a :class:`specheads.prompts.Prompt` (``text`` or ``messages``,
``source``, ``reference``, ``id``). Built in (``judge.checker=``):

* ``gsm8k``: the final number (after ``####``, else the last number in the text), as a number;
* ``arc``: the chosen letter (the first standalone A-E), as :mod:`specheads.grading` reads it;
* ``named``: for the fact and extraction questions (``specheads:facts``, ``specheads:extract``), the accepted
  answer when the first sentence names it, else that sentence's words (:func:`specheads.grading.answer`);
* ``exact``: the whole response, normalised (case, whitespace, surrounding punctuation);
* ``auto`` (default): ``gsm8k`` for GSM8K prompts, ``arc`` for ARC, ``named`` for facts and extraction
  questions, ``exact`` for the rest.

A checker whose answer, once a response gives one, stays put as text is appended (ARC's first letter) is
*prefix-stable*: a response cut at the length limit still has a trustworthy answer when it had the same one a
token earlier (:func:`stable`). ``arc`` is; ``gsm8k`` (the last number moves with the cut) and ``exact`` are
not; ``auto`` is for ARC prompts; a user's callable is when it has an attribute ``prefix_stable = True``.

Anything else names a user's callable as ``module:function`` (``mypkg.checks:run_unit_tests``): imported
when the run starts (a missing module or function is a one-line error), called once per response.
"""

from __future__ import annotations

import importlib
import re
from typing import Any, Callable

from specheads.errors import UserError
from specheads.grading import answer, letter, number

Checker = Callable[[Any, str], Any]
_SPACE = re.compile(r"\s+")


def gsm8k(prompt, text: str) -> str | None:
    return number(text)


def arc(prompt, text: str) -> str | None:
    return letter(text)


def exact(prompt, text: str) -> str:
    return _SPACE.sub(" ", text).strip().strip(".,;:!?\"'").strip().lower()


def named(prompt, text: str) -> str | None:
    """A fact or extraction question's answer (:func:`specheads.grading.answer`): the accepted answer when the
    first sentence names it, else that sentence's words."""
    return answer(prompt, text)


def auto(prompt, text: str):
    return {"gsm8k": gsm8k, "arc": arc, "facts": named, "extract": named}.get(getattr(prompt, "source", None), exact)(
        prompt, text
    )


arc.prefix_stable = True


def stable(checker: Checker, prompt) -> bool:
    """Whether ``checker``'s answer to ``prompt`` survives appending text (see the module docstring)."""
    if checker is auto:
        return getattr(prompt, "source", None) == "arc"
    return getattr(checker, "prefix_stable", False) is True


CHECKERS: dict[str, Checker] = {"auto": auto, "gsm8k": gsm8k, "arc": arc, "named": named, "exact": exact}


def resolve(name: str) -> Checker:
    """The checker ``judge.checker=name`` names (see the module docstring); UserError when there is none."""
    if name in CHECKERS:
        return CHECKERS[name]
    module, _, attr = name.partition(":")
    if not module or not attr:
        raise UserError(f"judge.checker={name!r}: choose from {list(CHECKERS)} or name a callable as module:function")
    try:
        fn = getattr(importlib.import_module(module), attr)
    except ImportError as exc:
        raise UserError(f"judge.checker={name!r}: cannot import {module!r} ({exc})") from None
    except AttributeError:
        raise UserError(f"judge.checker={name!r}: module {module!r} has no {attr!r}") from None
    if not callable(fn):
        raise UserError(f"judge.checker={name!r}: {attr!r} is not callable")
    return fn
