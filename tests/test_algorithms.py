"""The algorithm cards (specheads/algorithms.py) against the registries they name: every card complete, every key
it declares registered, every registry entry on exactly one card (or on the list of entries that are no algorithm),
and ARCHITECTURE.md's algorithm table generated from the cards."""

from __future__ import annotations

import itertools
import re
import subprocess
import sys
from pathlib import Path

import pytest

from specheads import algorithms
from specheads.algorithms import ALGORITHMS, KEYS, NOT_ALGORITHMS, STAGES, Algorithm, render_table, table_in
from specheads.datagen.registry import LABELLERS
from specheads.evaluate.rows import PREFIX, default_name
from specheads.evaluate.training_free import FAMILIES, TRAINING_FREE, _kind
from specheads.heads.registry import HEADS
from specheads.shim import POLICIES
from specheads.train.registry import ALIASES, TASKS

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = {"labels": "datagen", "head": "heads", "training": "train", "policy": "shim", "evaluation": "evaluate"}


def registries() -> dict[str, set[str]]:
    """Every key field's registry: the names it holds today."""
    return {
        "labels": set(LABELLERS),
        "heads": set(HEADS),
        "tasks": set(TASKS),
        # the package's own policies: a test's register_policy adds others to the same dict
        "policies": {n for n, cls in POLICIES.items() if cls.__module__.startswith("specheads.")},
        "rows": set(FAMILIES) | set(TRAINING_FREE),  # the kinds heads-eval's reports tell rows apart by
        "recipes": {p.stem for p in (ROOT / "recipes").glob("*.yaml")},
        "docs": {str(p.relative_to(ROOT)) for p in (ROOT / "docs/algorithms").glob("*.md")},
    }


def owners(cards: tuple[Algorithm, ...]) -> dict[tuple[str, str], list[str]]:
    """``(key field, entry) -> the cards (and "not an algorithm") that declare it``."""
    out: dict[tuple[str, str], list[str]] = {}
    for card in cards:
        for key in KEYS:
            for entry in getattr(card, key):
                out.setdefault((key, entry), []).append(card.name)
    for key, entries in NOT_ALGORITHMS.items():
        for entry in entries:
            out.setdefault((key, entry), []).append("not an algorithm")
    return out


def unowned(cards: tuple[Algorithm, ...], regs: dict[str, set[str]]) -> list[str]:
    """Registry entries on no card or on more than one; keys a card declares that no registry holds."""
    own = owners(cards)
    bad = [f"{k}={e!r} is on {who}" for (k, e), who in sorted(own.items()) if len(who) > 1]
    bad += [f"{k}={e!r} is registered but on no card" for k in KEYS for e in sorted(regs[k]) if (k, e) not in own]
    bad += [f"{k}={e!r} ({who}) is not registered" for (k, e), who in sorted(own.items()) if e not in regs[k]]
    return bad


def test_every_card_is_complete():
    """Every key field has keys or says why not; name, title and paper are given; each stage has its modules."""
    assert [p for card in ALGORITHMS for p in card.problems()] == []


def test_names_are_unique_and_uses_name_cards():
    names = algorithms.by_name()
    assert len(names) == len(ALGORITHMS)
    assert [(c.name, u) for c in ALGORITHMS for u in c.uses if u not in names or u == c.name] == []
    assert all(re.fullmatch(r"[a-z][a-z_]*", n) for n in names)


def test_every_registry_entry_is_on_exactly_one_card():
    """Each label family, head type, training task, policy, row kind, recipe and docs page belongs to one card (or
    to NOT_ALGORITHMS: the references and a run of several), and each key a card declares is registered."""
    assert unowned(ALGORITHMS, registries()) == []


def test_a_card_missing_a_key_or_a_registry_gaining_one_fails():
    """The checks above catch a key dropped from a card, a reason missing, and an entry registered without a card."""
    regs = registries()
    card = ALGORITHMS[0]
    dropped = Algorithm(**{**card.__dict__, "heads": ()})
    assert any("heads is empty" in p for p in dropped.problems())
    assert any("registered but on no card" in p for p in unowned((dropped, *ALGORITHMS[1:]), regs))
    grown = {**regs, "policies": regs["policies"] | {"margin_stop"}}
    assert unowned(ALGORITHMS, grown) == ["policies='margin_stop' is registered but on no card"]
    assert any("why_none" in p for p in Algorithm(**{**card.__dict__, "why_none": {"heads": "x"}}).problems())


