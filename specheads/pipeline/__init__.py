"""``heads-pipeline``: the main job end to end: vocab -> datagen -> train -> export -> eval.

    heads-pipeline                                  # recipe=quickstart: the shared target and its EAGLE head, CPU
    heads-pipeline recipe=quickstart datagen.num_prompts=128 train.depth=1 seed=1
    heads-pipeline recipe=specdecpp_draft_quickstart   # SpecDec++ on the shared 4-layer draft

Each stage reads its own section of the one recipe, chained so that every stage consumes what
the previous one wrote (with ``vocab.top_n`` set, every stage that loads the draft gets
``draft.vocab_file`` = ``vocab.output`` and ``draft.vocab_top_n`` = ``vocab.top_n``: the draft's
output layer pruned to the most frequent tokens; a recipe without a ``vocab`` section, or whose
later stages load no draft model (an EAGLE head drafting: ``eagle=``), skips that stage;
``train.data_dir`` = ``datagen.output_dir``, ``export.train_dir`` = ``train.output_dir``,
``eval.head`` = the exported file, or ``eval.sprinter.head`` for a SPRINTER verifier:
``heads-pipeline recipe=sprinter_quickstart``). Overrides are ``section.key=value`` for one stage,
or ``key=value`` for every stage that has that key (``seed=1``). All four configs are checked
before anything runs. Every stage resumes, so running the same command again after a crash
continues where it stopped. At the end a summary table is printed, with the two gains the main job
shows (the drafter's: the fastest lossless row against the target alone; the stop rules': each
stop-head and confidence row against the fastest fixed K), and written, with the stage timings, to
``pipeline.output_dir`` (``summary.json``, ``metrics.jsonl``, ``config.yaml``, ``manifest.json``).
"""

from __future__ import annotations

import dataclasses
import logging
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specheads import extras
from specheads.config import guarded, help_text, load_config, schema_for
from specheads.errors import UserError
from specheads.gains import where_heads_pay
from specheads.outputs import MetricsWriter, atomic_write_json, prepare_output_dir, write_manifest
from specheads.pipeline import parts as pipeline_parts
from specheads.pipeline.report import print_summary, summarize

log = logging.getLogger(__name__)

#: the heads-eval key an exported head feeds, by heads-train ``head=`` (aliases included; any other: ``head``,
#: SpecDec++'s acceptance head, also on an EAGLE head's states)
EVAL_KEY_OF_HEAD = {
    "verifier": "sprinter.head",
    "sprinter": "sprinter.head",
    "eagle_verifier": "sprinter.head",
    "judge": "judge.head",
    "eagle": "eagle",
}
PROG = "heads-pipeline"
STAGES = ("vocab", "datagen", "train", "export", "eval")


@dataclass
class PipelineConfig:
    """Run datagen, train, export and eval from one recipe, chained, and summarise."""

    stages: list[str] = field(default_factory=lambda: list(STAGES), metadata={"help": "which stages to run, in order"})
    output_dir: str = field(
        default="runs/pipeline", metadata={"help": "summary.json, metrics.jsonl, config.yaml, manifest.json"}
    )
    overwrite: bool = False
    regimes: list[str] = field(
        default_factory=list,
        metadata={
            "help": "more decoding regimes, each run through datagen -> train -> export -> eval again after the "
            "recipe's own (outputs <dir>-<regime>): greedy, or t<temperature> (t1, t0.7); the summary names the "
            "regime with the largest stop-rule ceiling and compares the learned head with the training-free rules there"
        },
    )
    datagen_parts: list[dict[str, Any]] = field(
        default_factory=list,
        metadata={
            "help": "datagen runs in order, each the recipe's datagen section with these keys changed (own output_dir; "
            "labels=prompts parts write a prompt file for later parts); training reads the others' data"
        },
    )
    train_stages: list[dict[str, Any]] = field(
        default_factory=list,
        metadata={
            "help": "training runs in order, each the recipe's train section with these keys changed, each starting "
            "from the one before's head (eagle.init_head); export reads the last"
        },
    )


def _split(argv: list[str]) -> tuple[str | None, dict[str, list[str]], list[str]]:
    recipe, per_stage, common = None, {s: [] for s in ("pipeline", *STAGES)}, []
    for item in argv:
        key, eq, _ = item.partition("=")
        head, dot, _ = key.partition(".")
        if key == "recipe":
            recipe = item
        elif dot and head in per_stage:
            per_stage[head].append(item[len(head) + 1 :])
        else:
            common.append(item)
    return recipe, per_stage, common


def _top_level(schema) -> set[str]:
    return {f.name for f in dataclasses.fields(schema)}


