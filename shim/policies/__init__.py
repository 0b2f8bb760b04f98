"""Decoding policies, one module per family, and their registry.

``base`` holds the interface (:class:`Round`, :class:`Verdict`, :class:`Policy`) and the one standard SD
acceptance rule; ``settings`` the settings machinery (:class:`Settings`, :class:`Check`, :class:`HeadSpec`);
``baselines`` the target or draft alone, standard SD, top-K verification and draft-confidence stopping
(the cost rules and the draft gate they share with SpecDec++ are in :mod:`..cost_rules`); ``specdecpp``,
``sprinter``, ``judge`` and ``fsd`` one family
each; ``hetero`` TLI, SLEM and SLRS; ``tree`` tree drafting with an EAGLE head. :data:`POLICIES` maps every
``policy=`` name to its class.
"""

from specheads.errors import UserError
from specheads.shim.policies.base import (
    Policy,
    Round,
    Verdict,
    greedy_accept,
    residual,
    sd_accepts,
    speculative_accept,
    standard_verify,
)
from specheads.shim.policies.baselines import STOPS, ConfidenceStop, DraftOnly, StandardSD, TargetOnly
from specheads.shim.policies.fsd_policy import FSD
from specheads.shim.policies.hetero_policies import SLEM, SLRS, TLI
from specheads.shim.policies.judge_policy import Judge
from specheads.shim.policies.settings import UNSET, Check, HeadSpec, Settings, settle
from specheads.shim.policies.specdecpp_policy import SpecDecPP
from specheads.shim.policies.sprinter_policy import Sprinter
from specheads.shim.policies.topk_policy import TopKVerify
from specheads.shim.policies.tree_policy import EagleTree

POLICIES: dict[str, type[Policy]] = {
    p.name: p
    for p in (
        StandardSD,
        SpecDecPP,
        Sprinter,
        Judge,
        TopKVerify,
        FSD,
        ConfidenceStop,
        EagleTree,
        TLI,
        SLEM,
        SLRS,
        TargetOnly,
        DraftOnly,
    )
}


def register_policy(cls: type[Policy]) -> type[Policy]:
    """Class decorator: registers a :class:`Policy` subclass under its ``name``, so that ``make_policy``,
    ``heads-decode policy=<name>`` (its settings as ``<name>.<setting>=``) and ``heads-eval`` rows find it.
    Refuses a name already taken by another class and a class missing a required hook."""
    if not (isinstance(cls, type) and issubclass(cls, Policy)):
        raise TypeError(f"register_policy needs a Policy subclass, got {cls!r}")
    missing = cls.missing_hooks()
    if missing:
        raise TypeError(f"{cls.__name__} does not define {', '.join(missing)} (required of every policy)")
    if POLICIES.get(cls.name, cls) is not cls:
        raise ValueError(f"policy name {cls.name!r} is taken by {POLICIES[cls.name].__name__}")
    POLICIES[cls.name] = cls
    return cls


def policy_class(name: str) -> type[Policy]:
    """The policy class registered as ``name``."""
    if name not in POLICIES:
        raise UserError(f"unknown policy {name!r}; choose one of {list(POLICIES)}")
    return POLICIES[name]


__all__ = [
    "POLICIES",
    "STOPS",
    "Check",
    "UNSET",
    "settle",
    "ConfidenceStop",
    "DraftOnly",
    "EagleTree",
    "FSD",
    "HeadSpec",
    "Judge",
    "Policy",
    "Round",
    "SLEM",
    "SLRS",
    "Settings",
    "SpecDecPP",
    "Sprinter",
    "StandardSD",
    "TLI",
    "TargetOnly",
    "TopKVerify",
    "Verdict",
    "greedy_accept",
    "policy_class",
    "register_policy",
    "residual",
    "sd_accepts",
    "speculative_accept",
    "standard_verify",
]
