"""Swap mining (datagen/mining.py, checkers.py, mined_view.py) on stub models whose important mismatch is
known by construction, and ``heads-datagen labels=judge judge.mining=swap`` end to end on the tiny pair."""

from __future__ import annotations

import json
import shutil
import sys
from types import SimpleNamespace

import pytest

from specheads.datagen import checkers, cli, mining
from specheads.datagen.mined_view import render
from specheads.datagen.tuples import IGNORE
from specheads.errors import UserError

# A toy vocabulary: the target always answers "so the answer is 7 </s>"; the draft says "thus" for "so"
# (same answer) and, once the response starts with "thus", "8" for "7" (another answer).
WORDS = {2: "</s>", 3: "so", 4: "thus", 5: "the", 6: "answer", 7: "is", 8: "7", 9: "8", 10: "Q"}
IDS = {w: i for i, w in WORDS.items()}
TEMPLATE = [IDS[w] for w in ("so", "the", "answer", "is", "7", "</s>")]
EOS = [2]
PROMPT = [IDS["Q"]]


def decode(ids):
    return " ".join(WORDS[i] for i in ids if i != 2)


def generate(contexts, max_new):
    """The target: the template's next tokens after however much of a response the context holds."""
    calls.append(len(contexts))
    return [TEMPLATE[len(c) - len(PROMPT) :][:max_new] for c in contexts]


def predict(seqs, positions):
    """The draft: "thus" at the first response token; "8" at the answer only after a response starting "thus"."""
    out = []
    for seq, pos in zip(seqs, positions):
        row = []
        for t in pos:
            nxt = seq[t] if t < len(seq) else 2
            j = t - len(PROMPT)
            if j == 0:
                nxt = IDS["thus"]
            elif j == 4 and seq[len(PROMPT)] == IDS["thus"]:
                nxt = IDS["8"]
            row.append(nxt)
        out.append(row)
    return out


calls: list[int] = []
PROMPTS = [
    SimpleNamespace(id="p0", source="gsm8k", text="Q", messages=None),
    SimpleNamespace(id="p1", source="gsm8k", text="Q", messages=None),
]


def _mine(max_mismatches=16, max_tokens=1000, prompts=PROMPTS):
    calls.clear()
    return mining.mine(
        generate,
        predict,
        decode,
        prompts,
        [PROMPT] * len(prompts),
        checkers.resolve("gsm8k"),
        mining.Budget(8, max_mismatches, max_tokens),
        EOS,
        batch_size=4,
    )


def test_the_answer_changing_swap_is_important_and_the_other_is_kept():
    s = _mine()[0]
    assert [(m.position, WORDS[m.target_token], WORDS[m.draft_token], m.important) for m in s.marks] == [
        (0, "so", "thus", False),
        (4, "7", "8", True),
    ]
    assert decode(s.response) == "thus the answer is 7" and s.answer == "7" and s.marks[1].answer_after == "8"
    assert not s.budget_hit and s.generated == 5 + 1  # the two continuations: 5 tokens, then "</s>"
    rows = mining.judge_rows(s, "p0-m", label_matches=False)
    assert [r["side"] for r in rows] == ["mined", "important-4"]
    assert rows[0]["input_ids"] == PROMPT + s.response and rows[0]["labels"] == [1] + [IGNORE] * 5
    assert rows[1]["input_ids"] == PROMPT + s.response[:4] + [IDS["8"]] and rows[1]["labels"] == [IGNORE] * 4 + [0]
    every = mining.judge_rows(s, "p0-m", label_matches=True)[0]["labels"]
    assert every == [1] * 6


def test_prompts_search_in_lockstep_batches():
    _mine()
    assert calls == [2, 2, 2]  # the answers, then one step per mismatch, both prompts in each call


def test_the_budget_stops_a_search_that_has_mismatches_left():
    s = _mine(max_mismatches=1)[0]
    assert len(s.marks) == 1 and s.budget_hit
    t = _mine(max_tokens=5)[0]  # the first continuation spends the token budget
    assert len(t.marks) == 1 and t.budget_hit
    assert mining.counts([s, t]) == {
        "prompts": 2,
        "mismatches_tried": 2,
        "important": 0,
        "unimportant": 2,
        "undetermined": 0,
        "unsearchable": 0,
        "budget_hits": 2,
        "continuation_tokens": 10,
    }


def test_a_search_without_mismatches_ends_without_a_budget_hit():
    def agree(seqs, positions):
        return [[seq[t] if t < len(seq) else 2 for t in pos] for seq, pos in zip(seqs, positions)]

    s = mining.mine(
        generate,
        agree,
        decode,
        PROMPTS[:1],
        [PROMPT],
        checkers.resolve("gsm8k"),
        mining.Budget(8, 1, 1),
        EOS,
        batch_size=4,
    )[0]
    assert s.marks == [] and not s.budget_hit and mining.judge_rows(s, "x", False) == []


