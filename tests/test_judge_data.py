"""Judge tuples: the arithmetic checker, the JSONL schema's validation, token labels from character offsets."""

from __future__ import annotations

import json

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from specheads.datagen import arith
from specheads.datagen.tuples import IGNORE, load_tuples, span_labels, token_labels
from specheads.errors import UserError

GOOD = (
    "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n"
    "Natalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.\n#### 72"
)


def test_checker_accepts_a_correct_solution():
    c = arith.check(GOOD, "72")
    assert c.error_span is None and c.final_correct is True and c.final_answer == "72"
    assert [s.correct for s in c.steps] == [True, True]


def test_checker_finds_the_first_false_annotation():
    text = GOOD.replace("<<48+24=72>>72", "<<48+24=71>>71").replace("#### 72", "#### 71")
    c = arith.check(text, "72")
    start, end = c.error_span
    assert text[start:end] == "71" and text.index("<<48+24=71>>") < start < text.index(">>71")
    assert c.final_correct is False


def test_checker_finds_the_first_false_inline_step():
    text = "She has 3 * 4 = 12 apples and 12 + 5 = 18 pears, so 18 - 2 = 15 are left.\n#### 15"
    c = arith.check(text, "15")
    start, end = c.error_span
    assert text[start:end] == "18" and start == text.index("= 18") + 2  # the second step, not the third
    assert [s.correct for s in c.steps] == [True, False, False]


@pytest.mark.parametrize(
    "text, ok",
    [
        ("10 / 3 = 3.33 each", True),  # rounding the text shows
        ("7 / 2 = 3 each", False),  # an integer that is not the result
        ("$1,200 x 2 = $2,400 in total", True),
        ("20% * 50 = 10 students", True),
        ("2 × 3 + 1 = 7", True),
        ("(4 + 6) * 3 = 30", True),
        ("12 ÷ 4 = 4", False),
    ],
)
def test_checker_step_forms(text, ok):
    c = arith.check(text)
    assert len(c.steps) == 1 and c.steps[0].correct is ok and (c.error_span is None) is ok


def test_checker_final_answer_without_marker_and_unsafe_input():
    assert arith.check("So the answer is 1,250.", "1250").final_correct is True
    assert arith.evaluate("__import__('os').system('true')") is None
    assert arith.evaluate("2 ** 10") is None  # powers are not arithmetic steps here
    assert arith.check("no numbers here", "3").final_correct is False


def _write(tmp_path, rows):
    path = tmp_path / "t.jsonl"
    path.write_text(
        "".join((r if isinstance(r, str) else json.dumps(r, ensure_ascii=False)) + "\n" for r in rows), encoding="utf-8"
    )
    return path


OK_ROW = {
    "question": "2+2?",
    "correct": "4",
    "wrong": "2+2 is 5",
    "error": [7, 8],
    "provenance": {"correct_model": "target", "wrong_model": "draft", "annotator": "arith"},
}


def test_tuples_load(tmp_path):
    tuples = load_tuples(_write(tmp_path, [OK_ROW, {**OK_ROW, "id": "x"}]))
    assert tuples[0].error == (7, 8) and tuples[0].id == "t-1" and tuples[1].id == "x"
    assert tuples[0].provenance["annotator"] == "arith"


@pytest.mark.parametrize(
    "row, message",
    [
        ({**OK_ROW, "error": [7, 30]}, "outside the wrong answer"),
        ({**OK_ROW, "error": [5, 5]}, "or empty"),
        ({**OK_ROW, "correct": "", "wrong": ""}, "both answers are empty"),
        ({k: v for k, v in OK_ROW.items() if k != "error"}, "no error span"),
        ({**OK_ROW, "question": " "}, "question is empty"),
        ({**OK_ROW, "error": "7-8"}, "[start, end]"),
        ({**OK_ROW, "schema_version": 9}, "newer"),
        ("{not json", "not valid JSON"),
    ],
)
def test_tuples_bad_lines_name_the_line(tmp_path, row, message):
    with pytest.raises(UserError) as err:
        load_tuples(_write(tmp_path, [OK_ROW, row]))
    assert "line 2" in str(err.value) and message in str(err.value)


