"""Recipe + schema + key=value loading, its error messages, and the CLI wrapper."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Optional

import pytest

from specheads import config
from specheads.config import UserError, cli_main, help_text, load_config, to_yaml


@dataclass
class Sampling:
    top_p: float = 1.0
    temperature: float = field(default=0.0, metadata={"help": "Softmax temperature."})


@dataclass
class Model:
    path: str = "???"
    dtype: str = "float32"


@dataclass
class TrainCfg:
    """Training settings for the test CLI."""

    lr: float = field(default=1e-3, metadata={"help": "Peak learning rate."})
    steps: int = 10
    policy: Literal["sd", "fsd"] = "sd"
    out: Path = Path("runs/x")
    note: Optional[str] = None
    tags: list[str] = field(default_factory=list)
    sampling: Sampling = field(default_factory=Sampling)
    target: Model = field(default_factory=lambda: Model(path="default/model"))


@dataclass
class NeedsPath:
    target: Model = field(default_factory=Model)
    name: str = "???"


RECIPE = """\
description: A test recipe
  over two lines.
lr: 0.5
steps: 3
sampling: {top_p: 0.8}
target: {path: "${oc.env:SPECHEADS_TEST_ROOT,/fallback}/m"}
not_a_train_field: 1
train:
  steps: 20
  sampling: {temperature: 0.7}
decode:
  k: 4
