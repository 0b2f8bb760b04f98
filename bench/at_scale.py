"""The lossy policies graded at scale, in one interleaved run: writes judge.json, sprinter.json and
training_free.json from one ``heads-eval`` sweep.

    python bench/at_scale.py                       # recipe eval_at_scale: 300 ARC-Challenge + 300 GSM8K test prompts
    python bench/at_scale.py eval.num_prompts=8    # a quick look (any heads-eval override, eval. prefix optional)

1. The judges and the SPRINTER verifier: ``heads-pipeline recipe=judge_mined_quickstart`` (swap-mined labels),
   ``recipe=judge_quickstart`` (arithmetic labels) and ``recipe=sprinter_quickstart`` with
   ``pipeline.stages=[datagen,train,export]``, each skipped when its exported head is already there
   (``--retrain`` runs them again).
2. ``heads-eval recipe=eval_at_scale``: the target alone, SD, each judge at each delta, SPRINTER, FSD with KL
   (the training-free KL judge), top-K verification, batched, every prompt graded (the built-in fact
   questions, ARC-Challenge, GSM8K), with the target's competence per source, each row's fidelity to the
   target's outputs, and ``select=max_disagree:0.02`` (the fastest threshold per lossy policy whose share of
   answers that differ from the target's is at most 2% on every graded source at the upper end of its 95%
   interval, chosen on half the prompts, reported on the other half with its accuracy drop on the sources where
   the target is competent). A killed run resumes where it stopped.
3. ``bench/judge.py``, ``bench/sprinter.py`` and ``bench/training_free.py`` with ``--sweep``: each result file
   reports its own rows of the one sweep (so the target-alone and SD rows, timed side by side with the rest,
   are the same in all three).

One configuration costs about 3 to 6 minutes on 2 CPU cores at the recipe's settings (612 prompts, 96 new
tokens for GSM8K, 16 for ARC and the facts, batch 16).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import judge
import sprinter
import training_free
from _common import eval_config, run_info

from specheads.evaluate.cli import main as eval_main
from specheads.pipeline import main as pipeline_main

ROOT = Path(__file__).resolve().parents[1]
# result file -> (the recipe whose pipeline trains its head, the head's path in the eval config)
HEADS = {
    "judge": ("judge_mined_quickstart", lambda cfg: cfg.judge),
    "judge_arith": ("judge_quickstart", lambda cfg: (cfg.judges or {}).get("arith")),
    "sprinter": ("sprinter_quickstart", lambda cfg: cfg.verifier),
}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", default="eval_at_scale")
    ap.add_argument(
        "--retrain",
        action="store_true",
        help="run the judge and SPRINTER pipelines even if their heads are exported already",
    )
    ap.add_argument("--results", default=str(ROOT / "bench/results"), help="where the three result files go")
    ap.add_argument(
        "--report-only",
        action="store_true",
        help="decode nothing: write the result files from the finished sweep in the recipe's output_dir",
    )
    args, overrides = ap.parse_known_args(argv)
    cfg, eval_args = eval_config("at_scale.py", args.recipe, overrides)  # fail fast on a bad override
    if cfg is None:
        return 2
    for recipe, field in [] if args.report_only else HEADS.values():
        head = field(cfg)
        if head and (args.retrain or not Path(head).is_file()):
            code = pipeline_main(
                [
                    f"recipe={recipe}",
                    "pipeline.stages=[datagen,train,export]",
                    *(["overwrite=true"] if args.retrain else []),
                ]
            )
            if code:
                return code
    code = 0 if args.report_only else eval_main(eval_args)
    if code:
        return code
    # the command that measured the sweep (--report-only only rewrites the files from it)
    command = run_info(__file__, [a for a in (argv if argv is not None else sys.argv[1:]) if a != "--report-only"], "")[
        "command"
    ]
    Path(args.results).mkdir(parents=True, exist_ok=True)
    for name, bench in (("judge", judge), ("sprinter", sprinter), ("training_free", training_free)):
        if name in HEADS and not HEADS[name][1](cfg):
            continue
        out = Path(args.results) / f"{name}.json"
        report = [
            *([f"--recipe={HEADS[name][0]}"] if name in HEADS else []),
            f"--sweep={cfg.output_dir}",
            f"--out={out}",
        ]
        code = bench.main(report)
        if code:
            return code
        result = json.loads(out.read_text())  # the command that measured it, then the one that wrote the file
        result = {"command": command, "report_command": result.pop("command"), **result}
        out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
