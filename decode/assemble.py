"""The one way from settings to a decoder: the models a decode runs on, loaded once (:func:`load`: the pair, the
EAGLE head, the cost table), a policy with its head (:func:`policy`) and a warmed, checked :class:`~.api.Decoder`
(:func:`decoder`). Every rule a decode's settings must meet is :func:`problems`, asked before any model loads.

``heads-decode`` (:mod:`.decode_cli`), ``heads-eval`` (its sweep's decoders), the Transformers ``generate``
integration (:class:`specheads.hf.Assistant`) and the vLLM proposer (:class:`specheads.vllm.proposer.Proposer`) all
build through it: the last two take the policy half (they run their own loops), the first two a decoder too.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

from specheads.decode.api import Decoder, load_eagle, policy_problems, run_problems
from specheads.decode.policy_factory import make_policy, pair_costs
from specheads.errors import UserError
from specheads.export.package import LoadedHead, outside_gate
from specheads.shim import (
    POLICIES,
    PROFILES,
    CostTable,
    ModelSpec,
    Pair,
    Policy,
    SamplingConfig,
    Settings,
    load_pair,
    policy_class,
    prepare_kernels,
)

log = logging.getLogger(__name__)


@dataclass
class Models:
    """What a decode's policies run on, loaded once: the pair, the EAGLE head drafting (None: the draft model)
    and the pair's cost table (None: no rule prices by it)."""

    pair: Pair
    eagle: LoadedHead | None = None
    costs: CostTable | None = None
    heads: dict = field(default_factory=dict)  # the policies' heads read so far: each file is read once
    warmed: bool = False  # the models' kernel choices taken (:func:`decoder`): once for every decoder on them


def problems(
    name: str,
    settings: Settings | None,
    *,
    eagle: bool,
    sampling: SamplingConfig,
    fused_forward: bool = True,
    batch_size: int = 1,
    max_new_tokens: int = 1,
    profile: str = "auto",
) -> list[str]:
    """Why a decode with policy ``name`` and its ``settings`` cannot run, one line each, before any model loads:
    the sampling settings, the decode's rules for the policy (:func:`~.api.policy_problems`; none for a name that
    is not a policy: the caller names that), the cost table a ``stop=cost`` rule reads, the budget and batch."""
    out = list(sampling.problems())
    if name in POLICIES:
        out += policy_problems(POLICIES[name], eagle, sampling, fused_forward, batch_size=batch_size)
    if getattr(settings, "stop", None) == "cost" and profile not in PROFILES and not Path(profile).is_file():
        out.append(f"profile={profile!r} is not auto, refresh or an existing cost-table JSON file")
    return out + run_problems(max_new_tokens, batch_size)


def load(
    target: ModelSpec,
    draft: ModelSpec | None,
    *,
    eagle: str | LoadedHead | None = None,
    same_vocab: bool = True,
    cost_pass: int | None = None,
    profile: str = "auto",
    fused_forward: bool = True,
    batch_size: int = 1,
) -> Models:
    """The pair (``draft`` None: the target alone), the EAGLE head checked against the target and placed with it,
    and, with ``cost_pass`` (the largest target pass a rule prices: most candidates + 1), the cost table of
    drafting with whichever drafts (the EAGLE head, else the draft model) at batch sizes up to ``batch_size``."""
    pair = load_pair(target, draft, same_vocab=same_vocab)
    head = load_eagle(eagle, pair) if eagle else None
    costs = None
    if cost_pass is not None:
        costs = pair_costs(pair, cost_pass, profile, fused_forward, eagle=head, batch_size=batch_size)
        log.info("%s", costs.describe())
    return Models(pair, head, costs)


def cost_pass(name: str, settings: Settings) -> int | None:
    """The largest target pass policy ``name``'s cost-aware rule prices (its most candidates + 1), None when it
    does not price by the cost table."""
    if getattr(settings, "stop", None) != "cost":
        return None
    own = policy_class(name).Settings.THRESHOLD
    if own and getattr(settings, own, None) is not None:
        log.warning("%s.%s=%s is not used with stop=cost", name, own, getattr(settings, own))
    return max(getattr(settings, "k_max", 20), getattr(settings, "tree_nodes", 0)) + 1


def policy(
    name: str,
    models: Models,
    settings: Settings | None = None,
    *,
    sampling: SamplingConfig | None = None,
    strict: bool = False,
    sources=(),
    **values,
) -> Policy:
    """Policy ``name`` with its head read once and checked against the models (:func:`make_policy`); a lossy
    policy's head whose threshold was chosen on other prompt sources than ``sources`` is named in a warning."""
    built = make_policy(
        name,
        models.pair,
        settings=settings,
        sampling=sampling,
        strict=strict,
        costs=models.costs,
        eagle=models.eagle,
        heads=models.heads,
        **values,
    )
    meta = getattr(built, "head_metadata", None)
    if not type(built).lossless and meta is not None and sources:
        why = outside_gate(meta, set(sources))
        if why:
            log.warning("%s head %s: %s", name, getattr(built.settings, "head", None), why)
    return built


def decoder(
    models: Models,
    built: Policy | str,
    *,
    max_new_tokens: int,
    sampling: SamplingConfig | None = None,
    seed: int = 0,
    chat_template: bool = True,
    fused_forward: bool = True,
    packed: bool = True,
    batch_size: int = 1,
    budgets: dict | None = None,
) -> Decoder:
    """A :class:`~.api.Decoder` of ``built`` on the models, checked for ``batch_size`` (one line when it cannot
    batch); the first decoder on the models takes their kernel choices for every pass size they can run, so that
    no first-use timing falls inside a timed decode."""
    d = Decoder(
        models.pair,
        built,
        max_new_tokens,
        sampling=sampling,
        seed=seed,
        chat_template=chat_template,
        fused_forward=fused_forward,
        eagle=models.eagle,
        packed=packed,
    )
    if batch_size > 1 and (why := d.batch_problem()):
        raise UserError(f"batch_size={batch_size}: {why}")
    d.budgets = dict(budgets or {})
    if not models.warmed:
        for m in (models.pair.target, models.pair.draft):
            if m is not None:
                prepare_kernels(m.model, fused=fused_forward)
        if models.eagle is not None:
            prepare_kernels(models.eagle.module, fused=False)
        models.warmed = True
    return d
