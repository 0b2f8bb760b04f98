"""``heads-pipeline``: datagen -> train -> export -> eval from one recipe, on tiny models."""

from __future__ import annotations

import json
import sys

import pytest
import yaml
from conftest import LABEL_PROMPTS

from specheads.pipeline import main

pytestmark = pytest.mark.slow  # trains and sweeps, stage after stage: CI's slow step


def _recipe(tmp_path, pair_dirs):
    t, d = pair_dirs
    prompts = tmp_path / "p.jsonl"
    words = LABEL_PROMPTS
    prompts.write_text("".join(json.dumps({"prompt": w}) + "\n" for w in words))
    runs = tmp_path / "runs"
    recipe = {
        "description": "tiny pipeline",
        "target": {"path": str(t), "device": "cpu"},
        "draft": {"path": str(d), "device": "cpu"},
        "sampling": {"do_sample": False},
        "seed": 0,
        "datagen": {
            "prompts": str(prompts),
            "max_new_tokens": 10,
            "batch_size": 4,
            "chunk_size": 4,
            "output_dir": str(runs / "dg"),
        },
        "train": {
            "data_dir": "ignored: chained",
            "depth": 1,
            "epochs": 2,
            "batch_size": 2,
            "grad_accum": 1,
            "lr": 1e-2,
            "eval_fraction": 0.2,
            "output_dir": str(runs / "tr"),
        },
        "export": {"output_dir": str(runs / "ex")},
        "eval": {
            "prompts": str(prompts),
            "num_prompts": 3,
            "max_new_tokens": 8,
            "ks": [1, 2],
            "thresholds": [0.5],
            "output_dir": str(runs / "ev"),
        },
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
    # the rule eval names to deploy, packed by heads-export into the head eval swept (the same weights)
    from specheads.export import read_metadata
    from specheads.export.cli import main as export_main

    again = [f"train_dir={runs / 'tr'}", f"deploy={runs / 'ev'}", f"output_dir={runs / 'ex'}", "overwrite=true"]
    assert export_main(again) == 0
    packed = read_metadata(runs / "ex" / "head.safetensors")["deploy"]
    assert packed["config"] == json.loads((runs / "ev" / "sweep.json").read_text())["deploy"]["config"]


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
    assert cfgs["eval"].sprinter.head == "/tmp/x-export/head.safetensors" and cfgs["eval"].head is None
    _, cfgs = load_configs(["recipe=quickstart", "export.output_dir=/tmp/y-export"])
    assert cfgs["eval"].head == "/tmp/y-export/head.safetensors" and cfgs["eval"].sprinter.head is None
    for head in ("sprinter", "eagle_verifier"):  # the alias, and the verifier on an EAGLE head's states
        _, cfgs = load_configs(["recipe=sprinter_eagle", f"train.head={head}", "export.output_dir=/tmp/w-export"])
        assert cfgs["eval"].sprinter.head == "/tmp/w-export/head.safetensors" and cfgs["eval"].head is None


def test_a_judge_recipe_chains_the_export_into_eval_judge():
    from specheads.pipeline import load_configs

    _, cfgs = load_configs(["recipe=judge_quickstart", "export.output_dir=/tmp/z-export"])
    assert cfgs["eval"].judge.head == "/tmp/z-export/head.safetensors" and cfgs["eval"].head is None


def test_the_vocab_stage_prunes_the_draft_of_every_later_stage():
    from specheads.pipeline import load_configs

    pipe, cfgs = load_configs(["recipe=specdecpp_draft_quickstart", "vocab.top_n=4096"])
    assert pipe.stages[0] == "vocab"
    for stage in ("datagen", "train", "eval"):
        assert cfgs[stage].draft.vocab_file == cfgs["vocab"].output
        assert cfgs[stage].draft.vocab_top_n == 4096
    _, cfgs = load_configs(["recipe=specdecpp_draft_quickstart", "vocab.top_n=null"])
    assert cfgs["datagen"].draft.vocab_file is None and cfgs["eval"].draft.vocab_top_n is None
    pipe, cfgs = load_configs(["recipe=judge_quickstart"])  # no vocab section: no vocab stage, no pruning
    assert "vocab" not in pipe.stages and "vocab" not in cfgs
    pipe, _ = load_configs(["recipe=specdecpp_draft_quickstart", "draft.path=''"])  # no draft model: nothing to prune
    assert "vocab" not in pipe.stages


def test_the_quickstart_runs_on_the_committed_eagle_head():
    """recipe=quickstart: no draft model and no vocab stage; the committed EAGLE head drafts in datagen
    (labels=eagle_rounds, on GSM8K-train prompts past those it trained on) and in eval, which gets the exported
    stop head; heads-decode keeps the 4-layer draft."""
    from pathlib import Path

    from specheads.config import load_config, schema_for
    from specheads.pipeline import load_configs

    pipe, cfgs = load_configs(["recipe=quickstart", "export.output_dir=/tmp/q-export"])
    assert pipe.stages == ["datagen", "train", "export", "eval"]
    dg, ev = cfgs["datagen"], cfgs["eval"]
    assert dg.labels == "eagle_rounds" and cfgs["train"].head == "eagle_stop"
    assert dg.eagle_rounds.head == ev.eagle and (Path(__file__).parents[1] / ev.eagle).is_file()
    assert dg.eagle_rounds.k >= ev.k_max
    assert dg.offset >= 320 and "gsm8k/train" in dg.prompts  # the head's training read GSM8K-train rows 0-319
    assert not dg.draft.path and not ev.draft.path and ev.head == "/tmp/q-export/head.safetensors"
    assert cfgs["train"].data_dir == dg.output_dir and ev.ks and ev.cost_stop and ev.confidence.taus
    assert load_config(schema_for("decode"), "decode", ["recipe=quickstart"]).draft.path


def _eagle_head(target_dir, path):
    """An EAGLE head for the tiny target (layer 1 of 2), started from the target as heads-train does."""
    from specheads.export import save_head
    from specheads.heads import EagleHead
    from specheads.shim import ModelSpec, load_pair
    from specheads.train.eagle_data import init_from_target

    pair = load_pair(ModelSpec(path=str(target_dir), device="cpu"), None)
    model = pair.target.model
    vocab = model.config.vocab_size
    head = EagleHead(
        hidden_size=32,
        layers=[1],
        draft_vocab_size=vocab,
        vocab_size=vocab,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        intermediate_size=64,
        rms_norm_eps=model.config.rms_norm_eps,
        rope_theta=10000.0,
    )
    init_from_target(head, model, list(range(vocab)), 0)
    save_head(
        path,
        head,
        "eagle",
        {
            "head_config": head.config(),
            "hidden_size": 32,
            "target": {"name": pair.target.name, "fingerprint": pair.target.fingerprint},
            "feature": {"model": "target", "state": "aux", "layers": [1]},
        },
    )
    return path


def _eagle_recipe(tiny_pair_dirs, tmp_path):
    """The quickstart's shape on tiny models, priced by a synthetic cost table (no timing decides a test)."""
    from specheads.shim.costs.cost_table import CostTable

    path, runs = _recipe(tmp_path, tiny_pair_dirs)
    recipe = yaml.safe_load(path.read_text())
    eagle = str(_eagle_head(tiny_pair_dirs[0], tmp_path / "eagle.safetensors"))
    table = tmp_path / "costs.json"  # a synthetic cost table: no timing decides the test
    table.write_text(json.dumps(CostTable(t_draft_ms=0.5, t_target_ms=[4 + 0.5 * k for k in range(1, 12)]).to_dict()))
    del recipe["draft"]
    recipe["vocab"] = {"corpus": recipe["datagen"]["prompts"], "output": str(runs / "vocab.json"), "top_n": 8}
    recipe["datagen"].update(labels="eagle_rounds", eagle_rounds={"head": eagle, "k": 4}, threads=1)
    recipe["train"].update(head="eagle_stop", depth=1, eval_fraction=0.25, threads=1)
    recipe["eval"].update(
        eagle=eagle, thresholds=[0.5], confidence={"taus": [0.5], "k_max": 4}, k_min=1, k_max=4, profile=str(table)
    )
    path.write_text(yaml.safe_dump(recipe))
    return path, runs, eagle


def test_an_eagle_pipeline_labels_trains_exports_and_sweeps_on_the_head(tiny_pair_dirs, tmp_path, capsys):
    """The quickstart's shape on tiny models: labels=eagle_rounds -> head=eagle_stop (a confidence head, d + 1
    inputs) -> export -> heads-eval eagle=; the vocab section is skipped (no draft model), and the summary
    prints the drafter's gain over the target alone and the stop rules' over the best fixed K."""

    path, runs, eagle = _eagle_recipe(tiny_pair_dirs, tmp_path)
    assert main([f"recipe={path}"]) == 0
    out = capsys.readouterr().out
    summary = json.loads((runs / "pipe" / "summary.json").read_text())
    assert list(summary["stage_seconds"]) == ["datagen", "train", "export", "eval"]
    assert not (runs / "vocab.json").exists()
    assert summary["datagen"]["labels"] == "eagle_rounds" and summary["train"]["eval_auroc_confidence"] is not None
    assert [r["config"] for r in summary["eval"]["table"]] == [
        "ar",
        "k1",
        "k2",
        "h0.5",
        "h-cost",
        "c0.5",
        "c-cost",
        "c-online-cost",
        "c-entropy-cost",
    ]
    assert summary["eval"]["eagle"]["path"] == eagle and summary["eval"]["drafter"] == f"EAGLE head {eagle}"
    ev_cfg = yaml.safe_load((runs / "ev" / "config.yaml").read_text())
    assert ev_cfg["head"] == str(runs / "ex" / "head.safetensors") and ev_cfg["eagle"] == eagle
    assert f"drafter gain (EAGLE head {eagle}): its fastest lossless row" in out
    assert "stop head gain over the best fixed K" in out and "h-cost" in out and "training-free c0.5" in out
    assert set(summary["eval"]["ceilings"]) == {"lag0", "lag1"} and "ceiling (a perfect stop rule" in out


def test_the_drafter_gain_counts_every_lossless_row_and_the_stop_gain_the_stop_rules():
    from specheads.gains import gains

    table = [  # each row says whether its policy is lossless (heads-eval's table: Policy.lossless)
        {"config": "ar", "tokens_per_s": 20.0, "lossless": True},
        {"config": "k2", "tokens_per_s": 25.0, "lossless": True},
        {"config": "tree-3x2x4", "tokens_per_s": 30.0, "lossless": True},
        {"config": "t2", "tokens_per_s": 40.0, "lossless": False},
        {"config": "my-policy", "tokens_per_s": 35.0, "lossless": False},
        {"config": "h-cost", "tokens_per_s": 24.0, "lossless": True},
    ]
    drafter, stop = gains({"table": table, "best_fixed_k": "k2", "drafter": "EAGLE head"})
    assert "tree-3x2x4 30.0 tokens/s = 1.500x" in drafter  # the lossy rows (t2, my-policy) are not counted
    assert "h-cost 24.0 tokens/s = 0.960x" in stop


def test_the_main_job_shows_each_stop_rows_ceiling_and_says_when_none_can_pay():
    from specheads.gains import ceiling_lines

    table = [
        {"config": "k2", "tokens_per_s": 25.0},
        {"config": "h-cost", "tokens_per_s": 24.0, "ceiling_vs_best_fixed_k": 1.03, "share_of_ceiling": -0.5},
        {"config": "c-cost", "tokens_per_s": 25.5, "ceiling_vs_best_fixed_k": 1.04, "share_of_ceiling": 0.25},
    ]
    low = {"table": table, "ceilings": {"lag0": {"vs_best_fixed_k": 1.04}, "lag1": {"vs_best_fixed_k": 1.03}}}
    line, verdict = ceiling_lines(low)
    assert "1.040x at lag 0, 1.030x at lag 1" in line and "h-cost -0.50, c-cost 0.25" in line
    assert verdict.startswith("no stop rule can pay here: even a perfect one gains at most 1.040x")
    high = {"table": table, "ceilings": {"lag0": {"vs_best_fixed_k": 1.3}, "lag1": {"vs_best_fixed_k": 1.2}}}
    assert len(ceiling_lines(high)) == 1  # room to pay: no verdict
    table[1]["ceiling_vs_best_fixed_k"] = 0.97  # the quickstart's case: lag 1 below the best K, lag 0 above
    split = {"table": table, "ceilings": {"lag0": {"vs_best_fixed_k": 1.1}, "lag1": {"vs_best_fixed_k": 0.97}}}
    _, verdict = ceiling_lines(split)
    assert (
        verdict.startswith("no lag-1 stop rule can pay here (h-cost): even a perfect one is 0.970x")
        and "1.100x" in verdict
    )
    assert ceiling_lines({"table": table}) == []


def test_a_sampled_regime_reruns_the_chain_and_the_summary_says_where_a_head_can_pay(tiny_pair_dirs, tmp_path, capsys):
    """``pipeline.regimes=[t1]`` runs datagen -> train -> export -> eval again at temperature 1 into
    ``<dir>-t1`` (each stage chained to its own regime's outputs), and the summary adds the regime's table and
    names the regime with the largest ceiling."""
    path, runs, _ = _eagle_recipe(tiny_pair_dirs, tmp_path)
    assert main([f"recipe={path}", "pipeline.regimes=[t1]"]) == 0
    out = capsys.readouterr().out
    summary = json.loads((runs / "pipe" / "summary.json").read_text())
    assert summary["regime"] == "greedy" and list(summary["regimes"]) == ["t1"]
    t1 = summary["regimes"]["t1"]
    assert list(t1["stage_seconds"]) == ["datagen", "train", "export", "eval"]
    assert [r["config"] for r in t1["eval"]["table"]] == [r["config"] for r in summary["eval"]["table"]]
    dg = yaml.safe_load((runs / "dg-t1" / "config.yaml").read_text())
    assert dg["sampling"]["do_sample"] and dg["sampling"]["temperature"] == 1.0
    tr = yaml.safe_load((runs / "tr-t1" / "config.yaml").read_text())
    ev = yaml.safe_load((runs / "ev-t1" / "config.yaml").read_text())
    assert tr["data_dir"] == str(runs / "dg-t1") and ev["head"] == str(runs / "ex-t1" / "head.safetensors")
    assert (
        ev["sampling"]["do_sample"]
        and not yaml.safe_load((runs / "ev" / "config.yaml").read_text())["sampling"]["do_sample"]
    )
    where = summary["where_heads_pay"]
    assert set(where["ceilings"]) == {"greedy", "t1"} and where["ceiling"] == max(where["ceilings"].values())
    assert "== regime t1 ==" in out and f"where a stop head can pay: {where['regime']}" in out
    lines = [json.loads(x) for x in (runs / "pipe" / "metrics.jsonl").read_text().splitlines()]
    assert [(x["stage"], x.get("regime")) for x in lines][-4:] == [
        ("datagen", "t1"),
        ("train", "t1"),
        ("export", "t1"),
        ("eval", "t1"),
    ]


def test_a_regime_that_is_not_one_or_is_listed_twice_stops_before_any_stage(tiny_pair_dirs, tmp_path, capsys):
    path, runs = _recipe(tmp_path, tiny_pair_dirs)
    for bad, words in (("[t0]", "'t0' is not a regime"), ("[hot]", "'hot' is not a regime"), ("[greedy]", "twice")):
        assert main([f"recipe={path}", f"pipeline.regimes={bad}"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and words in err, err
    assert not runs.exists()


def test_where_a_head_can_pay_picks_the_largest_ceiling_and_names_the_fastest_rule_there():
    from specheads.gains import where_heads_pay, where_lines

    def run(ceiling, rows):
        table = [{"config": c, "tokens_per_s": v} for c, v in rows.items()]
        return {"eval": {"table": table, "ceilings": {"lag0": {"vs_best_fixed_k": ceiling}, "lag1": {}}}}

    greedy = run(1.03, {"ar": 30.0, "k1": 40.0, "h-cost": 39.0, "c-cost": 41.0})
    t1 = run(1.16, {"ar": 30.0, "k1": 36.0, "k2": 35.0, "h-cost": 38.0, "c0.5": 37.0, "c-cost": 36.5})
    where = where_heads_pay({"greedy": greedy, "t1": t1})
    assert where["regime"] == "t1" and where["ceiling"] == 1.16 and where["pays"]
    assert (where["best_fixed_k"], where["best_training_free"], where["best_head"]) == ("k1", "c0.5", "h-cost")
    assert where["head_vs_best_training_free"] == round(38 / 37, 4)
    lines = where_lines(where)
    assert "greedy 1.030x, t1 1.160x" in lines[0] and lines[-1] == "fastest rule there: h-cost (the learned head pays)"
    t1["eval"]["table"][3]["tokens_per_s"] = 35.0  # the head slower than the training-free rule
    assert where_lines(where_heads_pay({"t1": t1}))[-1] == "fastest rule there: c0.5"
    low = where_heads_pay({"greedy": greedy})
    assert not low["pays"] and "in no regime run here can a stop rule pay" in where_lines(low)[-1]
    assert where_heads_pay({"greedy": {"eval": {"table": []}}}) is None and where_lines(None) == []
