"""``specheads.runtime.numerics``: the settings that change results bit for bit, and the resume check."""

from __future__ import annotations

import logging

import torch

from specheads.runtime import numerics
from specheads.runtime.numerics import check_resume, differences, numerics_settings, use_threads, without


def test_settings_record_threads_processes_dtypes_devices_torch_and_kernel_path(monkeypatch):
    """The kernel path is the shim's ``describe()`` without the choices made so far (process history)."""
    monkeypatch.setattr(
        numerics,
        "kernel_path",
        lambda: {"policy": "auto", "machine": {"cores": 2}, "choices": {"128x32:r1": "onednn:row"}},
    )
    with use_threads(1):
        got = numerics_settings(2, {"target": torch.bfloat16, "autocast": "no"}, {"target": torch.device("cpu")})
    assert got == {
        "threads": 1,
        "processes": 2,
        "dtypes": {"target": "bfloat16", "autocast": "no"},
        "devices": {"target": "cpu"},
        "torch": torch.__version__,
        "kernel_path": {"policy": "auto", "machine": {"cores": 2}},
    }
    monkeypatch.setattr(numerics, "kernel_path", None)  # the shim without a kernels module
    assert numerics_settings(1, {}, {})["kernel_path"] is None


def test_use_threads_sets_the_count_and_restores_it():
    before = torch.get_num_threads()
    with use_threads(before + 1) as inside:
        assert inside == torch.get_num_threads() == before + 1
    assert torch.get_num_threads() == before
    with use_threads(None) as inside:  # torch's default is left alone
        assert inside == before
    assert torch.get_num_threads() == before


def test_a_resume_under_other_settings_warns_in_one_line_naming_them(caplog):
    caplog.set_level(logging.WARNING)
    recorded = numerics_settings(1, {"target": torch.float32}, {"target": "cpu"})
    current = {**recorded, "threads": recorded["threads"] + 1, "processes": 4}
    assert check_resume(recorded, dict(recorded), "chunk 0") == [] and not caplog.records
    assert check_resume(None, current, "chunk 0") == []  # a run from before the record: nothing to compare
    assert check_resume(recorded, current, "chunk 0", ignore=("processes",)) == ["threads"]
    (record,) = caplog.records
    message = record.getMessage()
    assert record.levelno == logging.WARNING and len(message.splitlines()) == 1
    assert f"threads={recorded['threads']} now {current['threads']}" in message and "processes" not in message
    assert "chunk 0" in message and "not be byte-identical" in message
    assert differences(recorded, current) == {"threads": (recorded["threads"], current["threads"]), "processes": (1, 4)}


def test_differences_name_nested_settings_and_skip_kernel_choices():
    old = {"threads": 1, "dtypes": {"target": "float32"}, "kernel_path": {"policy": "auto", "choices": {"a": "x"}}}
    new = {"threads": 1, "dtypes": {"target": "bfloat16"}, "kernel_path": {"policy": "torch", "choices": {}}}
    assert differences(old, new) == {"dtypes.target": ("float32", "bfloat16"), "kernel_path.policy": ("auto", "torch")}
    assert differences(old, new, ignore=("dtypes",)) == {"kernel_path.policy": ("auto", "torch")}
    assert without(old, ("threads",)) == {"dtypes": {"target": "float32"}, "kernel_path": {"policy": "auto"}}
