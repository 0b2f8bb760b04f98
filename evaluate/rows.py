"""The rows of a ``heads-eval`` sweep, as one list: each row is ``{policy, settings, sweep, name}``.

- ``policy``: a registered policy (``POLICIES``, a ``register_policy`` one too);
- ``settings``: its fixed settings, under their own names (``{head: H, k: 10}``);
- ``sweep``: at most one setting and its values (``{delta: [0.5, 0.9]}``), one configuration per value;
- ``name``: the row names' prefix (``j`` gives ``j0.5``); without one, the names the reports know for the
  built-in policies (:func:`default_name`: ``j0.5``, ``fsd-js-0.3``, ``h-cost``), else ``<policy>-<setting>``
  (``margin_stop-margin0.3``), or the policy's name when nothing is swept.

``rows=[...]`` in the config gives rows directly; the per-policy fields (``ks``, ``thresholds``, ``etas``,
``deltas``, ``topk``, ``fsd_js`` ...) are a shorthand that :func:`shorthand_rows` turns into the same list,
with the row names the reports know (``k4``, ``h0.3``, ``h-cost``, ``s0.5``, ``j0.9``, ``t2``, ``fsd-js-0.3``,
``c0.4``, ``tree-4x3x8``, ``v-slem-k2``).
"""

from __future__ import annotations

import re

from specheads.decode.policy_factory import settings_for
from specheads.errors import UserError
from specheads.shim import POLICIES


def num(x: float) -> str:
    """A setting as it appears in a row name: ``:g`` for the usual values (``0.99``, ``1``), but every
    significant digit up to 12, so that ``0.9999999`` is not written ``1`` (two settings, one name)."""
    return f"{x:.12g}"


def parse_tree(spec: str) -> tuple[int, int, int, str]:
    """``DEPTHxWIDTHxNODES`` (``4x3x8``) -> ``(4, 3, 8, "threshold")``; with ``-cost`` (``5x3x12-cost``) the
    tree is sized per round by the cost table (``stop="cost"``: at most that depth and size); UserError for
    anything else."""
    m = re.fullmatch(r"(\d+)x(\d+)x(\d+)(-cost)?", str(spec))
    if not m or min(map(int, m.groups()[:3])) < 1:
        raise UserError(
            f"trees: {spec!r} is not DEPTHxWIDTHxNODES (each >= 1), optionally with -cost (e.g. 4x3x8, 5x3x12-cost)"
        )
    depth, width, nodes = map(int, m.groups()[:3])
    return depth, width, nodes, "cost" if m[4] else "threshold"


#: The row-name prefix of the built-in policies the reports know (``{setting}`` filled from the row's settings):
#: a row of these without ``name`` is named as the shorthand fields name it.
PREFIX = {
    "sd": "k",
    "specdecpp": "h",
    "sprinter": "s",
    "judge": "j",
    "topk_verify": "t",
    "confidence_stop": "c",
    "fsd": "fsd-{divergence}-",
}


def default_name(policy: str, fixed: dict, key: str | None) -> str:
    """A row's prefix (swept) or name (nothing swept) when the row gives none: the reports' names for the
    built-in policies (``j``, ``fsd-js-``, ``h-cost``, ``tree-4x3x8``, ``v-slem-k2``), else ``<policy>-<setting>``
    or the policy's name."""
    defaults = POLICIES[policy].Settings()

    def value(name: str):  # a setting of the row: given, else the policy's default
        return fixed.get(name, getattr(defaults, name, None))

    if policy == "tree" and key is None:
        size = f"{value('k')}x{value('tree_width')}x{value('tree_nodes')}"
        return f"tree-{size}" + ("-cost" if value("stop") == "cost" else "")
    if POLICIES[policy].bridge and key is None:
        return hetero_row(policy, value("k"))
    prefix = PREFIX.get(policy)
    if prefix is not None:
        prefix = prefix.format(divergence=value("divergence"))
        if policy == "confidence_stop" and value("estimate") != "q":  # c-online-cost, c-entropy0.5
            prefix = f"c-{value('estimate')}"
        if key is None and value("stop") == "cost":
            return f"{prefix}-cost"
        if key is not None:
            return prefix
    return f"{policy}-{key}" if key is not None else policy


def hetero_row(method: str, k: int) -> str:
    """Row name of a heterogeneous-vocabulary method (``v-slem-k2``)."""
    return f"v-{method}-k{k}"


