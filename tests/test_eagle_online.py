"""An EAGLE head trained on states made while it trains (``eagle.states=online|hybrid``) is the head trained on the
stored ones: the same loss at every step, the same weights; hybrid's cache is bounded, read back and reused."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import LABEL_PROMPTS, datagen_args, same_heads
from safetensors.torch import load_file

from specheads.datagen.cli import main as datagen_main
from specheads.train.cli import main as train_main


def _data(pair_dirs, root, *extra):
    prompts = root / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": w}) + "\n" for w in LABEL_PROMPTS))
    out = root / ("dg" + "".join(x.replace("=", "-") for x in extra))
    args = ["labels=drafter", "sampling.do_sample=false", "max_new_tokens=8", "drafter.top_k=5", *extra]
    assert datagen_main(datagen_args(pair_dirs, prompts, out, *args)) == 0
    return out


@pytest.fixture(scope="module")
def stored(tmp_path_factory, tiny_pair_dirs):
    return _data(tiny_pair_dirs, tmp_path_factory.mktemp("stored"))


@pytest.fixture(scope="module")
def ids_only(tmp_path_factory, tiny_pair_dirs):
    return _data(tiny_pair_dirs, tmp_path_factory.mktemp("ids"), "drafter.store_states=false")


def _train(pair_dirs, data, out, *extra):
    args = [
        f"data_dir={data}",
        "head=eagle",
        f"target.path={pair_dirs[0]}",
        "target.gguf_file=null",
        "target.device=cpu",
        f"output_dir={out}",
        "batch_size=2",
        "grad_accum=1",
        "epochs=3",
        "lr=3e-3",
        "eval_fraction=0.3",
        "patience=3",
        "eagle.ttt_steps=2",
        "vocab_top_n=20",
        *extra,
    ]
    assert train_main(args) == 0
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    manifest = json.loads((out / "manifest.json").read_text())
    return [r for r in rows if "loss" in r], rows, manifest


def test_ids_only_data_stores_no_states_and_the_same_ids(stored, ids_only):
    side, full = (load_file(str(d / "states" / "chunk-000000.safetensors")) for d in (ids_only, stored))
    assert side["states"].shape == (full["states"].shape[0], 0)
    for key in ("offsets", "top_ids", "top_logp", "response_offsets", "layers"):
        assert torch.equal(side[key], full[key])
    assert json.loads((ids_only / "manifest.json").read_text())["drafter"]["store_states"] is False
    assert (ids_only / "states" / "chunk-000000.safetensors").stat().st_size < (
        stored / "states" / "chunk-000000.safetensors"
    ).stat().st_size


def test_online_and_hybrid_train_the_offline_head(stored, ids_only, tiny_pair_dirs, tmp_path):
    offline, _, m_off = _train(tiny_pair_dirs, stored, tmp_path / "offline", "eagle.states=offline")
    online, _, m_on = _train(tiny_pair_dirs, ids_only, tmp_path / "online")  # auto: the data stores none
    hybrid, rows, m_hy = _train(tiny_pair_dirs, ids_only, tmp_path / "hybrid", "eagle.states=hybrid")
    assert m_off["states"]["mode"] == "offline" and m_on["states"]["mode"] == "online"
    assert len(offline) == len(online) == len(hybrid) > 3
    for a, b, c in zip(offline, online, hybrid):
        assert a["loss"] == b["loss"] == c["loss"]  # the same states, bit for bit: the same steps
    same_heads(tmp_path / "offline", tmp_path / "online")
    same_heads(tmp_path / "offline", tmp_path / "hybrid")
    st = m_hy["states"]
    sequences = m_hy["train_data"]["sequences"]
    assert st["cache_writes"] == sequences  # every sequence made once (train and held-out) ...
    assert st["made_tokens"] == m_hy["train_data"]["tokens"]  # ... and never again
    assert st["cache_hits"] > 0 and st["cache_bytes"] > 0
    assert m_on["states"]["made_tokens"] > 2 * m_on["train_data"]["tokens"]  # online: made every epoch


def test_a_full_cache_makes_the_rest_each_epoch_and_a_rerun_reads_it(ids_only, tiny_pair_dirs, tmp_path):
    cache = tmp_path / "cache"
    bound = ["eagle.states=hybrid", f"eagle.cache_dir={cache}", "eagle.cache_gb=0.000004"]  # 4 KB: a few sequences
    first, _, m1 = _train(tiny_pair_dirs, ids_only, tmp_path / "a", *bound)
    st = m1["states"]
    assert 0 < st["cache_writes"] < m1["train_data"]["sequences"] and st["cache_bytes"] <= 4000
    assert st["made_tokens"] > m1["train_data"]["tokens"]
    again, _, m2 = _train(tiny_pair_dirs, ids_only, tmp_path / "b", *bound)
    assert m2["states"]["cache_writes"] == 0 and m2["states"]["cache_hits"] > st["cache_hits"]
    assert [r["loss"] for r in first] == [r["loss"] for r in again]


def test_offline_without_stored_states_and_bad_settings_are_one_line_errors(ids_only, tiny_pair_dirs, tmp_path, capsys):
    for bad, message in [
        ("eagle.states=offline", "stores no states"),
        ("eagle.states=sometimes", "eagle.states"),
        ("eagle.engine=server", "eagle.engine"),
        ("eagle.cache_gb=-1", "eagle.cache_gb"),
    ]:
        with pytest.raises(AssertionError):
            _train(tiny_pair_dirs, ids_only, tmp_path / "x", bad)
        err = capsys.readouterr().err.strip()
        assert message in err and len(err.splitlines()) == 1, err


def test_report_to_tensorboard_logs_every_metrics_row(stored, tiny_pair_dirs, tmp_path, capsys):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    steps, rows, _ = _train(tiny_pair_dirs, stored, tmp_path / "tb", "report_to=[tensorboard]", "run_name=mine")
    events = EventAccumulator(str(next((tmp_path / "tb" / "mine").rglob("events.out.tfevents.*")).parent))
    events.Reload()
    logged = events.Scalars("loss")
    assert [e.step for e in logged] == [r["step"] for r in steps]
    assert [e.value for e in logged] == pytest.approx([r["loss"] for r in steps], rel=1e-6)
    assert "eval_accept_length" in events.Tags()["scalars"]  # the epochs' held-out rows too
    assert train_main(["head=eagle", f"data_dir={stored}", "report_to=[nosuch]", f"output_dir={tmp_path / 'x'}"]) == 2
    assert "report_to: 'nosuch'" in capsys.readouterr().err
