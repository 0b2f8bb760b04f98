"""heads-eval's checks of a config before anything loads: every problem in one error, the rows an EAGLE head
cannot draft, the largest target pass."""

from __future__ import annotations

import re
from pathlib import Path

from specheads.decode.api import run_problems
from specheads.errors import UserError
from specheads.evaluate.config import EvalConfig
from specheads.evaluate.rows import expand, parse_tree
from specheads.evaluate.rows import problems as rows_problems
from specheads.evaluate.select import parse as parse_select
from specheads.prompt_spec import budget_problems
from specheads.shim import (
    FSD,
    POLICIES,
    PROFILES,
    TLI,
    ConfidenceStop,
    Judge,
    SpecDecPP,
    Sprinter,
    StandardSD,
    TopKVerify,
)


def _check(cfg: EvalConfig) -> None:
    problems = []
    if not cfg.prompts:
        problems.append("prompts is not set; pass prompts=<held-out prompt file>")
    fsd = cfg.fsd.swept()
    if not (
        cfg.ks
        or cfg.head
        or cfg.sprinter.head
        or cfg.judge.head
        or cfg.judge.heads
        or cfg.topk.ks
        or fsd
        or cfg.confidence.taus
        or cfg.hetero.methods
        or cfg.trees
        or cfg.rows
    ):
        problems.append(
            "nothing to sweep: set ks=[...], head=, sprinter.head=, judge.head=, judge.heads=, topk.ks=[...], "
            "fsd.js=[...] (or fsd.tv, fsd.kl, fsd.kl_rev), confidence.taus=[...], hetero.methods=[tli,slem,slrs] "
            "and/or rows=[...]"
        )
    problems += rows_problems(cfg.rows)
    hetero = [name for name, policy in POLICIES.items() if policy.bridge]
    if any(m not in hetero for m in cfg.hetero.methods) or len(set(cfg.hetero.methods)) != len(cfg.hetero.methods):
        problems.append(f"hetero.methods={list(cfg.hetero.methods)}: each of {hetero} at most once")
    # Each policy checks the settings its rows share and the values they sweep, by heads-decode's rules.
    problems += TLI.Settings(k=cfg.hetero.k).problems({"k": "hetero.k"})
    problems += StandardSD.Settings.sweep("k", "ks", cfg.ks)
    problems += SpecDecPP.Settings.sweep("h", "thresholds", cfg.thresholds)
    problems += SpecDecPP.Settings(k_min=cfg.k_min, k_max=cfg.k_max).problems()
    problems += Sprinter.Settings.sweep("eta", "sprinter.etas", cfg.sprinter.etas)
    problems += Sprinter.Settings(max_run=cfg.sprinter.max_run).problems({"max_run": "sprinter.max_run"})
    problems += Judge.Settings.sweep("delta", "judge.deltas", cfg.judge.deltas)
    problems += Judge.Settings(k=cfg.judge.k).problems({"k": "judge.k"})
    problems += TopKVerify.Settings.sweep("verify_top_k", "topk.ks", cfg.topk.ks)
    problems += TopKVerify.Settings(k=cfg.topk.k).problems({"k": "topk.k"})
    for d, ts in fsd.items():
        problems += FSD.Settings.sweep("T", f"fsd.{d}", ts)
    if fsd:  # the settings every FSD row shares (T = 0 stands for the swept ones, checked above)
        problems += FSD.Settings(
            T=0.0, k=cfg.fsd.k, fsd_top_k=cfg.fsd.top_k, fsd_rule=cfg.fsd.rule, fsd_dist=cfg.fsd.dist
        ).problems({"k": "fsd.k", "fsd_top_k": "fsd.top_k", "fsd_rule": "fsd.rule", "fsd_dist": "fsd.dist"})
    problems += ConfidenceStop.Settings.sweep("tau", "confidence.taus", cfg.confidence.taus)
    problems += ConfidenceStop.Settings(k_max=cfg.confidence.k_max).problems({"k_max": "confidence.k_max"})
    unswept = [f"judge.heads.{n}" for n in cfg.judge.heads if not cfg.judge.head_deltas.get(n)]
    if cfg.judge.head and not cfg.judge.deltas:
        problems.append("judge.head is set but judge.deltas is empty")
    elif unswept and not cfg.judge.deltas:
        problems.append(f"judge.deltas is empty and judge.head_deltas gives none for {', '.join(unswept)}")
    for name, deltas in cfg.judge.head_deltas.items():
        if name not in cfg.judge.heads:
            problems.append(f"judge.head_deltas.{name}: no judge of that name in judge.heads={dict(cfg.judge.heads)}")
        problems += Judge.Settings.sweep("delta", f"judge.head_deltas.{name}", deltas)
    bad = [n for n in cfg.judge.heads if not re.fullmatch(r"[A-Za-z0-9_]+", str(n))]
    if bad:
        problems.append(f"judge.heads: names {bad} must be letters, digits and _ (rows j-<name>-<delta>)")
    if cfg.sprinter.head and not cfg.sprinter.etas:
        problems.append("sprinter.head is set but sprinter.etas is empty")
    if cfg.head and not cfg.thresholds and not cfg.cost_stop:
        problems.append("head is set but thresholds is empty (and cost_stop=false)")
    if cfg.profile not in PROFILES and not Path(cfg.profile).is_file():
        problems.append(f"profile={cfg.profile!r} is not auto, refresh or an existing cost-table JSON file")
    problems += run_problems(cfg.max_new_tokens, cfg.batch_size)
    try:
        parse_select(cfg.select)
    except UserError as exc:
        problems.append(str(exc))
    if not 0 <= cfg.competence_margin < 1:
        problems.append(f"competence_margin={cfg.competence_margin} must be in [0, 1) (0.1 = 10 points above chance)")
    if cfg.select and not cfg.accuracy:
        problems.append("select= chooses by graded answers: set accuracy=true")
    if cfg.write_default and not cfg.select:
        problems.append("write_default=true writes what select= chooses: set select=max_drop:X and/or max_disagree:Y")
    problems += budget_problems("max_new_tokens_by_source", cfg.max_new_tokens_by_source)
    for spec in cfg.trees:
        try:
            parse_tree(spec)
        except UserError as exc:
            problems.append(str(exc))
    if cfg.trees and (not cfg.eagle or cfg.sampling.do_sample):
        problems.append(
            "trees= are drafted by an EAGLE head and verified greedily: set eagle= and keep sampling.do_sample=false"
        )
    if cfg.eagle:
        drafting = eagle_conflicts(cfg)
        if drafting:
            problems.append(
                f"eagle= drafts with an EAGLE head, but {', '.join(drafting)} read the draft model "
                "(its states or vocabulary): sweep them in a run without eagle="
            )
    if cfg.batch_size > 1 and not cfg.fused_forward:
        problems.append(f"batch_size={cfg.batch_size} runs on the fused forward: set fused_forward=true")
    if problems:
        raise UserError("; ".join(problems))