"""


@pytest.fixture()
def recipe(tmp_path: Path) -> str:
    path = tmp_path / "mine.yaml"
    path.write_text(RECIPE)
    return f"recipe={path}"


def _error(schema: type, argv: list[str], section: str = "train") -> str:
    with pytest.raises(UserError) as info:
        load_config(schema, section, argv)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_precedence_defaults_common_section_cli(recipe: str) -> None:
    cfg = load_config(TrainCfg, "train", [recipe, "sampling.top_p=0.9"])
    assert isinstance(cfg, TrainCfg) and isinstance(cfg.sampling, Sampling)
    assert cfg.policy == "sd"  # schema default
    assert cfg.lr == 0.5  # recipe common key
    assert cfg.steps == 20  # recipe section beats common
    assert cfg.sampling.temperature == 0.7  # section, nested
    assert cfg.sampling.top_p == 0.9  # command line beats common
    assert cfg.target.dtype == "float32"  # default kept beside a recipe-set sibling
    cfg = load_config(TrainCfg, "train", [recipe, "steps=7", "lr=1e-4", "steps=8"])
    assert (cfg.steps, cfg.lr) == (8, 1e-4)  # the later of two items wins


def test_interpolation_resolves(recipe: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SPECHEADS_TEST_ROOT", raising=False)
    assert load_config(TrainCfg, "train", [recipe]).target.path == "/fallback/m"
    monkeypatch.setenv("SPECHEADS_TEST_ROOT", "/data")
    assert load_config(TrainCfg, "train", [recipe]).target.path == "/data/m"


def test_types_converted(recipe: str) -> None:
    cfg = load_config(TrainCfg, "train", [recipe, "out=a/b", "tags=[x,y]", "policy=fsd"])
    assert cfg.out == Path("a/b") and cfg.tags == ["x", "y"] and cfg.policy == "fsd"


def test_unknown_key_did_you_mean(recipe: str) -> None:
    message = _error(TrainCfg, [recipe, "lrr=3"])
    assert message == "unknown key 'lrr' for heads-train (did you mean 'lr'?)"


def test_unknown_nested_key_did_you_mean(recipe: str) -> None:
    message = _error(TrainCfg, [recipe, "sampling.top_q=0.9"])
    assert message == ("unknown key 'sampling.top_q' for heads-train (did you mean 'sampling.top_p'?)")
    assert "did you mean 'sampling.top_p'" in _error(TrainCfg, [recipe, "top_p=0.9"])


def test_bad_type(recipe: str) -> None:
    assert _error(TrainCfg, [recipe, "lr=abc"]) == "bad value for 'lr': 'abc' is not a float"
    assert "'1.5' is not an integer" in _error(TrainCfg, [recipe, "steps=1.5"])
    assert "'greedy' is not one of sd, fsd" in _error(TrainCfg, [recipe, "policy=greedy"])
    assert "null is not allowed" in _error(TrainCfg, [recipe, "steps=null"])
    assert "group of settings" in _error(TrainCfg, [recipe, "sampling=3"])


def test_every_problem_reported_together(recipe: str) -> None:
    message = _error(TrainCfg, [recipe, "lrr=1", "steps=x", "foo", "sampling.tmperature=1"])
    parts = message.split("; ")
    assert len(parts) == 4
    assert "expected key=value, got 'foo'" in parts
    assert any("'lrr'" in p for p in parts) and any("'steps'" in p for p in parts)
    assert any("did you mean 'sampling.temperature'" in p for p in parts)


def test_missing_equals() -> None:
    assert _error(TrainCfg, ["steps"]).startswith("expected key=value, got 'steps'")
    assert "without dashes" in _error(TrainCfg, ["--steps=3"])


def test_recipe_errors_name_the_recipe(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("train:\n  stepz: 1\n  sampling: {top_p: high}\n")
    message = _error(TrainCfg, [f"recipe={path}", "lr=x"])
    assert f"recipe '{path}': unknown key 'stepz'" in message
    assert "'sampling.top_p': 'high' is not a float" in message
    assert "'lr': 'x' is not a float" in message


def test_missing_mandatory(tmp_path: Path) -> None:
    path = tmp_path / "r.yaml"
    path.write_text("train: {}\n")
    message = _error(NeedsPath, [f"recipe={path}"])
    assert "missing value for 'target.path' (str); pass target.path=..." in message
    assert "missing value for 'name'" in message
    cfg = load_config(NeedsPath, "train", [f"recipe={path}", "target.path=p", "name=n"])
    assert cfg.target.path == "p"


def test_unresolvable_interpolation(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SPECHEADS_NOPE", raising=False)
    path = tmp_path / "r.yaml"
    path.write_text("train:\n  note: ${oc.env:SPECHEADS_NOPE}\n")
    message = _error(TrainCfg, [f"recipe={path}"])
    assert "cannot resolve note" in message and "SPECHEADS_NOPE" in message


def test_unknown_recipe_suggests(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("SPECHEADS_RECIPE", raising=False)  # conftest pins another default
    (tmp_path / "judge_405b.yaml").write_text("description: Judge.\ntrain: {}\n")
    (tmp_path / "quickstart.yaml").write_text("train: {steps: 2}\n")
    (tmp_path / "decode_only.yaml").write_text("decode: {}\n")
    monkeypatch.setattr(config, "_recipes_root", lambda: tmp_path)
    message = _error(TrainCfg, ["recipe=judge_450b"])
    assert message == (
        "unknown recipe 'judge_450b' (did you mean 'judge_405b'?); recipes for heads-train: judge_405b, quickstart"
    )
    assert load_config(TrainCfg, "train", []).steps == 2  # quickstart by default
    assert _error(TrainCfg, ["recipe=decode_only"]) == (
        "recipe 'decode_only' has no 'train' section; recipes for heads-train: judge_405b, quickstart"
    )
    assert list(config.list_recipes("decode")) == ["decode_only"]
    assert config.recipe_description(tmp_path / "judge_405b.yaml") == "Judge."


def test_specheads_recipe_names_the_default_recipe(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    (tmp_path / "quickstart.yaml").write_text("train: {steps: 2}\n")
    (tmp_path / "other.yaml").write_text("train: {steps: 3}\n")
    monkeypatch.setattr(config, "_recipes_root", lambda: tmp_path)
    monkeypatch.setenv("SPECHEADS_RECIPE", "other")
    assert load_config(TrainCfg, "train", []).steps == 3
    assert load_config(TrainCfg, "train", ["recipe=quickstart"]).steps == 2
    monkeypatch.delenv("SPECHEADS_RECIPE")
    assert load_config(TrainCfg, "train", []).steps == 2


def test_recipe_path_form(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "r.yaml"
    path.parent.mkdir()
    path.write_text("train: {steps: 5}\n")
    assert load_config(TrainCfg, "train", [f"recipe={path}"]).steps == 5
    assert "not found" in _error(TrainCfg, [f"recipe={tmp_path}/nope.yaml"])
    assert "has no 'decode' section" in _error(TrainCfg, [f"recipe={path}"], section="decode")


def test_help_lists_recipes_and_fields(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "quickstart.yaml").write_text("description: Tiny run.\ntrain: {}\n")
    monkeypatch.setattr(config, "_recipes_root", lambda: tmp_path)
    text = help_text(TrainCfg, "train", "heads-train")
    assert text.splitlines()[0] == "usage: heads-train [recipe=NAME] [key=value ...]"
    assert "quickstart  Tiny run." in text
    assert "  lr: float = 0.001" in text and "Peak learning rate." in text
    assert "  sampling.top_p: float = 1.0" in text and "Softmax temperature." in text
    assert "  target.path: str = default/model" in text
    assert "  note: str | None = null" in text and "  policy: sd|fsd = sd" in text
    assert cli_main("heads-train", TrainCfg, "train", ["--help"], lambda c: 1) == 0
    assert "sampling.temperature" in capsys.readouterr().out


def test_cli_main_user_error_one_line(recipe: str, capsys: pytest.CaptureFixture[str]) -> None:
    code = cli_main("heads-train", TrainCfg, "train", [recipe, "lrr=1", "steps=x"], lambda c: 0)
    err = capsys.readouterr().err
    assert code == 2
    assert err.count("\n") == 1 and err.startswith("heads-train: error: unknown key 'lrr'")


def test_cli_main_runs_and_maps_errors(recipe: str, capsys: pytest.CaptureFixture[str]) -> None:
    seen: list[TrainCfg] = []
    assert cli_main("heads-train", TrainCfg, "train", [recipe], lambda c: seen.append(c)) == 0
    assert seen[0].steps == 20

    def fails(_cfg: TrainCfg) -> int:
        raise UserError("head hidden_size=4096 but draft\nhidden_size=2048; pass head=...")

    assert cli_main("heads-train", TrainCfg, "train", [recipe], fails) == 2
    err = capsys.readouterr().err
    assert err == ("heads-train: error: head hidden_size=4096 but draft hidden_size=2048; pass head=...\n")

    def interrupted(_cfg: TrainCfg) -> int:
        raise KeyboardInterrupt

    assert cli_main("heads-train", TrainCfg, "train", [recipe], interrupted) == 130


def test_to_yaml_round_trips(recipe: str, tmp_path: Path) -> None:
    cfg = load_config(TrainCfg, "train", [recipe, "tags=[a]"])
    text = to_yaml(cfg)
    assert "!!python" not in text and "out: runs/x" in text
    path = tmp_path / "again.yaml"
    path.write_text("train:\n" + "".join(f"  {line}\n" for line in text.splitlines()))
    assert load_config(TrainCfg, "train", [f"recipe={path}"]) == cfg


@dataclass
class WithOptionalGroup:
    draft: Optional[Model] = None


def test_optional_group_and_empty_section(tmp_path: Path) -> None:
    path = tmp_path / "r.yaml"
    path.write_text("train:\n")  # an empty section means the schema defaults
    assert load_config(WithOptionalGroup, "train", [f"recipe={path}"]).draft is None
    cfg = load_config(WithOptionalGroup, "train", [f"recipe={path}", "draft.path=m"])
    assert cfg.draft == Model(path="m")
    message = _error(WithOptionalGroup, [f"recipe={path}", "draft.dtyp=x"])
    assert "did you mean 'draft.dtype'" in message
