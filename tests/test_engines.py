"""The target engine is looked up once (specheads/engines.py): an unknown one is the same one-line error in
every command that takes ``engine=``, before any model loads."""

from __future__ import annotations

import pytest

from specheads.datagen.cli import main as datagen_main
from specheads.decode.decode_cli import main as decode_main
from specheads.engines import ENGINES, engine_of
from specheads.evaluate.cli import main as eval_main


def test_each_engine_says_what_it_does():
    assert set(ENGINES) == {"specheads", "vllm"}
    own = ENGINES["specheads"]
    assert not (own.own_python or own.holds_target or own.splits_nodes)  # the package's own loop
    assert ENGINES["vllm"].own_python and ENGINES["vllm"].holds_target


@pytest.mark.parametrize("main", [datagen_main, eval_main, decode_main], ids=["datagen", "eval", "decode"])
def test_an_unknown_engine_is_a_one_line_error(main, tmp_path, capsys):
    code = main(["recipe=quickstart", "engine=gpu", f"output_dir={tmp_path / 'out'}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1
    assert "engine='gpu': choose specheads or vllm" in err[0]


def test_engine_of_reads_any_config():
    class Cfg:
        engine = "vllm"

    assert engine_of(Cfg()).name == "vllm"
