"""The rule to deploy: ``heads-export deploy=`` packs heads-eval's choice, ``heads-decode deploy=`` and the vLLM stop
plugin's settings run it by default (``export/deploy.py``)."""

from __future__ import annotations

import json

import pytest
from conftest import acceptance_head_file, decode_args

from specheads.decode.decode_cli import main as decode_main
from specheads.export import read_metadata
from specheads.export.cli import main as export_main
from specheads.export.deploy import plugin_rule
from specheads.shim import CostTable, SamplingConfig
from specheads.vllm.stop_config import StopSettings


def _head(pair_dirs, path, seed=0):
    return acceptance_head_file(pair_dirs, path, seed)


def _sweep(directory, config, kind, policy, settings, batch_size=1):
    directory.mkdir(parents=True, exist_ok=True)
    choice = {
        "config": config,
        "kind": kind,
        "tokens_per_s": 50.0,
        "tokens_per_s_interval": [48.0, 52.0],
        "within_noise_of_fixed_k": False,
        "policy": policy,
        "settings": settings,
        "regime": {"engine": "specheads", "batch_size": batch_size, "sampling": SamplingConfig().to_dict()},
    }
    (directory / "sweep.json").write_text(json.dumps({"table": [], "deploy": choice}))
    return directory


@pytest.fixture()
def trained(tiny_pair_dirs, tmp_path):
    """A heads-train-like output_dir holding one head."""
    train = tmp_path / "train"
    train.mkdir()
    _head(tiny_pair_dirs, train / "head.safetensors")
    return train


def _export(train, sweep, out, capsys=None) -> int:
    return export_main([f"train_dir={train}", f"deploy={sweep}", f"output_dir={out}"])


def _err(capsys, prog: str) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"{prog}: error: "), err
    return err[0]


def test_export_packs_the_learned_choice_and_decode_runs_it(tiny_pair_dirs, trained, tmp_path):
    table = tmp_path / "costs.json"
    table.write_text(json.dumps(CostTable(t_draft_ms=0.5, t_target_ms=[4 + 0.5 * k for k in range(1, 22)]).to_dict()))
    settings = {"head": str(trained / "head.safetensors"), "k_min": 2, "k_max": 6, "stop": "cost"}
    sweep = _sweep(tmp_path / "eval", "h-cost", "learned", "specdecpp", settings)
    assert _export(trained, sweep, tmp_path / "export") == 0
    file = tmp_path / "export" / "head.safetensors"
    record = read_metadata(file)["deploy"]
    assert record["config"] == "h-cost" and record["policy"] == "specdecpp"
    assert record["settings"] == {"k_min": 2, "k_max": 6, "stop": "cost"}  # the head is the file itself
    assert record["sweep"] == str((sweep / "sweep.json").resolve()) and record["tokens_per_s_interval"] == [48, 52]
    assert json.loads((tmp_path / "export" / "manifest.json").read_text())["deploy"] == "h-cost"
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "the cat sat"}) + "\n")
    out = tmp_path / "dec"
    assert decode_main(decode_args(tiny_pair_dirs, prompts, out, f"deploy={file}", f"profile={table}")) == 0
    cfg = json.loads((out / "metrics.json").read_text())
    assert cfg["policy"] == "specdecpp" and cfg["stop"] == "cost" and cfg["k_max"] == 6 and cfg["k_min"] == 2
    # a setting given in the policy's section wins over the packaged one
    out2 = tmp_path / "dec2"
    args = decode_args(tiny_pair_dirs, prompts, out2, f"deploy={file}", f"profile={table}", "specdecpp.k_max=4")
    assert decode_main(args) == 0
    assert json.loads((out2 / "metrics.json").read_text())["k_max"] == 4
    # the plugin: no rule given, the head's packaged one
    assert StopSettings(head=str(file)).rule == "h-cost"


def test_a_fixed_k_choice_runs_as_sd(tiny_pair_dirs, trained, tmp_path):
    sweep = _sweep(tmp_path / "eval", "k3", "fixed_k", "sd", {"k": 3})
    assert _export(trained, sweep, tmp_path / "export") == 0
    file = tmp_path / "export" / "head.safetensors"
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "one two three"}) + "\n")
    assert decode_main(decode_args(tiny_pair_dirs, prompts, tmp_path / "dec", f"deploy={file}")) == 0
    got = json.loads((tmp_path / "dec" / "metrics.json").read_text())
    assert got["policy"] == "sd" and got["k"] == 3
    s = StopSettings(head=str(file))
    assert (s.rule, s.fixed_k) == ("fixed", 3) and s.problems(6) == []
    assert StopSettings(head=str(file), rule="c-cost", costs=str(file)).rule == "c-cost"  # a given rule wins
    from specheads.vllm.stop_config import SECTION, speculative_config

    (tmp_path / "eagle").mkdir()
    (tmp_path / "eagle" / "config.json").write_text("{}")
    spec = speculative_config(str(tmp_path / "eagle"), 6, head=str(file))  # what every worker reads
    written = spec["draft_load_config"]["model_loader_extra_config"][SECTION]
    assert (written["rule"], written["fixed_k"]) == ("fixed", 3)


