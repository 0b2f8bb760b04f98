"""Merging config layers one key at a time and resolving the result, collecting every problem (helpers of
specheads.config)."""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from specheads import _schema


def _apply(
    cfg: DictConfig, items: list[tuple[str, Any, Any]], schema: type, prog: str, where: str, problems: list[str]
) -> DictConfig:
    """Merge ``(key, raw, layer)`` items one by one, keeping the good ones, noting the bad."""
    for key, raw, layer in items:
        try:
            cfg = OmegaConf.merge(cfg, layer)
        except Exception as exc:  # noqa: BLE001 - OmegaConf raises several unrelated types
            problems.append(where + _schema.describe(exc, schema, prog, key, raw))
    return cfg


def _check_resolved(
    node: DictConfig, prefix: str, schema: type, prog: str, problems: list[str], missing: list[str]
) -> None:
    """Resolve every value (interpolations, their types); note failures and ``???`` keys."""
    for key in node.keys():
        full = f"{prefix}{key}"
        if OmegaConf.is_missing(node, key):
            missing.append(str(full))
            continue
        try:
            value = node[key]
            if isinstance(value, ListConfig):
                OmegaConf.to_container(value, resolve=True)
        except Exception as exc:  # noqa: BLE001
            raw = OmegaConf.to_container(node, resolve=False)[key]  # as written: '${oc.env:X}'
            problems.append(_schema.describe(exc, schema, prog, full, raw))
            continue
        if isinstance(value, DictConfig):
            _check_resolved(value, f"{full}.", schema, prog, problems, missing)
