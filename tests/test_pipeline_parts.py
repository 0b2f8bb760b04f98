"""``heads-pipeline`` with ``pipeline.datagen_parts`` and ``pipeline.train_stages``: a drafter rebuilt by one
command on the tiny pair (two data parts, two training stages chained by ``eagle.init_head``), resumable, with its
cost."""

from __future__ import annotations

import json

import pytest
import yaml

from specheads.errors import UserError
from specheads.pipeline import load_configs, main

pytestmark = pytest.mark.slow  # trains and sweeps, stage after stage: CI's slow step

WORDS = ["the cat sat", "a dog ran up", "one two three", "why is the sun red", "big moon", "yes no up down"]


def _recipe(tmp_path, pair_dirs, **pipeline):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": w}) + "\n" for w in WORDS))
    runs = tmp_path / "runs"
    recipe = {
        "description": "tiny drafter pipeline",
        "target": {"path": str(pair_dirs[0]), "device": "cpu"},
        "sampling": {"do_sample": False},
        "seed": 0,
        "datagen": {
            "labels": "drafter",
            "prompts": str(prompts),
            "max_new_tokens": 8,
            "drafter": {"top_k": 5},
            "batch_size": 2,
            "chunk_size": 2,
            "output_dir": str(runs / "dg"),
        },
        "train": {
            "head": "eagle",
            "data_dir": "chained",
            "batch_size": 2,
            "grad_accum": 1,
            "epochs": 1,
            "lr": 3e-3,
            "eval_fraction": 0.3,
            "vocab_top_n": 20,
            "output_dir": str(runs / "tr"),
        },
        "export": {"output_dir": str(runs / "ex")},
        "pipeline": {
            "output_dir": str(runs / "pipe"),
            "stages": ["datagen", "train", "export"],
            "datagen_parts": [{"num_prompts": 3, "output_dir": str(runs / "first")}, {"offset": 3, "num_prompts": 3}],
            "train_stages": [{"eagle": {"ttt_steps": 1}}, {"eagle.ttt_steps": 2, "lr": 1e-3}],
            **pipeline,
        },
    }
    path = tmp_path / "drafter.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path, runs


def test_parts_and_stages_chain_into_one_training_set_and_one_head(tiny_pair_dirs, tmp_path):
    path, runs = _recipe(tmp_path, tiny_pair_dirs)
    pipe, cfgs = load_configs([f"recipe={path}", "datagen.max_new_tokens=6", "train.output_dir=" + str(runs / "x")])
    first, second = cfgs["datagen_parts"]
    assert (first.output_dir, second.output_dir) == (str(runs / "first"), str(runs / "dg-part2"))
    assert first.max_new_tokens == second.max_new_tokens == 6  # the command line reaches every part
    assert (first.offset, second.offset, second.num_prompts) == (0, 3, 3)
    one, two = cfgs["train_stages"]
    assert one.data_dir == two.data_dir == f"{first.output_dir},{second.output_dir}"
    assert (one.output_dir, two.output_dir) == (str(runs / "x-stage1"), str(runs / "x"))
    assert two.eagle.init_head == str(runs / "x-stage1" / "head.safetensors") and not one.eagle.init_head
    assert (one.eagle.ttt_steps, two.eagle.ttt_steps, two.lr) == (1, 2, 1e-3)
    assert cfgs["train"] is two and cfgs["export"].train_dir == str(runs / "x")


def test_the_pipeline_runs_every_part_and_stage_then_resumes_as_a_no_op(tiny_pair_dirs, tmp_path, capsys):
    path, runs = _recipe(tmp_path, tiny_pair_dirs)
    assert main([f"recipe={path}", "train.threads=1", "datagen.threads=1"]) == 0
    out = capsys.readouterr().out
    for part in ("first", "dg-part2"):
        assert json.loads((runs / part / "manifest.json").read_text())["prompts"] == 3
    stage2 = yaml.safe_load((runs / "tr" / "config.yaml").read_text())
    assert stage2["eagle"]["init_head"] == str(runs / "tr-stage1" / "head.safetensors")
    assert stage2["eagle"]["ttt_steps"] == 2
    assert (runs / "ex" / "head.safetensors").is_file()
    summary = json.loads((runs / "pipe" / "summary.json").read_text())
    assert [r["run"] for r in summary["cost"]] == ["datagen part 1", "datagen part 2", "train stage 1", "train stage 2"]
    assert all(r["disk_bytes"] > 0 for r in summary["cost"]) and summary["cost"][0]["tokens"] > 0
    assert summary["cost"][3]["steps"] > 0 and summary["datagen"]["parts"] == 2
    assert "what it cost" in out and "train stage 2" in out
    lines = [json.loads(x) for x in (runs / "pipe" / "metrics.jsonl").read_text().splitlines()]
    assert [(x["stage"], x.get("run")) for x in lines] == [
        ("datagen", "part 1"),
        ("datagen", "part 2"),
        ("train", "stage 1"),
        ("train", "stage 2"),
        ("export", None),
    ]
    before = (runs / "ex" / "head.safetensors").read_bytes()
    assert main([f"recipe={path}", "train.threads=1", "datagen.threads=1"]) == 0  # every run resumes: nothing new
    assert (runs / "ex" / "head.safetensors").read_bytes() == before
    again = json.loads((runs / "pipe" / "summary.json").read_text())["cost"]
    for first, second in zip(summary["cost"], again):  # the second try's cost holds the first's
        assert second["seconds_total"] == pytest.approx(first["seconds_total"] + second["seconds"], abs=0.2)
        assert second["seconds_total"] >= first["seconds_total"] > 0


