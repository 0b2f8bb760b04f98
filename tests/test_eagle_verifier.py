"""SPRINTER on the EAGLE drafter: heads-train head=eagle_verifier fits the verifier on the EAGLE head's states that
labels=eagle_rounds stored (the state that drew each candidate, or the one after it), with SPRINTER's ratio labels
q(y) <= lam * p(y); policy=sprinter decodes with it and that EAGLE head, and refuses another drafter."""

from __future__ import annotations

import json

import pytest
import test_eagle_stop
import torch
from conftest import chunk_rows
from test_eagle_stop import decode_args, eval_args, outputs, rounds_args, stop_args

from specheads.datagen.cli import main as datagen_main
from specheads.decode.decode_cli import main as decode_main
from specheads.evaluate.cli import main as eval_main
from specheads.export import read_metadata
from specheads.train.cli import main as train_main
from specheads.train.eagle_stop_task import StopStore

# that module's fixtures, shared: the tiny target, its EAGLE heads, their greedy lag-1 rounds, the target alone
setup, greedy_rounds, target_alone = test_eagle_stop.setup, test_eagle_stop.greedy_rounds, test_eagle_stop.target_alone


def verifier_args(data, out, *extra):
    return [*stop_args(data, out), "head=eagle_verifier", "class_weights=balanced", *extra]


@pytest.fixture(scope="module")
def lag0_rounds(setup):
    out = setup["root"] / "verifier-lag0"
    assert datagen_main(rounds_args(setup, out, "eagle_rounds.position=previous", "sampling.do_sample=false")) == 0
    return out


@pytest.fixture(scope="module")
def verifier(lag0_rounds, setup):
    out = setup["root"] / "verifier"
    assert train_main(verifier_args(lag0_rounds, out, "verifier.roc_lambdas=[1.0,2.0]")) == 0
    return out / "head.safetensors"


def test_the_ratio_is_the_stored_q_over_p(lag0_rounds):
    """The labels at any lambda come from the stored q(y) and p(y) of each candidate, in storage order."""
    rows = chunk_rows(lag0_rounds)
    q = torch.tensor([v for r in rows for v in r["q_token"]])
    p = torch.tensor([v for r in rows for v in r["p_token"]])
    store = StopStore(lag0_rounds)
    torch.testing.assert_close(store.ratio, q / p)
    assert 0 < float((store.ratio <= 1).float().mean()) < 1


def test_the_verifier_exports_for_its_eagle_head(verifier, setup):
    meta = read_metadata(verifier)
    assert meta["head_type"] == "verifier" and meta["lam"] == 1.0 and meta["label"] == "ratio"
    feature = meta["feature"]
    assert feature["model"] == "eagle" and feature["position"] == "previous"
    assert feature["eagle"]["tensors_sha256"] == read_metadata(setup["eagle"])["tensors_sha256"]
    metrics = json.loads((verifier.parent / "metrics.json").read_text())
    assert set(metrics["by_lambda"]) == {"1", "2"} and (verifier.parent / "roc.png").is_file()
    best = json.loads((verifier.parent / "best_metrics.json").read_text())
    for key in ("eval_auroc", "eval_auroc_confidence", "eval_tpr_at_eta", "eval_alpha"):
        assert key in best


def test_sprinter_decodes_with_it_and_its_eagle_head(verifier, setup, target_alone, tmp_path):
    """With the cap at 0 every candidate goes to the target (lossless: the target alone's tokens); at eta 0 the
    verifier approves every candidate and the target is called less than once per token."""
    common = ["policy=sprinter", f"sprinter.head={verifier}", f"eagle={setup['eagle']}"]
    assert decode_main(decode_args(setup, tmp_path / "capped", *common, "sprinter.max_run=0")) == 0
    assert outputs(tmp_path / "capped") == target_alone
    assert decode_main(decode_args(setup, tmp_path / "open", *common, "sprinter.eta=0", "sprinter.max_run=3")) == 0
    metrics = json.loads((tmp_path / "open" / "metrics.json").read_text())
    assert metrics["drafted"] > 0 and metrics["verification_rate"] < 1


def test_a_lag1_verifier_reads_the_state_after_the_candidate(greedy_rounds, setup, tmp_path, capsys):
    """eagle_rounds.position=own data is SPRINTER's feature=current; training it as previous is a one-line error."""
    assert train_main(verifier_args(greedy_rounds, tmp_path / "x")) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "verifier.feature=current" in err
    assert train_main(verifier_args(greedy_rounds, tmp_path / "cur", "verifier.feature=current")) == 0
    assert read_metadata(tmp_path / "cur" / "head.safetensors")["feature"]["position"] == "current"


@pytest.mark.parametrize(
    "extra, message",
    [
        (["verifier.feature=previous+embedding"], "no draft embedding"),
        (["verifier.lam=0"], "lam"),
        (["class_weights=x"], "balanced"),
    ],
)
def test_bad_settings_are_one_line_errors(extra, message, lag0_rounds, tmp_path, capsys):
    assert train_main(verifier_args(lag0_rounds, tmp_path / "x", *extra)) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err


def test_another_drafter_is_a_one_line_error(verifier, setup, tiny_pair_dirs, tmp_path, capsys):
    def fails(*extra):
        out = tmp_path / str(len(list(tmp_path.iterdir())))
        assert decode_main(decode_args(setup, out, "policy=sprinter", f"sprinter.head={verifier}", *extra)) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1
        return err

    assert "another" in fails(f"eagle={setup['other']}")
    assert "eagle=" in fails(f"draft.path={tiny_pair_dirs[1]}")


def test_heads_eval_sweeps_sprinter_on_the_eagle_head(verifier, setup, tmp_path):
    """heads-eval's SPRINTER rows draft with the EAGLE head when eagle= is set, one row per eta."""
    out = tmp_path / "ev"
    extra = [f"eagle={setup['eagle']}", f"sprinter.head={verifier}", "sprinter.etas=[0.0,1.0]", "sprinter.max_run=3"]
    assert eval_main(eval_args(setup, out, *extra, "ks=[2]")) == 0
    rows = [json.loads(x) for x in (out / "rows.jsonl").read_text().splitlines()]
    by: dict = {}
    for r in rows:
        by.setdefault(r["config"], []).append(r)
    names = [n for n in by if n.startswith("s")]
    assert len(names) == 2, names
    free = next(n for n in names if float(n[1:]) == 0.0)
    assert sum(r["drafted"] for r in by[free]) > 0
