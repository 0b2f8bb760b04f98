"""The stop plugin's settings (:mod:`specheads.vllm.stop_plugin`): what a user passes, how they travel inside vLLM's
``speculative_config`` and the checks vLLM's config gets when the plugin is selected.

The settings sit under ``draft_load_config.model_loader_extra_config["specheads_stop"]`` with the plugin's
``load_format="specheads"`` (vLLM's default loader, which otherwise refuses an unknown key), so every worker on every
node reads the same; nothing comes from the environment.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SECTION = "specheads_stop"
LOAD_FORMAT = "specheads"
RULES = ("c-cost", "c-online-cost", "h-cost", "fixed")


@dataclass
class StopSettings:
    """The plugin's settings (``speculative_config(...)``'s arguments past the EAGLE head and ``k``)."""

    rule: str | None = None  # None: the rule the head was exported with (heads-export deploy=), else h-cost/c-cost
    head: str | None = None  # h-cost: an exported stop head on this EAGLE head's states (heads-train head=eagle_stop)
    costs: str | None = None  # a cost table of vLLM's own steps (stop_tools.profile writes one)
    gate: bool = False  # the draft gate of the cost rules (off: bench/studies/vllm_stop_batch.py)
    k_min: int = 1  # fewest candidates of a drafted round
    # the largest batch whose requests' rules decide their lengths; at larger ones every request drafts the K the
    # cost table prices best for the acceptance seen so far (None: the rules at every batch; vllm_stop_qceiling.py)
    rule_max_batch: int | None = 1
    fixed_k: int | None = None  # rule=fixed: every request's length
    trace: bool = False  # keep every round (take_trace)
    profile: bool = False  # price vLLM's steps: every request drafts step % (K + 1) candidates, timed

    def __post_init__(self):
        self._unrunnable = None  # why the head's packaged rule cannot run here
        if self.rule is None:
            self.rule = "h-cost" if self.head else "c-cost"
            if self.head and Path(self.head).exists():
                from specheads.export.deploy import of_head, plugin_rule

                record = of_head(self.head)
                try:
                    if record:
                        self.rule, fixed = plugin_rule(record)
                        self.fixed_k = fixed if self.fixed_k is None else self.fixed_k
                except ValueError as err:
                    self._unrunnable = str(err)

    def problems(self, k: int) -> list[str]:
        """What is wrong with these settings for ``k`` = vLLM's ``num_speculative_tokens`` (an empty list: none)."""
        out = [self._unrunnable] if self._unrunnable else []
        if self.rule not in RULES:
            out.append(f"rule={self.rule!r}: expected one of {', '.join(RULES)}")
        if self.rule == "h-cost" and not self.head:
            out.append("rule=h-cost needs head= (an exported stop head on this EAGLE head's states)")
        if self.head and not Path(self.head).exists():
            out.append(f"head={self.head!r} does not exist")
        if self.rule == "fixed" and not (self.fixed_k is not None and 0 <= self.fixed_k <= k):
            out.append(f"rule=fixed needs 0 <= fixed_k <= num_speculative_tokens={k}; got fixed_k={self.fixed_k}")
        if self.rule.endswith("cost") and not self.profile:
            if not self.costs:
                out.append(f"rule={self.rule} needs costs= (a cost table of vLLM's steps: specheads.vllm.stop_plugin)")
            elif not Path(self.costs).is_file():
                out.append(f"costs={self.costs!r} is not a file")
        if self.rule_max_batch is not None and self.rule_max_batch < 1:
            out.append(f"rule_max_batch={self.rule_max_batch} must be >= 1 (or None: the rules at every batch)")
        if not 1 <= self.k_min <= k:
            out.append(f"k_min={self.k_min} must be in [1, num_speculative_tokens={k}]")
        return out


METHODS = ("eagle3", "draft_model")


def speculative_config(eagle: str, k: int, method: str = "eagle3", **settings: Any) -> dict:
    """vLLM's ``speculative_config`` for EAGLE-3 head directory ``eagle`` (``heads-export format=speculators``, or
    one speculators or SpecForge wrote) at most ``k`` candidates a round, stopped by this plugin (``settings``:
    :class:`StopSettings`' fields). ``method="draft_model"``: ``eagle`` is a draft model's directory instead, run by
    vLLM's own ``draft_model`` proposer (sharded as vLLM shards it), its rounds stopped the same way (``h-cost``: a
    SpecDec++ head trained on that draft's states). Checked here: a mistake is a one-line
    :class:`~specheads.errors.UserError`."""
    from specheads.errors import UserError

    names = {f.name for f in dataclasses.fields(StopSettings)}
    unknown = sorted(set(settings) - names)
    if unknown:
        raise UserError(f"the stop plugin has no setting {', '.join(unknown)}; its settings: {sorted(names)}")
    s = StopSettings(**settings)
    bad = s.problems(int(k)) + ([] if Path(eagle, "config.json").is_file() else [f"{eagle!r} has no config.json"])
    if method not in METHODS:
        bad.append(f"method={method!r}: the stop plugin runs on {' or '.join(METHODS)}")
    if bad:
        raise UserError("; ".join(bad))
    for key in ("head", "costs"):  # vLLM's workers may start elsewhere: absolute paths
        if getattr(s, key):
            setattr(s, key, str(Path(getattr(s, key)).resolve()))
    return {
        "method": method,
        "model": str(Path(eagle).resolve()),
        "num_speculative_tokens": int(k),
        "draft_load_config": {
            "load_format": LOAD_FORMAT,
            "model_loader_extra_config": {SECTION: dataclasses.asdict(s)},
        },
    }


