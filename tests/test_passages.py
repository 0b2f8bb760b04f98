"""``heads-datagen labels=passages``: instructions over passages made of the target's earlier responses. The
sentence trim, the passage's length bounds, determinism per item, the prompt file a later run reads, resumption,
and one-line errors."""

from __future__ import annotations

import json
import re

import pytest
from conftest import datagen_args, pair_args

from specheads.datagen.cli import main
from specheads.datagen.passages import FRAMES, TASKS, compose, sentence_trim
from specheads.prompts import load_prompt_files


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("One thing. Two things. Three thin", "One thing. Two things."),
        ("Steps:\n1. Mix it.\n2.", "Steps:\n1. Mix it."),  # a list number's point is no sentence end
        ("Is it? Yes! And then", "Is it? Yes!"),
        ("no end at all", "no end at all"),
    ],
)
def test_a_response_is_cut_at_its_last_sentence_end(text, want):
    assert sentence_trim(text) == want


POOL = [" ".join(f"w{i}x{j}." for j in range(n)) for i, n in enumerate([3, 5, 8, 2, 13, 4, 6, 9, 7, 5])]


def count(text: str) -> int:
    return len(text.split())


@pytest.mark.parametrize("index", range(12))
def test_a_passage_holds_min_to_max_tokens_and_an_instruction_of_its_kind(index):
    kind = list(TASKS)[index % len(TASKS)]
    prompt, n = compose(index, 0, kind, POOL, count, 10, 16)
    assert 10 <= n <= 16
    assert any(instruction in prompt for instruction in TASKS[kind])
    words = re.findall(r"w\d+x\d+\.", prompt)
    assert len(words) == n and len(set(words)) == n  # each response once, whole sentences only
    assert compose(index, 0, kind, POOL, count, 10, 16) == (prompt, n)  # seeded by (seed, index) alone


def test_items_and_seeds_give_different_prompts_and_an_exhausted_pool_a_short_passage():
    made = {compose(i, s, "extract", POOL, count, 10, 16)[0] for i in range(6) for s in range(2)}
    assert len(made) >= 10  # 90 combinations of template, frame and start: few collide
    assert compose(0, 0, "title", POOL, count, 500, 600)[1] == sum(map(count, POOL))  # all of it, still short
    assert {f.split("{passage}")[0] for f in FRAMES} >= {"{instruction}\n\n", ""}  # before and after


@pytest.fixture(scope="module")
def source(tiny_pair_dirs, tmp_path_factory):
    """A ``labels=drafter`` run of the tiny pair: 8 greedy responses of up to 12 tokens."""
    root = tmp_path_factory.mktemp("passages")
    prompts = root / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"a b c {i}"}) + "\n" for i in range(8)))
    args = datagen_args(tiny_pair_dirs, prompts, root / "drafter", "labels=drafter", "sampling.do_sample=false")
    assert main([*args, "max_new_tokens=12", "drafter.top_k=4"]) == 0
    return root / "drafter"


def _args(pair_dirs, src, out, *extra):
    return [
        *pair_args(pair_dirs),
        "draft.path=''",
        "labels=passages",
        f"passages.sources=[{src}]",
        "passages.min_tokens=15",
        "passages.max_tokens=30",
        "num_prompts=10",
        "chunk_size=4",
        f"output_dir={out}",
        *extra,
    ]


