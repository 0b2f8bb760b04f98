"""Configuration: YAML recipe + dataclass schema + ``key=value`` overrides.

Precedence is schema defaults < recipe common keys < recipe section < command line; OmegaConf
does the merge and the type checks. Library code receives the plain dataclass, never a
DictConfig. Every problem found is collected and raised as one :class:`UserError`.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import importlib.resources
import logging
import os
import re
import sys
from pathlib import Path
from typing import Any, Callable, TypeVar

import yaml
from omegaconf import OmegaConf

from specheads import _schema
from specheads.config_merge import _apply, _check_resolved
from specheads.errors import UserError  # re-exported: one class for every layer

__all__ = [
    "UserError",
    "SECTIONS",
    "PROGS",
    "cli_main",
    "help_text",
    "list_recipes",
    "load_config",
    "recipe_description",
    "schema_for",
    "to_yaml",
]

T = TypeVar("T")

#: Section name -> "module:ClassName" of the schema of the CLI that reads it.
SECTIONS: dict[str, str] = {
    "decode": "specheads.decode.decode_config:DecodeConfig",
    "datagen": "specheads.datagen.config:DatagenConfig",
    "train": "specheads.train.config:TrainConfig",
    "export": "specheads.export.export_config:ExportConfig",
    "eval": "specheads.evaluate.config:EvalConfig",
    "pipeline": "specheads.pipeline:PipelineConfig",
    "vocab": "specheads.datagen.vocab_ranking:VocabConfig",
}
#: Every section a recipe may hold, with the CLI that reads it.
PROGS: dict[str, str] = {
    "decode": "heads-decode",
    "datagen": "heads-datagen",
    "train": "heads-train",
    "eval": "heads-eval",
    "export": "heads-export",
    "pipeline": "heads-pipeline",
    "vocab": "heads-vocab",
}
DEFAULT_RECIPE = "quickstart"
RECIPE_ENV = "SPECHEADS_RECIPE"  # another recipe to use without recipe= (the test suite pins the draft-based one)


def default_recipe() -> str:
    """The recipe a command reads without ``recipe=``: ``$SPECHEADS_RECIPE`` when set, else ``quickstart``."""
    return os.environ.get(RECIPE_ENV) or DEFAULT_RECIPE


def schema_for(section: str) -> type:
    """Import and return the schema dataclass registered for ``section`` in :data:`SECTIONS`."""
    module, _, name = SECTIONS[section].partition(":")
    return getattr(importlib.import_module(module), name)


def _prog(section: str) -> str:
    return PROGS.get(section, f"heads-{section}")


def _read_yaml(path: Path) -> dict[str, Any]:
    """A recipe as plain data, interpolations unresolved (OmegaConf's YAML reading: 1e-3 is a
    float, duplicate keys are errors)."""
    try:
        data = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
    except Exception as exc:  # noqa: BLE001 - OSError, YAML and OmegaConf errors alike
        detail = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UserError(f"cannot read recipe {str(path)!r}: {detail}; fix the file") from exc
    if not isinstance(data, dict):
        raise UserError(
            f"recipe {str(path)!r} holds a {type(data).__name__}, not a mapping; write top-level keys such as 'decode:'"
        )
    return data


def _recipes_root() -> Path:
    return Path(str(importlib.resources.files("specheads.recipes")))


def list_recipes(section: str | None = None) -> dict[str, Path]:
    """Built-in recipes, name -> path, sorted by name.

    Args:
        section: When given, only recipes holding this section (e.g. ``"decode"``).
    """
    found = {p.stem: p for p in sorted(_recipes_root().glob("*.yaml"))}
    if section is None:
        return found
    return {name: p for name, p in found.items() if section in _read_yaml(p)}


def recipe_description(path: str | Path) -> str:
    """The recipe's top-level ``description:`` string, or ``""``."""
    description = _read_yaml(Path(path)).get("description", "")
    return " ".join(str(description).split())


def _resolve_recipe(spec: str, section: str) -> tuple[str, dict[str, Any]]:
    """Find recipe ``spec`` (a name or a path) and return its label and its contents."""
    prog = _prog(section)
    usable = list_recipes(section)
    choices = ", ".join(usable) or "(none)"
    if "/" in spec or spec.endswith((".yaml", ".yml")):
        path = Path(spec).expanduser()
        if not path.is_file():
            raise UserError(f"recipe file {spec!r} not found; give an existing .yaml path or a recipe name ({choices})")
        label = spec
    else:
        path = list_recipes().get(spec)  # type: ignore[assignment]
        if path is None:
            close = difflib.get_close_matches(spec, list(usable), n=1, cutoff=0.5)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise UserError(f"unknown recipe {spec!r}{hint}; recipes for {prog}: {choices}")
        label = spec
    data = _read_yaml(path)
    if section not in data:
        raise UserError(f"recipe {label!r} has no {section!r} section; recipes for {prog}: {choices}")
    if data[section] is None:  # "train:" with nothing under it: the schema defaults
        data[section] = {}
    if not isinstance(data[section], dict):
        raise UserError(f"recipe {label!r}: section {section!r} must be a mapping of key: value")
    return label, data


def _split_argv(argv: list[str], problems: list[str]) -> tuple[str, list[tuple[str, str]]]:
    recipe, overrides = default_recipe(), []
    for item in argv:
        key, eq, value = item.partition("=")
        key = key.strip()
        if not eq or not key:
            problems.append(f"expected key=value, got {item!r}")
        elif key.startswith("-"):
            problems.append(
                f"options are written key=value without dashes: got {item!r}, write {key.lstrip('-')}={value}"
            )
        elif key == "recipe":
            recipe = value
        else:
            overrides.append((key, value))
    return recipe, overrides


