"""Building a decoding policy by name or from a ``heads-decode``-style config, with its exported head
loaded and checked against the pair, and the pair's profiled cost table for the cost-aware rules."""

from __future__ import annotations

from dataclasses import fields

from specheads.errors import UserError, article
from specheads.export.package import LoadedHead, check_head_against_pair, check_sampling, check_stop_drafter, load_head
from specheads.shim import CostTable, Pair, Policy, SamplingConfig, Settings, batch_sizes, cost_table, policy_class


def _policy_head(
    cls: type[Policy],
    path: str | None,
    pair: Pair,
    sampling,
    strict: bool,
    eagle: LoadedHead | None = None,
    loaded: dict | None = None,
) -> LoadedHead | None:
    """Loads and checks the exported head ``cls.HEAD`` names (its module in the dtype of the states it reads),
    or None. With ``eagle`` (the EAGLE head decoding drafts with), a head on drafting states must read that head's.
    ``loaded``: heads read before, by path and device (a sweep's rows of one head read its file once)."""
    spec = cls.HEAD
    if spec is None or (not path and not spec.required):
        return None
    if not path:
        raise UserError(
            f"policy={cls.name} needs its head: {cls.name}.head=<exported {spec.type} head .safetensors> "
            f"(heads-train head={spec.type}, then heads-export)"
        )
    drafts = spec.model == "draft" and eagle is not None  # the EAGLE head stands in for the draft model
    model = pair.target if drafts else pair.draft if spec.model == "draft" else pair.target
    if model is None:
        raise UserError(f"policy={cls.name} needs a {spec.model} model; set {spec.model}.path")
    # read once, where the states it reads are: the EAGLE head's (it sits on the target's input GPU), else where
    # the model's final states come out (a split target's last GPU); then checked
    device = model.device if drafts else model.output_device
    cache = {} if loaded is None else loaded
    head = cache.get((str(path), str(device))) or load_head(path, device=device)
    cache[(str(path), str(device))] = head
    meta = head.metadata
    reads = meta.get("feature", {}).get("model", "draft")
    fits = reads in ("draft", "eagle") if spec.model == "draft" else reads == spec.model  # drafting states
    if meta.get("head_type") != spec.type or not fits:
        raise UserError(
            f"{path!r} is {article(meta.get('head_type'))} head on the {reads}'s states; policy={cls.name} "
            f"needs {article(spec.type)} head on the {spec.model}'s states"
        )
    if spec.model == "draft":  # a head on the draft model's states, or on the EAGLE head's: its drafter
        check_stop_drafter(meta.get("feature", {}), eagle.metadata if eagle is not None else None)
    check_head_against_pair(meta, pair)
    check_sampling(meta, (sampling or SamplingConfig()).to_dict(), strict)
    dtype = next(eagle.module.parameters()).dtype if drafts else model.model.dtype
    return LoadedHead(head.module.to(dtype), head.metadata)


def pair_costs(
    pair: Pair, max_pass: int, profile: str = "auto", fused: bool = True, eagle=None, batch_size: int = 1
) -> CostTable:
    """The pair's profiled cost table (:func:`~.shim.costs.cost_table`): cached for this machine and
    settings, measured when absent (``profile="auto"``), re-measured (``"refresh"``) or read from a
    JSON path. ``max_pass`` is the largest target pass needed: the most candidates per round + 1. ``eagle`` (a
    loaded EAGLE head): the table of drafting with it instead of with the draft model. ``batch_size`` > 1 (the
    batched engine's rows): batch sizes up to it are priced too (:func:`~.shim.cost_profile.batch_sizes`)."""
    batches = batch_sizes(batch_size) if fused else ()
    if eagle is not None:  # the EAGLE head's draft step is the draft forward
        return cost_table(
            pair.target.model,
            eagle.module,
            max_pass,
            pair.target.fingerprint,
            eagle.metadata.get("tensors_sha256", ""),
            fused=fused,
            profile=profile,
            batches=batches,
        )
    if pair.draft is None:
        raise UserError("a cost table needs a draft model; set draft.path")
    vt = pair.target.model.get_output_embeddings().weight.shape[0]
    vd = pair.draft.model.get_output_embeddings().weight.shape[0]
    return cost_table(
        pair.target.model,
        pair.draft.model,
        max_pass,
        pair.target.fingerprint,
        pair.draft.fingerprint,
        fused=fused,
        vocab_size=min(vt, vd) if vt != vd else None,
        profile=profile,
        batches=batches,
    )


