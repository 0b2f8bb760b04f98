"""``heads-pipeline``: datagen -> train -> export -> eval from one recipe, on tiny models."""

from __future__ import annotations

import json
import sys

import yaml

from specheads.pipeline import main


def _recipe(tmp_path, pair_dirs):
    t, d = pair_dirs
    prompts = tmp_path / "p.jsonl"
    words = ["the cat sat", "a dog ran up", "one two three", "why is the sun red", "big moon", "yes no up down",
             "left right", "the red sun", "two three four", "who was it"]
    prompts.write_text("".join(json.dumps({"prompt": w}) + "\n" for w in words))
    runs = tmp_path / "runs"
    recipe = {
        "description": "tiny pipeline",
        "target": {"path": str(t), "device": "cpu"}, "draft": {"path": str(d), "device": "cpu"},
        "sampling": {"do_sample": False}, "seed": 0,
        "datagen": {"prompts": str(prompts), "max_new_tokens": 10, "batch_size": 4, "chunk_size": 4,
                    "output_dir": str(runs / "dg")},
        "train": {"data_dir": "ignored: chained", "depth": 1, "epochs": 2, "batch_size": 2, "grad_accum": 1,
                  "lr": 1e-2, "eval_fraction": 0.2, "output_dir": str(runs / "tr")},
        "export": {"output_dir": str(runs / "ex")},
        "eval": {"prompts": str(prompts), "num_prompts": 3, "max_new_tokens": 8, "ks": [1, 2],
                 "thresholds": [0.5], "output_dir": str(runs / "ev")},
        "pipeline": {"output_dir": str(runs / "pipe")},
    }
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path, runs


def test_pipeline_runs_every_stage_chained(tiny_pair_dirs, tmp_path, capsys):
    path, runs = _recipe(tmp_path, tiny_pair_dirs)
    assert main([f"recipe={path}", "train.depth=0", "seed=3"]) == 0
    out = capsys.readouterr().out
    assert "== heads-pipeline summary ==" in out and "best fixed K" in out and "oracle predicted" in out
    summary = json.loads((runs / "pipe" / "summary.json").read_text())
    assert set(summary["stage_seconds"]) == {"datagen", "train", "export", "eval"}
    assert summary["datagen"]["prompts"] == 10 and summary["train"]["eval_binary_kl"] is not None
    assert [r["config"] for r in summary["eval"]["table"]] == ["ar", "draft", "k1", "k2", "h0.5", "h-cost"]
    assert summary["eval"]["oracle"]["predicted_tokens_per_s"] > 0 and summary["eval"]["best_lossless"]["config"]
    ev_cfg = yaml.safe_load((runs / "ev" / "config.yaml").read_text())
    assert ev_cfg["head"] == str(runs / "ex" / "head.safetensors") and ev_cfg["seed"] == 3
    tr_cfg = yaml.safe_load((runs / "tr" / "config.yaml").read_text())
    assert tr_cfg["data_dir"] == str(runs / "dg") and tr_cfg["depth"] == 0
    lines = (runs / "pipe" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["stage"] for x in lines] == ["datagen", "train", "export", "eval"]
    assert main([f"recipe={path}", "train.depth=0", "seed=3"]) == 0  # everything resumes: a no-op rerun


def test_pipeline_checks_every_stage_before_running(tiny_pair_dirs, tmp_path, capsys):
    path, runs = _recipe(tmp_path, tiny_pair_dirs)
    assert main([f"recipe={path}", "train.dept=2", "eval.ks=[0]", "colour=red"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no stage has a key 'colour'" in err
    assert main([f"recipe={path}", "train.dept=2"]) == 2
    err = capsys.readouterr().err
    assert "[train]" in err and "depth" in err and not (runs / "dg").exists()
    assert main(["--help"]) == 0
    assert "datagen -> train -> export -> eval" in capsys.readouterr().out


def test_a_missing_extra_stops_the_pipeline_before_any_stage(tiny_pair_dirs, tmp_path, capsys, monkeypatch):
    """Without the [eval] extra the pipeline ends in one line naming it before datagen starts, not in a
    traceback after the earlier stages ran."""
    path, runs = _recipe(tmp_path, tiny_pair_dirs)
    monkeypatch.setitem(sys.modules, "rouge_score", None)  # not installed, as importlib sees it
    assert main([f"recipe={path}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "needs the [eval] extra (not installed: rouge_score)" in err[0], err
    assert not runs.exists()


def test_a_common_overwrite_reaches_the_pipeline_and_every_stage(tiny_pair_dirs, tmp_path):
    from specheads.pipeline import load_configs

    recipe, _ = _recipe(tmp_path, tiny_pair_dirs)
    pipe, cfgs = load_configs([f"recipe={recipe}", "overwrite=true"])
    assert pipe.overwrite and all(c.overwrite for c in cfgs.values() if hasattr(c, "overwrite"))
    pipe, _ = load_configs([f"recipe={recipe}"])
    assert not pipe.overwrite


def test_a_verifier_recipe_chains_the_export_into_eval_verifier():
    from specheads.pipeline import load_configs

    _, cfgs = load_configs(["recipe=sprinter_quickstart", "export.output_dir=/tmp/x-export", "eval.head=null"])
    assert cfgs["train"].head == "verifier"
    assert cfgs["eval"].verifier == "/tmp/x-export/head.safetensors" and cfgs["eval"].head is None
    _, cfgs = load_configs(["recipe=quickstart", "export.output_dir=/tmp/y-export"])
    assert cfgs["eval"].head == "/tmp/y-export/head.safetensors" and cfgs["eval"].verifier is None


def test_a_judge_recipe_chains_the_export_into_eval_judge():
    from specheads.pipeline import load_configs

    _, cfgs = load_configs(["recipe=judge_quickstart", "export.output_dir=/tmp/z-export"])
    assert cfgs["eval"].judge == "/tmp/z-export/head.safetensors" and cfgs["eval"].head is None


def test_the_vocab_stage_prunes_the_draft_of_every_later_stage():
    from specheads.pipeline import load_configs

    pipe, cfgs = load_configs(["recipe=quickstart", "vocab.top_n=4096"])
    assert pipe.stages[0] == "vocab"
    for stage in ("datagen", "train", "eval"):
        assert cfgs[stage].draft.vocab_file == cfgs["vocab"].output
        assert cfgs[stage].draft.vocab_top_n == 4096
    _, cfgs = load_configs(["recipe=quickstart", "vocab.top_n=null"])
    assert cfgs["datagen"].draft.vocab_file is None and cfgs["eval"].draft.vocab_top_n is None
    pipe, cfgs = load_configs(["recipe=judge_quickstart"])  # no vocab section: no vocab stage, no pruning
    assert "vocab" not in pipe.stages and "vocab" not in cfgs
