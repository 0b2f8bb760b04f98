"""``heads-datagen labels=judge``: imported and generated tuples, token labels, target features, counts."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from conftest import chunk_rows
from safetensors.torch import load_file

from specheads.datagen import cli, judge_tuples
from specheads.datagen.tuples import IGNORE, span_labels
from specheads.shim.runners.hidden import HiddenCapture

TUPLES = [
    {"question": "what is one two", "correct": "three four", "wrong": "two three five six", "error": [4, 9]},
    {"question": "why is the sun red", "correct": "the sun is red", "wrong": "", "error": None},
    {"question": "who ran up", "correct": "the dog ran up", "wrong": "a cat sat down", "error": [0, 1]},
]


def _args(pair_dirs, out, *extra):
    t, d = pair_dirs
    return [
        f"target.path={t}",
        "target.gguf_file=null",
        f"draft.path={d}",
        "target.device=cpu",
        "draft.device=cpu",
        f"output_dir={out}",
        "num_prompts=null",
        "max_new_tokens=8",
        "batch_size=2",
        "chunk_size=2",
        "labels=judge",
        "chat_template=false",
        *extra,
    ]


def test_imported_tuples_give_labels_and_target_features(tiny_pair, tiny_pair_dirs, tokenizer, tmp_path):
    src = tmp_path / "t.jsonl"
    src.write_text("".join(json.dumps(t) + "\n" for t in TUPLES))
    out = tmp_path / "dg"
    assert cli.main(_args(tiny_pair_dirs, out, f"judge.tuples={src}", "prompts=''")) == 0
    rows = chunk_rows(out)
    assert [(r["tuple_id"], r["side"]) for r in rows] == [
        ("t-1", "correct"),
        ("t-1", "wrong"),
        ("t-2", "correct"),
        ("t-3", "correct"),
        ("t-3", "wrong"),
    ]
    wrong = rows[1]
    enc = tokenizer("two three five six", add_special_tokens=False, return_offsets_mapping=True)
    assert wrong["labels"] == span_labels([tuple(o) for o in enc["offset_mapping"]], (4, 9)) == [1, 0, IGNORE, IGNORE]
    # features: the target's pre-norm states at the labelled answer tokens, in row order
    target, _ = tiny_pair
    feats = [load_file(str(p)) for p in sorted((out / "features").glob("chunk-*.safetensors"))]
    first = feats[0]
    assert first["features"].dtype == torch.float16 and first["offsets"].tolist()[-1] == first["features"].shape[0]
    with HiddenCapture(target) as cap, torch.no_grad():
        target(input_ids=torch.tensor([wrong["input_ids"]]))
        keep = [wrong["answer_start"] + j for j, v in enumerate(wrong["labels"]) if v != IGNORE]
        want = cap.pre[0, keep]
    a, b = first["offsets"][1].item(), first["offsets"][2].item()
    torch.testing.assert_close(first["features"][a:b].float(), want, atol=2e-2, rtol=1e-2)
    assert first["labels"][a:b].tolist() == [1.0, 0.0]
    # the target's verdict on each labelled token, from its logits one position earlier (teacher-forced)
    with torch.no_grad():
        logp = target(input_ids=torch.tensor([wrong["input_ids"]])).logits[0].float().log_softmax(-1)
    for row, pos in zip(first["signals"][a:b], keep):
        y, lp = wrong["input_ids"][pos], logp[pos - 1]
        assert row[0].item() == pytest.approx(lp[y].item(), abs=1e-3)  # logp
        assert row[1].item() == pytest.approx((lp[y] - lp.max()).item(), abs=1e-3)  # gap
        assert row[2].item() == pytest.approx(-(lp.exp() * lp).sum().item(), abs=1e-3)  # entropy
        assert (row[3].item() == 0.0) == bool(lp[y] >= lp.max())  # rank 0 for the target's own choice
    assert manifest_signals(out) == ["logp", "gap", "entropy", "rank"]
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["labels"] == "judge" and manifest["tuple_counts"]["tuples"] == 3
    assert manifest["positive_tokens"] + manifest["negative_tokens"] == manifest["labelled_tokens"]
    assert manifest["negative_tokens"] == 2 and manifest["feature"]["state"] == "pre"
    assert len((out / "tuples.jsonl").read_text().splitlines()) == 3


def manifest_signals(out):
    return json.loads((out / "manifest.json").read_text())["feature"]["signals"]


GSM = [
    {"question": "one two?", "answer": "1 + 2 = <<1+2=3>>3\n#### 3"},
    {"question": "two two?", "answer": "2 + 2 = <<2+2=4>>4\n#### 4"},
]


def test_generated_answers_are_graded_localised_and_reviewed(tiny_pair_dirs, tmp_path, monkeypatch):
    prompts = tmp_path / "gsm.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in GSM))

    def fake_answers(cfg, pair, batch, ids, seed, pad, eos):
        out = []
        for p in batch:
            ref = int(p.reference)
            out.append(
                [
                    judge_tuples.Answer(f"the sum is {ref}\n#### {ref}", "target", "greedy"),
                    judge_tuples.Answer(f"1 + 1 = 3 so {ref + 1}\n#### {ref + 1}", "draft", "greedy"),  # a false step
                    judge_tuples.Answer(f"it is {ref + 2}\n#### {ref + 2}", "draft", "sample-1"),
                ]
            )  # wrong, no step
        return out

    monkeypatch.setattr(judge_tuples, "_answers", fake_answers)  # where the tuples are built
    out = tmp_path / "dg"
    assert cli.main(_args(tiny_pair_dirs, out, f"prompts={prompts}")) == 0
    m = json.loads((out / "manifest.json").read_text())
    assert m["tuple_counts"] == {
        "items": 2,
        "answers": 6,
        "correct": 2,
        "wrong": 4,
        "ungraded": 0,
        "localised": 2,
        "review": 2,
        "tuples": 2,
        "too_long": 0,
    }
    tuples = [json.loads(x) for x in (out / "tuples.jsonl").read_text().splitlines()]
    t = tuples[0]
    assert t["wrong"][t["error"][0] : t["error"][1]] == "3" and t["provenance"]["correct_model"] == "target"
    review = [json.loads(x) for x in (out / "review.jsonl").read_text().splitlines()]
    assert len(review) == 2 and all("cannot localise" in r["reason"] for r in review)


def test_generated_answers_end_to_end_on_the_tiny_pair(tiny_pair_dirs, tmp_path):
    prompts = tmp_path / "gsm.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in GSM))
    out = tmp_path / "dg"
    assert cli.main(_args(tiny_pair_dirs, out, f"prompts={prompts}", "judge.answer_samples=1")) == 0
    m = json.loads((out / "manifest.json").read_text())
    c = m["tuple_counts"]
    assert c["answers"] == 2 * 2 * 2 and c["correct"] + c["wrong"] + c["ungraded"] == c["answers"]
    assert c["review"] + c["localised"] == c["wrong"]


def test_judge_datagen_needs_prompts_or_tuples(tiny_pair_dirs, tmp_path, capsys):
    assert cli.main(_args(tiny_pair_dirs, tmp_path / "x", "prompts=''")) == 2
    assert "judge.tuples=<file>" in capsys.readouterr().err


@pytest.mark.parametrize("bad", ["judge.answer_models=[teacher]", "judge.answer_temperature=0"])
def test_judge_datagen_bad_settings(tiny_pair_dirs, tmp_path, capsys, bad):
    assert cli.main(_args(tiny_pair_dirs, tmp_path / "x", "prompts=p.jsonl", bad)) == 2


@pytest.fixture(scope="module")
def judge_data(tmp_path_factory, tiny_pair_dirs):
    """``heads-datagen labels=judge`` over 16 imported tuples of random words (chunks of 4)."""
    import random

    words = "the cat dog sat on a mat and ran to big red blue sun moon one two three four five".split()
    rng = random.Random(0)
    rows = []
    for i in range(16):
        correct = " ".join(rng.choice(words) for _ in range(6))
        wrong = " ".join(rng.choice(words) for _ in range(6))
        start = wrong.index(" ", 3) + 1
        rows.append(
            {
                "question": " ".join(rng.choice(words) for _ in range(4)),
                "correct": correct,
                "wrong": wrong,
                "error": [start, start + 2],
            }
        )
    root = tmp_path_factory.mktemp("judge")
    src = root / "t.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = root / "dg"
    assert cli.main(_args(tiny_pair_dirs, data, f"judge.tuples={src}", "prompts=''", "chunk_size=4")) == 0
    return data


@pytest.fixture(scope="module")
def judge_trained(judge_data):
    """A depth-0 judge head trained on ``judge_data``."""
    from specheads.train.cli import main as train_main

    tr = judge_data.parent / "tr"
    assert (
        train_main(
            [
                f"data_dir={judge_data}",
                f"output_dir={tr}",
                "head=judge",
                "depth=0",
                "epochs=3",
                "lr=1e-2",
                "batch_size=2",
                "grad_accum=1",
                "eval_fraction=0.25",
                "w_rej=3.0",
                "weight_decay=0.01",
                "threshold=0.5",
                "patience=3",
                "draft.path=unused",
            ]
        )
        == 0
    )
    return tr


@pytest.fixture(scope="module")
def judge_head(judge_trained):
    """``judge_trained``'s head, exported."""
    from specheads.export.cli import main as export_main

    exp = judge_trained.parent / "exp"
    assert export_main([f"train_dir={judge_trained}", f"output_dir={exp}"]) == 0
    return exp / "head.safetensors"


