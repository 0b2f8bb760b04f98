"""``heads-datagen recipe=... show [index=N]``: one searched prompt of a ``judge.mining=swap`` run, coloured.

Reads ``mined.jsonl`` of the run's ``output_dir`` (the ``N``-th record, default the first) and prints
the question, the target's final answer, and the final response token by token with every tried
mismatch marked: an unimportant one shows the draft's token that was kept (green) with the target's
token it replaced in brackets; an important one shows the draft's token that would have changed the
answer (red, struck through ``[draft -> answer]``) before the target's token that stayed. Colours go
to a terminal only (``NO_COLOR`` turns them off, ``FORCE_COLOR`` on).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from specheads.errors import UserError

GREEN, RED, DIM, RESET = "\033[32m", "\033[31m", "\033[2m", "\033[0m"


def _color() -> bool:
    if os.environ.get("NO_COLOR"):
        return False
    return bool(os.environ.get("FORCE_COLOR")) or sys.stdout.isatty()


def render(rec: dict, color: bool) -> str:
    """One record of ``mined.jsonl`` as text."""

    def paint(code: str, text: str) -> str:
        return f"{code}{text}{RESET}" if color else text

    by_pos: dict[int, list[dict]] = {}
    for m in rec["marks"]:
        by_pos.setdefault(m["position"], []).append(m)
    body = []
    for j, tok in enumerate(rec["response_tokens"]):
        marks = by_pos.get(j, [])
        for m in marks:
            if m["important"]:
                body.append(paint(RED, f"[{m['draft_token']!r} -> {m['answer_after']}]"))
            elif m["important"] is None:
                body.append(paint(DIM, f"[{m['draft_token']!r} -> ? (ran to the length limit)]"))
        kept = next((m for m in marks if m["important"] is False), None)
        body.append(paint(GREEN, tok) + paint(DIM, f"[{kept['target_token']!r}]") if kept else tok)
    verdicts = [m["important"] for m in rec["marks"]]
    lines = [
        f"prompt {rec['prompt_index']} ({rec['source']}, id {rec['prompt_id']}): "
        f"{rec['mismatches_tried']} mismatches tried, {verdicts.count(True)} important, "
        f"{verdicts.count(False)} unimportant"
        + (f", {verdicts.count(None)} undetermined" if None in verdicts else "")
        + (", budget hit" if rec["budget_hit"] else "")
        + (
            ""
            if rec.get("searchable", True)
            else ", not searched (its answer ran to the length limit or gives no answer)"
        ),
        f"question: {rec['question']}",
        f"answer: {rec['answer']}",
        "",
        "".join(body),
        "",
        "legend: "
        + paint(GREEN, "draft token kept")
        + paint(DIM, "['target token']")
        + "  "
        + paint(RED, "['draft token' -> answer it gives]")
        + " rejected before the target's token",
    ]
    return "\n".join(lines)


def show(output_dir: str, index: str | int) -> int:
    """Prints record ``index`` of ``output_dir/mined.jsonl``; a missing file or index is a UserError."""
    try:
        index = int(index)
    except ValueError:
        raise UserError(f"index={index!r}: expected a record number (0, 1, ...)") from None
    path = Path(output_dir) / "mined.jsonl"
    if not path.is_file():
        raise UserError(f"{path} not found: show reads a finished heads-datagen labels=judge judge.mining=swap run")
    records = [x for x in path.read_text(encoding="utf-8").splitlines() if x.strip()]
    if not 0 <= index < len(records):
        raise UserError(f"index={index}: {path} holds {len(records)} records (index 0 to {len(records) - 1})")
    print(render(json.loads(records[index]), _color()))
    return 0