@pytest.mark.parametrize(
    ("pipeline", "fragment"),
    [
        (
            {"datagen_parts": [{"num_prompts": 2}, {"num_prompts": 2, "output_dir": "same"}, {"output_dir": "same"}]},
            "output_dir ['same'] is shared by parts",
        ),
        ({"datagen_parts": [{"labels": "prompts", "num_prompts": 4}]}, "every part writes prompts"),
        ({"train_stages": [{"output_dir": "a"}, {"output_dir": "a"}]}, "two stages write"),
        ({"regimes": ["t1"]}, "pipeline.regimes cannot rerun datagen_parts"),
        ({"datagen_parts": [{"batch_size": "many"}]}, "[datagen part 1]"),
        ({"datagen_parts": [{"labels": "acceptance"}, {"labels": "acceptance"}]}, "several parts feed one training"),
    ],
)
def test_bad_parts_and_stages_fail_before_anything_runs(tiny_pair_dirs, tmp_path, pipeline, fragment):
    path, runs = _recipe(tmp_path, tiny_pair_dirs, **pipeline)
    with pytest.raises(UserError) as err:
        load_configs([f"recipe={path}"])
    assert fragment in str(err.value)
    assert not runs.exists()


def test_a_prompts_part_feeds_a_later_part_and_not_training(tiny_pair_dirs, tmp_path):
    made = tmp_path / "runs" / "self"
    parts = [
        {"labels": "prompts", "num_prompts": 12, "sampling": {"do_sample": True}, "output_dir": str(made)},
        {"prompts": str(made / "prompts.jsonl"), "num_prompts": None},
    ]
    path, runs = _recipe(tmp_path, tiny_pair_dirs, datagen_parts=parts)
    _, cfgs = load_configs([f"recipe={path}"])
    assert cfgs["datagen_parts"][0].labels == "prompts" and cfgs["datagen_parts"][0].sampling.do_sample
    assert cfgs["datagen_parts"][1].prompts == str(made / "prompts.jsonl")
    assert cfgs["train"].data_dir == str(runs / "dg-part2")


def test_parts_and_stages_get_what_the_pipeline_chains():
    """The pruned draft reaches every part; stages without parts read the recipe's datagen run."""
    _, cfgs = load_configs(["recipe=specdecpp_draft_quickstart", "pipeline.datagen_parts=[{offset: 64}]"])
    (part,) = cfgs["datagen_parts"]
    assert part.draft.vocab_file == cfgs["vocab"].output and part.draft.vocab_top_n == 8192 and part.offset == 64
    assert cfgs["train"].data_dir == part.output_dir == cfgs["datagen"].output_dir + "-part1"
    _, cfgs = load_configs(["recipe=specdecpp_draft_quickstart", "pipeline.train_stages=[{epochs: 1}, {}]"])
    one, two = cfgs["train_stages"]
    assert one.data_dir == two.data_dir == cfgs["datagen"].output_dir and one.epochs == 1
    assert two.output_dir == cfgs["export"].train_dir


def test_earlier_seconds_sums_each_run_over_tries_and_skips_regimes_and_torn_lines(tmp_path):
    from specheads.pipeline.parts import earlier_seconds

    path = tmp_path / "metrics.jsonl"
    assert earlier_seconds(path) == {}
    rows = [
        {"stage": "datagen", "run": "part 1", "seconds": 10.0, "exit_code": 0},
        {"stage": "datagen", "run": "part 1", "seconds": 2.5, "exit_code": 0},
        {"stage": "train", "seconds": 4.0, "exit_code": 0},
        {"stage": "train", "regime": "t1", "seconds": 99.0, "exit_code": 0},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"stage": "exp')
    assert earlier_seconds(path) == {"datagen part 1": 12.5, "train": 4.0}