def _takes(schema, item: str) -> bool:
    """Whether a stage's schema has the key ``item`` sets (``eagle=X`` a setting, not a section; ``a.b=X`` a field
    ``b`` in a section ``a``, or a key of a mapping ``a``): a common key goes only to the stages it fits
    (``eagle=`` is eval's EAGLE head, while train's ``eagle`` is a section of settings)."""
    *path, last = item.partition("=")[0].split(".")
    for name in path:
        f = {f.name: f for f in dataclasses.fields(schema)}.get(name)
        if f is None:
            return False
        sub = f.default_factory if f.default_factory is not dataclasses.MISSING else None
        if not (isinstance(sub, type) and dataclasses.is_dataclass(sub)):
            return sub is dict or "dict" in str(f.type)  # a mapping takes any key; a plain value none
        schema = sub
    f = {f.name: f for f in dataclasses.fields(schema)}.get(last)
    sub = None if f is None or f.default_factory is dataclasses.MISSING else f.default_factory
    return f is not None and not (isinstance(sub, type) and dataclasses.is_dataclass(sub))


REGIME_STAGES = ("datagen", "train", "export", "eval")


def regime_args(name: str) -> list[str]:
    """The overrides that make the recipe's run regime ``name``: ``greedy`` or ``t<temperature>``."""
    if name == "greedy":
        return ["sampling.do_sample=false"]
    match = re.fullmatch(r"t(\d+(?:\.\d*)?)", name)
    if not match or not float(match[1]) > 0:
        raise UserError(f"pipeline.regimes: {name!r} is not a regime; write greedy or t<temperature> (t1, t0.7)")
    # trees are verified greedily: a sampled regime has none
    return ["sampling.do_sample=true", f"sampling.temperature={float(match[1])}", "eval.trees=[]"]


def recipe_regime(cfgs: dict) -> str:
    """The regime the recipe itself runs (named as in ``pipeline.regimes``)."""
    s = cfgs["datagen"].sampling
    return f"t{s.temperature:g}" if s.do_sample else "greedy"


def regime_configs(argv: list[str], pipe: PipelineConfig, cfgs: dict) -> dict[str, dict]:
    """Each of ``pipe.regimes``' stage configs: the recipe's, with its sampling and each output_dir + ``-<name>``."""
    out = {}
    for name in pipe.regimes:
        if name == recipe_regime(cfgs) or name in out:
            raise UserError(
                f"pipeline.regimes: {name!r} is listed twice (the recipe itself runs {recipe_regime(cfgs)})"
            )
        dirs = [f"{s}.output_dir={cfgs[s].output_dir}-{name}" for s in REGIME_STAGES if s in cfgs]
        out[name] = load_configs([*argv, *regime_args(name), *dirs])[1]
    return out


def load_configs(argv: list[str]) -> tuple[PipelineConfig, dict]:
    """The pipeline's config and each stage's, chained and validated (UserError lists every problem)."""
    recipe, per_stage, common = _split(argv)
    base = [recipe] if recipe else []
    problems = []
    for item in common:
        key = item.partition("=")[0]
        if not any(_takes(schema_for(s), item) for s in STAGES):
            problems.append(
                f"{item!r}: no stage has a key {key!r}; write stage.key=value (stages: {', '.join(STAGES)})"
            )
    if problems:
        raise UserError("; ".join(problems))

    def stage_args(stage: str, chained: list[str], last: list[str] | None = None) -> list[str]:
        mine = [c for c in common if _takes(schema_for(stage), c)]
        return base + chained + mine + per_stage[stage] + (last or [])

    # A common key the pipeline itself has (overwrite) applies to it too.
    own = [c for c in common if c.partition("=")[0] in _top_level(PipelineConfig)]
    try:
        pipe = load_config(PipelineConfig, "pipeline", base + own + per_stage["pipeline"])
    except UserError as err:
        if "has no 'pipeline' section" not in str(err):
            raise
        pipe = load_config(PipelineConfig, "pipeline", own + per_stage["pipeline"])
    unknown = [s for s in pipe.stages if s not in STAGES]
    if unknown:
        raise UserError(f"stages={pipe.stages}: unknown {unknown}; choose from {list(STAGES)}")
    cfgs, chained = {}, {}
    for stage in STAGES:
        try:
            cfgs[stage] = load_config(schema_for(stage), stage, stage_args(stage, chained.get(stage, [])))
        except UserError as err:
            if f"has no '{stage}' section" in str(err) and (stage == "vocab" or stage not in pipe.stages):
                pipe.stages = [s for s in pipe.stages if s != stage]  # a stage the recipe does not run
                continue
            problems.append(f"[{stage}] {err}")
            continue
        if stage == "vocab" and cfgs[stage].top_n is not None:
            prune = [f"draft.vocab_file={cfgs[stage].output}", f"draft.vocab_top_n={cfgs[stage].top_n}"]
            for later in STAGES:
                if "draft" in _top_level(schema_for(later)):
                    chained.setdefault(later, []).extend(prune)
        elif stage == "datagen":
            chained.setdefault("train", []).append(f"data_dir={cfgs[stage].output_dir}")
        elif stage == "train":
            chained["export"] = [f"train_dir={cfgs[stage].output_dir}"]
        elif stage == "export":  # a verifier feeds SPRINTER's rows, a judge the judge's, an acceptance head SpecDec++'s
            key = EVAL_KEY_OF_HEAD.get(getattr(cfgs.get("train"), "head", "acceptance"), "head")
            out = Path(cfgs[stage].output_dir)
            chained.setdefault("eval", []).append(
                f"{key}={out if cfgs[stage].format == 'hf' else out / 'head.safetensors'}"
            )
    if problems:
        raise UserError("; ".join(problems))
    pipeline_parts.expand(
        pipe, cfgs, chained, stage_args, lambda stage, args: load_config(schema_for(stage), stage, args)
    )
    if "vocab" in pipe.stages and not _loads_a_draft(pipe, cfgs):  # nothing to prune (e.g. an EAGLE drafter)
        log.info("no later stage loads a draft model (draft.path): the vocab stage is skipped")
        pipe.stages = [s for s in pipe.stages if s != "vocab"]
    return pipe, cfgs