def shorthand_rows(cfg, cost_rows: bool) -> list[dict]:
    """The rows the per-policy fields of ``EvalConfig`` stand for, in the sweep's order; ``cost_rows``: the
    cost-aware ones too (``h-cost``, ``c-cost``, ``tree-...-cost``)."""
    out = [{"policy": "sd", "sweep": {"k": list(cfg.ks)}, "name": "k"}] if cfg.ks else []
    if cfg.head:
        stop = {"head": cfg.head, "k_min": cfg.k_min, "k_max": cfg.k_max}
        out.append({"policy": "specdecpp", "settings": stop, "sweep": {"h": list(cfg.thresholds)}, "name": "h"})
        if cost_rows and cfg.cost_stop:
            out.append({"policy": "specdecpp", "settings": {**stop, "stop": "cost"}, "name": "h-cost"})
    for spec in cfg.trees:
        depth, width, nodes, stop = parse_tree(spec)
        if stop == "cost" and not cost_rows:
            raise UserError(f"trees: {spec} needs the cost table")
        tree = {"k": depth, "tree_width": width, "tree_nodes": nodes, "stop": stop}
        out.append({"policy": "tree", "settings": tree, "name": f"tree-{spec}"})
    if cfg.topk.ks:
        out.append(
            {
                "policy": "topk_verify",
                "settings": {"k": cfg.topk.k},
                "sweep": {"verify_top_k": cfg.topk.ks},
                "name": "t",
            }
        )
    fsd = {"k": cfg.fsd.k, "fsd_top_k": cfg.fsd.top_k, "fsd_rule": cfg.fsd.rule, "fsd_dist": cfg.fsd.dist}
    for div, thresholds in cfg.fsd.swept().items():
        out.append(
            {"policy": "fsd", "settings": {**fsd, "divergence": div}, "sweep": {"T": thresholds}, "name": f"fsd-{div}-"}
        )
    if cfg.confidence.taus:
        out.append(
            {
                "policy": "confidence_stop",
                "settings": {"k_max": cfg.confidence.k_max},
                "sweep": {"tau": list(cfg.confidence.taus)},
                "name": "c",
            }
        )
        for estimate in cfg.confidence.estimates if cost_rows and cfg.cost_stop else []:
            out.append(
                {
                    "policy": "confidence_stop",
                    "settings": {"k_max": cfg.confidence.k_max, "stop": "cost", "estimate": estimate},
                    "name": "c-cost" if estimate == "q" else f"c-{estimate}-cost",
                }
            )
    judges = ({"": cfg.judge.head} if cfg.judge.head else {}) | dict(cfg.judge.heads)
    for label, head in judges.items():
        deltas = cfg.judge.head_deltas.get(label, cfg.judge.deltas)
        out.append(
            {
                "policy": "judge",
                "settings": {"head": head, "k": cfg.judge.k},
                "sweep": {"delta": list(deltas)},
                "name": f"j-{label}-" if label else "j",
            }
        )
    for method in cfg.hetero.methods:
        out.append({"policy": method, "settings": {"k": cfg.hetero.k}, "name": hetero_row(method, cfg.hetero.k)})
    if cfg.sprinter.head:
        out.append(
            {
                "policy": "sprinter",
                "settings": {"head": cfg.sprinter.head, "max_run": cfg.sprinter.max_run},
                "sweep": {"eta": list(cfg.sprinter.etas)},
                "name": "s",
            }
        )
    return out


def expand(row: dict) -> list[tuple[str, str, dict]]:
    """One row -> its configurations ``(name, policy, settings)``, one per swept value (UserError for a row
    that is not ``{policy, settings, sweep, name}`` with a registered policy and at most one swept setting)."""
    if not isinstance(row, dict) or set(row) - {"policy", "settings", "sweep", "name"} or "policy" not in row:
        raise UserError(
            f"rows: {row!r} is not {{policy: NAME, settings: {{...}}, sweep: {{SETTING: [...]}}, name: PREFIX}}"
        )
    policy = row["policy"]
    if policy not in POLICIES:
        raise UserError(f"rows: unknown policy {policy!r}; choose one of {list(POLICIES)}")
    fixed, sweep = dict(row.get("settings") or {}), dict(row.get("sweep") or {})
    if len(sweep) > 1:
        raise UserError(f"rows: policy={policy} sweeps {sorted(sweep)}; sweep one setting per row")
    if not sweep:
        return [(row.get("name") or default_name(policy, fixed, None), policy, fixed)]
    ((key, values),) = sweep.items()
    prefix = row.get("name") or default_name(policy, fixed, key)
    return [
        (
            f"{prefix}{num(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else v}",
            policy,
            {**fixed, key: v},
        )
        for v in values
    ]


def problems(rows: list[dict]) -> list[str]:
    """Every problem of the rows given as ``rows=``, by the policies' own rules (a swept setting's every value)."""
    out = []
    for row in rows:
        try:
            for _, policy, settings in expand(row):
                settings_for(policy, **settings)
        except UserError as exc:  # expand's own errors already say rows:
            out.append(str(exc) if str(exc).startswith("rows:") else f"rows: {exc}")
    return out
