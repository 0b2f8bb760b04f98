"""A graded single-fact task on which a small target is competent: questions from a committed fact table.

The table (``table.csv`` beside this module, written for this project from general knowledge: world
capitals, chemical symbols, antonyms, irregular past tenses and plurals, national languages) holds one
fact a row: ``kind, subject, answer, aliases`` (aliases ``;``-separated; a question whose answer is
spelled in its own subject, such as the capital of Luxembourg, is left out, since it would always
grade right). :func:`rows` turns it into questions with a seeded generator: one phrasing per fact
drawn from its kind's templates, the rows in a seeded order, so that the even (calibration) and odd
(test) halves of ``heads-eval select=`` mix the kinds alike.

Use it as a prompt file named ``specheads:facts`` (``heads-eval prompts=specheads:facts``; one kind or several:
``specheads:facts:capital+symbol``), or write it out with ``python -m specheads.facts facts.jsonl``: rows
``{"id", "question", "answers", "kind"}``, read back as source ``facts``. :mod:`specheads.facts.extract` is a
second such task (``specheads:extract``).

The checker (:func:`correct`) reads the first sentence of the answer and accepts it when one of the
accepted answers appears in it as whole words (accents and case folded; an answer of one or two
characters, a chemical symbol, is matched with its case). Chance on open answers is 0: no fixed set of
choices to guess from.
"""

from __future__ import annotations

import csv
import json
import random
import re
import sys
import unicodedata
from pathlib import Path

TABLE = Path(__file__).with_name("table.csv")
NAME = "specheads:facts"  # the prompt-file name that reads these rows
SEED = 0
TEMPLATES = {
    "capital": (
        "What is the capital of {s}? Answer with one word.",
        "What is the capital city of {s}? Answer in one short sentence.",
    ),
    "symbol": ("What is the chemical symbol for {s}? Answer with the symbol only.",),
    "antonym": ('What is the opposite of "{s}"? Answer with one word.',),
    "past": ('What is the past tense of the verb "{s}"? Answer with one word.',),
    "plural": ('What is the plural of "{s}"? Answer with one word.',),
    "language": ("What is the main language spoken in {s}? Answer with one word.",),
}
SEPARATOR = "|"  # between the accepted answers in a Prompt's reference
_SENTENCE_END = re.compile(r"[.!?](?=\s|$)|\n")


def table(path: str | Path = TABLE) -> list[dict]:
    """The fact table's rows: ``{"kind", "subject", "answers"}`` (the answer first, then its aliases)."""
    with open(path, encoding="utf-8", newline="") as handle:
        facts = []
        for row in csv.DictReader(handle):
            aliases = [a.strip() for a in (row.get("aliases") or "").split(";") if a.strip()]
            facts.append({"kind": row["kind"], "subject": row["subject"], "answers": [row["answer"], *aliases]})
    return facts


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", fold(text)).strip("_")


def rows(seed: int = SEED, path: str | Path = TABLE) -> list[dict]:
    """The questions, one per fact, in a seeded order: ``{"id", "question", "answers", "kind"}``."""
    rng = random.Random(seed)
    out = []
    for fact in table(path):
        template = rng.choice(TEMPLATES[fact["kind"]])
        out.append(
            {
                "id": f"facts-{fact['kind']}-{_slug(fact['subject'])}",
                "question": template.format(s=fact["subject"]),
                "answers": fact["answers"],
                "kind": fact["kind"],
            }
        )
    rng.shuffle(out)
    return out


def fold(text: str) -> str:
    """Lower case without accents (``Brasília`` -> ``brasilia``)."""
    return "".join(c for c in unicodedata.normalize("NFKD", text) if not unicodedata.combining(c)).lower()


def first_sentence(text: str) -> str:
    """The answer's first non-empty sentence (up to the first ``.``, ``!`` or ``?`` before a space, or a line end)."""
    for part in _SENTENCE_END.split(text.strip()):
        if part.strip():
            return part.strip()
    return ""


def _words(text: str, keep_case: bool) -> str:
    text = text if keep_case else fold(text)
    return " " + " ".join(re.findall(r"[^\W_]+", text)) + " "


def correct(text: str, answers: list[str]) -> bool:
    """Whether the first sentence of ``text`` names one of ``answers`` as whole words."""
    sentence = first_sentence(text)
    for a in answers:
        keep_case = len(a) <= 2  # a chemical symbol: "Co" is not "CO"
        words = _words(a, keep_case).strip()
        if words and f" {words} " in _words(sentence, keep_case):
            return True
    return False


def answer(text: str, answers: list[str]) -> str:
    """What the output answers, to compare two outputs: the accepted answer when it is right, else its first
    sentence (folded to words), so two wrong outputs agree only when they say the same thing."""
    return answers[0] if correct(text, answers) else _words(first_sentence(text), False).strip()


def builtin_rows(name: str) -> list[dict]:
    """The rows of a built-in question set: ``specheads:facts`` or ``specheads:extract``
    (:mod:`specheads.facts.extract`), optionally with ``:<kind>+<kind>`` (only those kinds, in the set's order);
    UserError for an unknown set or kind."""
    from specheads.errors import UserError
    from specheads.facts import extract

    base, sep, spec = name.partition(":")[2].partition(":")
    known = {"facts": sorted(TEMPLATES), "extract": list(extract.KINDS)}
    if base not in known:
        raise UserError(f"prompt file {name!r}: the built-in sets are specheads:facts and specheads:extract")
    kinds = [k for k in spec.split("+") if k] if sep else None
    bad = [k for k in kinds or [] if k not in known[base]]
    if bad or (sep and not kinds):
        raise UserError(f"prompt file {name!r}: unknown kind {bad or spec!r}; choose from {'+'.join(known[base])}")
    items = rows() if base == "facts" else extract.rows()
    return [r for r in items if kinds is None or r["kind"] in kinds]


def main(argv: list[str] | None = None) -> int:
    """``python -m specheads.facts OUT.jsonl [SEED]``: write the questions as a prompt file."""
    args = sys.argv[1:] if argv is None else argv
    if not args or len(args) > 2 or args[0].startswith("-"):
        print("usage: python -m specheads.facts OUT.jsonl [SEED]", file=sys.stderr)
        return 2
    seed = int(args[1]) if len(args) > 1 else SEED
    items = rows(seed)
    Path(args[0]).write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in items), encoding="utf-8")
    print(f"{len(items)} questions -> {args[0]}")
    return 0
