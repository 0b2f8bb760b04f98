"""Prompt files: JSONL or JSON arrays in the common benchmark layouts, auto-detected per row.

Recognised rows (extra fields are ignored):

- ``{"prompt": str}`` or ``{"messages": [{"role", "content"}, ...]}``, optional ``id``,
  ``reference``;
- GSM8K ``{"question", "answer"}``: the reference is the final answer after ``####``;
- Alpaca ``{"instruction", "input", "output"}`` (usually a JSON array file);
- MT-Bench ``{"question_id", "turns"}``: the first turn;
- ARC ``{"question", "choices": {"text", "label"}, "answerKey"}``: lettered choices;
- facts ``{"question", "answers": [str, ...]}``: one fact, any of the answers right
  (:mod:`specheads.facts`; the prompt file ``specheads:facts`` is its built-in question set).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from specheads.errors import UserError
from specheads.prompt_spec import split_slice

RECOGNISED = "prompt, messages, question (GSM8K/ARC/facts), instruction (Alpaca), turns (MT-Bench)"


_BOM = b"\xef\xbb\xbf"


@dataclass
class Prompt:
    """One prompt; exactly one of ``text`` and ``messages`` is set.

    Attributes:
        id: Row id from the file, else ``"<file stem>-<row index>"``.
        text: Plain prompt text (a chat template is applied later, by the model side).
        messages: Chat messages ``[{"role": ..., "content": ...}]``.
        reference: Expected answer when the data set has one (GSM8K number, ARC letter...).
        source: Row layout it was read as: ``prompt``, ``messages``, ``gsm8k``, ``alpaca``,
            ``mt_bench`` or ``arc``.
        reference_text: The data set's whole reference response when it has one (GSM8K
            solution, Alpaca output, a ``reference`` field): what text-overlap metrics compare with.
        choices: The number of choices of a multiple-choice question (ARC), else None.
    """

    id: str
    text: str | None = None
    messages: list[dict] | None = None
    reference: str | None = None
    source: str = ""
    reference_text: str | None = None
    choices: int | None = None


def _messages(value: Any, where: str) -> list[dict]:
    if not isinstance(value, list) or not value:
        raise UserError(
            f"{where}: 'messages' must be a non-empty list of {{role, content}} objects, got {_short(value)}"
        )
    for i, msg in enumerate(value):
        ok = isinstance(msg, dict) and isinstance(msg.get("role"), str) and isinstance(msg.get("content"), str)
        if not ok:
            raise UserError(
                f"{where}: messages[{i}] must be an object with string 'role' and 'content', got {_short(msg)}"
            )
    return [dict(m) for m in value]


def _short(value: Any, limit: int = 80) -> str:
    text = json.dumps(value, ensure_ascii=False)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _str_field(row: dict, key: str, where: str) -> str:
    value = row[key]
    if not isinstance(value, str):
        raise UserError(f"{where}: {key!r} must be a string, got {_short(value)}")
    return value


def _gsm8k_reference(answer: Any) -> str | None:
    if not isinstance(answer, str):
        return None if answer is None else str(answer)
    final = answer.rsplit("####", 1)[-1] if "####" in answer else answer
    return final.strip().replace(",", "")


def _arc_text(row: dict, where: str) -> str:
    choices = row["choices"]
    texts = choices.get("text") if isinstance(choices, dict) else None
    labels = choices.get("label") if isinstance(choices, dict) else None
    if not isinstance(texts, list) or not isinstance(labels, list) or len(texts) != len(labels):
        raise UserError(
            f"{where}: 'choices' must be {{text: [...], label: [...]}} of equal length, got {_short(choices)}"
        )
    lines = [_str_field(row, "question", where)]
    lines += [f"{label}. {text}" for label, text in zip(labels, texts)]
    return "\n".join(lines) + "\nAnswer with the letter of the correct choice."


ANSWER_SOURCES = ("facts", "extract")  # rows {question, answers} graded by naming an answer (specheads.facts)


def _fact(row: dict, pid: str, where: str) -> Prompt:
    from specheads.facts import SEPARATOR

    answers = row["answers"]
    if not isinstance(answers, list) or not answers or not all(isinstance(a, str) and a.strip() for a in answers):
        raise UserError(f"{where}: 'answers' must be a non-empty list of non-empty strings, got {_short(answers)}")
    source = row.get("source", "facts")
    if source not in ANSWER_SOURCES:
        raise UserError(f"{where}: 'source' of a row with answers must be one of {list(ANSWER_SOURCES)}")
    return Prompt(pid, text=_str_field(row, "question", where), reference=SEPARATOR.join(answers), source=source)


def _to_prompt(row: Any, index: int, stem: str, where: str) -> Prompt:
    """Read one row in whichever recognised layout it has."""
    if not isinstance(row, dict):
        raise UserError(f"{where}: expected a JSON object, got {_short(row)}")
    rid = row.get("id", row.get("question_id"))
    pid = f"{stem}-{index}" if rid is None else str(rid)
    reference = row.get("reference")
    reference = None if reference is None else str(reference)
    if "messages" in row:
        msgs = _messages(row["messages"], where)
        return Prompt(pid, messages=msgs, reference=reference, source="messages", reference_text=reference)
    if "prompt" in row:
        return Prompt(
            pid, text=_str_field(row, "prompt", where), reference=reference, source="prompt", reference_text=reference
        )
    if "turns" in row:
        turns = row["turns"]
        if not isinstance(turns, list) or not turns or not isinstance(turns[0], str):
            raise UserError(f"{where}: 'turns' must be a non-empty list of strings, got {_short(turns)}")
        return Prompt(pid, text=turns[0], reference=reference, source="mt_bench")
    if "question" in row and "choices" in row:
        ref = reference or (None if row.get("answerKey") is None else str(row["answerKey"]))
        return Prompt(pid, text=_arc_text(row, where), reference=ref, source="arc", choices=len(row["choices"]["text"]))
    if "question" in row and "answers" in row:
        return _fact(row, pid, where)
    if "question" in row:
        ref = reference or _gsm8k_reference(row.get("answer"))
        full = row.get("answer") if isinstance(row.get("answer"), str) else reference
        return Prompt(pid, text=_str_field(row, "question", where), reference=ref, source="gsm8k", reference_text=full)
    if "instruction" in row:
        text = _str_field(row, "instruction", where)
        extra = row.get("input") or ""
        if not isinstance(extra, str):
            raise UserError(f"{where}: 'input' must be a string, got {_short(extra)}")
        ref = reference or (None if row.get("output") is None else str(row["output"]))
        return Prompt(
            pid, text=text + ("\n\n" + extra if extra else ""), reference=ref, source="alpaca", reference_text=ref
        )
    keys = ", ".join(map(str, row)) or "(none)"
    raise UserError(f"{where}: row has none of the recognised fields ({RECOGNISED}); its keys: {keys}")


def _decode(raw: bytes, path: Path, line: int) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UserError(
            f"{path} line {line} is not UTF-8 ({exc.reason} at byte {exc.start}); re-encode the file as UTF-8"
        ) from None


def _jsonl_rows(path: Path, handle: Any) -> Iterator[tuple[int, int, bytes]]:
    """``(row_index, line_number, raw_line)`` for each non-blank line."""
    index = 0
    for number, raw in enumerate(handle, start=1):
        if number == 1 and raw.startswith(_BOM):
            raw = raw[len(_BOM) :]
        if raw.strip():
            yield index, number, raw
            index += 1


def _parse_line(raw: bytes, path: Path, number: int) -> Any:
    text = _decode(raw, path, number)
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise UserError(
            f"{path} line {number} is not valid JSON ({exc.msg} at column "
            f"{exc.colno}): {text.strip()[:60]!r}; fix or remove that line"
        ) from None


def _array_rows(path: Path, data: bytes) -> list[Any]:
    """Rows of a file that starts with ``[`` (so it parses to a list or not at all)."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        raise UserError(f"{path} line {line} is not UTF-8 ({exc.reason}); re-encode the file as UTF-8") from None
    try:
        return json.loads(text.lstrip("\ufeff"))
    except json.JSONDecodeError as exc:
        raise UserError(
            f"{path} line {exc.lineno} is not valid JSON ({exc.msg} at column {exc.colno}); fix the file"
        ) from None


def read_rows(path: Path) -> list[Any]:
    """Every row of a JSONL file (one value a line) or a JSON array file, parsed, in file order; the same format
    detection and one-line errors (file and line) as :func:`iter_prompts`, without turning rows into prompts."""
    with path.open("rb") as handle:
        if handle.read(4096).lstrip(_BOM).lstrip().startswith(b"["):
            handle.seek(0)
            return _array_rows(path, handle.read())
        handle.seek(0)
        return [_parse_line(raw, path, number) for _, number, raw in _jsonl_rows(path, handle)]


def iter_prompts(path: str | Path, limit: int | None = None, offset: int = 0) -> Iterator[Prompt]:
    """Prompts of a JSONL file (one object a line) or a JSON array file, one at a time.

    A JSONL file is read line by line (memory does not grow with the file); a JSON array file
    has to be parsed whole.

    Args:
        path: The prompt file.
        limit: At most this many prompts (``None``: all).
        offset: Skip this many rows first (row ids keep their position in the file).

    Yields:
        The prompts in file order.

    Raises:
        UserError: Missing, empty or non-UTF-8 file, invalid JSON or an unrecognised row
            (naming the file and line), raised when the reader reaches it.
    """
    if limit is not None and limit < 0 or offset < 0:
        raise UserError(f"limit and offset must be >= 0, got limit={limit}, offset={offset}")
    if str(path).startswith(("specheads:facts", "specheads:extract")):  # the built-in graded questions
        from specheads.facts import builtin_rows

        items = builtin_rows(str(path))
        if offset >= len(items) and limit != 0:
            raise UserError(f"{path} has {len(items)} questions, none after offset={offset}; lower offset")
        for i, row in enumerate(items[offset : None if limit is None else offset + limit], start=offset):
            yield _fact(row, row["id"], f"{path} row {i}")
        return
    path = Path(path)
    if not path.exists():
        raise UserError(f"prompt file {str(path)!r} not found; check the path (relative paths start at {Path.cwd()})")
    if path.is_dir():
        raise UserError(f"prompt file {str(path)!r} is a directory; give a .jsonl or .json file")
    seen = given = 0
    with path.open("rb") as handle:
        head = handle.read(4096).lstrip(_BOM).lstrip()
        handle.seek(0)
        if head.startswith(b"["):  # one JSON array: it has to be parsed whole
            rows = _array_rows(path, handle.read())
            seen = len(rows)
            for index in range(offset, len(rows)):
                if limit is not None and given >= limit:
                    break
                given += 1
                yield _to_prompt(rows[index], index, path.stem, f"{path} element {index}")
        else:
            for index, number, raw in _jsonl_rows(path, handle):
                seen = index + 1
                if index < offset:
                    continue
                if limit is not None and given >= limit:
                    break
                given += 1
                yield _to_prompt(_parse_line(raw, path, number), index, path.stem, f"{path} line {number}")
    if seen == 0:
        raise UserError(f"prompt file {str(path)!r} is empty; give a file with prompts")
    if not given and limit != 0:
        raise UserError(f"prompt file {str(path)!r} has {seen} rows, none after offset={offset}; lower offset")


def load_prompts(path: str | Path, limit: int | None = None, offset: int = 0) -> list[Prompt]:
    """Every prompt of a file as a list (:func:`iter_prompts` reads them one at a time)."""
    return list(iter_prompts(path, limit, offset))


def _paths(spec: str) -> list[str]:
    paths = [p.strip() for p in str(spec).split(",") if p.strip()]
    if not paths:
        raise UserError("no prompt file given; set prompts=<file> (or several, comma-separated)")
    return paths


def iter_prompt_files(spec: str, limit: int | None = None, offset: int = 0) -> Iterator[Prompt]:
    """:func:`load_prompt_files`, one prompt at a time (bounded memory for JSONL files)."""
    for path in _paths(spec):
        path, n, start = split_slice(path, limit, offset)
        yield from iter_prompts(path, limit=n, offset=start)


def load_prompt_files(spec: str, limit: int | None = None, offset: int = 0) -> list[Prompt]:
    """Prompts from one file or several, comma-separated (``a.jsonl,b.json``), concatenated in order.

    ``limit`` and ``offset`` apply to each file, unless its name ends in a slice (``b.jsonl[500:650]``: rows
    500 to 649 of that file); ids stay unique (``<file stem>-<row>``).
    """
    return list(iter_prompt_files(spec, limit, offset))