def test_each_policy_is_named_by_its_cards_row_kind():
    """The row kind ``heads-eval`` names a card's policy by (``h`` for ``h0.5``, ``tree`` for ``tree-4x3x8``) is the
    card's: a policy and its rows are on one card."""
    kind_of = {}
    for name in registries()["policies"]:
        row = default_name(name, {}, "x" if name in PREFIX else None)  # swept when it has a prefix
        kind_of[name] = row if row in FAMILIES else _kind(row)
    cards = [(c.policies, c.rows) for c in ALGORITHMS] + [
        (tuple(NOT_ALGORITHMS["policies"]), tuple(NOT_ALGORITHMS["rows"]))
    ]
    assert [(p, kind_of[p], rows) for policies, rows in cards for p in policies if kind_of[p] not in rows] == []


def test_tasks_export_their_cards_heads_and_aliases_name_cards():
    """A card's training task writes a head of that card (or of a card it uses); ``heads-train head=specdecpp`` and
    the other aliases are card names that resolve to one of their card's tasks."""
    names = algorithms.by_name()
    wrong = []
    for card in ALGORITHMS:
        heads = set(card.heads).union(*(names[u].heads for u in card.uses))
        wrong += [(card.name, t) for t in card.tasks if TASKS[t].head_type in HEADS and TASKS[t].head_type not in heads]
    assert wrong == []
    assert {a: t for a, t in ALIASES.items() if a not in names or t not in names[a].tasks} == {}


def _files(cell: str) -> list[str]:
    return re.findall(r"`([\w/.-]+\.(?:py|safetensors))`", cell)


def test_every_file_in_the_table_exists():
    """A file the cards' modules name exists, in its stage's folder or from the repository root."""
    missing = []
    for card in ALGORITHMS:
        for stage in (*STAGES, "recipes"):
            for f in _files(card.modules.get(stage, "")):
                folders = [ROOT / FOLDERS.get(stage, ""), ROOT]
                if not any((d / f).is_file() for d in folders):
                    missing.append((card.name, stage, f))
    assert missing == []


def test_architecture_table_is_generated_from_the_cards():
    """ARCHITECTURE.md's "Algorithm × stage" table is the cards' (``python -m specheads.algorithms --write``)."""
    text = (ROOT / "ARCHITECTURE.md").read_text(encoding="utf-8")
    assert table_in(text) == render_table(), "run: python -m specheads.algorithms --write"


@pytest.mark.parametrize("args, rc", [(["--check"], 0), ([], 0)])
def test_the_command_checks_and_prints(args, rc):
    proc = subprocess.run(
        [sys.executable, "-m", "specheads.algorithms", *args], capture_output=True, text=True, cwd=ROOT
    )
    assert proc.returncode == rc, proc.stderr
    assert (proc.stdout == render_table()) if not args else proc.stdout == ""


def test_a_stale_table_is_rewritten():
    text = (ROOT / "ARCHITECTURE.md").read_text(encoding="utf-8")
    stale = algorithms.with_table(text, "| old |\n")
    assert table_in(stale) != render_table()
    assert algorithms.with_table(stale, render_table()) == text


def test_the_perfect_head_bound_is_the_policys_rule(monkeypatch):
    """The oracle's perfect head drafts what SpecDec++'s own stop rule says (its closed form over a grid), and a
    change to the rule moves the bound with it: the rule is written once."""
    from specheads.evaluate import oracle
    from specheads.shim import SpecDecPP

    for agreed, room, k_min, lag in itertools.product(range(6), range(6), range(1, 4), (0, 1)):
        if agreed <= room:
            closed = min(room, max(k_min, agreed + 1 + lag)) if agreed < room else room
            assert oracle.perfect_head_drawn(agreed, room, k_min, 5, lag) == closed
    agree = [True, False, True, True, False]
    before = oracle.perfect_head_schedule(agree, 1, 20, 1)
    monkeypatch.setattr(SpecDecPP, "threshold_stop", staticmethod(lambda n, keep, h, k_min, k_max: n >= k_max))
    after = oracle.perfect_head_schedule(agree, 1, 20, 1)
    # never stopping early, the first round drafts all of its room (4 candidates, not 3), the second its 2
    assert (before.draft_forwards, after.draft_forwards) == (5, 6)
