"""Building a decoding policy by name or from a ``heads-decode``-style config, with its exported head
loaded and checked against the pair, and the pair's profiled cost table for the cost-aware rules."""

from __future__ import annotations

from dataclasses import fields
from types import SimpleNamespace

from specheads.errors import UserError

from .package import LoadedHead, check_stop_drafter, load_head, read_metadata
from .shim.cost_profile import batch_sizes
from .shim.costs import CostTable, cost_table
from .shim.models import Pair
from .shim.policies import Policy, policy_class
from .shim.sampling import SamplingConfig


def _policy_head(cls: type[Policy], path: str | None, pair: Pair, sampling, strict: bool,
                 eagle: LoadedHead | None = None) -> LoadedHead | None:
    """Loads and checks the exported head ``cls.HEAD`` names (its module in the dtype of the states it reads),
    or None. With ``eagle`` (the EAGLE head decoding drafts with), a head on drafting states must read that head's."""
    spec = cls.HEAD
    if spec is None or (not path and not spec.required):
        return None
    if not path:
        raise UserError(f"policy={cls.name} needs head=<exported {spec.type} head .safetensors> "
                        f"(heads-train head={spec.type}, then heads-export)")
    meta = read_metadata(path)
    reads = meta.get("feature", {}).get("model", "draft")
    fits = reads in ("draft", "eagle") if spec.model == "draft" else reads == spec.model  # drafting states
    if meta.get("head_type") != spec.type or not fits:
        raise UserError(f"{path!r} is a {meta.get('head_type')} head on the {reads}'s states; policy={cls.name} "
                        f"needs a {spec.type} head on the {spec.model}'s states")
    if spec.model == "draft":  # a head on the draft model's states, or on the EAGLE head's: its drafter
        check_stop_drafter(meta.get("feature", {}), eagle.metadata if eagle is not None else None)
    drafts = spec.model == "draft" and eagle is not None  # the EAGLE head stands in for the draft model
    model = pair.target if drafts else pair.draft if spec.model == "draft" else pair.target
    if model is None:
        raise UserError(f"policy={cls.name} needs a {spec.model} model; set {spec.model}.path")
    loaded = load_head(path, pair=pair, sampling=sampling or SamplingConfig(), strict=strict, device=model.device,
                       eagle=eagle.metadata if eagle is not None else None)
    dtype = next(eagle.module.parameters()).dtype if drafts else model.model.dtype
    return LoadedHead(loaded.module.to(dtype), loaded.metadata)


def pair_costs(pair: Pair, max_pass: int, profile: str = "auto", fused: bool = True, eagle=None,
               batch_size: int = 1) -> CostTable:
    """The pair's profiled cost table (:func:`~.shim.costs.cost_table`): cached for this machine and
    settings, measured when absent (``profile="auto"``), re-measured (``"refresh"``) or read from a
    JSON path. ``max_pass`` is the largest target pass needed: the most candidates per round + 1. ``eagle`` (a
    loaded EAGLE head): the table of drafting with it instead of with the draft model. ``batch_size`` > 1 (the
    batched engine's rows): batch sizes up to it are priced too (:func:`~.shim.cost_profile.batch_sizes`)."""
    batches = batch_sizes(batch_size) if fused else ()
    if eagle is not None:  # the EAGLE head's draft step is the draft forward
        return cost_table(pair.target.model, eagle.module, max_pass, pair.target.fingerprint,
                          eagle.metadata.get("tensors_sha256", ""), fused=fused, profile=profile,
                          batches=batches)
    if pair.draft is None:
        raise UserError("a cost table needs a draft model; set draft.path")
    vt = pair.target.model.get_output_embeddings().weight.shape[0]
    vd = pair.draft.model.get_output_embeddings().weight.shape[0]
    return cost_table(pair.target.model, pair.draft.model, max_pass, pair.target.fingerprint, pair.draft.fingerprint,
                      fused=fused, vocab_size=min(vt, vd) if vt != vd else None, profile=profile, batches=batches)


