"""``messages`` conversations regenerated turn by turn (``drafter.turn``, ``drafter.history``): each part answers one
user turn after the target's own earlier answers, never the data set's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import chunk_rows, datagen_args

from specheads.datagen.cli import main as datagen_main

SHARED = Path(__file__).resolve().parents[1].parent / "shared"
CONVERSATIONS = [
    [("user", "the cat sat on"), ("assistant", "DATASET ANSWER ONE"), ("user", "and the dog")],
    [("system", "be brief"), ("user", "one two three"), ("assistant", "DATASET ANSWER TWO"), ("user", "four five")],
    [("user", "why is the sky"), ("assistant", "DATASET ANSWER THREE")],
]


def _write(path: Path) -> Path:
    rows = [
        {"id": f"c{i}", "messages": [{"role": r, "content": t} for r, t in conv]}
        for i, conv in enumerate(CONVERSATIONS)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _parts(base: list[str], root: Path, main=datagen_main) -> tuple[list[dict], list[dict]]:
    one, two = root / "turn1", root / "turn2"
    assert main([*base, f"output_dir={one}"]) == 0
    assert main([*base, f"output_dir={two}", "drafter.turn=2", f"drafter.history=[{one}]"]) == 0
    return chunk_rows(one), chunk_rows(two)


def _check(first: list[dict], second: list[dict], decode) -> None:
    assert [r["prompt_id"] for r in first] == ["c0", "c1", "c2"] and [r["prompt_id"] for r in second] == ["c0", "c1"]
    for r in first + second:
        assert "DATASET ANSWER" not in decode(r["input_ids"])  # the data set's answers are never the target's text
    for r1, r2 in zip(first, second):
        answer = decode(r1["input_ids"][r1["response_start"] :], skip_special_tokens=True).strip()
        prompt = decode(r2["input_ids"][: r2["response_start"]])
        assert answer and answer in prompt  # turn 2 reads the target's own turn-1 answer ...
        assert prompt.rstrip().count(CONVERSATIONS[int(r2["prompt_id"][1])][-1][1]) == 1  # ... then the next user turn


def test_turns_are_regenerated_on_the_targets_own_answers(tiny_pair_dirs, tmp_path):
    from transformers import AutoTokenizer

    prompts = _write(tmp_path / "conv.jsonl")
    base = datagen_args(tiny_pair_dirs, prompts, tmp_path / "x", "labels=drafter", "sampling.do_sample=false")
    base += ["max_new_tokens=6", "drafter.top_k=3", "drafter.store_states=false", "chunk_size=8", "batch_size=4"]
    first, second = _parts(base, tmp_path)
    _check(first, second, AutoTokenizer.from_pretrained(tiny_pair_dirs[0]).decode)


@pytest.mark.parametrize(
    "extra, message",
    [
        (["drafter.turn=2"], "drafter.history"),
        (["drafter.turn=0"], "drafter.turn"),
        (["drafter.turn=2", "drafter.history=[/no/run]"], "not a finished"),
    ],
)
def test_bad_turn_settings_are_one_line_errors(extra, message, tiny_pair_dirs, tmp_path, capsys):
    prompts = _write(tmp_path / "conv.jsonl")
    args = datagen_args(tiny_pair_dirs, prompts, tmp_path / "x", "labels=drafter", *extra)
    assert datagen_main(args) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err


@pytest.mark.slow
def test_the_shared_target_regenerates_a_conversation_under_its_chat_template(tmp_path):
    from transformers import AutoTokenizer

    target = SHARED / "models" / "smollm2-135m-instruct"
    prompts = _write(tmp_path / "conv.jsonl")
    base = [f"target.path={target}", "target.gguf_file=SmolLM2-135M-Instruct.Q4_1.gguf", "target.dtype=float32"]
    base += [f"prompts={prompts}", "num_prompts=null", "labels=drafter", "sampling.do_sample=false"]
    base += ["max_new_tokens=12", "drafter.top_k=3", "drafter.store_states=false", "chunk_size=8", "batch_size=4"]
    first, second = _parts(base, tmp_path)
    tok = AutoTokenizer.from_pretrained(target, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
    _check(first, second, tok.decode)
    assert "<|im_start|>assistant" in tok.decode(second[0]["input_ids"][: second[0]["response_start"]])