def test_checkers():
    p = SimpleNamespace(source="arc")
    assert checkers.resolve("arc")(p, "I pick B, not C") == "B"
    assert checkers.resolve("gsm8k")(p, "so 1,250.0 dollars") == "1250"
    assert checkers.resolve("gsm8k")(p, "#### 1234567") != checkers.resolve("gsm8k")(p, "#### 1234571")
    assert checkers.resolve("exact")(p, "  The  Cat sat. ") == checkers.resolve("exact")(p, "the cat sat")
    assert checkers.resolve("auto")(p, "B") == "B"
    assert checkers.resolve("auto")(SimpleNamespace(source="gsm8k"), "#### 12") == "12"
    assert checkers.resolve("auto")(SimpleNamespace(source="prompt"), "Hi!") == "hi"
    assert checkers.resolve("os.path:basename") is __import__("os").path.basename  # a user's callable
    for bad, why in (
        ("nope", "choose from"),
        ("no_such_module_x:f", "cannot import"),
        ("os:no_such_fn", "has no"),
        ("sys:version", "not callable"),
    ):
        with pytest.raises(UserError, match=why):
            checkers.resolve(bad)


def test_render_marks_both_kinds():
    rec = mining.record(
        _mine()[0], SimpleNamespace(id="p0", source="gsm8k", text="Q", messages=None), 0, lambda t: WORDS[t]
    )
    plain = render(rec, color=False)
    assert "[8 -> 8]" not in plain and "['8' -> 8]" in plain and "thus['so']" in plain
    assert "1 important, 1 unimportant" in plain and "\033[" not in plain
    assert "\033[31m" in render(rec, color=True)


def _args(pair_dirs, out, prompts, *extra):
    t, d = pair_dirs
    return [
        "labels=judge",
        "judge.mining=swap",
        f"target.path={t}",
        "target.gguf_file=null",
        f"draft.path={d}",
        "target.device=cpu",
        "draft.device=cpu",
        f"prompts={prompts}",
        f"output_dir={out}",
        "max_new_tokens=12",
        "batch_size=2",
        "chunk_size=2",
        "chat_template=false",
        "judge.checker=exact",
        *extra,
    ]


