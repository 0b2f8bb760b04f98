"""How prompt settings are spelled: per-source response budgets, row slices of a prompt file, open user turns."""

from __future__ import annotations

import re

from specheads.errors import UserError

SOURCES = (
    "arc",
    "gsm8k",
    "facts",
    "extract",
    "mt_bench",
    "alpaca",
    "prompt",
    "messages",
)  # a Prompt's ``source``, by file format


def budget_problems(key: str, budgets: dict) -> list[str]:
    """One line per bad entry of a per-source response length setting (``{arc: 16}``) named ``key``."""
    return [
        f"{key}.{src}={n!r}: expected one of {list(SOURCES)} -> an int >= 1"
        for src, n in budgets.items()
        if src not in SOURCES or not isinstance(n, int) or isinstance(n, bool) or n < 1
    ]


_SLICE = re.compile(r"^(?P<path>.+)\[(?P<start>\d*):(?P<stop>\d*)\]$")


def split_slice(path: str, limit: int | None, offset: int) -> tuple[str, int | None, int]:
    """``file[500:650]`` -> ``(file, 150, 500)``: a slice after a file name picks its rows and overrides
    ``limit`` and ``offset`` for that file; a name without one keeps them."""
    m = _SLICE.match(path)
    if m is None:
        return path, limit, offset
    start, stop = int(m["start"] or 0), int(m["stop"]) if m["stop"] else None
    if stop is not None and stop <= start:
        raise UserError(f"prompt file {path!r}: the slice is empty; use file[start:stop] with start < stop")
    return m["path"], None if stop is None else stop - start, start


def open_user_turn(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of ``messages`` (the last: a user turn without content) rendered by the chat template up to where
    the user's words begin: what a model continues to write a user's request (Magpie; ``labels=prompts``)."""
    if not getattr(tokenizer, "chat_template", None):
        raise UserError("an open user turn needs a tokenizer with a chat template")
    mark = "\u2063open-user-turn\u2063"  # rendered in place of the words, then cut off with them
    rendered = tokenizer.apply_chat_template([*messages[:-1], {"role": "user", "content": mark}], tokenize=False)
    if mark not in rendered:
        raise UserError("the tokenizer's chat template drops the user's words; it cannot render an open user turn")
    return tokenizer(rendered[: rendered.index(mark)], add_special_tokens=False)["input_ids"]
