"""Introspection of dataclass schemas and one-line wording of OmegaConf errors.

Private helpers of :mod:`specheads.config`: flattened field listings for ``--help`` and
turning OmegaConf's multi-line exceptions into the "say what, show the value, say the fix"
lines the CLIs print.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import json
import pathlib
import re
import types
import typing
from typing import Any, Literal, Union

from omegaconf import OmegaConf
from omegaconf.errors import ConfigKeyError, InterpolationResolutionError, MissingMandatoryValue

NOTHING = object()  # "no raw value known" marker


@dataclasses.dataclass
class FieldInfo:
    """One leaf field of a schema, with its dotted name."""

    name: str
    type: Any
    default: Any
    help: str = ""


def _hints(cls: type) -> dict[str, Any]:
    try:
        return typing.get_type_hints(cls)
    except Exception:  # noqa: BLE001 - unresolvable string annotations: fall back to raw ones
        return {f.name: f.type for f in dataclasses.fields(cls)}


def _strip_optional(tp: Any) -> tuple[Any, bool]:
    if typing.get_origin(tp) in (Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0], len(args) < len(typing.get_args(tp))
    return tp, False


def _nested_dataclass(tp: Any) -> type | None:
    inner, _ = _strip_optional(tp)
    return inner if isinstance(inner, type) and dataclasses.is_dataclass(inner) else None


def flat_fields(schema: type) -> list[FieldInfo]:
    """Every leaf field of ``schema`` (nested dataclasses flattened to dotted names).

    Defaults come from ``OmegaConf.structured`` so nested ``default_factory`` values show as
    they will be used; a mandatory value shows as ``???``.
    """
    defaults = OmegaConf.to_container(OmegaConf.structured(schema), resolve=False)
    out: list[FieldInfo] = []

    def walk(cls: type, values: Any, prefix: str) -> None:
        hints = _hints(cls)
        for f in dataclasses.fields(cls):
            tp = hints.get(f.name, f.type)
            value = values.get(f.name) if isinstance(values, dict) else None
            sub = _nested_dataclass(tp)
            if sub is not None and isinstance(value, dict):
                walk(sub, value, f"{prefix}{f.name}.")
            elif sub is not None:  # an Optional group that is None by default
                out.append(FieldInfo(f"{prefix}{f.name}", tp, value, f.metadata.get("help", "")))
                sub_defaults = OmegaConf.to_container(OmegaConf.structured(sub), resolve=False)
                walk(sub, sub_defaults, f"{prefix}{f.name}.")
            else:
                helper = getattr(cls, "help", None)  # a policy's Settings: its help lines
                text = f.metadata.get("help", "") or (helper(f.name) if callable(helper) else "")
                out.append(FieldInfo(f"{prefix}{f.name}", tp, value, text))

    walk(schema, defaults, "")
    return out


def field_type(schema: type, dotted: str) -> Any:
    """The annotated type of ``dotted`` in ``schema``, or ``NOTHING`` if it is not a field."""
    cls: Any = schema
    for part in dotted.split("."):
        if cls is None or not dataclasses.is_dataclass(cls):
            return NOTHING
        hints = _hints(cls)
        if part not in hints:
            return NOTHING
        tp = hints[part]
        cls = _nested_dataclass(tp)
    return tp


def type_name(tp: Any) -> str:
    """Short readable name of a type annotation, e.g. ``float``, ``str | None``, ``sd|fsd``."""
    inner, optional = _strip_optional(tp)
    if optional:
        return f"{type_name(inner)} | None"
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Literal:
        return "|".join(str(a) for a in args)
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return "|".join(m.name for m in tp)
    if origin is not None:
        inner_names = ", ".join(type_name(a) for a in args)
        return f"{getattr(origin, '__name__', str(origin))}[{inner_names}]"
    if isinstance(tp, type):
        return tp.__name__
    return str(tp)


def _expected(tp: Any) -> str:
    """What a value of type ``tp`` must be, phrased to follow 'is not'."""
    inner, optional = _strip_optional(tp)
    if optional:
        return f"{_expected(inner)} or null"
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Literal:
        return "one of " + ", ".join(str(a) for a in args)
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return "one of " + ", ".join(m.name for m in tp)
    if origin in (list, tuple):
        return "a list such as [a,b]"
    if origin is dict:
        return "a mapping such as {a: 1}"
    words = {bool: "a boolean (true/false)", int: "an integer", float: "a float", str: "a string"}
    if tp in words:
        return words[tp]
    if tp is pathlib.Path:
        return "a path"
    return f"a {type_name(tp)}"


def suggest(key: str, names: list[str]) -> str:
    """`` (did you mean 'x'?)`` for the closest of ``names`` to ``key``, or ``""``."""
    leaf = key.rsplit(".", 1)[-1]
    same_leaf = [n for n in names if n.rsplit(".", 1)[-1] == leaf and n != key]
    close = same_leaf or difflib.get_close_matches(key, names, n=1, cutoff=0.6)
    if not close:  # a typo in the leaf of a long dotted key scores low on the whole string
        by_leaf = {n.rsplit(".", 1)[-1]: n for n in names if n.startswith(key.rpartition(".")[0])}
        leaves = difflib.get_close_matches(leaf, list(by_leaf), n=1, cutoff=0.6)
        close = [by_leaf[leaves[0]]] if leaves else []
    return f" (did you mean {close[0]!r}?)" if close else ""


def _show(raw: Any) -> str:
    if raw is None:
        return "null"
    return repr(raw) if isinstance(raw, str) else repr(raw).replace("\n", " ")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def describe(exc: Exception, schema: type, prog: str, key: str, raw: Any = NOTHING) -> str:
    """One line for an OmegaConf error raised while applying ``key`` (raw value ``raw``).

    Args:
        exc: The exception OmegaConf raised.
        schema: The dataclass schema being filled.
        prog: CLI name, e.g. ``heads-train``.
        key: The dotted key the user (or recipe) set.
        raw: The value as written, or ``NOTHING`` when unknown.
    """
    full_key = getattr(exc, "full_key", None) or key
    names = [f.name for f in flat_fields(schema)]
    if isinstance(exc, ConfigKeyError):
        moved = getattr(schema, "MOVED", {}).get(full_key)  # a schema's renamed keys: old spelling -> new
        if moved:
            value = "..." if raw is NOTHING else raw if isinstance(raw, str) else json.dumps(raw, default=str)
            return f"{full_key} is now {moved}; write {moved}={value}"
        return f"unknown key {full_key!r} for {prog}{suggest(full_key, names)}"
    if isinstance(exc, MissingMandatoryValue):
        return missing_message(schema, full_key)
    if isinstance(exc, InterpolationResolutionError):
        shown = "" if raw is NOTHING else f" = {_show(raw)}"
        why = re.sub(r"^\w+ raised while resolving interpolation: ", "", _first_line(exc))
        fix = (
            "set the variable or give a default: ${oc.env:NAME,default}"
            if "oc.env" in str(raw)
            else "fix the interpolation"
        )
        return f"cannot resolve {full_key}{shown}: {why.strip(chr(34))}; {fix}"
    tp = field_type(schema, full_key)
    if key.startswith(full_key + ".") and tp is not NOTHING and _nested_dataclass(tp) is None:
        return f"unknown key {key!r} for {prog}: {full_key!r} holds {_expected(tp)}, not a group of settings"
    group = None if tp is NOTHING else _nested_dataclass(tp)
    if group is not None and full_key == key and not isinstance(raw, dict):
        first = dataclasses.fields(group)[0].name
        return (
            f"bad value for {key!r}: it is a group of settings ({group.__name__}), "
            f"not a single value; set its fields, e.g. {key}.{first}=..."
        )
    if tp is NOTHING or full_key != key or raw is NOTHING:
        shown = "" if raw is NOTHING or full_key != key else f" {_show(raw)}"
        return f"bad value for {full_key!r}:{shown} {_first_line(exc)}"
    if "None" in str(exc) and raw in (None, "null", "~", "Null", "NULL", ""):
        empty = "an empty value means null, which" if raw == "" else "null"
        hint = f"; write {key}='' for an empty string" if raw == "" and tp is str else ""
        return f"bad value for {key!r}: {empty} is not allowed, it must be {_expected(tp)}{hint}"
    return f"bad value for {key!r}: {_show(raw)} is not {_expected(tp)}"


def missing_message(schema: type, key: str) -> str:
    """The line for a mandatory value (``???``) nobody set."""
    tp = field_type(schema, key)
    kind = "" if tp is NOTHING else f" ({type_name(tp)})"
    return f"missing value for {key!r}{kind}; pass {key}=... or set it in the recipe"


def plain(value: Any) -> Any:
    """A dataclass (or container) as plain YAML-safe types: paths as str, enums by name."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, pathlib.PurePath):
        return str(value)
    if isinstance(value, enum.Enum):
        return value.name  # OmegaConf reads members back by name
    return value


def flatten(layer: dict[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    """Leaf ``(dotted_key, value)`` pairs of a nested mapping, so each is checked alone."""
    items: list[tuple[str, Any]] = []
    for key, value in layer.items():
        if isinstance(value, dict) and value:
            items.extend(flatten(value, f"{prefix}{key}."))
        else:
            items.append((f"{prefix}{key}", value))
    return items


def nest(dotted: str, value: Any) -> dict[str, Any]:
    """``("a.b", v)`` -> ``{"a": {"b": v}}`` (OmegaConf takes ``{"a.b": v}`` as one key)."""
    for part in reversed(dotted.split(".")):
        value = {part: value}
    return value