def load_config(schema: type[T], section: str, argv: list[str]) -> T:
    """Build the config of one CLI from its recipe and ``key=value`` overrides.

    Args:
        schema: Dataclass type of the CLI's config.
        section: Recipe section the CLI reads (``decode``, ``train`` ...).
        argv: ``key=value`` items; ``recipe=NAME`` or ``recipe=path/to.yaml`` picks the recipe
            (default ``quickstart``), dotted keys reach nested fields.

    Returns:
        A ``schema`` instance with every interpolation resolved.

    Raises:
        UserError: Listing every problem found, joined with "; ".
    """
    prog = _prog(section)
    problems: list[str] = []
    recipe, overrides = _split_argv(list(argv), problems)
    try:
        label, data = _resolve_recipe(recipe, section)
    except UserError as exc:
        raise UserError("; ".join([*problems, str(exc)])) from None
    names = {f.name for f in dataclasses.fields(schema)}  # type: ignore[arg-type]
    common = {k: v for k, v in data.items() if k in names and k not in PROGS}
    cfg = OmegaConf.structured(schema)
    where = f"recipe {label!r}: "
    for layer in (common, data[section]):
        items = [(k, v, _schema.nest(k, v)) for k, v in _schema.flatten(layer)]
        cfg = _apply(cfg, items, schema, prog, where, problems)
    cli_items = []
    for key, value in overrides:
        try:
            cli_items.append((key, value, OmegaConf.from_dotlist([f"{key}={value}"])))
        except Exception as exc:  # noqa: BLE001 - YAML parser errors on e.g. 'a=[1'
            problems.append(
                f"bad value for {key!r}: cannot parse {value!r} "
                f"({_schema._first_line(exc)}); quote it or fix the brackets"
            )
    cfg = _apply(cfg, cli_items, schema, prog, "", problems)
    missing: list[str] = []
    _check_resolved(cfg, "", schema, prog, problems, missing)
    problems += [_schema.missing_message(schema, k) for k in missing]
    if problems:
        raise UserError("; ".join(problems))
    try:
        return OmegaConf.to_object(cfg)  # type: ignore[return-value]
    except Exception as exc:  # noqa: BLE001 - anything the passes above did not foresee
        raise UserError(_schema.describe(exc, schema, prog, getattr(exc, "full_key", "") or "?"))


def help_text(schema: type, section: str, prog: str) -> str:
    """Usage, the recipes holding ``section`` and every field with its type and default."""
    lines = [f"usage: {prog} [recipe=NAME] [key=value ...]", ""]
    if schema.__doc__ and not schema.__doc__.startswith(f"{schema.__name__}("):
        lines += [schema.__doc__.strip().splitlines()[0], ""]
    recipes = list_recipes(section)
    lines.append(f"recipes (recipe=NAME or recipe=path/to/file.yaml; default {default_recipe()}):")
    width = max([len(n) for n in recipes] + [4])
    for name, path in recipes.items():
        lines.append(f"  {name:<{width}}  {recipe_description(path)}".rstrip())
    if not recipes:
        lines.append("  (none)")
    lines += ["", "fields (key: type = default):"]
    for info in _schema.flat_fields(schema):
        default = "null" if info.default is None else info.default
        lines.append(f"  {info.name}: {_schema.type_name(info.type)} = {default}")
        if info.help:
            lines.append(f"      {info.help}")
    return "\n".join(lines)


def to_yaml(cfg: Any) -> str:
    """YAML of a resolved config dataclass, to write next to outputs (plain types only)."""
    return yaml.safe_dump(_schema.plain(cfg), sort_keys=False, allow_unicode=True)


def _one_line(message: str) -> str:
    return re.sub(r"\s*\n\s*", " ", message.strip())


def _setup_logging() -> None:
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")


def _wants_help(argv: list[str]) -> bool:
    return any(a in ("-h", "--help") for a in argv)


def cli_main(prog: str, schema: type[T], section: str, argv: list[str] | None, run: Callable[[T], int | None]) -> int:
    """Run a CLI: ``--help``, logging, config loading, then ``run(cfg)``.

    Args:
        prog: CLI name for messages, e.g. ``heads-decode``.
        schema: The CLI's config dataclass.
        section: The recipe section it reads.
        argv: Arguments without the program name; ``None`` takes ``sys.argv[1:]``.
        run: Does the work with the loaded config; returns the exit code.

    Returns:
        The exit code: ``run``'s, 0 after ``--help``, 2 on a :class:`UserError`, 130 on Ctrl-C.
    """
    args = sys.argv[1:] if argv is None else list(argv)
    if _wants_help(args):
        print(help_text(schema, section, prog))
        return 0
    return guarded(prog, lambda: run(load_config(schema, section, args)))


def guarded(prog: str, work: Callable[[], int | None], interrupted: str = "interrupted") -> int:
    """Runs ``work()`` as a command does: logging set up, its exit code (None: 0), 2 with one line for a
    :class:`UserError`, 130 with ``interrupted`` on Ctrl-C."""
    try:
        _setup_logging()
        code = work()
        return 0 if code is None else int(code)
    except UserError as exc:
        print(f"{prog}: error: {_one_line(str(exc))}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{prog}: {interrupted}", file=sys.stderr)
        return 130
