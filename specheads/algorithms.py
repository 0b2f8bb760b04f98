"""One card per algorithm: its one name, the keys each stage's registry knows it by, and where its parts live.

An algorithm spans the stages by design, so no folder is its home: the card is. Each card declares, as the
strings the registries are keyed by, its label families (``heads-datagen labels=``), head types (the
``head_type`` exported files carry), training tasks (``heads-train head=``), decoding policies (``policy=``),
``heads-eval`` row kinds (``h`` for ``h0.5`` and ``h-cost``, ``fsd`` for ``fsd-js-0.3``, ``tree``, ``v``), recipes
(``recipes/NAME.yaml``) and docs page (``docs/algorithms/NAME.md``). A field left empty says why in
``why_none``: every field is decided. The keys are strings, not imports, so this module sits at the package's
bottom layer; ``tests/test_algorithms.py`` checks that every key resolves in its registry and that every
registry entry is on exactly one card or in :data:`NOT_ALGORITHMS`.

ARCHITECTURE.md's "Algorithm × stage" table is :func:`render_table` of the cards (their ``modules``: the files
of each stage); after editing a card, ``python -m specheads.algorithms --write`` rewrites it (``--check``
says whether it is current, no option prints it).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field
from pathlib import Path

KEYS = ("labels", "heads", "tasks", "policies", "rows", "recipes", "docs")  # the fields of registry keys
STAGES = ("labels", "head", "training", "policy", "evaluation")  # the table's columns of modules
HEADER = (
    "Algorithm",
    "Labels (`datagen/`)",
    "Head (`heads/`)",
    "Training (`train/`)",
    "Decoding policy (`shim/`)",
    "Evaluation (`evaluate/`)",
    "Recipes",
)
BEGIN = "<!-- the algorithm table: generated from specheads/algorithms.py by python -m specheads.algorithms --write -->"
END = "<!-- end of the generated algorithm table -->"


@dataclass(frozen=True)
class Algorithm:
    """An algorithm's card. The key fields hold the registry keys it owns (a part it shares with another card
    is that card's, named in ``uses``); ``why_none`` says, for each empty key field, why it has none;
    ``modules`` gives, per stage of :data:`STAGES` (and ``recipes``: notes), the table's entries."""

    name: str
    title: str
    paper: str
    labels: tuple[str, ...]
    heads: tuple[str, ...]
    tasks: tuple[str, ...]
    policies: tuple[str, ...]
    rows: tuple[str, ...]
    recipes: tuple[str, ...]
    docs: tuple[str, ...]
    why_none: dict[str, str] = field(default_factory=dict)
    modules: dict[str, str] = field(default_factory=dict)
    uses: tuple[str, ...] = ()  # the cards whose registered parts it builds on

    def problems(self) -> list[str]:
        """What is undecided or malformed on the card (empty when it is complete)."""
        out = [f"{self.name}: {f} is empty" for f in ("name", "title", "paper") if not getattr(self, f)]
        for key in KEYS:
            value, why = getattr(self, key), self.why_none.get(key)
            if not isinstance(value, tuple) or not all(isinstance(v, str) and v for v in value):
                out.append(f"{self.name}: {key}={value!r} is not a tuple of names")
            elif not value and not why:
                out.append(f"{self.name}: {key} is empty and why_none does not say why")
            elif value and why:
                out.append(f"{self.name}: {key} has keys and a why_none reason; drop one")
        out += [f"{self.name}: why_none[{k!r}] names no key field" for k in set(self.why_none) - set(KEYS)]
        if set(self.modules) - {*STAGES, "recipes"} or set(STAGES) - set(self.modules):
            out.append(f"{self.name}: modules has {sorted(self.modules)}; give each of {list(STAGES)} (and recipes)")
        out += [f"{self.name}: docs page {d!r} is not docs/algorithms/*.md" for d in self.docs if not _page(d)]
        return out


def _page(path: str) -> bool:
    return path.startswith("docs/algorithms/") and path.endswith(".md") and path.count("/") == 2


_NO_TRAINING = {"labels": "training-free", "heads": "training-free", "tasks": "training-free"}

