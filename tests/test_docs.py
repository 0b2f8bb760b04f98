"""The docs site says what the code has: its lists of policies, recipes, extras and commands match the code, every
page is in the site's navigation, and the benchmarks page is what ``bench/docs_page.py`` makes of the results."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib
import yaml

from specheads.shim.policies import POLICIES

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def _ticked(path: Path) -> set[str]:
    """Every name written in backticks on a page."""
    return set(re.findall(r"`([^`\s]+)`", path.read_text()))


def _nav_pages(node) -> list[str]:
    if isinstance(node, str):
        return [node]
    if isinstance(node, list):
        return [p for item in node for p in _nav_pages(item)]
    if isinstance(node, dict):
        return [p for v in node.values() for p in _nav_pages(v)]
    return []


def test_every_policy_is_on_the_decode_page():
    named = _ticked(DOCS / "commands/heads-decode.md") | {
        m for t in _ticked(DOCS / "commands/heads-decode.md") for m in re.findall(r"policy=(\w+)", t)
    }
    assert sorted(set(POLICIES) - named) == []


def test_every_recipe_is_on_the_configuration_page():
    recipes = {p.stem for p in (ROOT / "recipes").glob("*.yaml")}
    text = (DOCS / "configuration.md").read_text()
    assert sorted(r for r in recipes if f"`{r}`" not in text) == []


def test_every_extra_is_on_the_getting_started_page():
    extras = set(PYPROJECT["project"]["optional-dependencies"])
    text = (DOCS / "getting-started.md").read_text()
    assert sorted(e for e in extras if f'".[{e}]"' not in text) == []


def test_every_command_has_its_page_in_the_navigation():
    nav = _nav_pages(yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"])
    for command in PYPROJECT["project"]["scripts"]:
        assert f"commands/{command}.md" in nav, command
    pages = {str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md")}
    assert sorted(pages - set(nav)) == [] and sorted(set(nav) - pages) == []


def test_no_page_or_module_cites_a_file_outside_the_repository():
    files = [
        *DOCS.rglob("*.md"),
        ROOT / "README.md",
        *ROOT.glob("*/*.py"),
        *ROOT.glob("*/*/*.py"),
        *ROOT.glob("*/*/*/*.py"),
    ]
    citing = [str(f.relative_to(ROOT)) for f in files if "ALGORITHMS.md" in f.read_text() and f.name != "test_docs.py"]
    assert citing == []


def test_the_benchmarks_page_is_generated_from_the_results():
    proc = subprocess.run([sys.executable, str(ROOT / "bench/docs_page.py"), "--check"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("page", sorted(str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md")))
def test_relative_links_resolve(page):
    path = DOCS / page
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", path.read_text()):
        if "://" in target or target.startswith("mailto:"):
            continue
        assert (path.parent / target).resolve().is_file(), f"{page}: {target}"