@pytest.fixture()
def chat_prompts(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text(
        "".join(json.dumps({"prompt": p}) + "\n" for p in ["the cat sat", "why is the sun red", "one two three"])
    )
    return path


def test_swap_mining_end_to_end_on_the_tiny_pair(tiny_pair_dirs, chat_prompts, tmp_path, capsys):
    out = tmp_path / "dg"
    assert cli.main(_args(tiny_pair_dirs, out, chat_prompts)) == 0
    m = json.loads((out / "manifest.json").read_text())
    mine = m["mining"]
    assert (
        mine["prompts"] == 3
        and mine["mismatches_tried"] == (mine["important"] + mine["unimportant"] + mine["undetermined"]) > 0
    )
    assert mine["mismatches_per_minute"] > 0 and (mine["method"], mine["checker"]) == ("swap", "exact")
    assert m["positive_tokens"] == mine["unimportant"] and m["negative_tokens"] == mine["important"]
    records = [json.loads(x) for x in (out / "mined.jsonl").read_text().splitlines()]
    assert [r["prompt_index"] for r in records] == [0, 1, 2]
    assert sum(r["mismatches_tried"] for r in records) == mine["mismatches_tried"]
    assert cli.main(_args(tiny_pair_dirs, out, chat_prompts, "verify")) == 0
    capsys.readouterr()
    assert cli.main(_args(tiny_pair_dirs, out, chat_prompts, "show", "index=2")) == 0
    assert "prompt 2 (prompt" in capsys.readouterr().out
    assert cli.main(_args(tiny_pair_dirs, out, chat_prompts, "show", "index=7")) == 2
    assert "holds 3 records" in capsys.readouterr().err
    assert cli.main(_args(tiny_pair_dirs, out, chat_prompts, "show", "index=x")) == 2
    assert "expected a record number" in capsys.readouterr().err


def test_swap_mining_relabels_a_lost_chunk_to_the_same_bytes(tiny_pair_dirs, chat_prompts, tmp_path):
    whole, part = tmp_path / "whole", tmp_path / "part"
    assert cli.main(_args(tiny_pair_dirs, whole, chat_prompts)) == 0
    shutil.copytree(whole, part)
    lost = sorted((part / "data").glob("chunk-*.parquet"))[-1]
    lost.unlink()
    (part / "manifest.json").unlink()
    (part / "config.yaml").write_text((part / "config.yaml").read_text().replace(str(whole), str(part)))
    assert cli.main(_args(tiny_pair_dirs, part, chat_prompts)) == 0
    for name in ("data/" + lost.name, "mined.jsonl", "features/" + lost.stem + ".safetensors"):
        assert (part / name).read_bytes() == (whole / name).read_bytes(), name


def test_a_shorter_response_per_source():
    """limits: prompt 0 fits its 6 tokens (EOS included) and is searched; prompt 1 is cut at 5, before its EOS,
    so its final answer cannot be trusted and it is not searched."""
    s = mining.mine(
        generate,
        predict,
        decode,
        PROMPTS,
        [PROMPT] * 2,
        checkers.resolve("gsm8k"),
        mining.Budget(8, 16, 1000),
        EOS,
        batch_size=4,
        limits=[6, 5],
    )
    assert len(s[0].marks) == 2 and s[0].searchable
    assert decode(s[1].response) == "so the answer is 7" and s[1].marks == [] and not s[1].searchable
    assert mining.counts(s)["unsearchable"] == 1 and mining.judge_rows(s[1], "x", True) == []


def first_word(prompt, text):
    return text.split()[0] if text.split() else None


first_word.prefix_stable = True


def test_a_prefix_stable_answer_is_trusted_at_the_cut():
    """A prefix-stable checker (the first word here, ARC's first letter in practice): a response cut at the
    limit is searched when its answer was there a token earlier, and a swap that changes it is important
    even though neither response reaches EOS; the last-number checker trusts neither."""
    s = mining.mine(
        generate, predict, decode, PROMPTS[:1], [PROMPT], first_word, mining.Budget(5, 16, 1000), EOS, batch_size=4
    )[0]
    assert s.searchable and s.answer == "so"
    assert [(m.position, m.important, m.answer_after) for m in s.marks] == [(0, True, "thus")]
    assert decode(s.response) == "so the answer is 7"  # R stays: the swap was important
    loose = mining.mine(
        generate,
        predict,
        decode,
        PROMPTS[:1],
        [PROMPT],
        checkers.resolve("gsm8k"),
        mining.Budget(5, 16, 1000),
        EOS,
        batch_size=4,
    )[0]
    assert not loose.searchable and loose.marks == []

    def one_token(prompt, text):  # answers only at the response's last token: not settled a token earlier
        return text.split()[-1] if len(text.split()) == 5 else None

    one_token.prefix_stable = True
    cut = mining.mine(
        generate, predict, decode, PROMPTS[:1], [PROMPT], one_token, mining.Budget(5, 16, 1000), EOS, batch_size=4
    )[0]
    assert cut.answer == "7" and not cut.searchable


def test_which_checkers_are_prefix_stable():
    arc = SimpleNamespace(id="a", source="arc", text="Q", messages=None)
    assert checkers.stable(checkers.resolve("arc"), PROMPTS[0]) and checkers.stable(checkers.resolve("auto"), arc)
    assert not checkers.stable(checkers.resolve("auto"), PROMPTS[0])
    assert not checkers.stable(checkers.resolve("gsm8k"), arc) and not checkers.stable(checkers.resolve("exact"), arc)
    assert checkers.stable(first_word, PROMPTS[0]) and not checkers.stable(decode, PROMPTS[0])


def test_a_swap_that_runs_to_the_limit_is_undetermined():
    """A draft that inserts a word the target then repeats past the limit: no EOS, no label, R stays."""

    def chatty(contexts, max_new):
        out = []
        for c in contexts:
            r = c[len(PROMPT) :]
            out.append(([IDS["the"]] * max_new) if IDS["thus"] in r else TEMPLATE[len(r) :][:max_new])
        return out

    s = mining.mine(
        chatty,
        predict,
        decode,
        PROMPTS[:1],
        [PROMPT],
        checkers.resolve("gsm8k"),
        mining.Budget(8, 16, 1000),
        EOS,
        batch_size=4,
    )[0]
    assert [(m.position, m.important) for m in s.marks] == [(0, None)]
    assert decode(s.response) == "so the answer is 7"  # the target's own, unchanged
    assert mining.judge_rows(s, "x", False) == [] and mining.counts([s])["undetermined"] == 1
    assert "undetermined" in render(mining.record(s, PROMPTS[0], 0, lambda t: WORDS[t]), color=False)


def test_merged_nodes_keep_every_mined_record(tiny_pair_dirs, chat_prompts, tmp_path):
    """Two nodes' outputs (chunk 0 on one, chunk 1 on the other) merged into a fresh directory: the mined
    records and counts of both are there."""
    whole = tmp_path / "whole"
    assert cli.main(_args(tiny_pair_dirs, whole, chat_prompts)) == 0
    nodes = [tmp_path / "n0", tmp_path / "n1"]
    for n, drop in zip(nodes, ("chunk-000001", "chunk-000000")):
        shutil.copytree(whole, n)
        for f in list(n.rglob(drop + "*")):
            f.unlink()
        (n / "manifest.json").unlink()
    merged = tmp_path / "merged"
    assert cli.main(_args(tiny_pair_dirs, merged, chat_prompts, "merge", f"from={nodes[0]},{nodes[1]}")) == 0
    assert (merged / "mined.jsonl").read_bytes() == (whole / "mined.jsonl").read_bytes()
    assert json.loads((merged / "manifest.json").read_text())["mining"] == json.loads(
        (whole / "manifest.json").read_text()
    )["mining"] | {"mismatches_per_minute": None}


@pytest.mark.parametrize(
    "bad, why",
    [
        ("judge.mine_max_mismatches=0", "judge.mine_max_mismatches=0"),
        ("judge.mine_max_new_tokens_by_source={arcs: 3}", "mine_max_new_tokens_by_source.arcs"),
        ("judge.checker=nope", "choose from"),
        ("judge.mining=magic", "choose arith or swap"),
    ],
)
def test_swap_mining_bad_settings(tiny_pair_dirs, chat_prompts, tmp_path, capsys, bad, why):
    assert cli.main(_args(tiny_pair_dirs, tmp_path / "x", chat_prompts, bad)) == 2
    err = capsys.readouterr().err
    assert why in err and len(err.strip().splitlines()) == 1


def test_a_user_checker_is_called_with_the_prompt(tiny_pair_dirs, chat_prompts, tmp_path, monkeypatch):
    seen = []
    module = SimpleNamespace(check=lambda prompt, text: seen.append(prompt.source) or len(text.split()) > 3)
    monkeypatch.setitem(sys.modules, "my_checks_for_test", module)
    assert cli.main(_args(tiny_pair_dirs, tmp_path / "u", chat_prompts, "judge.checker=my_checks_for_test:check")) == 0
    assert seen and set(seen) == {"prompt"}


def test_judge_data_sets_from_several_sources_train_one_head(tiny_pair_dirs, chat_prompts, tmp_path, capsys):
    """Two data sets (here two swap-mined runs) train one judge; another target's set is refused."""
    from specheads.train.cli import main as train_main
    from specheads.train.judge_data import JudgeStore

    a, b = tmp_path / "a", tmp_path / "b"
    assert cli.main(_args(tiny_pair_dirs, a, chat_prompts, "num_prompts=2", "judge.mine_label_matches=true")) == 0
    assert (
        cli.main(
            _args(tiny_pair_dirs, b, chat_prompts, "num_prompts=2", "judge.mine_label_matches=true", "chunk_size=1")
        )
        == 0
    )
    both = JudgeStore(f"{a},{b}")
    assert len(both.examples) == len(JudgeStore(a).examples) + len(JudgeStore(b).examples)
    assert {e.tuple_id.split(":")[0] for e in both.examples} == {"0", "1"}
    assert len(both.labels) == len(JudgeStore(a).labels) + len(JudgeStore(b).labels)
    args = [
        "head=judge",
        "depth=0",
        "epochs=1",
        "batch_size=1",
        "grad_accum=1",
        "eval_fraction=0.34",
        "draft.path=unused",
        "class_weights=fixed",
    ]
    assert train_main([f"data_dir={a},{b}", f"output_dir={tmp_path / 'tr'}", *args]) == 0
    m = json.loads((b / "manifest.json").read_text())
    m["target"]["fingerprint"] = "sha256:other"
    (b / "manifest.json").write_text(json.dumps(m))
    capsys.readouterr()
    assert train_main([f"data_dir={a},{b}", f"output_dir={tmp_path / 'tr2'}", *args]) == 2
    assert "another target" in capsys.readouterr().err


def test_a_padded_draft_vocabulary_never_makes_a_mismatch():
    """The draft pads its output layer past the target's vocabulary and its padding rows score highest: the
    search's draft predictions stay within the shared tokens."""
    import torch
    from conftest import tiny_llama

    target, draft = tiny_llama(48, seed=0), tiny_llama(56, seed=1)
    with torch.no_grad():
        draft.lm_head.weight[48:] = 0.0
        draft.lm_head.bias = None
        draft.model.norm.weight.fill_(1.0)
        draft.lm_head.weight[48:, 0] = 1e4  # a huge logit for padding ids wherever feature 0 is positive
    generate, predict = mining.greedy_tokens(target, draft, eos=[2], pad=0)
    seqs = [[5, 6, 7, 8, 9, 10, 11, 12]]
    preds = predict(seqs, [list(range(1, 8))])[0]
    assert max(preds) < 48
    logits = draft(torch.tensor(seqs)).logits[0, :7]
    assert (logits.argmax(-1) >= 48).any()  # without the cut some prediction would be a padding id
    assert all(t < 48 for r in generate([[5, 6]], 6) for t in r)
