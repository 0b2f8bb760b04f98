"""Docstrings and pages name what exists: every dotted module name they cite resolves (a renamed or moved
module leaves no stale reference behind)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from conftest import package_modules

import specheads

ROOT = Path(__file__).resolve().parents[1]
FILES = (".json", ".jsonl", ".safetensors", ".yaml", ".py", ".md", ".txt", ".csv", ".png")  # file names, not modules
ABSOLUTE = re.compile(r"(?<![\w./-])specheads(?:\.[A-Za-z_]\w*)+")
RELATIVE = re.compile(r"(?<![\w.~/-])~?\.(?!\.)([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+)")


def _mentions(module_path: Path, name: str) -> bool:
    return re.search(rf"\b{re.escape(name)}\b", module_path.read_text(encoding="utf-8")) is not None


def _absolute(dotted: str, modules: dict) -> bool:
    parts = dotted.split(".")
    if len(parts) == 2 and parts[1] in specheads.__all__ + ["__version__"]:
        return True  # the public API (specheads.generate ...)
    for i in range(len(parts), 1, -1):
        name = ".".join(parts[:i])
        if name in modules:
            return i == len(parts) or _mentions(modules[name], parts[i])
    return False


def _relative(dotted: str, modules: dict) -> bool:
    """``.a.b.C`` (Sphinx's relative form): some module named ``*.a.b`` (or ``*.a``) that holds the rest."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        suffix = ".".join(parts[:i])
        hits = [m for m in modules if m.endswith("." + suffix)]
        if hits:
            return i == len(parts) or any(_mentions(modules[h], parts[i]) for h in hits)
    return False


def _texts():
    for name, path in package_modules().items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        docs = (
            ast.get_docstring(n) for n in ast.walk(tree) if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef))
        )
        yield name, "\n".join(d for d in docs if d)
    for path in [ROOT / "README.md", ROOT / "ARCHITECTURE.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        yield str(path.relative_to(ROOT)), path.read_text(encoding="utf-8")


def test_every_dotted_module_name_in_a_docstring_or_page_resolves():
    """``specheads.x.y`` and ``~.y.Z`` in docstrings, README, ARCHITECTURE and docs/ name a module (and a name in
    it) that exists."""
    modules = package_modules()
    stale = set()
    for where, text in _texts():
        for m in ABSOLUTE.finditer(text):
            dotted = m.group(0)
            if (
                not dotted.endswith(FILES)
                and not dotted.startswith("specheads.recipes")
                and not _absolute(dotted, modules)
            ):
                stale.add((where, dotted))
        for m in RELATIVE.finditer(text):
            dotted = m.group(1)
            if not m.group(0).endswith(FILES) and not _relative(dotted, modules):
                stale.add((where, "~." + dotted))
    assert sorted(stale) == []
