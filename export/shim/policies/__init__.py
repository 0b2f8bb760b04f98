"""Decoding policies, one module per family, and their registry.

``base`` holds the interface (:class:`Round`, :class:`Verdict`, :class:`Policy`) and the one standard SD
acceptance rule; ``settings`` the settings machinery (:class:`Settings`, :class:`Check`, :class:`HeadSpec`);
``baselines`` the target or draft alone, standard SD, top-K verification and draft-confidence stopping
(the cost rules and the draft gate they share with SpecDec++ are in :mod:`..cost_rules`); ``specdecpp``, ``sprinter``, ``judge`` and ``fsd`` one family
each; ``hetero`` TLI, SLEM and SLRS; ``tree`` tree drafting with an EAGLE head. :data:`POLICIES` maps every ``policy=`` name to its class.
"""

from specheads.errors import UserError

from .base import Policy, Round, Verdict, greedy_accept, residual, sd_accepts, speculative_accept, standard_verify
from .baselines import STOPS, ConfidenceStop, DraftOnly, StandardSD, TargetOnly, TopKVerify
from .fsd import FSD
from .hetero import SLEM, SLRS, TLI
from .judge import Judge
from .settings import Check, HeadSpec, Settings
from .specdecpp import SpecDecPP
from .sprinter import Sprinter
from .tree import EagleTree

POLICIES: dict[str, type[Policy]] = {p.name: p for p in (StandardSD, SpecDecPP, Sprinter, Judge, TopKVerify, FSD,
                                                           ConfidenceStop, EagleTree, TLI, SLEM, SLRS, TargetOnly,
                                                           DraftOnly)}


def policy_class(name: str) -> type[Policy]:
    """The policy class registered as ``name``."""
    if name not in POLICIES:
        raise UserError(f"unknown policy {name!r}; choose one of {list(POLICIES)}")
    return POLICIES[name]


def build_policy(name: str, **kwargs) -> Policy:
    """Instantiates a registered policy by name (keyword arguments: its constructor's)."""
    return policy_class(name)(**kwargs)


__all__ = ["POLICIES", "STOPS", "Check", "ConfidenceStop", "DraftOnly", "EagleTree", "FSD", "HeadSpec", "Judge", "Policy", "Round",
           "SLEM", "SLRS", "Settings", "SpecDecPP", "Sprinter", "StandardSD", "TLI", "TargetOnly", "TopKVerify", "Verdict",
           "build_policy", "greedy_accept", "policy_class", "residual", "sd_accepts", "speculative_accept",
           "standard_verify"]