def _one_prompt(tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "the cat sat"}) + "\n")
    return prompts


def test_judge_data_verifies_and_damaged_features_fail(judge_data, tmp_path):
    import shutil

    assert cli.main([f"output_dir={judge_data}", "verify"]) == 0  # tuple sides once, features match their shards
    shutil.copytree(judge_data, tmp_path / "damaged")
    feats = sorted((tmp_path / "damaged" / "features").glob("chunk-*.safetensors"))[0]
    feats.write_bytes(feats.read_bytes()[:-8])
    assert cli.main([f"output_dir={tmp_path / 'damaged'}", "verify"]) == 1


def test_judge_head_trains_on_the_target_states(judge_trained):
    from specheads.export import read_metadata

    meta = read_metadata(judge_trained / "head.safetensors")
    assert meta["head_type"] == "judge" and meta["feature"] == {
        "model": "target",
        "state": "pre",
        "layer": -1,
        "position": "own",
    }
    metrics = json.loads((judge_trained / "metrics.json").read_text())
    assert {"auroc", "negative_precision", "negative_recall", "wrong_accepted_share"} <= set(metrics)


def test_exported_judge_head_decodes(judge_head, tiny_pair_dirs, tmp_path):
    from specheads.decode.decode_cli import main as decode_main

    t, d = tiny_pair_dirs
    dec = tmp_path / "dec"
    assert (
        decode_main(
            [
                f"target.path={t}",
                "target.gguf_file=null",
                f"draft.path={d}",
                "target.device=cpu",
                "draft.device=cpu",
                f"prompts={_one_prompt(tmp_path)}",
                f"output_dir={dec}",
                "max_new_tokens=10",
                "policy=judge",
                "judge.k=4",
                f"judge.head={judge_head}",
            ]
        )
        == 0
    )
    row = json.loads((dec / "outputs.jsonl").read_text().splitlines()[0])
    assert 1 <= len(row["tokens"]) <= 10 and row["stats"]["target_calls"] >= 1


