"""``heads-datagen`` acceptance labels on the tiny pair: files, manifest, determinism, resumption."""

from __future__ import annotations

import json

import pytest
from conftest import DATAGEN_PROMPTS, chunk_rows, datagen_args

from specheads.datagen.cli import main


def test_datagen_writes_labelled_chunks(tiny_pair_dirs, prompts_file, tmp_path):
    out = tmp_path / "dg"
    assert main(datagen_args(tiny_pair_dirs, prompts_file, out)) == 0
    rows = chunk_rows(out)
    assert [r["prompt_index"] for r in rows] == list(range(len(DATAGEN_PROMPTS)))
    for r in rows:
        n = len(r["input_ids"]) - r["response_start"]
        assert 1 <= n <= 6 and len(r["label"]) == len(r["draft_token"]) == len(r["expected_label"]) == n
        assert all(0.0 <= v <= 1.0 for v in r["label"] + r["expected_label"])
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["prompts"] == len(DATAGEN_PROMPTS) and manifest["chunks"] == 3
    assert manifest["labelled_tokens"] == sum(len(r["label"]) for r in rows)
    assert manifest["sampling"]["do_sample"] is True and manifest["draft"]["fingerprint"].startswith("sha256:")
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 3


def test_datagen_resumes_and_is_deterministic(tiny_pair_dirs, prompts_file, tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    assert main(datagen_args(tiny_pair_dirs, prompts_file, a)) == 0
    assert main(datagen_args(tiny_pair_dirs, prompts_file, b)) == 0
    (b / "data" / "chunk-000001.parquet").unlink()  # as if killed before this chunk finished
    (b / "manifest.json").unlink()
    assert main(datagen_args(tiny_pair_dirs, prompts_file, b)) == 0
    assert chunk_rows(a) == chunk_rows(b)
    assert json.loads((b / "manifest.json").read_text())["prompts"] == len(DATAGEN_PROMPTS)


@pytest.mark.slow  # a long run: CI's slow step
def test_two_processes_write_the_same_examples_as_one(tiny_pair_dirs, prompts_file, tmp_path):
    """Data-parallel under accelerate (torchrun, gloo on CPU): the same files as one process (one thread
    per process in both, set by the config: not by the machine's default or the environment)."""
    import os
    import subprocess
    import sys

    one, two = tmp_path / "one", tmp_path / "two"
    assert main(datagen_args(tiny_pair_dirs, prompts_file, one, "threads=1")) == 0
    cmd = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--multi_gpu",
        "--num_processes",
        "2",
        "--num_machines",
        "1",
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
        "-m",
        "specheads.datagen.cli",
        *datagen_args(tiny_pair_dirs, prompts_file, two, "threads=1"),
    ]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert chunk_rows(one) == chunk_rows(two)
    assert [p.name for p in sorted((two / "data").iterdir())] == [p.name for p in sorted((one / "data").iterdir())]
    numerics = [json.loads((d / "manifest.json").read_text())["numerics"] for d in (one, two)]
    assert [n.pop("processes") for n in numerics] == [1, 2] and numerics[0] == numerics[1]
    assert numerics[0]["threads"] == 1


def test_manifest_records_numerics_and_a_resume_under_others_warns(tiny_pair_dirs, prompts_file, tmp_path, caplog):
    """``threads=1`` is set for the run only; chunk footers and the manifest record the numerics
    settings; a resume under another thread count (here torch's default, changed) warns and is listed."""
    import logging

    import torch

    from specheads.dataset import chunk_info
    from specheads.runtime import numerics

    before = torch.get_num_threads()
    out = tmp_path / "dg"
    assert main(datagen_args(tiny_pair_dirs, prompts_file, out, "threads=1")) == 0
    assert torch.get_num_threads() == before  # the caller's count is restored
    manifest = json.loads((out / "manifest.json").read_text())
    with numerics.use_threads(1):
        expected = numerics.numerics_settings(
            1, {"target": "float32", "draft": "float32"}, {"target": "cpu", "draft": "cpu"}
        )
    assert manifest["numerics"] == expected and expected["threads"] == 1 and expected["torch"] == torch.__version__
    footer = chunk_info(out / "data" / "chunk-000000.parquet")["numerics"]
    assert footer == {k: v for k, v in manifest["numerics"].items() if k != "processes"}
    assert "numerics_otherwise" not in manifest

    again = tmp_path / "again"  # threads=null: the count in force, which differs between the two attempts
    with numerics.use_threads(1):
        assert main(datagen_args(tiny_pair_dirs, prompts_file, again)) == 0
    (again / "data" / "chunk-000001.parquet").unlink()
    caplog.set_level(logging.WARNING)
    with numerics.use_threads(2):
        assert main(datagen_args(tiny_pair_dirs, prompts_file, again)) == 0
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("threads=1 now 2" in m and "not be byte-identical" in m for m in warned)
    assert any("1 chunks (first: 1) were labelled with other numerics settings (threads" in m for m in warned)
    manifest = json.loads((again / "manifest.json").read_text())
    assert manifest["numerics"]["threads"] == 1 and manifest["numerics_otherwise"] == [1]


@pytest.mark.parametrize(
    "bad, fragment",
    [
        ("num_prompts=0", "num_prompts=0 must be >= 1 (or null"),
        ("num_prompts=-3", "num_prompts=-3 must be >= 1"),
        ("offset=-1", "offset=-1 must be >= 0"),
        ("chunk_size=0", "chunk_size=0 must be >= 1"),
        ("batch_size=-2", "batch_size=-2 must be >= 1"),
        ("max_new_tokens=0", "max_new_tokens=0 must be >= 1"),
    ],
)
def test_zero_or_negative_counts_fail_before_any_model_loads(tmp_path, capsys, bad, fragment):
    """The quickstart recipe as given, one count wrong: one line, exit code 2, nothing written or loaded."""
    out = tmp_path / "o"
    assert main(["recipe=quickstart", f"output_dir={out}", bad]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("heads-datagen: error: ") and fragment in err
    assert "Traceback" not in err and not out.exists()