# fmt: off
# laid out by hand: a card's keys side by side, so that a card reads as one
ALGORITHMS: tuple[Algorithm, ...] = (
    Algorithm(
        name="specdecpp", title="SpecDec++ stop head (the acceptance head; on a draft model or the EAGLE drafter)",
        paper="2024, SpecDec++: Boosting Speculative Decoding via Adaptive Candidate Lengths",
        labels=("acceptance", "eagle_rounds"), heads=("acceptance",), tasks=("acceptance", "eagle_stop"),
        policies=("specdecpp",), rows=("h",), docs=("docs/algorithms/specdecpp.md",), uses=("eagle",),
        recipes=("specdecpp_draft_quickstart", "specdecpp_llama2_7b_70b", "specdecpp_llama31_8b_70b",
                 "specdecpp_smollm2", "quickstart"),
        modules={
            "labels": "`acceptance_labels.py`, `eagle_rounds.py` (on the EAGLE drafter: SD rounds decoded with the "
                      "EAGLE head)",
            "head": "`acceptance_head.py`",
            "training": "`acceptance_data.py` (data, features), `acceptance_task.py`, `eagle_stop_task.py` (on the "
                        "EAGLE drafter: stored states, no model)",
            "policy": "`policies/specdecpp_policy.py` (threshold `h` or `stop=cost`; its rule "
                      "`SpecDecPP.threshold_stop`; with `eagle=` drafting through `loop/eagle_drafter.py`, the head "
                      "checked against its EAGLE head: `export/package.py`)",
            "evaluation": "`oracle.py` (greedy oracle, perfect head by the policy's rule; `rounds_perfect_head` on "
                          "the EAGLE drafter), `report.py`, `sweep.py` (`h` rows, with `eagle=` on the EAGLE drafter)",
            "recipes": "`specdecpp_draft_quickstart`: the draft-based quickstart; `quickstart`: on the committed "
                       "`recipes/heads/eagle_smollm2.safetensors`",
        },
    ),
    Algorithm(
        name="eagle", title="EAGLE-3-style draft head",
        paper="2024-2025, EAGLE, EAGLE-2 and EAGLE-3 (training-time test)",
        labels=("drafter", "prompts", "passages"), heads=("eagle",), tasks=("eagle",), policies=(), rows=(),
        recipes=("eagle_smollm2", "eagle_llama31_8b", "eagle_llama31_70b"), docs=("docs/algorithms/eagle.md",),
        why_none={
            "policies": "a drafter, not a policy: eagle=<head> drafts for the same-vocabulary policies",
            "rows": "no row kind of its own: eagle= runs the k, h, c and tree rows drafting with the head",
        },
        modules={
            "labels": "`drafter.py` (`labels=drafter`: the target's responses, its states at chosen layers, its "
                      "top-k distributions), `self_prompts.py` (`labels=prompts`: prompts the target writes), "
                      "`passages.py` (`labels=passages`: prompts over long passages), `turns.py` (conversations "
                      "regenerated turn by turn)",
            "head": "`eagle_head.py` (the head; `unrolled_attention`/`unrolled_forward`: training-time test)",
            "training": "`eagle_data.py` (data, vocabulary subset, the unrolled loss), `eagle_task.py`, "
                        "`eagle_states.py` (states stored, made online, or cached: hybrid)",
            "policy": "`loop/eagle_drafter.py` (`EagleDrafter`: drafting from the verification pass's states), "
                      "`runners/eagle_cache.py` (its cache and draft step), `loop/drafting.py` (a candidate drawn and "
                      "added, shared by every drafter); `export/speculators.py` (`heads-export format=speculators`, "
                      "the layout vLLM loads)",
            "evaluation": "`cli.py` (`eagle=`: the same-vocabulary rows on the head), `oracle.py` (`RoundRecorder`, "
                          "`rounds_oracle`: the oracle from SD's rounds)",
        },
    ),
    Algorithm(
        name="trees", title="Draft trees on the EAGLE head (EAGLE-2)",
        paper="2024, EAGLE-2: Faster Inference of Language Models with Dynamic Draft Trees",
        labels=(), heads=(), tasks=(), policies=("tree",), rows=("tree",), recipes=(),
        docs=("docs/algorithms/trees.md",), uses=("eagle",),
        why_none={
            "labels": "no training of its own: it drafts with the EAGLE head", "heads": "the EAGLE head's (eagle)",
            "tasks": "no training of its own: it drafts with the EAGLE head",
            "recipes": "none of its own: quickstart (the specdecpp card's) runs its tree-3x2x4 row",
        },
        modules={
            "labels": "— (uses the EAGLE head)", "head": "", "training": "",
            "policy": "`policies/tree_policy.py` (`EagleTree`: settings, cost-aware size and depth), "
                      "`loop/tree_loop.py` (`grow_tree`, `DraftTree` mask and walk, the round loop), "
                      "`runners/model_runner.py` (`FusedRunner.forward_tree`, `keep`), `runners/eagle_cache.py` "
                      "(`forward_tree`)",
            "evaluation": "`rows.py` (`trees=`: rows `tree-DxWxN[-cost]`)", "recipes": "`quickstart`: `tree-3x2x4`",
        },
    ),
    Algorithm(
        name="sprinter", title="SPRINTER verifier",
        paper="2025, Speeding up Speculative Decoding via Approximate Verification",
        labels=("sprinter",), heads=("verifier",), tasks=("verifier", "eagle_verifier"), policies=("sprinter",),
        rows=("s",), docs=("docs/algorithms/sprinter.md",), uses=("specdecpp", "eagle"),
        recipes=("sprinter_eagle", "sprinter_gpt2_small_xl", "sprinter_gptneo_125m_1_3b", "sprinter_quickstart"),
        modules={
            "labels": "`sprinter_labels.py` (ratio measure: `specheads/runtime/ratio.py`)",
            "head": "`verifier_head.py`",
            "training": "`verifier_data.py` (data, ROC), `verifier_task.py`, `eagle_verifier_task.py` (on the EAGLE "
                        "drafter: `labels=eagle_rounds` states, no model)",
            "policy": "`policies/sprinter_policy.py` (`eta`)",
            "evaluation": "`quality.py` (alpha, TV bound, ROUGE, FLOPs), `quality_report.py`",
        },
    ),
    Algorithm(
        name="judge", title="Judge head",
        paper="2025, Judge Decoding: Faster Speculative Sampling Requires Going Beyond Model Alignment",
        labels=("judge",), heads=("judge",), tasks=("judge",), policies=("judge",), rows=("j",),
        recipes=("judge_405b", "judge_70b", "judge_margin", "judge_mined_quickstart", "judge_quickstart"),
        docs=("docs/algorithms/judge.md",),
        modules={
            "labels": "`judge_labels.py`, `tuples.py`, `arith.py`; swap mining: `mining.py`, `checkers.py`, "
                      "`mined_view.py` (grading: `specheads/grading.py`)",
            "head": "`judge_head.py`", "training": "`judge_data.py` (data), `judge_task.py`",
            "policy": "`policies/judge_policy.py` (`delta`)", "evaluation": "`accuracy.py`",
        },
    ),
    Algorithm(
        name="fsd", title="FSD and the FSD acceptance head",
        paper="Holsman, Huang and Dhingra 2025, Fuzzy Speculative Decoding for a Tunable Accuracy-Runtime Tradeoff",
        labels=("fsd",), heads=(), tasks=(), policies=("fsd",), rows=("fsd",),
        recipes=("fsd_head_quickstart", "fsd_quickstart"), docs=("docs/algorithms/fsd.md",), uses=("specdecpp",),
        why_none={
            "heads": "its learned head is SpecDec++'s acceptance head (head_type acceptance) trained on labels=fsd",
            "tasks": "heads-train head=acceptance acceptance.fsd_label=DIV@T: SpecDec++'s task on FSD's label",
        },
        modules={
            "labels": "`fsd_labels.py`", "head": "`acceptance_head.py`",
            "training": "`fsd_data.py` (its label), `acceptance_task.py`",
            "policy": "`policies/fsd_policy.py` (`T`), `core/divergence.py`", "evaluation": "`training_free.py`",
        },
    ),
    Algorithm(
        name="topk", title="Top-K verification", paper="none: the training-free baseline a judge has to beat",
        labels=(), heads=(), tasks=(), policies=("topk_verify",), rows=("t",), recipes=(),
        docs=("docs/algorithms/topk.md",),
        why_none={
            **_NO_TRAINING,
            "recipes": "none of its own: fsd_quickstart and judge_quickstart sweep it beside their own rows",
        },
        modules={
            "labels": "", "head": "", "training": "",
            "policy": "`policies/topk_policy.py` (`verify_top_k`)", "evaluation": "`training_free.py`",
        },
    ),
    Algorithm(
        name="confidence", title="Draft-confidence stop",
        paper="none: Hugging Face's assistant_confidence_threshold; AdaEDL's entropy bound (2024)",
        labels=(), heads=(), tasks=(), policies=("confidence_stop",), rows=("c",), recipes=(),
        docs=("docs/algorithms/confidence.md",),
        why_none={**_NO_TRAINING, "recipes": "none of its own: fsd_quickstart and quickstart sweep it"},
        modules={
            "labels": "", "head": "", "training": "",
            "policy": "`policies/baselines.py` (`ConfidenceStop`: `tau` or `stop=cost`)",
            "evaluation": "`training_free.py`",
        },
    ),
    Algorithm(
        name="cost", title="Cost table and cost-aware stopping, draft gate",
        paper="SpecDec++'s cost model (Lemma 3.1), priced by pass size and batch size",
        labels=(), heads=(), tasks=(), policies=(), rows=(), recipes=(), docs=("docs/algorithms/cost-model.md",),
        why_none={
            "labels": "measured on the machine, not learned", "heads": "no head", "tasks": "no training",
            "policies": "stop=cost and gate= are settings of specdecpp, confidence_stop and tree",
            "rows": "its rows are those policies' (h-cost, c-cost, tree-DxWxN-cost)",
            "recipes": "every recipe's eval runs at the profiled costs",
        },
        modules={
            "labels": "", "head": "", "training": "",
            "policy": "`costs/cost_table.py` (the table, by pass size and batch size), `costs/cost_profile.py` (its "
                      "measurement at batch 1 and batched), `costs/cost_rules.py` (stop rule, gate, predicted "
                      "ms/token; priced at the round's batch)",
            "evaluation": "`oracle.py`",
        },
    ),
    Algorithm(
        name="hetero", title="TLI / SLEM / SLRS (different vocabularies)",
        paper="Timor et al. 2025, Accelerating LLM Inference with Lossless Speculative Decoding Algorithms for "
              "Heterogeneous Vocabularies",
        labels=(), heads=(), tasks=(), policies=("tli", "slem", "slrs"), rows=("v",), recipes=(),
        docs=("docs/algorithms/hetero.md",),
        why_none={**_NO_TRAINING, "recipes": "none yet: heads-eval hetero.methods=[tli,slem,slrs] on any pair"},
        modules={
            "labels": "", "head": "", "training": "",
            "policy": "`policies/hetero_policies.py`, `vocab/hetero_loop.py`, `vocab/token_text.py`; SLRS: "
                      "`vocab/slrs.py` (its process, `psi`, `n_max`), `vocab/slrs_draft.py` (its drafting in the "
                      "shim, the tree forward)",
            "evaluation": "`rows.py` (`hetero.methods=`: rows `v-<method>-k<K>`), `checks.py`",
        },
    ),
    Algorithm(
        name="vocab_pruning", title="Draft vocabulary pruning (FR-Spec)",
        paper="2025, FR-Spec: Frequency-Ranked Speculative Sampling",
        labels=(), heads=(), tasks=(), policies=(), rows=(), recipes=(), docs=(),
        why_none={
            **_NO_TRAINING,
            "labels": "its ranking is heads-vocab (datagen/vocab_ranking.py), a command of its own, not a labels=",
            "policies": "a setting of the draft (vocab=) under any same-vocabulary policy",
            "rows": "no row kind: it changes the draft under every row",
            "recipes": "none of its own: specdecpp_draft_quickstart and specdecpp_smollm2 prune their draft",
            "docs": "no page of its own: docs/commands/heads-vocab.md",
        },
        modules={
            "labels": "`vocab_ranking.py` (`heads-vocab`)", "head": "", "training": "",
            "policy": "`runners/vocab_pruning.py`", "evaluation": "",
            "recipes": "`specdecpp_draft_quickstart`, `specdecpp_smollm2` prune their draft",
        },
    ),
    Algorithm(
        name="distill", title="Standalone draft distillation (DistillSpec)",
        paper="2024, DistillSpec: Improving Speculative Decoding via Knowledge Distillation",
        labels=(), heads=(), tasks=("draft",), policies=(), rows=(), recipes=("draft_smollm2",), docs=(),
        uses=("eagle",),
        why_none={
            "labels": "labels=drafter, the eagle card's: the target's responses and top-k distributions",
            "heads": "it trains a whole draft model, written as a Hugging Face model directory",
            "policies": "the distilled draft decodes under any same-vocabulary policy (draft.path=)",
            "rows": "no row kind: any row with draft.path=<output_dir>/draft",
            "docs": "no page of its own: docs/algorithms/eagle.md, 'A standalone draft on the same data'",
        },
        modules={
            "labels": "`drafter.py` (`labels=drafter`)", "head": "— (a Hugging Face model directory)",
            "training": "`distill.py` (batches, divergences), `distill_model.py` (`distill.init`, the training "
                        "forward, the `draft/` directory), `distill_task.py`",
            "policy": "any same-vocabulary policy with `draft.path=<output_dir>/draft`", "evaluation": "",
        },
    ),
)
# fmt: on