def test_heads_decode_warns_when_a_gated_judge_decodes_outside_its_gate(judge_head, tiny_pair_dirs, tmp_path, caplog):
    import logging

    from specheads.decode.decode_cli import main as decode_main
    from specheads.export.package import set_default_threshold

    head = tmp_path / "gated.safetensors"
    shutil.copy(judge_head, head)
    set_default_threshold(head, 0.9, {"gate": "max_drop:0.01", "competent_sources": ["facts"]})
    t, d = tiny_pair_dirs
    argv = [f"target.path={t}", "target.gguf_file=null", f"draft.path={d}", "target.device=cpu", "draft.device=cpu"]
    argv += [f"prompts={_one_prompt(tmp_path)}", f"output_dir={tmp_path / 'dec'}", "max_new_tokens=4"]
    with caplog.at_level(logging.WARNING):
        assert decode_main(argv + ["policy=judge", "judge.k=2", f"judge.head={head}"]) == 0
    assert any("outside that gate" in r.getMessage() and "prompt" in r.getMessage() for r in caplog.records)


def test_a_judge_on_the_targets_verdict_trains_exports_and_decodes(judge_data, tiny_pair_dirs, tmp_path):
    """judge.signals: the head reads the target's state and its verdict on the token (stored by datagen);
    exported, it rebuilds itself from its header and decodes, with the margin floor too."""
    from specheads.decode.decode_cli import main as decode_main
    from specheads.export import read_metadata
    from specheads.export.cli import main as export_main
    from specheads.train.cli import main as train_main

    tr, exp = tmp_path / "tr", tmp_path / "exp"
    args = [f"data_dir={judge_data}", f"output_dir={tr}", "head=judge", "depth=1", "epochs=2", "lr=1e-2"]
    args += ["batch_size=2", "grad_accum=1", "eval_fraction=0.25", "draft.path=unused"]
    assert train_main(args + ["judge.signals=[logp,gap,entropy,rank,logp]"]) == 2  # each signal at most once
    assert train_main(args + ["judge.signals=[gap,rank]"]) == 0
    assert export_main([f"train_dir={tr}", f"output_dir={exp}"]) == 0
    meta = read_metadata(exp / "head.safetensors")
    assert meta["head_config"] == {"in_features": 32, "depth": 1, "signals": ["gap", "rank"]}
    assert meta["feature"]["signals"] == ["gap", "rank"]
    t, d = tiny_pair_dirs
    for extra in ([], ["judge.max_gap=0.5"]):
        dec = tmp_path / f"dec{len(extra)}"
        argv = [f"target.path={t}", "target.gguf_file=null", f"draft.path={d}", "target.device=cpu"]
        argv += ["draft.device=cpu", f"prompts={_one_prompt(tmp_path)}", f"output_dir={dec}", "max_new_tokens=10"]
        argv += ["policy=judge", "judge.k=4", f"judge.head={exp / 'head.safetensors'}", *extra]
        assert decode_main(argv) == 0
        row = json.loads((dec / "outputs.jsonl").read_text().splitlines()[0])
        assert 1 <= len(row["tokens"]) <= 10


