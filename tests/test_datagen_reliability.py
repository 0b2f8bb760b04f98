"""``heads-datagen`` under failure: SIGKILL loops, NaN/Inf logits, verify, merge, damaged and newer data."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pyarrow.parquet as pq
import pytest
import torch
from conftest import DATAGEN_PROMPTS, datagen_args, run_killed

from specheads import dataset
from specheads.datagen import shards
from specheads.datagen.cli import main
from specheads.outputs import file_sha256


def _prompts(tmp_path, n):
    path = tmp_path / "p.jsonl"
    path.write_text(
        "".join(json.dumps({"prompt": DATAGEN_PROMPTS[i % len(DATAGEN_PROMPTS)] + f" {i}"}) + "\n" for i in range(n))
    )
    return path


def _indices(out):
    return sorted(i for p in dataset.shard_paths(out) for i in pq.read_table(p).column("prompt_index").to_pylist())


def _shas(out):
    return {p.name: file_sha256(p) for p in sorted((out / "data").glob("chunk-*.parquet"))}


@pytest.fixture(scope="module")
def reference(tiny_pair_dirs, tmp_path_factory):
    """An uninterrupted one-process run over 32 prompts (16 chunks), one thread (as every run it is compared with)."""
    root = tmp_path_factory.mktemp("ref")
    prompts = _prompts(root, 32)
    assert main(datagen_args(tiny_pair_dirs, prompts, root / "out", "threads=1")) == 0
    return prompts, root / "out"


def test_manifest_lists_every_shard_and_verify_passes(reference, capsys):
    prompts, out = reference
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["schema_version"] == dataset.SCHEMA_VERSION and manifest["chunks"] == 16
    assert [s["file"] for s in manifest["shards"]] == [f"data/chunk-{c:06d}.parquet" for c in range(16)]
    assert manifest["prompts_read"] == 32 and manifest["skipped_nonfinite"] == 0
    assert all(s["sha256"] == file_sha256(out / s["file"]) for s in manifest["shards"])
    info = dataset.chunk_info(out / "data" / "chunk-000003.parquet")
    assert info["chunk"] == 3 and info["first_prompt"] == 6 and info["prompts"] == 2 and info["skipped"] == []
    assert main([f"output_dir={out}", "verify"]) == 0
    assert "OK: 16 shards, 32 prompts (32 labelled once, 0 skipped" in capsys.readouterr().out
    assert _indices(out) == list(range(32))


def test_chunk_owners_do_not_depend_on_other_processes_files(tmp_path):
    """The static split (engine=vllm): chunk c belongs to rank c % world, the shares of any count partition
    the unfinished chunks."""
    (tmp_path / "data").mkdir()
    for c in (0, 3, 5):
        dataset.chunk_path(tmp_path, c).write_bytes(b"x")
    for world in (1, 2, 3, 4):
        shares = [shards.my_chunks(tmp_path, 8, r, world) for r in range(world)]
        assert sorted(c for s in shares for c in s) == [1, 2, 4, 6, 7]


@pytest.mark.slow  # a long run: CI's slow step
def test_sigkill_loop_then_resume_labels_every_prompt_once(reference, tiny_pair_dirs, tmp_path):
    """SIGKILLed four times, each time at a fixed point of its own work: while a chunk's file is
    written (complete in its temporary file, not yet renamed into place), after 0 to 2 chunks of
    that attempt; each restart resumes; the end result is the uninterrupted run's files, every
    prompt labelled exactly once."""
    prompts, ref = reference
    out = tmp_path / "killed"
    args = datagen_args(tiny_pair_dirs, prompts, out, "threads=1")
    done = 0
    for nth in (2, 1, 3, 2):  # die at this attempt's nth chunk rename: nth - 1 chunks done, one half-written
        run_killed("specheads.datagen.cli", args, "chunk-*.parquet", nth, "before")
        done += nth - 1
        assert len(list((out / "data").glob("chunk-*.parquet"))) == done
        temporaries = [p.name for p in (out / "data").glob(".chunk-*")]  # the earlier attempts' are removed
        assert len(temporaries) == 1 and temporaries[0].startswith(f".chunk-{done:06d}.parquet.")
        assert (out / shards.CLAIMS / f"chunk-{done:06d}.claim").is_file()  # the killed chunk's claim stays
    finished = subprocess.run(
        [sys.executable, "-m", "specheads.datagen.cli", *args], capture_output=True, text=True, timeout=300
    )
    assert finished.returncode == 0, finished.stderr[-2000:]
    assert f"resuming: {done} of 16 chunks" in finished.stderr
    assert not list((out / "data").glob(".chunk-*"))  # the killed attempts' temporaries removed
    assert not (out / shards.CLAIMS).exists()  # and their claims
    assert _indices(out) == list(range(32))
    assert _shas(out) == _shas(ref)
    assert main([f"output_dir={out}", "verify"]) == 0
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert sorted(r["chunk"] for r in lines) == list(range(16))  # one line per chunk


@pytest.mark.slow  # a long run: CI's slow step
def test_a_kill_between_a_chunks_rename_and_its_metrics_line_loses_no_line(tiny_pair_dirs, tmp_path):
    """Killed right after chunk 1's file is in place (its metrics line not yet written): the resumed run's
    metrics.jsonl still has one line per chunk, the lost one rebuilt from the chunk file."""
    out = tmp_path / "killed"
    args = datagen_args(tiny_pair_dirs, _prompts(tmp_path, 3), out, "threads=1", "chunk_size=1")
    run_killed("specheads.datagen.cli", args, "chunk-*.parquet", 2, "after")
    assert len(list((out / "data").glob("chunk-*.parquet"))) == 2
    assert main(args) == 0
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["chunk"] for r in lines] == [0, 1, 2]
    assert [r.get("recovered", False) for r in lines] == [False, True, False]
    assert lines[1]["rows"] == dataset.chunk_info(dataset.chunk_path(out, 1))["rows"] > 0


@pytest.mark.slow  # a long run: CI's slow step
def test_a_run_started_by_four_processes_is_finished_by_two(reference, tiny_pair_dirs, tmp_path):
    """Half the chunks were finished before a 4-process run died, with chunk 1 claimed and half-written and
    chunk 7 claimed; two processes (accelerate launch, gloo) claim the rest from one chunk queue: the same
    files as one uninterrupted process, and no claim left behind."""
    import shutil

    prompts, ref = reference
    out = tmp_path / "four-then-two"
    (out / "data").mkdir(parents=True)
    shutil.copy(ref / "config.yaml", out / "config.yaml")
    for c in range(16):
        if shards.owner(c, 4) in (0, 2):
            shutil.copy(dataset.chunk_path(ref, c), dataset.chunk_path(out, c))
    (out / "data" / ".chunk-000001.parquet.999.tmp").write_bytes(b"half")  # rank 1 died mid-write
    (out / shards.CLAIMS).mkdir()
    for c in (1, 7):  # the dead launch's claims must not block this one
        (out / shards.CLAIMS / f"chunk-{c:06d}.claim").write_text("old launch rank 1\n")
    (out / "config.yaml").write_text((ref / "config.yaml").read_text().replace(str(ref), str(out)))
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
        *datagen_args(tiny_pair_dirs, prompts, out, "threads=1"),
    ]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert _shas(out) == _shas(ref)
    assert not list((out / "data").glob(".chunk-*"))  # the new launch cleaned it up before claiming
    assert not (out / shards.CLAIMS).exists()
    assert main([f"output_dir={out}", "verify"]) == 0


def test_nonfinite_logits_skip_the_sample_and_count_it(tiny_pair_dirs, tmp_path, monkeypatch, capsys):
    from specheads.datagen import acceptance_labels as acceptance
    from specheads.train.acceptance_data import load_examples

    real = acceptance.teacher_forced_pair
    calls = []

    def poisoned(*args, **kwargs):
        p, q, rows = real(*args, **kwargs)
        calls.append(1)
        if len(calls) == 2:  # chunk 1 = prompts 2 and 3: prompt 3's last target logit row is NaN
            p = p.clone()
            p[sum(rows) - 1, 5] = float("nan")
        if len(calls) == 3:  # prompt 4: an Inf in the draft's logits
            q = q.clone()
            q[0, 0] = float("inf")
        return p, q, rows

    monkeypatch.setattr(acceptance, "teacher_forced_pair", poisoned)
    out = tmp_path / "nan"
    assert main(datagen_args(tiny_pair_dirs, _prompts(tmp_path, 6), out)) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["skipped_nonfinite"] == 2 and manifest["prompts"] == 4
    assert [s["prompt_index"] for s in manifest["skipped_samples"]] == [3, 4]
    assert _indices(out) == [0, 1, 2, 5]
    for path in dataset.shard_paths(out):
        for row in pq.read_table(path).to_pylist():
            assert all(v == v for v in row["label"] + row["expected_label"])  # no NaN written
    assert main([f"output_dir={out}", "verify"]) == 0
    assert "4 labelled once, 2 skipped" in capsys.readouterr().out
    assert [e.index for e in load_examples(out)] == [0, 1, 2, 5]


def test_sample_survives_a_nonfinite_row():
    from specheads.shim.core.sampling import sample_finite

    probs = torch.tensor([[0.0, 1.0, 0.0], [float("nan"), 0.5, 0.5], [0.0, 0.0, 0.0]])
    tok = sample_finite(probs, torch.Generator().manual_seed(0))
    assert tok[0] == 1 and all(0 <= t < 3 for t in tok.tolist())


def test_verify_finds_damage_missing_and_stray_files(reference, tmp_path, capsys):
    import shutil

    _, ref = reference
    out = tmp_path / "copy"
    shutil.copytree(ref, out)
    path = out / "data" / "chunk-000002.parquet"
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    path.write_bytes(bytes(raw))
    (out / "data" / "chunk-000005.parquet").unlink()
    shutil.copy(out / "data" / "chunk-000001.parquet", out / "data" / "chunk-000042.parquet")
    capsys.readouterr()
    assert main([f"output_dir={out}", "verify"]) == 1
    text = capsys.readouterr().out
    assert "chunk-000002.parquet: bytes or SHA-256 differ" in text and "chunk-000005.parquet: missing" in text
    assert "chunk-000042.parquet" in text and "neither labelled nor skipped" in text and "FAILED" in text
    from specheads.errors import UserError
    from specheads.train.acceptance_data import load_examples

    with pytest.raises(UserError, match="missing or changed since heads-datagen wrote it"):
        load_examples(out)


def test_duplicate_rows_are_found(reference, tmp_path, capsys):
    """A shard holding a prompt twice (as a buggy writer or a hand merge would) fails verify."""
    import shutil

    import pyarrow as pa

    _, ref = reference
    out = tmp_path / "dup"
    shutil.copytree(ref, out)
    path = out / "data" / "chunk-000000.parquet"
    table = pq.read_table(path)
    doubled = pa.concat_tables([table, table.slice(0, 1)])
    pq.write_table(doubled, path)
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["shards"][0].update(bytes=path.stat().st_size, sha256=file_sha256(path), rows=3)
    (out / "manifest.json").write_text(json.dumps(manifest))
    assert main([f"output_dir={out}", "verify"]) == 1
    assert "1 prompts labelled more than once (first: [0])" in capsys.readouterr().out


def test_merge_joins_per_node_outputs(reference, tmp_path, capsys):
    """Two nodes without a shared filesystem each hold their processes' chunks; merge joins them."""
    import shutil

    _, ref = reference
    nodes = [tmp_path / "node0", tmp_path / "node1"]
    for n, node in enumerate(nodes):
        (node / "data").mkdir(parents=True)
        (node / "config.yaml").write_text((ref / "config.yaml").read_text())
        for c in range(16):
            if shards.owner(c, 4) // 2 == n:  # 2 nodes x 2 processes: ranks 0-1 on node 0, 2-3 on node 1
                shutil.copy(dataset.chunk_path(ref, c), dataset.chunk_path(node, c))
    merged = tmp_path / "merged"
    assert main(["merge", f"from={nodes[0]},{nodes[1]}", f"output_dir={merged}"]) == 0
    assert _shas(merged) == _shas(ref)
    assert main([f"output_dir={merged}", "verify"]) == 0
    ours = json.loads((merged / "manifest.json").read_text())["shards"]
    assert ours == json.loads((ref / "manifest.json").read_text())["shards"]
    # only one node's share: merge says which chunks are missing
    assert main(["merge", f"from={nodes[0]}", f"output_dir={tmp_path / 'half'}"]) == 2
    assert "8 of 16 chunks" in capsys.readouterr().err
    # a chunk that differs between sources is refused
    bad = tmp_path / "bad"
    shutil.copytree(nodes[1], bad)
    shutil.copy(dataset.chunk_path(ref, 1), dataset.chunk_path(bad, 0))
    assert main(["merge", f"from={nodes[0]},{bad}", f"output_dir={tmp_path / 'm2'}"]) == 2
    assert "chunk 0 differs" in capsys.readouterr().err
    other = tmp_path / "other"
    (other / "data").mkdir(parents=True)
    (other / "config.yaml").write_text((ref / "config.yaml").read_text().replace("seed: 0", "seed: 1"))
    assert main(["merge", f"from={nodes[0]},{other}", f"output_dir={tmp_path / 'm3'}"]) == 2
    assert "holds a different run" in capsys.readouterr().err


