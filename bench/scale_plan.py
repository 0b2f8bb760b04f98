"""The plan (``plan=true``) of the at-scale recipes on one node of 8x80 GB GPUs, and what is refused there.

    python bench/scale_plan.py                 # a table of heads-datagen and heads-train per recipe
    python bench/scale_plan.py --out plan.json # the same figures as JSON

:func:`measure` gives ``bench/results/scale.json``'s ``plan`` entry: for ``judge_405b`` and
``specdecpp_llama31_8b_70b``, the figures of ``heads-datagen`` and ``heads-train`` (per process, GB; disk;
time), whether each fits, and the refusal line with the alternatives that would fit. Nothing is loaded or
downloaded: the shapes are the models' published ones (``specheads/model_shapes.py``); the datagen time is
the memory-bandwidth bound (``gpu_bandwidth_gbs``), the training time needs a measured ``tokens_per_s``.
"""

from __future__ import annotations

import argparse
import json
import sys

RECIPES = ("judge_405b", "specdecpp_llama31_8b_70b")
CLUSTER = ["nodes=1", "gpus=8", "gpu_memory_gb=80"]


def measure(recipes=RECIPES, cluster: list[str] | None = None) -> dict:
    """Per recipe and CLI, the plan's figures on ``cluster`` (default one node of 8x80 GB)."""
    from specheads.plan import plan_figures

    cluster = list(CLUSTER if cluster is None else cluster)
    out = {"cluster": " ".join(cluster), "recipes": {}, "refusals": []}
    for recipe in recipes:
        out["recipes"][recipe] = {}
        for cli in ("heads-datagen", "heads-train"):
            plan = plan_figures(cli, recipe, cluster)
            out["recipes"][recipe][cli] = plan
            if not plan["fits"]:
                out["refusals"].append(
                    {"recipe": recipe, "cli": cli, "refusal": plan["refusal"], "would_fit": plan["would_fit"]}
                )
    return out


def table(result: dict) -> str:
    """The figures as a text table (GB)."""
    head = f"{'recipe':<26}{'command':<15}{'target':>8}{'draft':>7}{'head':>7}{'act':>7}{'KV':>7}{'labels':>8}"
    head += f"{'optim':>7}{'fullest':>9}{'usable':>8}{'disk':>8}{'hours':>8}  fits"
    lines = [f"plan on {result['cluster']} (GB per process; fullest: the fullest GPU)", head]
    for recipe, plans in result["recipes"].items():
        for cli, p in plans.items():
            f, w, t = p["per_process_gb"], p["per_process_gb"]["weights"], p["time"]
            hours = f"{t['hours']:.3g}" if t["hours"] is not None else "-"
            fits = "yes" if p["fits"] else "NO"
            lines.append(
                f"{recipe:<26}{cli:<15}{w['target']:>8.1f}{w['draft']:>7.1f}{w['head']:>7.2f}{f['activations']:>7.1f}"
                f"{f['kv_cache']:>7.1f}{f['label_buffers']:>8.1f}{f['optimizer']:>7.2f}{f['fullest_gpu']:>9.1f}"
                f"{f['usable_per_gpu']:>8.1f}{sum(p['disk_gb'].values()):>8.2f}{hours:>8}  {fits}"
            )
    for r in result["refusals"]:
        lines.append(f"{r['cli']} recipe={r['recipe']}: {r['refusal']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="also write the figures as JSON here")
    parser.add_argument(
        "overrides", nargs="*", help="cluster key=value settings (default: nodes=1 gpus=8 gpu_memory_gb=80)"
    )
    args = parser.parse_args(argv)
    result = measure(cluster=args.overrides or None)
    print(table(result))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