def test_a_judge_asking_for_signals_the_data_lacks_is_told_to_regenerate(judge_data, tmp_path, capsys):
    from safetensors.torch import save_file

    from specheads.train.cli import main as train_main

    old = tmp_path / "old"
    shutil.copytree(judge_data, old)
    for path in (old / "features").glob("chunk-*.safetensors"):  # data written before the signals existed
        save_file({k: v for k, v in load_file(str(path)).items() if k != "signals"}, str(path))
    args = [f"data_dir={old}", f"output_dir={tmp_path / 'tr'}", "head=judge", "judge.signals=[gap]"]
    assert train_main(args + ["draft.path=unused", "eval_fraction=0.25"]) == 2
    assert "holds no signals" in capsys.readouterr().err


@pytest.mark.parametrize("spelling", ["shorthand", "rows"])
def test_heads_eval_sweeps_the_judge_over_deltas(judge_head, tiny_pair_dirs, tmp_path, spelling):
    """Judge rows over a delta sweep, top-K verification, SD, accuracy where a grader exists; the same run
    whether the rows come from the shorthand fields or from rows= (named as the reports know them)."""
    from specheads.evaluate.cli import main as eval_main
    from specheads.export import read_metadata

    t, d = tiny_pair_dirs
    gsm = tmp_path / "gsm.jsonl"
    gsm.write_text("".join(json.dumps(r) + "\n" for r in GSM))
    ev = tmp_path / "ev"
    head = tmp_path / "judge.safetensors"  # a copy: write_default rewrites it
    shutil.copy(judge_head, head)
    assert (
        eval_main(
            [
                f"target.path={t}",
                "target.gguf_file=null",
                f"draft.path={d}",
                "target.device=cpu",
                "draft.device=cpu",
                f"prompts={gsm},{_one_prompt(tmp_path)}",
                f"output_dir={ev}",
                "max_new_tokens=12",
                "offset=0",
                "num_prompts=null",
                "ks=[4]",
                "head=null",
                *(
                    [f"judge.head={head}", "judge.deltas=[0.5,1.0]", "judge.k=4", "topk.ks=[2]", "topk.k=4"]
                    if spelling == "shorthand"
                    else [
                        f"rows=[{{policy: judge, settings: {{head: {head}, k: 4}}, sweep: {{delta: [0.5, 1.0]}}}}, "
                        "{policy: topk_verify, settings: {k: 4}, sweep: {verify_top_k: [2]}}]"
                    ]
                ),
                "select=max_drop:0.5,max_disagree:0.9",
                "competence_margin=0",  # the random tiny target is at chance: trust its accuracy anyway
                "write_default=true",
            ]
        )
        == 0
    )
    summary = json.loads((ev / "sweep.json").read_text())
    by = {r["config"]: r for r in summary["table"]}
    assert set(by) == {"ar", "draft", "k4", "t2", "j0.5", "j1"}
    assert summary["competence"]["gsm8k"]["informative"] and summary["competence"]["gsm8k"]["chance"] == 0.0
    assert set(summary["fidelity"]) == {"k4", "t2", "j0.5", "j1"}  # every row but the target and the draft alone
    assert summary["fidelity"]["j1"]["exact_match"]["value"] == 1.0  # delta = 1 is SD: the target's outputs
    assert summary["fidelity"]["j1"]["logprob_gap"]["value"] == 0.0
    rows = [json.loads(x) for x in (ev / "rows.jsonl").read_text().splitlines()]
    toks = {(r["index"], r["config"]): r["tokens"] for r in rows}
    assert all(toks[(i, "j1")] == toks[(i, "k4")] for i in range(3))  # delta = 1 is SD at the same K
    assert by["j1"]["accepted_per_call"] == by["k4"]["accepted_per_call"]
    assert summary["accuracy"]["ar"]["gsm8k"]["prompts"] == 2 and "prompt" not in summary["accuracy"]["ar"]
    assert summary["judge"]["sd_reference"] == "k4"
    assert summary["judge"]["by_delta"]["j1"]["vs_sd_accepted_per_call"] == 1.0
    # intervals, the paired drop against the target, and the quality-gated choice written into the head
    acc = summary["accuracy"]
    assert acc["ar"]["gsm8k"]["accuracy_low"] <= acc["ar"]["gsm8k"]["accuracy"] <= acc["ar"]["gsm8k"]["accuracy_high"]
    assert "acc_drop" in acc["j1"]["gsm8k"] and acc["j1"]["gsm8k"]["acc_drop"] == 0.0
    gated = summary["gated"]
    assert (gated["calibration_prompts"], gated["test_prompts"]) == (1, 1)
    chosen = gated["rows"]["judge"]
    assert chosen["row"] in ("j0.5", "j1") and chosen["sd_reference"] == "k4" and chosen["written_to"] == str(head)
    meta = read_metadata(head)
    assert meta["default_threshold"] == chosen["threshold"]
    chosen_by = meta["default_threshold_chosen_by"]
    assert chosen_by["command"] == "heads-eval select=max_drop:0.5,max_disagree:0.9"
    assert chosen_by["gate"] == "max_drop:0.5,max_disagree:0.9" and chosen_by["competent_sources"] == ["gsm8k"]
    assert gated["rows"]["topk_verify"]["row"] == "t2" or gated["rows"]["topk_verify"]["row"] is None