def test_bad_deploy_input_is_one_line(tiny_pair_dirs, trained, tmp_path, capsys):
    other = _head(tiny_pair_dirs, tmp_path / "other.safetensors", seed=1)
    learned = {"head": str(other), "stop": "cost"}
    sweep = _sweep(tmp_path / "eval", "h-cost", "learned", "specdecpp", learned)
    assert _export(trained, sweep, tmp_path / "e1") == 2
    assert "read the head" in _err(capsys, "heads-export")
    assert _export(trained, tmp_path / "nowhere", tmp_path / "e2") == 2
    assert "no sweep.json" in _err(capsys, "heads-export")
    (tmp_path / "none").mkdir()
    (tmp_path / "none" / "sweep.json").write_text(json.dumps({"table": []}))
    assert _export(trained, tmp_path / "none", tmp_path / "e3") == 2
    assert "names no rule to deploy" in _err(capsys, "heads-export")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "a"}) + "\n")
    bare = trained / "head.safetensors"  # exported without deploy=
    assert decode_main(decode_args(tiny_pair_dirs, prompts, tmp_path / "d1", f"deploy={bare}")) == 2
    assert "carries no rule to deploy" in _err(capsys, "heads-decode")
    sweep = _sweep(tmp_path / "eval2", "k2", "fixed_k", "sd", {"k": 2})
    assert _export(trained, sweep, tmp_path / "e4") == 0
    k2 = tmp_path / "e4" / "head.safetensors"
    assert decode_main(decode_args(tiny_pair_dirs, prompts, tmp_path / "d2", f"deploy={k2}", "policy=judge")) == 2
    assert "runs policy=sd" in _err(capsys, "heads-decode")


@pytest.mark.parametrize(
    "policy, settings, rule",
    [
        ("sd", {"k": 4}, ("fixed", 4)),
        ("confidence_stop", {"k_max": 10, "stop": "cost", "estimate": "q"}, ("c-cost", None)),
        ("confidence_stop", {"k_max": 10, "stop": "cost", "estimate": "online"}, ("c-online-cost", None)),
        ("specdecpp", {"k_max": 6, "stop": "cost"}, ("h-cost", None)),
        ("confidence_stop", {"k_max": 10, "tau": 0.4}, None),
        ("specdecpp", {"h": 0.3}, None),
        ("judge", {"delta": 0.9}, None),
    ],
)
def test_the_plugin_runs_fixed_k_and_the_cost_rules(policy, settings, rule):
    record = {"config": "x", "policy": policy, "settings": settings}
    if rule is None:
        with pytest.raises(ValueError, match="does not run in the stop plugin"):
            plugin_rule(record)
    else:
        assert plugin_rule(record) == rule


def test_plugin_default_rule_without_a_packaged_choice(tiny_pair_dirs, trained, tmp_path):
    assert StopSettings().rule == "c-cost"
    assert StopSettings(head=str(trained / "head.safetensors")).rule == "h-cost"
    sweep = _sweep(tmp_path / "eval", "c0.4", "training_free", "confidence_stop", {"k_max": 10, "tau": 0.4})
    assert _export(trained, sweep, tmp_path / "export") == 0
    s = StopSettings(head=str(tmp_path / "export" / "head.safetensors"))
    assert any("c0.4" in p and "pass rule=" in p for p in s.problems(6))


def test_a_vllm_sweep_names_its_fastest_speculating_row():
    from specheads.evaluate.config import EvalConfig
    from specheads.evaluate.vllm_sweep import deploy

    cfg = EvalConfig(ks=[2, 4], head=None)
    cfg.confidence.taus = [0.3]
    rows = {"ar": 10.0, "k2": 20.0, "k4": 18.0, "c0.3": 22.0, "c-cost": 30.0}
    summary = {n: {"tokens_per_s": v, "greedy_identical": n != "c-cost"} for n, v in rows.items()}
    d = deploy(cfg, summary)  # c-cost changed the greedy tokens: never the choice
    assert (d["config"], d["kind"], d["policy"]) == ("c0.3", "training_free", "confidence_stop")
    assert d["settings"] == {"tau": 0.3, "k_max": cfg.confidence.k_max} and d["regime"]["engine"] == "vllm"
    assert d["vs_best_fixed_k"] == {"value": 1.1, "low": None, "high": None, "against": "k2"}
    with pytest.raises(ValueError, match="c0.3"):  # a threshold rule: the plugin asks for rule=
        plugin_rule(d)