#: Registry entries on no card, by key field, and why: the references every algorithm is measured against
#: (standard SD is the one rule every lossless policy verifies with, in the shared loop), and runs of several.
NOT_ALGORITHMS: dict[str, dict[str, str]] = {
    "policies": {
        "ar": "the target alone",
        "draft": "the draft alone",
        "sd": "standard SD at a fixed K; `policies/baselines.py`",
    },
    "rows": {"ar": "the target alone", "draft": "the draft alone", "k": "standard SD at a fixed K, `k4`"},
    "recipes": {"eval_at_scale": "the lossy policies of several cards graded together"},
}


def by_name() -> dict[str, Algorithm]:
    """The cards by name (ValueError for a name on two cards)."""
    names = [a.name for a in ALGORITHMS]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"algorithm names on more than one card: {twice}")
    return {a.name: a for a in ALGORITHMS}


def _recipes(card: Algorithm) -> str:
    keys = ", ".join(f"`{r}`" for r in card.recipes) or "—"
    notes = card.modules.get("recipes")
    return f"{keys} ({notes})" if notes else keys


def render_table(cards: tuple[Algorithm, ...] = ALGORITHMS) -> str:
    """ARCHITECTURE.md's algorithm table (markdown) from the cards: a row per card (its name, its title), a
    column per stage of :data:`STAGES` (its ``modules``) and its recipes; then the entries on no card."""
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    for c in cards:
        cells = (f"`{c.name}`: {c.title}", *(c.modules.get(s) or "—" for s in STAGES), _recipes(c))
        lines.append("| " + " | ".join(cells) + " |")
    rest = "; ".join(
        f"{key} " + ", ".join(f"`{k}` ({why})" for k, why in entries.items()) for key, entries in NOT_ALGORITHMS.items()
    )
    baselines = f"On no card, the references every algorithm is measured against and a run of several: {rest}."
    return "\n".join(lines) + "\n\n" + baselines + "\n"