def test_named_judges_sweep_side_by_side_and_gate_apart(judge_head, tiny_pair_dirs, tmp_path):
    """judge.heads={a: ..., b: ...}: rows j-a-<delta> and j-b-<delta>, one gated family each, each chosen threshold
    written into its own head; delta = 1 is SD for both."""
    from specheads.evaluate.cli import main as eval_main
    from specheads.export import read_metadata

    t, d = tiny_pair_dirs
    gsm = tmp_path / "gsm.jsonl"
    gsm.write_text("".join(json.dumps(r) + "\n" for r in GSM))
    heads = {n: tmp_path / f"{n}.safetensors" for n in ("a", "b")}
    for path in heads.values():
        shutil.copy(judge_head, path)
    ev = tmp_path / "ev"
    args = [
        f"target.path={t}",
        "target.gguf_file=null",
        f"draft.path={d}",
        "target.device=cpu",
        "draft.device=cpu",
        f"prompts={gsm}",
        f"output_dir={ev}",
        "max_new_tokens=8",
        "offset=0",
        "num_prompts=null",
        "ks=[4]",
        "head=null",
        "judge.deltas=[1.0]",
        "judge.k=4",
        "select=max_drop:0.5",
        "competence_margin=0",
        "write_default=true",
        "quality=false",
    ]
    assert eval_main([*args, f"judge.heads={{a: {heads['a']}, b: {heads['b']}}}"]) == 0
    summary = json.loads((ev / "sweep.json").read_text())
    assert {r["config"] for r in summary["table"]} == {"ar", "draft", "k4", "j-a-1", "j-b-1"}
    rows = [json.loads(x) for x in (ev / "rows.jsonl").read_text().splitlines()]
    toks = {(r["index"], r["config"]): r["tokens"] for r in rows}
    assert all(toks[(i, "j-a-1")] == toks[(i, "j-b-1")] == toks[(i, "k4")] for i in range(2))
    gated = summary["gated"]["rows"]
    assert set(gated) == {"judge_a", "judge_b"}
    for name, path in heads.items():
        assert gated[f"judge_{name}"]["row"] == f"j-{name}-1" and gated[f"judge_{name}"]["sd_reference"] == "k4"
        assert read_metadata(path)["default_threshold"] == 1.0
    assert eval_main([*args, "output_dir=" + str(tmp_path / "bad"), "judge.heads={'a-b': x}"]) == 2
    ev2 = tmp_path / "ev2"
    assert (
        eval_main(
            [
                *args,
                f"output_dir={ev2}",
                f"judge.heads={{a: {heads['a']}, b: {heads['b']}}}",
                "judge.head_deltas={b: [0.5, 1.0]}",
                "select=null",
                "write_default=false",
            ]
        )
        == 0
    )
    assert {r["config"] for r in json.loads((ev2 / "sweep.json").read_text())["table"]} == {
        "ar",
        "draft",
        "k4",
        "j-a-1",
        "j-b-0.5",
        "j-b-1",
    }
    assert (
        eval_main(
            [
                *args,
                "output_dir=" + str(tmp_path / "bad"),
                f"judge.heads={{a: {heads['a']}}}",
                "judge.head_deltas={c: [0.5]}",
            ]
        )
        == 2
    )


