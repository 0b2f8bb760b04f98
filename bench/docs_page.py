"""Writes the docs site's benchmarks page from ``bench/results/*.json``, then ``bench/studies/results/*.json`` under
"Studies": never typed by hand.

    python bench/docs_page.py            # -> docs/benchmarks.md
    python bench/docs_page.py --check    # exit 1 when docs/benchmarks.md is not what the results give

Per result file, in name order (the benchmarks, then the studies; ``bench/README.md`` says which script is
which): the command that wrote it and the machine it ran on, every headline figure (its ``ratios`` block and the
top-level numbers and flags), and its ``table`` when it has one (a list of rows).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench/results"
STUDIES = ROOT / "bench/studies/results"
PAGE = ROOT / "docs/benchmarks.md"
MAX_ROWS = 40
MAX_COLUMNS = 12


def _cell(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, (dict, list)):
        text = json.dumps(v)
        return text if len(text) <= 60 else text[:57] + "..."
    return str(v).replace("|", "\\|").replace("\n", " ")


def _table(rows: list[dict]) -> list[str]:
    cols = []
    for r in rows:
        cols += [c for c in r if c not in cols and not isinstance(r[c], (dict, list))]
    cols = cols[:MAX_COLUMNS]
    out = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    out += ["| " + " | ".join(_cell(r.get(c, "")) for c in cols) + " |" for r in rows[:MAX_ROWS]]
    if len(rows) > MAX_ROWS:
        out.append(f"\n({len(rows) - MAX_ROWS} more rows in the file)")
    return out


def section(path: Path, level: str = "##") -> list[str]:
    data = json.loads(path.read_text())
    out = [f"{level} {path.stem}", "", f"Source: `{path.relative_to(ROOT).as_posix()}`", ""]
    if not isinstance(data, dict):
        return out + ["(not a JSON object)", ""]
    if data.get("command"):
        out += [f"Command: `{data['command']}`", ""]
    if data.get("machine"):
        out += [f"Machine: {_cell(data['machine'])}", ""]
    figures = dict(data.get("ratios") or {})
    figures.update({k: v for k, v in data.items() if isinstance(v, (int, float, bool)) and k not in figures})
    if figures:
        out += ["| figure | value |", "|---|---|"]
        out += [f"| `{k}` | {_cell(v)} |" for k, v in figures.items()]
        out.append("")
    table = data.get("table")
    if isinstance(table, list) and table and all(isinstance(r, dict) for r in table):
        out += _table(table) + [""]
    return out + _quality(data)


def _value(x: dict | None) -> str:
    """``{"value", "low", "high"}`` as ``v [low, high]``."""
    if not x or x.get("value") is None:
        return "-"
    return f"{_cell(x['value'])} [{_cell(x['low'])}, {_cell(x['high'])}]"


def _quality(data: dict) -> list[str]:
    """The quality blocks of a lossy-policy result file: competence, fidelity and the gated choices."""
    out = []
    if isinstance(data.get("competence"), dict):
        out += ["Competence (the target alone against chance, per graded source):", ""]
        rows = [
            {
                "source": src,
                "target_accuracy": f"{_cell(c['target_accuracy'])} [{_cell(c['target_accuracy_low'])}, "
                f"{_cell(c['target_accuracy_high'])}]",
                "prompts": c["prompts"],
                "chance": c["chance"],
                "informative": c["informative"],
            }
            for src, c in data["competence"].items()
        ]
        out += _table(rows) + [""]
    if isinstance(data.get("fidelity"), dict) and data["fidelity"]:
        out += ["Fidelity to the target's outputs (paired by prompt, 95% intervals):", ""]
        rows = [
            {
                "row": row,
                **{f"agreement {src}": _value(v) for src, v in f["agreement"].items()},
                "exact_match": _value(f["exact_match"]),
                "rouge_l": _value(f["rouge_l"]),
                "logprob_gap": _value(f.get("logprob_gap")),
            }
            for row, f in data["fidelity"].items()
        ]
        out += _table(rows) + [""]
    if isinstance(data.get("gated"), dict) and data["gated"]:
        gate = (data.get("eval") or {}).get("select") or f"max_drop:{(data.get('eval') or {}).get('max_drop')}"
        out += [f"Gated (`select={gate}`: chosen on one half of the prompts, reported on the other):", ""]
        rows = [
            {
                "policy": name,
                "row": e.get("row") or "none",
                "disagree_upper": e.get("disagree_upper"),
                "acc_drop_upper": e.get("acc_drop_upper"),
                "accepted_per_call_vs_sd": e.get("accepted_per_call_vs_sd"),
                "tokens_per_s_vs_sd": e.get("tokens_per_s_vs_sd"),
                "reason": e.get("reason") or "",
            }
            for name, e in data["gated"].items()
        ]
        out += _table(rows) + [""]
    drafters = data.get("drafters")
    if isinstance(drafters, dict) and all(
        isinstance(b, dict) and isinstance(b.get("gated"), dict) for b in drafters.values()
    ):
        out += ["Gated per drafter (the test half; tokens/s against the fastest lossless row, SD at any K):", ""]
        rows = [
            {
                "drafter": drafter,
                "policy": name,
                "row": e.get("row") or "none",
                "accepted_per_call_vs_sd": e.get("accepted_per_call_vs_sd"),
                "tokens_per_s_vs_best_lossless": e.get("tokens_per_s_vs_best_lossless"),
                "reason": e.get("reason") or "",
            }
            for drafter, b in drafters.items()
            for name, e in b["gated"].items()
        ]
        out += _table(rows) + [""]
    return out


def render() -> str:
    lines = [
        "# Benchmarks",
        "",
        "Generated by `python bench/docs_page.py` from the committed result files in `bench/results/` (the",
        "benchmarks) and `bench/studies/results/` (the studies, last); each section names the command that measured",
        "it. Every figure was measured on the machine named with it.",
        "",
    ]
    for path in sorted(RESULTS.glob("*.json")):
        lines += section(path)
    lines += [
        "## Studies",
        "",
        "One-off investigations, each behind a decision (`bench/studies/`; the decision each informed is in",
        "`bench/README.md`).",
        "",
    ]
    for path in sorted(STUDIES.glob("*.json")):
        lines += section(path, "###")
    return "\n".join(lines).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="compare with the committed page instead of writing it")
    args = ap.parse_args(argv)
    text = render()
    if args.check:
        current = PAGE.read_text() if PAGE.is_file() else ""
        if current != text:
            print(f"{PAGE.relative_to(ROOT)} is out of date: run python bench/docs_page.py", file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(text)
    print(f"wrote {PAGE.relative_to(ROOT)} ({len(text.splitlines())} lines)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
