"""Prompt files: every layout against the real shared data, every error on small tmp files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from specheads.config import UserError
from specheads.prompts import Prompt, load_prompts

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"


def _data(relative: str) -> Path:
    path = DATA / relative
    if not path.is_file():
        pytest.skip(f"shared data file {path} is absent")
    return path


def _write(tmp_path: Path, name: str, text: str | bytes) -> Path:
    path = tmp_path / name
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text, encoding="utf-8")
    return path


def _jsonl(tmp_path: Path, rows: list[object], name: str = "p.jsonl") -> Path:
    return _write(tmp_path, name, "".join(json.dumps(r) + "\n" for r in rows))


def _error(path: Path, **kwargs: int) -> str:
    with pytest.raises(UserError) as info:
        load_prompts(path, **kwargs)
    assert "\n" not in str(info.value)
    return str(info.value)


def test_gsm8k_real_file() -> None:
    prompts = load_prompts(_data("gsm8k/test.jsonl"))
    assert len(prompts) == 1319
    first = prompts[0]
    assert first.id == "test-0" and first.source == "gsm8k" and first.messages is None
    assert first.text.startswith("Janet\u2019s ducks lay 16 eggs per day.")
    assert first.reference == "18"
    assert all(p.reference and "," not in p.reference and "####" not in p.reference for p in prompts)


def test_alpaca_real_file() -> None:
    prompts = load_prompts(_data("alpaca/alpaca_5000.json"))
    assert len(prompts) == 5000 and prompts[0].id == "alpaca_5000-0"
    assert prompts[0].text == (
        "Are the two sentences below grammatically correct? Output yes or no.\n\n"
        "Sentence 1: I am going to the store.\nSentence 2: I goes to the store."
    )
    assert prompts[0].reference == "No" and prompts[0].source == "alpaca"
    no_input = [p for p in prompts if "\n\n" not in p.text]
    assert no_input  # rows with an empty input keep the bare instruction


def test_mt_bench_real_file() -> None:
    prompts = load_prompts(_data("mt_bench/question.jsonl"))
    assert len(prompts) == 80
    assert prompts[0].id == "81" and prompts[0].source == "mt_bench"
    assert prompts[0].text.startswith("Compose an engaging travel blog post about a recent trip")
    assert "Rewrite your previous response" not in prompts[0].text  # first turn only


def test_arc_real_file() -> None:
    prompts = load_prompts(_data("arc_challenge/test.jsonl"))
    assert len(prompts) == 1172
    first = prompts[0]
    assert first.id == "Mercury_7175875" and first.reference == "C" and first.source == "arc"
    assert first.text == (
        "An astronomer observes that a planet rotates faster after a meteorite impact. Which is "
        "the most likely effect of this increase in rotation?\n"
        "A. Planetary density will decrease.\nB. Planetary years will become longer.\n"
        "C. Planetary days will become shorter.\nD. Planetary gravity will become stronger.\n"
        "Answer with the letter of the correct choice."
    )
    assert "best answer" not in first.text  # the model-written `response` field is ignored


def test_limit_and_offset_real_file() -> None:
    path = _data("gsm8k/test.jsonl")
    prompts = load_prompts(path, limit=3, offset=10)
    assert [p.id for p in prompts] == ["test-10", "test-11", "test-12"]
    assert [p.id for p in load_prompts(_data("alpaca/alpaca_5000.json"), limit=1, offset=4999)] == ["alpaca_5000-4999"]


def test_prompt_and_messages_rows(tmp_path: Path) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    path = _jsonl(tmp_path, [{"prompt": "Say hi.", "reference": "hi"}, {"id": 7, "messages": messages}])
    prompts = load_prompts(path)
    assert prompts[0] == Prompt(id="p-0", text="Say hi.", reference="hi", source="prompt", reference_text="hi")
    assert prompts[1] == Prompt(id="7", messages=messages, source="messages")


def test_gsm8k_reference_drops_commas(tmp_path: Path) -> None:
    path = _jsonl(tmp_path, [{"question": "How many?", "answer": "a\nb <<1+1=2>>\n#### 1,250 "}])
    assert load_prompts(path)[0].reference == "1250"
    assert load_prompts(path)[0].reference_text == "a\nb <<1+1=2>>\n#### 1,250 "  # ROUGE compares the whole solution


def test_blank_lines_and_bom(tmp_path: Path) -> None:
    text = '\ufeff{"prompt": "a"}\n\n   \n{"prompt": "b"}\n'
    path = _write(tmp_path, "b.jsonl", text)
    assert [(p.id, p.text) for p in load_prompts(path)] == [("b-0", "a"), ("b-1", "b")]


def test_missing_file(tmp_path: Path) -> None:
    message = _error(tmp_path / "nope.jsonl")
    assert "nope.jsonl" in message and "not found" in message
    assert "is a directory" in _error(tmp_path)


def test_empty_file(tmp_path: Path) -> None:
    assert "is empty" in _error(_write(tmp_path, "e.jsonl", ""))
    assert "is empty" in _error(_write(tmp_path, "w.jsonl", "\n  \n"))
    assert "is empty" in _error(_write(tmp_path, "a.json", "[]"))


def test_no_rows_after_offset(tmp_path: Path) -> None:
    path = _jsonl(tmp_path, [{"prompt": "a"}, {"prompt": "b"}])
    assert _error(path, offset=2).endswith("has 2 rows, none after offset=2; lower offset")
    assert "must be >= 0" in _error(path, offset=-1)


def test_not_utf8(tmp_path: Path) -> None:
    path = _write(tmp_path, "l.jsonl", b'{"prompt": "a"}\n{"prompt": "caf\xe9"}\n')
    message = _error(path)
    assert "l.jsonl line 2 is not UTF-8" in message
    path = _write(tmp_path, "l.json", b'[{"prompt": "a"},\n{"prompt": "caf\xe9"}]')
    assert "l.json line 2 is not UTF-8" in _error(path)


def test_invalid_json_names_line(tmp_path: Path) -> None:
    path = _write(tmp_path, "j.jsonl", '{"prompt": "a"}\n\n{"prompt": "b",}\n')
    message = _error(path)
    assert "j.jsonl line 3 is not valid JSON" in message
    path = _write(tmp_path, "j.json", '[{"prompt": "a"},\n {"prompt": }]')
    assert "j.json line 2 is not valid JSON" in _error(path)


def test_unrecognised_row(tmp_path: Path) -> None:
    path = _jsonl(tmp_path, [{"prompt": "a"}, {"query": "b", "label": 1}])
    message = _error(path)
    assert "p.jsonl line 2: row has none of the recognised fields" in message
    assert "prompt, messages" in message and "its keys: query, label" in message
    assert "expected a JSON object" in _error(_jsonl(tmp_path, [["a"]], "l.jsonl"))


@pytest.mark.parametrize(
    "messages, fragment",
    [
        ("hello", "'messages' must be a non-empty list"),
        ([], "'messages' must be a non-empty list"),
        ([{"role": "user"}], "messages[0] must be an object with string 'role' and 'content'"),
        ([{"role": "user", "content": "a"}, "b"], "messages[1] must be an object"),
    ],
)
def test_malformed_messages(tmp_path: Path, messages: object, fragment: str) -> None:
    message = _error(_jsonl(tmp_path, [{"messages": messages}]))
    assert message.startswith(f"{tmp_path / 'p.jsonl'} line 1: ") and fragment in message


def test_wrong_field_types(tmp_path: Path) -> None:
    assert "'prompt' must be a string" in _error(_jsonl(tmp_path, [{"prompt": 3}]))
    assert "'turns' must be a non-empty list" in _error(_jsonl(tmp_path, [{"turns": []}]))
    bad_arc = {"question": "q", "choices": {"text": ["a"], "label": []}, "answerKey": "A"}
    assert "'choices' must be" in _error(_jsonl(tmp_path, [bad_arc]))
    one_object = _write(tmp_path, "o.json", '{"prompt": "a"}')  # read as a one-line JSONL
    assert load_prompts(one_object)[0].text == "a"


def test_several_prompt_files(tmp_path):
    from specheads.prompts import load_prompt_files

    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_text("".join(json.dumps({"prompt": f"a{i}"}) + "\n" for i in range(3)))
    b.write_text("".join(json.dumps({"prompt": f"b{i}"}) + "\n" for i in range(3)))
    got = load_prompt_files(f"{a}, {b}", limit=2, offset=1)
    assert [p.text for p in got] == ["a1", "a2", "b1", "b2"]
    assert len({p.id for p in got}) == 4
    with pytest.raises(UserError, match="no prompt file"):
        load_prompt_files(" , ")
