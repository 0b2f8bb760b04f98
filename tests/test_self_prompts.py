"""``heads-datagen labels=prompts``: user turns the target writes itself (Magpie): the open turn, the filter,
the run-wide deduplication, the prompt file later runs read, and determinism."""

from __future__ import annotations

import json
import shutil
from types import SimpleNamespace

import pytest
from conftest import pair_args

from specheads.datagen import shards
from specheads.datagen.cli import main
from specheads.datagen.config import SelfPromptOptions
from specheads.datagen.self_prompts import COLUMNS, KINDS, kinds, verdict, write_prompts
from specheads.decode.api import format_prompt
from specheads.errors import UserError
from specheads.prompt_spec import open_user_turn
from specheads.prompts import load_prompt_files

TEMPLATE = (
    "{% for m in messages %}<s> {{ m['role'] }} {{ m['content'] }} </s> {% endfor %}"
    "{% if add_generation_prompt %}<s> assistant {% endif %}"
)


@pytest.fixture(scope="module")
def chat_target(tiny_pair_dirs, tmp_path_factory):
    """The tiny target with a chat template, whose end of turn (</s>) ties with the token it says most often."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path_factory.mktemp("chat") / "target"
    shutil.copytree(tiny_pair_dirs[0], out)
    tok = AutoTokenizer.from_pretrained(out)
    tok.chat_template = TEMPLATE
    tok.save_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    with torch.no_grad():
        favourite = int(model(torch.arange(3, 40)[None]).logits[0].argmax(-1).mode().values)
        model.lm_head.weight[tok.eos_token_id] = model.lm_head.weight[favourite]
    model.save_pretrained(out)
    return out


def test_an_open_user_turn_is_the_template_up_to_the_users_words(tokenizer):
    tok = tokenizer.__class__(tokenizer_object=tokenizer.backend_tokenizer, eos_token="</s>", bos_token="<s>")
    tok.chat_template = TEMPLATE
    msgs = [{"role": "system", "content": "the cat"}, {"role": "user", "content": None}]
    want = tok("<s> system the cat </s> <s> user ", add_special_tokens=False)["input_ids"]
    assert open_user_turn(tok, msgs) == want
    assert format_prompt(tok, SimpleNamespace(messages=msgs, text=None)) == want
    closed = format_prompt(tok, SimpleNamespace(messages=[msgs[0], {"role": "user", "content": "dog"}], text=None))
    assert closed[: len(want)] == want and len(closed) > len(want) + 1  # the words, then the assistant's turn
    with pytest.raises(UserError, match="chat template"):
        open_user_turn(tokenizer, msgs)  # no template


@pytest.mark.parametrize(
    ("response", "why"),
    [
        ([5, 6, 7, 2], ""),
        ([5, 6, 7], "no end of turn"),
        ([5, 6, 7, 8], "truncated"),
        ([5, 1, 7, 2], "template token"),
        ([5, 2], "too short"),
    ],
)
def test_the_filter_keeps_whole_turns_of_words(response, why):
    assert verdict(response, eos={2}, special={0, 1, 2}, max_new_tokens=4, min_tokens=2) == why


def test_kinds_are_named_or_written_and_an_unknown_one_is_refused():
    got = kinds(SimpleNamespace(self_prompts=SelfPromptOptions(kinds=["code", "poems: The user asks for a poem."])))
    assert got[0][0] == "code" and KINDS["code"] in got[0][1]
    assert got[1] == ("poems", "The user asks for a poem.")
    with pytest.raises(UserError, match="'sonnets' is not one of"):
        kinds(SimpleNamespace(self_prompts=SelfPromptOptions(kinds=["sonnets"])))


def test_the_prompt_file_is_deduplicated_over_the_run(tmp_path):
    def chunk(c, rows):
        cols = {k: [r[i] for r in rows] for i, k in enumerate(COLUMNS)}
        shards.write_chunk(tmp_path, c, cols, {})

    chunk(0, [("a", 0, "code", "Fix  my loop", 5, ""), ("b", 1, "chat", "x", 9, "truncated")])
    chunk(1, [("c", 2, "code", "fix my loop ", 5, ""), ("d", 3, "facts", "Why is the sky blue?", 7, "")])
    stats = write_prompts(tmp_path)
    rows = [json.loads(x) for x in (tmp_path / "prompts.jsonl").read_text().splitlines()]
    assert [r["id"] for r in rows] == ["a", "d"]
    assert stats["kept"] == 2 and stats["dropped"] == {"duplicate": 1, "truncated": 1} and stats["prompts"] == 4
    assert stats["kept_by_kind"] == {"code": 1, "facts": 1} and stats["labelled_tokens"] == 26
    assert [p.text for p in load_prompt_files(str(tmp_path / "prompts.jsonl"))] == [
        "Fix  my loop",
        "Why is the sky blue?",
    ]


def _args(target, out, *extra):
    return [
        *pair_args((target, target)),
        "draft.path=''",
        "labels=prompts",
        "sampling.do_sample=true",
        "num_prompts=6",
        "offset=0",
        "max_new_tokens=12",
        "self_prompts.min_tokens=1",
        "batch_size=3",
        "chunk_size=3",
        f"output_dir={out}",
        *extra,
    ]


def test_a_run_writes_its_kept_turns_once_and_the_same_on_a_rerun(chat_target, tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    assert main(_args(chat_target, a)) == 0
    assert main(_args(chat_target, b)) == 0
    assert (a / "prompts.jsonl").read_text() == (b / "prompts.jsonl").read_text()
    manifest = json.loads((a / "manifest.json").read_text())
    assert manifest["prompts"] == 6 and manifest["kept"] + sum(manifest["dropped"].values()) == 6
    assert manifest["kept"] >= 1 and manifest["dropped"]  # the filter has work on both sides
    (a / "data" / "chunk-000001.parquet").unlink()  # killed before the second chunk landed: resumed
    (a / "manifest.json").unlink()
    assert main(_args(chat_target, a)) == 0
    assert (a / "prompts.jsonl").read_text() == (b / "prompts.jsonl").read_text()
    assert manifest["self_prompts"]["kinds"] == SelfPromptOptions().kinds  # the six by default
    rows = [json.loads(x) for x in (a / "prompts.jsonl").read_text().splitlines()]
    assert len(rows) == manifest["kept"] and len({r["prompt"].lower() for r in rows}) == len(rows)
    assert [r["kind"] for r in rows] == [r["id"].split("-")[1] for r in rows]  # item i has kind i % 6


@pytest.mark.parametrize(
    ("extra", "fragment"),
    [
        (["sampling.do_sample=false"], "sampling.do_sample=true"),
        (["num_prompts=null"], "set num_prompts="),
        (["self_prompts.kinds=[limericks]"], "'limericks' is not one of"),
        (["chat_template=false"], "chat_template=true"),
    ],
)
def test_bad_settings_fail_in_one_line(chat_target, tmp_path, capsys, extra, fragment):
    assert main(_args(chat_target, tmp_path / "x", *extra)) == 2
    err = capsys.readouterr().err
    assert fragment in err and err.count("\n") == 1