def settings_for(name: str, threshold: float | None = None, **values) -> Settings:
    """Policy ``name``'s settings from values under their own names (``None``: unset, the default), checked;
    ``threshold`` is the policy's threshold under one name (SpecDec++'s ``h``, SPRINTER's ``eta``, the
    judge's ``delta``, FSD's ``T``, ``confidence_stop``'s ``tau``)."""
    cls = policy_class(name)
    names = {f.name for f in fields(cls.Settings)}
    values = {k: v for k, v in values.items() if v is not None}
    unknown = sorted(set(values) - names)
    if unknown:
        raise UserError(f"policy={name} has no setting {', '.join(unknown)}; its settings: {sorted(names) or 'none'}")
    if threshold is not None:
        own = cls.Settings.THRESHOLD
        if own is None:
            raise UserError(f"policy={name} has no threshold")
        if values.get(own, threshold) != threshold:
            raise UserError(
                f"threshold={threshold} and {own}={values[own]} disagree; set only {own} (threshold is its other name)"
            )
        values[own] = threshold
    settings = cls.Settings(**values)
    settings.check()
    return settings


def make_policy(
    name: str,
    pair: Pair | None = None,
    *,
    settings: Settings | None = None,
    sampling: SamplingConfig | None = None,
    strict: bool = False,
    costs: CostTable | None = None,
    eagle: LoadedHead | None = None,
    threshold: float | None = None,
    heads: dict | None = None,
    **values,
) -> Policy:
    """The one way to build a policy: by its registered name, with its settings, its head loaded and checked.

    Args:
        name: the policy (a key of ``POLICIES``: ``ar``, ``draft``, ``sd``, ``specdecpp`` ...).
        pair: the loaded pair (a head is checked against it).
        settings: the policy's ``Settings`` (from ``heads-decode``'s ``<policy>.<setting>`` keys); or
        values: its settings under their own names (``k=``, ``head=``, ``h=``, ``delta=``, ``k_max=`` ...;
            ``policy.Settings`` lists them; ``None`` leaves one at its default), and
        threshold: the policy's threshold under one name (``h``, ``eta``, ``delta``, ``T`` or ``tau``).
        sampling: the decoding's sampling settings (checked against a head's).
        strict: refuse a head trained under other sampling settings instead of warning.
        costs: the pair's cost table (:func:`pair_costs`) for ``stop="cost"``.
        eagle: the EAGLE head decoding drafts with (``load_eagle``): a stop head must have been trained on
            that head's states (``heads-train head=eagle_stop``).
        heads: heads read by earlier calls (filled in): the same file is read once.
    """
    cls = policy_class(name)
    if settings is None:
        settings = settings_for(name, threshold, **values)
    elif values or threshold is not None:
        raise UserError("make_policy: give settings= or the settings' values, not both")
    else:
        settings.check()
    head = _policy_head(cls, getattr(settings, "head", None), pair, sampling, strict, eagle, heads)
    policy = cls.from_settings(settings, pair=pair, head=head, costs=costs)
    if head is not None:  # whose states the head reads, and the drafter it was checked against (the one site)
        policy.head_metadata = head.metadata
        policy.head_feature = {"model": "draft", **head.metadata.get("feature", {})}
        policy.head_drafter = drafter_id(eagle.metadata if eagle is not None else None)
    return policy


def drafter_id(eagle: dict | None) -> str | None:
    """The drafter a stop head was checked against: an EAGLE head's ``tensors_sha256``, or None (the draft)."""
    return None if eagle is None else str(eagle.get("tensors_sha256"))