def test_judge_metrics_by_hand():
    from specheads.train.judge_data import judge_metrics

    scores = torch.tensor([0.9, 0.8, 0.2, 0.7, 0.1])
    labels = torch.tensor([1.0, 1.0, 1.0, 0.0, 0.0])
    m = judge_metrics(scores, labels, delta=0.5)
    # accepted: 0.9 0.8 0.7; predicted negative: 0.2 (a correct token) and 0.1 (a wrong one)
    assert m["negative_precision"] == 0.5 and m["negative_recall"] == 0.5 and m["wrong_accepted_share"] == 0.5
    assert m["auroc"] == pytest.approx(5 / 6)


def test_eval_named_judges_need_deltas_somewhere(tmp_path):
    """judge.deltas= may be empty when judge.head_deltas= gives every named judge its own; a named judge left without
    any is a one-line error naming it."""
    from specheads.errors import UserError
    from specheads.evaluate.cli import _check
    from specheads.evaluate.config import EvalConfig, JudgeRows

    heads = {"a": "a.safetensors", "b": "b.safetensors"}
    prompts = str(tmp_path / "p.jsonl")
    _check(
        EvalConfig(
            prompts=prompts, ks=[4], judge=JudgeRows(deltas=[], heads=heads, head_deltas={"a": [0.5], "b": [0.9]})
        )
    )
    with pytest.raises(UserError, match=r"judge.head_deltas gives none for judge\.heads\.b"):
        _check(EvalConfig(prompts=prompts, ks=[4], judge=JudgeRows(deltas=[], heads=heads, head_deltas={"a": [0.5]})))
    with pytest.raises(UserError, match="judge.head is set but judge.deltas is empty"):
        _check(EvalConfig(prompts=prompts, judge=JudgeRows(head="j.safetensors", deltas=[])))


def test_an_offset_past_the_tuples_is_refused_before_any_model_loads(tiny_pair_dirs, tmp_path, capsys):
    src = tmp_path / "t.jsonl"
    src.write_text("".join(json.dumps(t) + "\n" for t in TUPLES))
    out = tmp_path / "dg"
    assert cli.main(_args(tiny_pair_dirs, out, f"judge.tuples={src}", "prompts=''", "offset=3")) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "nothing to label: offset=3" in err and not (out / "data").exists()
