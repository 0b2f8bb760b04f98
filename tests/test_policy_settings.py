"""A policy's settings are written once, in its Settings: its constructor's arguments for them default to
UNSET (the Settings' value), it keeps what it resolved as ``policy.settings``, and ``from_settings`` hands the
Settings over whole."""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch

from specheads.errors import UserError
from specheads.shim import POLICIES
from specheads.shim.policies.baselines import ConfidenceStop, StandardSD, TargetOnly
from specheads.shim.policies.settings import UNSET
from specheads.shim.policies.sprinter_policy import Sprinter, SprinterSettings
from specheads.shim.policies.topk_policy import TopKSettings, TopKVerify

RUNTIME = {"self", "head", "costs", "stopper", "embedding", "feature", "position", "settings"}  # objects, not settings


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_no_constructor_writes_a_settings_default(name):
    cls = POLICIES[name]
    own = [p for p in inspect.signature(cls.__init__).parameters.values() if p.name not in RUNTIME]
    written = [p.name for p in own if p.default is not inspect.Parameter.empty and p.default is not UNSET]
    assert written == [], f"{cls.__name__}.__init__ writes defaults its Settings own: {written}"
    if own:  # a policy with settings takes them whole too
        assert "settings" in inspect.signature(cls.__init__).parameters


def test_the_settings_defaults_are_the_constructors():
    assert StandardSD().k == StandardSD(settings=StandardSD.Settings()).k == StandardSD.Settings().k
    c = ConfidenceStop()
    assert c.settings == dataclasses.replace(ConfidenceStop.Settings(), tau=c.tau) and c.k == c.settings.k_max
    assert TargetOnly().describe() == {}


def test_arguments_override_the_settings_given_and_are_checked():
    base = TopKSettings(k=5, verify_top_k=3)
    p = TopKVerify(top_k=4, settings=base)
    assert (p.k, p.top_k, p.delta) == (5, 4, None) and p.settings == TopKSettings(5, 4, None)
    assert p.describe() == {"k": 5, "verify_top_k": 4}
    with pytest.raises(UserError, match="top_k=0 must be >= 1"):  # the constructor's own spelling
        TopKVerify(top_k=0)


def test_a_threshold_left_unset_is_resolved_into_the_settings():
    head = torch.nn.Linear(4, 1)
    s = Sprinter(head)
    assert s.eta == 0.5 and s.settings == SprinterSettings(eta=0.5)  # the head spec's default: one value
    assert Sprinter(head, settings=SprinterSettings(eta=0.7, max_run=None)).max_run is None
