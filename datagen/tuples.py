"""Judge training tuples: a question, a correct answer, a wrong answer and where it first goes wrong.

JSONL schema, one object per line (``schema_version`` 1)::

    {"question": str,                       # the prompt, as the user wrote it
     "correct": str,                        # an answer judged correct
     "wrong": str,                          # an answer judged wrong
     "error": [start, end],                 # characters of wrong[start:end]: its first mistake
     "provenance": {"correct_model": str, "wrong_model": str, "annotator": str, ...},   # optional
     "id": str}                             # optional

``error`` is a half-open character span (Python string indices, so a multi-byte character is one
position). ``correct`` may be empty only when ``wrong`` is given and vice versa; both empty, an
empty question, a span outside ``wrong`` or an empty span, and a ``wrong`` without ``error`` are
errors that name the line. Token labels (:func:`token_labels`) come from the target tokenizer's
character offsets.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from specheads.errors import UserError

SCHEMA_VERSION = 1
IGNORE = -1  # label of tokens after the error: no loss


@dataclass
class JudgeTuple:
    """One annotated tuple (see the module docstring)."""

    question: str
    correct: str
    wrong: str
    error: tuple[int, int] | None
    provenance: dict = field(default_factory=dict)
    id: str = ""

    def to_json(self) -> str:
        d = asdict(self)
        d["error"] = list(self.error) if self.error is not None else None
        return json.dumps(d, ensure_ascii=False)


def _problem(row, where: str) -> JudgeTuple:
    if not isinstance(row, dict):
        raise UserError(f"{where}: expected a JSON object, got {type(row).__name__}")
    missing = [k for k in ("question", "correct", "wrong") if k not in row]
    if missing:
        raise UserError(f"{where}: missing field(s) {missing}; each tuple needs question, correct, wrong and error")
    for key in ("question", "correct", "wrong"):
        if not isinstance(row[key], str):
            raise UserError(f"{where}: {key!r} must be a string")
    if not row["question"].strip():
        raise UserError(f"{where}: the question is empty")
    if not row["correct"].strip() and not row["wrong"].strip():
        raise UserError(f"{where}: both answers are empty")
    error = row.get("error")
    if row["wrong"].strip():
        if error is None:
            raise UserError(
                f'{where}: the wrong answer has no error span; add "error": [start, end] '
                "(characters of its first mistake)"
            )
        if (
            not isinstance(error, (list, tuple))
            or len(error) != 2
            or not all(isinstance(v, int) and not isinstance(v, bool) for v in error)
        ):
            raise UserError(f'{where}: "error" must be [start, end] character offsets, got {error!r}')
        start, end = error
        if not 0 <= start < end <= len(row["wrong"]):
            raise UserError(
                f"{where}: error span [{start}, {end}] is outside the wrong answer "
                f"(length {len(row['wrong'])} characters) or empty"
            )
        error = (start, end)
    elif error is not None:
        raise UserError(f"{where}: an error span but an empty wrong answer")
    prov = row.get("provenance", {})
    if not isinstance(prov, dict):
        raise UserError(f'{where}: "provenance" must be an object')
    version = row.get("schema_version", SCHEMA_VERSION)
    if not isinstance(version, int) or version > SCHEMA_VERSION:
        raise UserError(
            f"{where}: schema_version={version!r} is newer than this specheads ({SCHEMA_VERSION}); upgrade specheads"
        )
    return JudgeTuple(row["question"], row["correct"], row["wrong"], error, prov, str(row.get("id", "")))


def load_tuples(path: str | Path) -> list[JudgeTuple]:
    """Reads and validates a tuple file; the first bad line ends it with a UserError naming the line."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"tuple file {str(path)!r} does not exist")
    out = []
    with open(path, "rb") as fh:
        for number, raw in enumerate(fh, start=1):
            where = f"{path} line {number}"
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                raise UserError(f"{where} is not UTF-8; re-encode the file as UTF-8") from None
            if not text.strip():
                continue
            try:
                row = json.loads(text)
            except json.JSONDecodeError as err:
                raise UserError(f"{where} is not valid JSON ({err.msg}); one tuple object per line") from None
            t = _problem(row, where)
            out.append(
                t
                if t.id
                else JudgeTuple(t.question, t.correct, t.wrong, t.error, t.provenance, f"{path.stem}-{number}")
            )
    if not out:
        raise UserError(f"tuple file {str(path)!r} holds no tuples")
    return out


def write_tuples(path: str | Path, tuples: list[JudgeTuple]) -> Path:
    """Writes tuples as JSONL (atomically)."""
    from specheads.outputs import atomic_write_text

    atomic_write_text(Path(path), "".join(t.to_json() + "\n" for t in tuples))
    return Path(path)


def span_labels(offsets: list[tuple[int, int]], error: tuple[int, int] | None) -> list[int]:
    """Per answer token, from its character span ``[s, e)``.

    Without an error (a correct answer) every token is 1. With ``error = [es, ee)``: tokens
    ending at or before ``es`` are 1, tokens overlapping the error 0 (a token straddling its
    start included), tokens starting at or after ``ee`` :data:`IGNORE`.
    """
    if error is None:
        return [1] * len(offsets)
    es, ee = error
    out = []
    for s, e in offsets:
        if e <= s:  # a token with no characters of its own (e.g. a special token): by position
            e = s + 1 if s < es else s
        if e <= es:
            out.append(1)
        elif s < ee:
            out.append(0)
        else:
            out.append(IGNORE)
    return out


def token_labels(tokenizer, answer: str, error: tuple[int, int] | None) -> tuple[list[int], list[int]]:
    """The answer's token ids (no special tokens) and their labels, from the tokenizer's offsets.

    Needs a fast tokenizer (``return_offsets_mapping``).
    """
    enc = tokenizer(answer, add_special_tokens=False, return_offsets_mapping=True)
    offsets = [tuple(o) for o in enc["offset_mapping"]]
    return list(enc["input_ids"]), span_labels(offsets, error)