def test_tuples_not_utf8(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_bytes(json.dumps(OK_ROW).encode() + b"\n\xff\xfe\n")
    with pytest.raises(UserError, match="line 2 is not UTF-8"):
        load_tuples(path)


def test_span_labels_by_hand():
    offsets = [(0, 3), (3, 5), (5, 9), (9, 12), (12, 15)]
    assert span_labels(offsets, None) == [1, 1, 1, 1, 1]
    # error [6, 10): token (5, 9) straddles its start, (9, 12) its end; (12, 15) comes after
    assert span_labels(offsets, (6, 10)) == [1, 1, 0, 0, IGNORE]
    assert span_labels(offsets, (5, 9)) == [1, 1, 0, IGNORE, IGNORE]


@pytest.fixture(scope="module")
def bpe():
    """A byte-level BPE trained here, on text with multi-byte characters (é, €, 数)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = ["the café costs 12 euros", "le café coûte 12 €", "数学 is 12 + 3 = 15", "cafés and 123 dollars"] * 20
    tok.train_from_iterator(
        corpus,
        trainers.BpeTrainer(vocab_size=300, show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()),
    )
    return PreTrainedTokenizerFast(tokenizer_object=tok)


def test_token_labels_multibyte_and_straddling(bpe):
    wrong = "le café coûte 13 € et 数学 15"
    start = wrong.index("3 €")  # the error starts inside the token "13" (character, not byte, offsets)
    ids, labels = token_labels(bpe, wrong, (start, start + 1))
    enc = bpe(wrong, add_special_tokens=False, return_offsets_mapping=True)
    assert ids == enc["input_ids"] and len(labels) == len(ids)
    pieces = [wrong[s:e] for s, e in enc["offset_mapping"]]
    # character offsets covering the text; the byte pieces of one multi-byte character share its span
    assert {i for s, e in enc["offset_mapping"] for i in range(s, e)} == set(range(len(wrong)))
    straddle = next(i for i, (s, e) in enumerate(enc["offset_mapping"]) if s < start < e or s == start)
    assert labels[straddle] == 0
    assert all(v == 1 for v in labels[:straddle])  # "le café coûte 1..." before the error, é and û included
    assert all(v == IGNORE for v in labels[straddle + 1 :]) and "数" in "".join(pieces[straddle + 1 :])
    # An error on "€", a character this tokenizer splits into byte tokens: every piece of it is 0.
    euro = wrong.index("€")
    _, labels_e = token_labels(bpe, wrong, (euro, euro + 1))
    pieces_e = [i for i, (s, e) in enumerate(enc["offset_mapping"]) if s <= euro < e]
    assert len(pieces_e) >= 1 and all(labels_e[i] == 0 for i in pieces_e)
    assert all(v == 1 for v in labels_e[: pieces_e[0]]) and all(v == IGNORE for v in labels_e[pieces_e[-1] + 1 :])
    ids_c, labels_c = token_labels(bpe, "le café coûte 12 €", None)
    assert labels_c == [1] * len(ids_c)


def test_extraction_questions_are_seeded_split_by_kind_and_graded_by_the_named_answer():
    """specheads:extract: the same questions every run; a kind subset holds exactly the full set's questions of
    those kinds; graded (and mined) by naming the field's value."""
    from specheads.datagen.checkers import auto
    from specheads.errors import UserError
    from specheads.facts import builtin_rows
    from specheads.grading import chance, grade
    from specheads.prompts import iter_prompt_files

    every = list(iter_prompt_files("specheads:extract"))
    assert len(every) == 360 and {p.source for p in every} == {"extract"}
    again = list(iter_prompt_files("specheads:extract"))
    assert [(p.id, p.text, p.reference) for p in every] == [(p.id, p.text, p.reference) for p in again]
    some = list(iter_prompt_files("specheads:extract:phone+age"))
    assert [p.id for p in some] == [p.id for p in every if p.id.split("-")[1] in ("phone", "age")]
    p = some[0]
    assert p.reference in p.text and grade(p, f"{p.reference}.") and not grade(p, "I cannot tell.")
    assert chance(p) == 0.0 and auto(p, f"It is {p.reference}.") == p.reference
    facts = list(iter_prompt_files("specheads:facts:capital+symbol"))
    assert len(facts) == 190 and {q.id.split("-")[1] for q in facts} == {"capital", "symbol"}
    assert len(builtin_rows("specheads:facts")) == 392
    for bad in ("specheads:extract:colour", "specheads:nothing", "specheads:facts:"):
        with pytest.raises(UserError):
            builtin_rows(bad)