def eagle_conflicts(cfg: EvalConfig) -> list[str]:
    """The configured settings whose rows need a draft model's states or vocabulary, which an EAGLE head lacks:
    SPRINTER's verifier trained on the draft's states (one on an EAGLE head's runs), an FSD row with a head, and
    the heterogeneous-vocabulary methods. The judges read the target's states and FSD without a head compares the
    two distributions: both run on an EAGLE head."""
    reads = tuple(n for n, p in POLICIES.items() if p.bridge)
    given = [
        f"rows (policy={r.get('policy')})"
        for r in cfg.rows
        if isinstance(r, dict)
        and (
            r.get("policy") in reads
            or (r.get("policy") == "fsd" and (r.get("settings") or {}).get("head"))
            or (r.get("policy") == "sprinter" and not _on_eagle((r.get("settings") or {}).get("head")))
        )
    ]
    sprinter = bool(cfg.sprinter.head) and not _on_eagle(cfg.sprinter.head)
    return ["sprinter.head="] * sprinter + ["hetero.methods="] * bool(cfg.hetero.methods) + given


def _on_eagle(head: str | None) -> bool:
    """Whether an exported SPRINTER verifier reads an EAGLE head's states (``heads-train head=eagle_verifier``);
    a file not written yet counts as such (loading it checks its drafter)."""
    if not head or not Path(head).is_file():
        return bool(head)
    from specheads.export import read_metadata

    return read_metadata(head).get("feature", {}).get("model") == "eagle"


def _most(settings: dict) -> int:
    """The most candidates per round a row's settings allow (its ``k``, ``k_max`` or ``tree_nodes``)."""
    return max([1, *(int(settings[k]) for k in ("k", "k_max", "tree_nodes") if settings.get(k) is not None)])


def _max_pass(cfg: EvalConfig) -> int:
    """The largest target pass the sweep's rows and the oracle use: most candidates per round + 1
    (SPRINTER's catch-up passes can be longer; the table extrapolates those)."""
    fsd = bool(cfg.fsd.swept())
    most = [
        1,
        *cfg.ks,
        cfg.k_max if cfg.head or cfg.oracle else 1,
        cfg.topk.k if cfg.topk.ks else 1,
        cfg.fsd.k if fsd else 1,
        cfg.confidence.k_max if cfg.confidence.taus else 1,
        cfg.judge.k if cfg.judge.head or cfg.judge.heads else 1,
        *(parse_tree(t)[2] for t in cfg.trees),
        (cfg.sprinter.max_run if cfg.sprinter.max_run is not None else 20) + 1 if cfg.sprinter.head else 1,
        *(_most(settings) for row in cfg.rows for _, _, settings in expand(row)),
    ]
    return min(max(most), 63) + 1
