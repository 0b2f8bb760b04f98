"""A policy written outside the package (docs/howto/add-a-policy.md): subclassing ``Policy`` and registering it
is all it takes to build it with ``make_policy``, run it from ``heads-decode`` (its settings as
``<name>.<setting>=``) and sweep it as a ``heads-eval`` row."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

import pytest
from conftest import decode_args

import specheads
from specheads.errors import UserError
from specheads.shim import POLICIES, UNSET, Check, Policy, Round, Settings, register_policy, settle

DEFAULT_MARGIN = 0.2


@dataclass
class MarginSettings(Settings):
    margin: float | None = None  # None: DEFAULT_MARGIN
    k_max: int = 20
    k_min: int = 1
    THRESHOLD = "margin"
    HELP = {"margin": "stop after a candidate whose draft top-1 minus top-2 probability is below this"}
    CHECKS = {"margin": Check(lambda m: 0 <= m <= 1, "{key}={value} must be in [0, 1]")}

    def relations(self) -> list[str]:
        return [] if 1 <= self.k_min <= self.k_max else [f"need 1 <= k_min <= k_max, got {self.k_min}, {self.k_max}"]


class MarginStop(Policy):
    """Stop drafting after a candidate whose draft distribution is undecided; SD's verification (lossless)."""

    name = "margin_stop"
    Settings = MarginSettings

    def __init__(
        self,
        margin: float | None = UNSET,
        k_max: int = UNSET,
        k_min: int = UNSET,
        *,
        settings: MarginSettings | None = None,
    ):
        # the Settings' defaults (or the given settings) under the arguments passed, checked: one UserError
        s = settle(MarginSettings, settings, {"margin": margin, "k_max": k_max, "k_min": k_min})
        self.settings = dataclasses.replace(s, margin=DEFAULT_MARGIN if s.margin is None else float(s.margin))
        super().__init__(s.k_max)  # self.k: the most candidates per round
        self.margin, self.k_min = self.settings.margin, s.k_min

    @classmethod
    def from_settings(cls, s, pair=None, head=None, costs=None) -> Policy:
        return cls(settings=s)

    def stop_drafting(self, rnd: Round) -> bool:
        if rnd.n >= self.k:
            return True
        top2 = rnd.draft_logits[-1].float().softmax(-1).topk(2).values
        return rnd.n >= self.k_min and float(top2[0] - top2[1]) < self.margin


@pytest.fixture
def registered():
    register_policy(MarginStop)
    yield MarginStop
    POLICIES.pop(MarginStop.name)


def _prompts(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ["the cat sat", "one two three"]))
    return path


_common = decode_args  # conftest


def _tokens(out):
    return [json.loads(x)["tokens"] for x in (out / "outputs.jsonl").read_text().splitlines()]


def test_a_registered_policy_runs_from_heads_decode(registered, tiny_pair_dirs, tmp_path, capsys):
    from specheads.decode.decode_cli import main

    prompts = _prompts(tmp_path)
    assert main(_common(tiny_pair_dirs, prompts, tmp_path / "ar") + ["policy=ar"]) == 0
    args = ["policy=margin_stop", "margin_stop.margin=0.3", "margin_stop.k_max=6"]
    assert main(_common(tiny_pair_dirs, prompts, tmp_path / "m") + args) == 0
    assert _tokens(tmp_path / "m") == _tokens(tmp_path / "ar")  # greedy and lossless
    metrics = json.loads((tmp_path / "m" / "metrics.json").read_text())
    assert metrics["policy"] == "margin_stop" and metrics["margin"] == 0.3 and metrics["k_max"] == 6
    assert main(["--help"]) == 0
    assert "  margin_stop.margin: " in capsys.readouterr().out
    bad = ["policy=margin_stop", "margin_stop.margin=1.5"]
    assert main(_common(tiny_pair_dirs, prompts, tmp_path / "bad") + bad) == 2
    assert "margin_stop.margin=1.5 must be in [0, 1]" in capsys.readouterr().err


def test_a_registered_policy_is_a_heads_eval_row(registered, tiny_pair_dirs, tmp_path):
    from specheads.evaluate.cli import main

    prompts = _prompts(tmp_path)
    rows = "rows=[{policy: margin_stop, settings: {k_max: 4}, sweep: {margin: [0.1, 0.5]}}]"
    out = tmp_path / "eval"
    args = _common(tiny_pair_dirs, prompts, out) + [
        "head=null",
        "ks=[2]",
        "offset=0",
        "oracle=false",
        "accuracy=false",
        rows,
    ]
    assert main(args) == 0
    sweep = json.loads((out / "sweep.json").read_text())
    names = [r["config"] for r in sweep["table"]]
    assert {"ar", "k2", "margin_stop-margin0.1", "margin_stop-margin0.5"} <= set(names)
    by = {}
    for line in (out / "rows.jsonl").read_text().splitlines():
        r = json.loads(line)
        by.setdefault(r["config"], []).append(r["tokens"])
    assert by["margin_stop-margin0.1"] == by["ar"] == by["margin_stop-margin0.5"]


def test_make_policy_and_registration_rules(registered):
    policy = specheads.make_policy("margin_stop", margin=0.4, k_max=5)
    assert isinstance(policy, MarginStop) and policy.margin == 0.4 and policy.k == 5
    assert specheads.make_policy("margin_stop", threshold=0.25).margin == 0.25  # threshold= is its margin
    with pytest.raises(UserError, match="has no setting delta"):
        specheads.make_policy("margin_stop", delta=0.5)

    class NoBuilder(Policy):
        name = "no_builder"

    with pytest.raises(TypeError, match="does not define from_settings"):
        register_policy(NoBuilder)

    class Impostor(MarginStop):
        pass

    with pytest.raises(ValueError, match="taken by MarginStop"):
        register_policy(Impostor)
    assert Policy.REQUIRED_HOOKS == ("name", "from_settings") and "stop_drafting" in Policy.OPTIONAL_HOOKS
