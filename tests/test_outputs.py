"""Output directories: atomic writes, refusing to mix runs, manifest, metrics.jsonl."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest

from specheads import __version__, outputs
from specheads.config import UserError
from specheads.outputs import MetricsWriter, atomic_write_json, atomic_write_text, prepare_output_dir, write_manifest


def test_atomic_write_text_replaces_and_leaves_no_temp(tmp_path: Path) -> None:
    path = tmp_path / "deep" / "a.txt"
    atomic_write_text(path, "one")
    atomic_write_text(path, "two\u00e9")
    assert path.read_text(encoding="utf-8") == "two\u00e9"
    assert sorted(os.listdir(path.parent)) == ["a.txt"]


def test_atomic_write_keeps_old_file_on_failure(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "a.json"
    atomic_write_json(path, {"n": 1})

    def broken_replace(src: str, dst: str) -> None:
        raise OSError("disk gone")

    monkeypatch.setattr(outputs.os, "replace", broken_replace)
    with pytest.raises(OSError):
        atomic_write_json(path, {"n": 2})
    assert json.loads(path.read_text()) == {"n": 1}
    assert os.listdir(tmp_path) == ["a.json"]  # the temporary file was removed


def test_atomic_write_json_paths(tmp_path: Path) -> None:
    path = atomic_write_json(tmp_path / "x.json", {"p": Path("a/b"), "v": [1, 2]})
    assert json.loads(path.read_text()) == {"p": "a/b", "v": [1, 2]}


def test_prepare_output_dir(tmp_path: Path) -> None:
    out = tmp_path / "run"
    assert prepare_output_dir(out, "lr: 0.1\n") == out
    assert (out / "config.yaml").read_text() == "lr: 0.1\n"
    prepare_output_dir(out, "lr: 0.1\n")  # same config: resuming is fine


def test_prepare_output_dir_refuses_a_different_run(tmp_path: Path) -> None:
    out = tmp_path / "run"
    prepare_output_dir(out, "lr: 0.1\n")
    with MetricsWriter(out) as metrics:
        metrics.write(step=1)
    with pytest.raises(UserError) as info:
        prepare_output_dir(out, "lr: 0.2\n")
    assert str(info.value) == (
        f"output_dir '{out}' already holds a different run; choose another output_dir or pass overwrite=true"
    )
    assert (out / "config.yaml").read_text() == "lr: 0.1\n"
    prepare_output_dir(out, "lr: 0.2\n", overwrite=True)
    assert (out / "config.yaml").read_text() == "lr: 0.2\n"
    assert not (out / "metrics.jsonl").exists()  # the old run's metrics do not mix in


def test_prepare_output_dir_on_a_file(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_text("x")
    with pytest.raises(UserError, match="is a file"):
        prepare_output_dir(path, "a: 1\n")


def test_write_manifest(tmp_path: Path) -> None:
    path = write_manifest(tmp_path, rows=12, head=Path("h.safetensors"))
    manifest = json.loads(path.read_text())
    assert path.name == "manifest.json"
    assert manifest["rows"] == 12 and manifest["head"] == "h.safetensors"
    assert manifest["specheads_version"] == __version__
    assert manifest["created"].endswith("+00:00")
    for key in ("argv", "python", "torch", "transformers", "hostname"):
        assert key in manifest


def test_metrics_writer_appends_flushed_lines(tmp_path: Path) -> None:
    metrics = MetricsWriter(tmp_path)
    metrics.write({"step": 1}, loss=0.5)
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()  # flushed before close
    assert [json.loads(line) for line in lines] == [{"step": 1, "loss": 0.5}]
    metrics.close()
    metrics.close()
    with MetricsWriter(tmp_path) as again:
        again.write(step=2, auroc=math.nan)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and math.isnan(rows[1]["auroc"])


@pytest.mark.parametrize("torn", ['{"step": 2, "lo', "{", "x"])
def test_metrics_writer_cuts_a_torn_line_before_appending(tmp_path: Path, torn: str) -> None:
    """A run killed mid-line left a fragment: the next run's first line is not glued onto it."""
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n' + torn)
    with MetricsWriter(tmp_path) as metrics:
        metrics.write(step=2)
    assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 1}\n{"step": 2}\n'
    (tmp_path / "only.jsonl").write_text(torn)  # a fragment and nothing before it
    with MetricsWriter(tmp_path, "only.jsonl") as metrics:
        metrics.write(step=1)
    assert (tmp_path / "only.jsonl").read_text() == '{"step": 1}\n'
