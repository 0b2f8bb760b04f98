"""``heads-pipeline``: the main job end to end: vocab -> datagen -> train -> export -> eval.

    heads-pipeline                                  # recipe=quickstart: the shared pair on CPU
    heads-pipeline recipe=quickstart datagen.num_prompts=128 train.depth=2 seed=1

Each stage reads its own section of the one recipe, chained so that every stage consumes what
the previous one wrote (with ``vocab.top_n`` set, every stage that loads the draft gets
``draft.vocab_file`` = ``vocab.output`` and ``draft.vocab_top_n`` = ``vocab.top_n``: the draft's
output layer pruned to the most frequent tokens; a recipe without a ``vocab`` section skips that
stage; ``train.data_dir`` = ``datagen.output_dir``, ``export.train_dir`` =
``train.output_dir``, ``eval.head`` = the exported file, or ``eval.verifier`` for a SPRINTER
verifier: ``heads-pipeline recipe=sprinter_quickstart``). Overrides are ``section.key=value``
for one stage, or ``key=value`` for every stage that has that key (``seed=1``). All four configs
are checked before anything runs. Every stage resumes, so running the same command again after
a crash continues where it stopped. At the end a summary table is printed and written, with the
stage timings, to ``pipeline.output_dir`` (``summary.json``, ``metrics.jsonl``, ``config.yaml``,
``manifest.json``).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from specheads.config import _setup_logging, help_text, load_config, schema_for
from specheads import extras
from specheads.errors import UserError
from specheads.outputs import MetricsWriter, atomic_write_json, prepare_output_dir, write_manifest

log = logging.getLogger(__name__)
PROG = "heads-pipeline"
STAGES = ("vocab", "datagen", "train", "export", "eval")


@dataclass
class PipelineConfig:
    """Run datagen, train, export and eval from one recipe, chained, and summarise."""

    stages: list[str] = field(default_factory=lambda: list(STAGES), metadata={"help": "which stages to run, in order"})
    output_dir: str = field(default="runs/pipeline", metadata={"help": "summary.json, metrics.jsonl, config.yaml, manifest.json"})
    overwrite: bool = False


def _split(argv: list[str]) -> tuple[str | None, dict[str, list[str]], list[str]]:
    recipe, per_stage, common = None, {s: [] for s in ("pipeline", *STAGES)}, []
    for item in argv:
        key, eq, _ = item.partition("=")
        head, dot, _ = key.partition(".")
        if key == "recipe":
            recipe = item
        elif dot and head in per_stage:
            per_stage[head].append(item[len(head) + 1:])
        else:
            common.append(item)
    return recipe, per_stage, common


def _top_level(schema) -> set[str]:
    return {f.name for f in dataclasses.fields(schema)}


def load_configs(argv: list[str]) -> tuple[PipelineConfig, dict]:
    """The pipeline's config and each stage's, chained and validated (UserError lists every problem)."""
    recipe, per_stage, common = _split(argv)
    base = [recipe] if recipe else []
    problems = []
    for item in common:
        key = item.partition("=")[0].partition(".")[0]
        if not any(key in _top_level(schema_for(s)) for s in STAGES):
            problems.append(f"{item!r}: no stage has a key {key!r}; write stage.key=value "
                            f"(stages: {', '.join(STAGES)})")
    if problems:
        raise UserError("; ".join(problems))

    def stage_args(stage: str, chained: list[str]) -> list[str]:
        mine = [c for c in common if c.partition("=")[0].partition(".")[0] in _top_level(schema_for(stage))]
        return base + chained + mine + per_stage[stage]

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
            if stage == "vocab" and "has no 'vocab' section" in str(err):  # no pruning in this recipe
                pipe.stages = [s for s in pipe.stages if s != "vocab"]
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
            key = {"verifier": "verifier", "judge": "judge"}.get(getattr(cfgs.get("train"), "head", "acceptance"), "head")
            out = Path(cfgs[stage].output_dir)
            chained.setdefault("eval", []).append(f"{key}={out if cfgs[stage].format == 'hf' else out / 'head.safetensors'}")
    if problems:
        raise UserError("; ".join(problems))
    return pipe, cfgs


# the install extra each stage needs (heads-export needs only the base install)
STAGE_EXTRAS = {"vocab": "train", "datagen": "train", "train": "train", "eval": "eval"}

def _runner(stage: str):
    if stage == "vocab":
        from specheads.datagen.vocab import run
    elif stage == "datagen":
        from specheads.datagen.cli import run
    elif stage == "train":
        from specheads.train.cli import run
    elif stage == "export":
        from specheads.export.cli import run
    else:
        from specheads.evaluate.cli import run
    return run


def summarize(cfgs: dict, times: dict) -> dict:
    """Facts from the stages' outputs: labels, head quality, the sweep's headline rows."""
    out: dict = {"stage_seconds": {k: round(v, 1) for k, v in times.items()}}
    dg = Path(cfgs["datagen"].output_dir) / "manifest.json"
    if dg.is_file():
        m = json.loads(dg.read_text())
        out["datagen"] = {k: m.get(k) for k in ("prompts", "labelled_tokens", "label_mean", "expected_label_mean",
                                                "category_shares", "label_mean_by_lambda")}
    best = Path(cfgs["train"].output_dir) / "best_metrics.json"
    if best.is_file():
        b = json.loads(best.read_text())
        out["train"] = {k: b.get(k) for k in ("eval_binary_kl", "eval_auroc", "eval_weighted_loss", "epoch",
                                              "eval_tpr_at_eta", "eval_fpr_at_eta", "eval_wrong_accepted_share")}
    sweep = Path(cfgs["eval"].output_dir) / "sweep.json"
    if sweep.is_file():
        s = json.loads(sweep.read_text())
        out["eval"] = {k: s.get(k) for k in ("table", "oracle", "perfect_head", "ratios", "best_fixed_k",
                                             "best_threshold", "best_stop_rule", "best_lossless", "pareto_dominates",
                                             "pareto_png", "t_target_ms", "t_draft_ms", "cost_table", "sprinter",
                                             "judge", "accuracy")}
    return out


def print_summary(summary: dict, file=None) -> None:
    file = file or sys.stdout
    p = lambda *a: print(*a, file=file)  # noqa: E731
    p("\n== heads-pipeline summary ==")
    p("stage seconds: " + ", ".join(f"{k} {v}" for k, v in summary["stage_seconds"].items()))
    if "datagen" in summary:
        d = summary["datagen"]
        p(f"datagen: {d['prompts']} prompts, {d['labelled_tokens']} labelled tokens, mean label {d['label_mean']}")
    if "train" in summary:
        t = summary["train"]
        if t.get("eval_wrong_accepted_share") is not None:
            p(f"judge: eval AUROC {t['eval_auroc']}, wrong tokens accepted at delta {t['eval_wrong_accepted_share']} "
              f"(epoch {t['epoch']})")
        elif t.get("eval_binary_kl") is not None:
            p(f"head: eval binary KL {t['eval_binary_kl']}, AUROC {t['eval_auroc']} (epoch {t['epoch']})")
        else:
            p(f"verifier: eval AUROC {t['eval_auroc']}, TPR {t['eval_tpr_at_eta']} / FPR {t['eval_fpr_at_eta']} "
              f"at eta (epoch {t['epoch']})")
    ev = summary.get("eval")
    if ev:
        cols = ("config", "tokens_per_s", "tokens_per_call", "verification_rate", "discard_rate",
                "predicted_ms_per_token", "measured_ms_per_token")
        p(" | ".join(cols))
        for r in ev["table"]:  # predicted: the cost table at the row's own target pass sizes
            p(" | ".join("-" if r.get(c) is None else str(r.get(c)) for c in cols))
        if ev.get("oracle"):
            o = ev["oracle"]
            p(f"oracle | {o.get('predicted_tokens_per_s', '-')} (predicted) | - | {o['verification_rate']} | 0.0 | "
              f"{o['model_cost_ms_per_token']} | -")
        if ev.get("oracle") and ev.get("best_lossless"):
            b = ev["best_lossless"]
            p(f"oracle predicted {ev['oracle'].get('predicted_tokens_per_s')} tokens/s vs best lossless row "
              f"{b['config']}: {b['tokens_per_s']} tokens/s measured ({b['predicted_tokens_per_s']} predicted)")
        p(f"best fixed K: {ev.get('best_fixed_k')}, best SpecDec++ threshold: {ev.get('best_threshold')}, "
          f"best stop rule: {ev.get('best_stop_rule')}, ratios: {ev.get('ratios')}, "
          f"pareto_dominates: {ev.get('pareto_dominates')}")
        p(f"Pareto plot: {ev.get('pareto_png')}")
        if ev.get("judge"):
            p(f"judge vs {ev['judge']['sd_reference']}: " + ", ".join(
                f"{n}: accepted/call x{v['vs_sd_accepted_per_call']}, tokens/s x{v['vs_sd_tokens_per_s']}"
                for n, v in ev["judge"]["by_delta"].items()))
        sp = ev.get("sprinter")
        if sp:
            p(f"SPRINTER {sp['main']}: alpha {sp['alpha']}; vs best SD {sp.get('best_sd')}: {sp.get('ratios')}")


def run(argv: list[str]) -> int:
    from specheads.config import to_yaml

    pipe, cfgs = load_configs(argv)
    for stage in pipe.stages:  # every stage's extra up front, not after hours of the earlier stages
        if STAGE_EXTRAS.get(stage):
            extras.require(STAGE_EXTRAS[stage])
    text = "".join(f"{s}:\n" + "".join(f"  {line}\n" for line in to_yaml(cfgs[s]).splitlines()) for s in STAGES
                   if s in cfgs)
    out = prepare_output_dir(pipe.output_dir, to_yaml(pipe) + text, overwrite=pipe.overwrite)
    times = {}
    with MetricsWriter(out) as metrics:
        for stage in pipe.stages:
            log.info("== %s ==", stage)
            t0 = time.perf_counter()
            code = _runner(stage)(cfgs[stage])
            times[stage] = time.perf_counter() - t0
            metrics.write(stage=stage, seconds=round(times[stage], 3), exit_code=code or 0)
            if code:
                return code
    summary = summarize(cfgs, times)
    atomic_write_json(out / "summary.json", summary)
    write_manifest(out, command=PROG, stages=pipe.stages, seconds=round(sum(times.values()), 1))
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
    try:
        _setup_logging()
        return run(args)
    except UserError as exc:
        print(f"{PROG}: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted; run the same command again to resume", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