def _section(text: str) -> tuple[int, int]:
    start, end = text.find(BEGIN), text.find(END)
    if start < 0 or end < start:
        raise ValueError(f"ARCHITECTURE.md has no generated algorithm table: put it between {BEGIN!r} and {END!r}")
    return start + len(BEGIN), end


def table_in(text: str) -> str:
    """The generated table of an ARCHITECTURE.md text, between :data:`BEGIN` and :data:`END`."""
    start, end = _section(text)
    return text[start:end].strip("\n") + "\n"


def with_table(text: str, table: str) -> str:
    """``text`` with its generated table replaced by ``table``."""
    start, end = _section(text)
    return text[:start] + "\n" + table + text[end:]


def main(argv: list[str] | None = None) -> int:
    """``python -m specheads.algorithms [--check | --write]``: print the table, check ARCHITECTURE.md's, or
    rewrite it (a checkout's, next to the package)."""
    ap = argparse.ArgumentParser(prog="python -m specheads.algorithms", description=__doc__.split("\n")[0])
    one = ap.add_mutually_exclusive_group()
    one.add_argument("--check", action="store_true", help="exit 1 when ARCHITECTURE.md's table is not the cards'")
    one.add_argument("--write", action="store_true", help="rewrite ARCHITECTURE.md's table from the cards")
    args = ap.parse_args(argv)
    bad = [p for c in ALGORITHMS for p in c.problems()]
    if bad:
        print("\n".join(bad), file=sys.stderr)
        return 1
    table = render_table()
    if not (args.check or args.write):
        sys.stdout.write(table)
        return 0
    path = Path(__file__).resolve().parents[1] / "ARCHITECTURE.md"
    if not path.is_file():
        print(f"{path} does not exist: --check and --write work in a checkout", file=sys.stderr)
        return 2
    text = path.read_text(encoding="utf-8")
    if args.write:
        path.write_text(with_table(text, table), encoding="utf-8")
        return 0
    if table_in(text) != table:
        print(
            "ARCHITECTURE.md's algorithm table is not the cards': python -m specheads.algorithms --write",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