def test_a_run_writes_a_prompt_file_the_same_on_a_rerun_and_after_a_crash(tiny_pair_dirs, source, tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    assert main(_args(tiny_pair_dirs, source, a)) == 0
    assert main(_args(tiny_pair_dirs, source, b)) == 0
    assert (a / "prompts.jsonl").read_text() == (b / "prompts.jsonl").read_text()
    manifest = json.loads((a / "manifest.json").read_text())
    assert manifest["prompts"] == 10 and manifest["kept"] + sum(manifest["dropped"].values()) == 10
    assert manifest["passages"]["sources"] == [str(source)]
    rows = [json.loads(x) for x in (a / "prompts.jsonl").read_text().splitlines()]
    assert rows and [r["kind"] for r in rows] == [r["id"].split("-")[1] for r in rows]
    assert {r["kind"] for r in rows} <= set(TASKS) and len({r["kind"] for r in rows}) >= 5  # kinds in turn
    assert all(len(r["prompt"].split()) > 15 for r in rows)  # the passage and its instruction
    assert len(load_prompt_files(str(a / "prompts.jsonl"))) == len(rows)  # a prompt file later runs read
    (a / "data" / "chunk-000001.parquet").unlink()  # killed before the second chunk landed: resumed
    (a / "manifest.json").unlink()
    assert main(_args(tiny_pair_dirs, source, a)) == 0
    assert (a / "prompts.jsonl").read_text() == (b / "prompts.jsonl").read_text()


@pytest.mark.parametrize(
    ("extra", "fragment"),
    [
        (["passages.sources=[]"], "set passages.sources="),
        (["passages.tasks=[poems]"], "not among"),
        (["passages.min_tokens=40"], "min_tokens <= max_tokens"),
        (["num_prompts=null"], "set num_prompts="),
        (["engine=vllm"], "engine=specheads"),
    ],
)
def test_bad_settings_fail_in_one_line(tiny_pair_dirs, source, tmp_path, capsys, extra, fragment):
    assert main(_args(tiny_pair_dirs, source, tmp_path / "x", *extra)) == 2
    err = capsys.readouterr().err
    assert fragment in err and err.count("\n") == 1


def test_a_source_without_responses_fails_in_one_line(tiny_pair_dirs, tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert main(_args(tiny_pair_dirs, tmp_path / "empty", tmp_path / "x")) == 2
    err = capsys.readouterr().err
    assert "holds no datagen chunks" in err and err.count("\n") == 1


def test_a_file_of_documents_is_a_source_with_its_field_and_first_rows(tiny_pair_dirs, tmp_path):
    docs = [
        {"instruction": f"i{i}", "output": f"Document {i} says one thing. It says a second thing {i}."}
        for i in range(6)
    ]
    (tmp_path / "docs.json").write_text(json.dumps([*docs, {"instruction": "no output"}]))
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    for name in ("docs.json", "docs.jsonl"):
        out = tmp_path / name.replace(".", "-")
        extra = ["passages.text_field=output", "passages.rows=3", "passages.min_tokens=8", "passages.max_tokens=40"]
        assert main([*_args(tiny_pair_dirs, tmp_path / name, out), *extra]) == 0
        text = (out / "prompts.jsonl").read_text()
        used = set(re.findall(r"Document (\d)", text))
        assert used == {"0", "1", "2"}  # the first 3 rows only
        manifest = json.loads((out / "manifest.json").read_text())
        assert manifest["passages"]["text_field"] == "output" and manifest["passages"]["rows"] == 3


@pytest.mark.parametrize(
    ("content", "extra", "fragment"),
    [
        ('[{"text": "A thing."}]', ["passages.text_field=body"], "no row of"),
        ('"A thing."', [], "not a list of rows"),  # a row that is no JSON object
        ("[{", [], "is not valid JSON"),
        ('[{"text": "A thing."}]', ["passages.rows=0"], "need a positive count"),
    ],
)
def test_a_bad_file_source_fails_in_one_line(tiny_pair_dirs, tmp_path, capsys, content, extra, fragment):
    (tmp_path / "d.json").write_text(content)
    assert main([*_args(tiny_pair_dirs, tmp_path / "d.json", tmp_path / "x"), *extra]) == 2
    err = capsys.readouterr().err
    assert fragment in err and err.count("\n") == 1


def test_a_source_that_is_neither_a_run_nor_a_document_file_fails_in_one_line(tiny_pair_dirs, tmp_path, capsys):
    (tmp_path / "d.txt").write_text("A thing.")
    assert main(_args(tiny_pair_dirs, tmp_path / "d.txt", tmp_path / "x")) == 2
    err = capsys.readouterr().err
    assert "neither a labels=drafter output directory" in err and err.count("\n") == 1