def test_newer_schema_and_missing_columns_are_refused(reference, tiny_pair_dirs, tmp_path, capsys):
    import shutil

    from specheads.train.cli import main as train

    _, ref = reference
    newer = tmp_path / "newer"
    shutil.copytree(ref, newer)
    manifest = json.loads((newer / "manifest.json").read_text())
    manifest["schema_version"] = dataset.SCHEMA_VERSION + 1
    (newer / "manifest.json").write_text(json.dumps(manifest))
    targs = [
        f"data_dir={newer}",
        f"draft.path={tiny_pair_dirs[1]}",
        "draft.device=cpu",
        "epochs=1",
        f"output_dir={tmp_path / 't1'}",
    ]
    assert train(targs) == 2
    err = capsys.readouterr().err
    assert "newer than this specheads reads" in err and "upgrade specheads" in err and len(err.splitlines()) == 1
    assert main([f"output_dir={newer}", "verify"]) == 2
    capsys.readouterr()
    cut = tmp_path / "cut"
    shutil.copytree(ref, cut)
    manifest = json.loads((cut / "manifest.json").read_text())
    for shard in manifest["shards"]:
        path = cut / shard["file"]
        pq.write_table(pq.read_table(path).drop_columns(["label"]), path)
        shard.update(bytes=path.stat().st_size, sha256=file_sha256(path))
    (cut / "manifest.json").write_text(json.dumps(manifest))
    targs[0], targs[-1] = f"data_dir={cut}", f"output_dir={tmp_path / 't2'}"
    assert train(targs) == 2
    err = capsys.readouterr().err
    assert "lacks columns ['label']" in err and "regenerate it with heads-datagen" in err


@pytest.mark.parametrize(
    "content, fragment",
    [
        (b"", "is empty"),
        (b"\n\n", "is empty"),
        (b'{"prompt": "caf\xe9"}\n', "is not UTF-8"),
        (b'{"prompt": "a"}\nnot json\n', "line 2 is not valid JSON"),
        (b'{"text": "a"}\n', "none of the recognised fields"),
    ],
)
def test_bad_prompt_files_fail_before_any_model_loads(tiny_pair_dirs, tmp_path, capsys, content, fragment):
    path = tmp_path / "bad.jsonl"
    path.write_bytes(content)
    out = tmp_path / "o"
    assert main(datagen_args(tiny_pair_dirs, path, out)) == 2
    err = capsys.readouterr().err
    assert fragment in err and len(err.strip().splitlines()) == 1
    assert not (out / "data").exists()