def _loads_a_draft(pipe: PipelineConfig, cfgs: dict) -> bool:
    """Whether a stage after ``vocab`` loads a draft model whose output layer the ranking would prune."""
    return any(getattr(getattr(cfgs.get(s), "draft", None), "path", "") for s in pipe.stages if s != "vocab")


# the install extra each stage needs (heads-export needs only the base install)
STAGE_EXTRAS = {"vocab": "train", "datagen": "train", "train": "train", "eval": "eval"}


def _runner(stage: str):
    if stage == "vocab":
        from specheads.datagen.vocab_ranking import run
    elif stage == "datagen":
        from specheads.datagen.cli import run
    elif stage == "train":
        from specheads.train.cli import run
    elif stage == "export":
        from specheads.export.cli import run
    else:
        from specheads.evaluate.cli import run
    return run


def run(argv: list[str]) -> int:
    from specheads.config import to_yaml

    pipe, cfgs = load_configs(argv)
    more = regime_configs(argv, pipe, cfgs)  # every regime's configs checked before anything runs
    for stage in pipe.stages:  # every stage's extra up front, not after hours of the earlier stages
        if STAGE_EXTRAS.get(stage):
            extras.require(STAGE_EXTRAS[stage])
    text = "".join(
        f"{s}:\n" + "".join(f"  {line}\n" for line in to_yaml(cfgs[s]).splitlines()) for s in STAGES if s in cfgs
    )
    out = prepare_output_dir(pipe.output_dir, to_yaml(pipe) + text, overwrite=pipe.overwrite)
    plan = [(None, pipe.stages, cfgs)] + [(n, [s for s in pipe.stages if s != "vocab"], c) for n, c in more.items()]
    times: dict = {}
    earlier = pipeline_parts.earlier_seconds(out / "metrics.jsonl")  # a resumed pipeline's cost counts every try
    with MetricsWriter(out) as metrics:
        for regime, stages, stage_cfgs in plan:
            mine = times.setdefault(regime, {})
            for stage in stages:
                for label, cfg in pipeline_parts.runs(stage_cfgs, stage):
                    name = f"{stage} {label}" if label else stage
                    log.info("== %s%s ==", name, f" ({regime})" if regime else "")
                    t0 = time.perf_counter()
                    code = _runner(stage)(cfg)
                    mine[name] = time.perf_counter() - t0
                    metrics.write(
                        stage=stage,
                        **({"run": label} if label else {}),
                        **({"regime": regime} if regime else {}),
                        seconds=round(mine[name], 3),
                        exit_code=code or 0,
                    )
                    if code:
                        return code
    mine = times.pop(None)
    summary = summarize(cfgs, mine)
    summary["cost"] = pipeline_parts.cost(cfgs, mine, earlier)  # unrounded: a total adds up to its tries
    if more:
        summary["regime"] = recipe_regime(cfgs)
        summary["regimes"] = {name: summarize(more[name], times[name]) for name in more}
        summary["where_heads_pay"] = where_heads_pay({summary["regime"]: summary, **summary["regimes"]})
    atomic_write_json(out / "summary.json", summary)
    seconds = sum(sum(t.values()) for t in times.values()) + sum(summary["stage_seconds"].values())
    write_manifest(out, command=PROG, stages=pipe.stages, regimes=pipe.regimes, seconds=round(seconds, 1))
    print_summary(summary)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``heads-pipeline``."""
    args = sys.argv[1:] if argv is None else list(argv)
    if any(a in ("-h", "--help") for a in args):
        print(__doc__.strip())
        print()
        print(help_text(PipelineConfig, "pipeline", PROG))
        print("\nEach stage's keys: see heads-vocab / heads-datagen / heads-train / heads-export / heads-eval --help.")
        return 0
    return guarded(PROG, lambda: run(args), "interrupted; run the same command again to resume")