def policy_from_config(name: str, cfg, pair: Pair, sampling: SamplingConfig | None = None, strict: bool = False,
                       costs: CostTable | None = None, eagle: LoadedHead | None = None) -> Policy:
    """The policy ``name`` with the settings a flat config gives (:class:`~.decode_config.DecodeConfig`,
    or any object with those names; ``threshold`` stands for the policy's own threshold name): the
    settings checked, the head loaded and checked against the pair and the sampling settings
    (``strict``: refuse other sampling settings instead of warning), ``costs`` for ``stop="cost"``;
    ``eagle``: the EAGLE head (``load_eagle``) decoding drafts with, which a stop head must have been trained on."""
    cls = policy_class(name)
    problems = cls.Settings.config_problems(cfg)
    if problems:
        raise UserError("; ".join(problems))
    settings = cls.Settings.from_config(cfg)
    head = _policy_head(cls, getattr(settings, "head", None), pair, sampling, strict, eagle)
    policy = cls.from_settings(settings, pair=pair, head=head, costs=costs)
    if head is not None:  # what the Decoder checks its drafter against
        policy.head_feature = {"model": "draft", **head.metadata.get("feature", {})}
    return policy


def make_policy(name: str, pair: Pair, k: int = 4, head: str | None = None, threshold: float | None = None,
                k_min: int = 2, k_max: int = 20, sampling: SamplingConfig | None = None,
                strict: bool = False, max_run: int | None = 20, top_k: int = 2, divergence: str = "js",
                fsd_top_k: int = 0, fsd_rule: str = "paper", fsd_dist: str = "raw", stop: str = "threshold",
                costs: CostTable | None = None, eagle: LoadedHead | None = None, **own) -> Policy:
    """A policy by name (a key of ``POLICIES``: ``ar``, ``draft``, ``sd`` ...), its head loaded and checked.

    Args:
        name: the policy.
        pair: the loaded pair (heads are checked against it).
        k: candidates per round of ``sd``, ``judge``, ``topk_verify`` and ``fsd``; draft tokens per round
            of ``tli`` and ``slem``.
        head: exported head for ``specdecpp``, ``sprinter`` and ``judge``; for ``fsd``, optionally an
            acceptance head trained on FSD labels that decides when to stop drafting (``k_min``,
            ``k_max`` and its default threshold ``h`` then apply instead of ``k``).
        threshold: the policy's threshold under its other name: SpecDec++'s ``h``, SPRINTER's ``eta``,
            the judge's ``delta`` (default: the head's ``default_threshold``), FSD's ``T`` (required),
            ``confidence_stop``'s ``tau`` (default 0.4, Hugging Face's).
        k_min, k_max: SpecDec++'s bounds on candidates per round; ``k_max`` also caps ``confidence_stop``.
        sampling: the decoding's sampling settings (checked against a head's).
        strict: refuse a head trained under other sampling settings instead of warning.
        max_run: cap on SPRINTER's approved runs.
        top_k: ``topk_verify``'s K.
        divergence, fsd_top_k, fsd_rule, fsd_dist: FSD's settings (see :class:`~.shim.policies.FSD`).
        stop: ``threshold`` or ``cost``: how ``specdecpp`` and ``confidence_stop`` stop drafting; ``cost``
            ignores the threshold and needs ``costs`` (:func:`pair_costs`).
        costs: the pair's cost table for ``stop="cost"``.
        eagle: the EAGLE head decoding drafts with (``load_eagle``): ``specdecpp`` then needs a head trained
            on that head's states (``heads-train head=eagle_stop``).
        own: settings under the policy's own names (``h=``, ``eta=``, ``delta=``, ``T=``, ``tau=``,
            ``lookbehind=``, ``gate=``).
    """
    names = {f.name for f in fields(policy_class(name).Settings)}
    unknown = sorted(set(own) - names)
    if unknown:
        raise UserError(f"policy={name} has no setting {', '.join(unknown)}; its settings: {sorted(names)}")
    cfg = SimpleNamespace(k=k, head=head, threshold=threshold, k_min=k_min, k_max=k_max, max_run=max_run,
                          verify_top_k=top_k, divergence=divergence, fsd_top_k=fsd_top_k, fsd_rule=fsd_rule,
                          fsd_dist=fsd_dist, stop=stop, **own)
    return policy_from_config(name, cfg, pair, sampling, strict, costs, eagle)
