"""Every head family trained by two processes (``accelerate launch``, DDP over gloo on the CPU;
tests/ddp_runs.py): the head one process trains with the same global batch, one writer of each run file,
a SIGKILLed run resumed to the uninterrupted run's head; and the feature cache built while the other
processes wait past the process group's timeout."""

from __future__ import annotations

import json

import ddp_runs
import pytest


@pytest.fixture(scope="module")
def pair_dirs(tmp_path_factory):
    return ddp_runs.pair(tmp_path_factory.mktemp("ddp-pair"))


@pytest.mark.slow
@pytest.mark.parametrize("family", ddp_runs.FAMILIES)
def test_two_processes_train_the_one_process_head_and_resume_after_a_kill(family, pair_dirs, tmp_path):
    """2 processes x batch 2 x grad_accum 1 against 1 process x batch 2 x grad_accum 2: the same 4
    examples a step, summed in another order (an all-reduce of two micro-batch means), so the heads agree
    within ``ddp_runs.TOLERANCE`` (1e-5; measured: at most 3e-7 over the families, 0 for some). Only the main
    process writes ``manifest.json`` and ``config.yaml`` (the verifier's manifest keeps its report fields).
    A run SIGKILLed after its first (mid-epoch) checkpoint and rerun ends with the uninterrupted run's head
    and ``metrics.jsonl``, bit for bit."""
    got = ddp_runs.check_family(family, tmp_path, pair_dirs)
    assert not got["errors"], "\n".join(got["errors"])
    assert got["max_abs_diff_ws2_vs_ws1"] <= got["tolerance"], got
    assert got["manifests"] == 1 and ddp_runs.writers(tmp_path / family / "writes.log", "config.yaml") == 1, got
    manifest = json.loads((tmp_path / family / "ws2" / "manifest.json").read_text())
    assert manifest["numerics"]["processes"] == 2
    if family == "verifier":  # the main process's report, not a field-less manifest of another rank
        assert {"auroc", "tpr_at_eta", "roc_png"} <= manifest.keys()
    assert got["resumed_after_kill_identical"], got