def settings_of(spec_config) -> StopSettings | None:
    """The plugin's settings in vLLM's ``SpeculativeConfig`` (None: not selected)."""
    load = getattr(spec_config, "draft_load_config", None) if spec_config is not None else None
    raw = (getattr(load, "model_loader_extra_config", None) or {}).get(SECTION) if load is not None else None
    return StopSettings(**raw) if raw is not None else None


def config_problems(engine_args) -> list[str]:
    """Why vLLM's engine arguments cannot run the plugin (an empty list: it can, or it is not selected); turns async
    scheduling off when it is left to vLLM's default. Runs where vLLM builds its config from them, in the process
    that starts the engine, so a mistake is one line there."""
    spec = engine_args.speculative_config
    if isinstance(spec, str):
        spec = json.loads(spec)
    if not isinstance(spec, dict):
        return []
    load = spec.get("draft_load_config") or {}
    extra = (load.get("model_loader_extra_config") if isinstance(load, dict) else None) or {}
    raw = extra.get(SECTION) if isinstance(extra, dict) else None
    if raw is None:
        return []
    names = {f.name for f in dataclasses.fields(StopSettings)}
    unknown = sorted(set(raw) - names)
    if unknown:
        return [f"the stop plugin has no setting {', '.join(unknown)}; its settings: {sorted(names)}"]
    out = []
    if spec.get("method") not in METHODS:
        out.append(f"the stop plugin runs on method {' or '.join(METHODS)}; got method={spec.get('method')!r}")
    for flag in ("use_local_argmax_reduction", "use_heterogeneous_vocab", "parallel_drafting"):
        if spec.get(flag):
            out.append(f"the stop plugin does not run with {flag}=True (its draft tokens are chosen elsewhere)")
    if spec.get("draft_sample_method", "greedy") != "greedy":
        out.append("the stop plugin needs draft_sample_method='greedy' (vLLM's default)")
    if spec.get("disable_padded_drafter_batch"):
        out.append("the stop plugin needs the padded drafter batch (disable_padded_drafter_batch=False, the default)")
    if engine_args.async_scheduling:
        out.append(
            "the stop plugin needs async scheduling off (--no-async-scheduling / async_scheduling=False): with it "
            "vLLM takes each step's drafts as one [requests, K] tensor (vllm/v1/worker/gpu_model_runner.py:1857)"
        )
    elif engine_args.async_scheduling is None:
        engine_args.async_scheduling = False
    return out + StopSettings(**raw).problems(int(spec.get("num_speculative_tokens") or 0))


def rule_policy(s: StopSettings, k: int, eagle_meta: dict | None, hidden: int | None = None):
    """The toolkit policy that decides one request's rounds under settings ``s`` at most ``k`` candidates (forked per
    request): the policy's own settings (``settings_for``, the names and rules ``heads-decode`` checks) built by its
    class from them, its head read and checked against the drafter (``eagle_meta``: the EAGLE head's specheads
    metadata, None for a draft model; ``hidden``: the drafter's state width). ``fixed`` and ``profile``: standard SD
    at ``k``, the lengths set per round."""
    from specheads.decode.policy_factory import settings_for
    from specheads.shim import load_table, policy_class

    if s.profile or s.rule == "fixed":
        return policy_class("sd").from_settings(settings_for("sd", k=k))
    costs = load_table(s.costs) if s.costs else None
    common = {"stop": "cost", "k_min": s.k_min, "k_max": k, "gate": s.gate}
    if s.rule in ("c-cost", "c-online-cost"):
        estimate = "online" if s.rule == "c-online-cost" else "q"
        return policy_class("confidence_stop").from_settings(
            settings_for("confidence_stop", estimate=estimate, **common), costs=costs
        )
    from specheads.export import load_head
    from specheads.export.package import check_stop_drafter

    head = load_head(s.head)
    if head.metadata.get("head_type") != "acceptance":
        raise ValueError(f"head={s.head!r} is a {head.metadata.get('head_type')} head; rule=h-cost reads a stop head")
    check_stop_drafter(head.metadata.get("feature", {}), eagle_meta)
    width = head.module.hidden_size
    if hidden is not None and width not in (0, hidden):
        raise ValueError(f"head={s.head!r} reads {width}-wide states; the drafter's are {hidden} wide")
    head = type(head)(head.module.float().eval(), head.metadata)
    return policy_class("specdecpp").from_settings(
        settings_for("specdecpp", head=s.head, **common), head=head, costs=costs
    )
