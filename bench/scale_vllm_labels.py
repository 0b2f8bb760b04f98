"""Acceptance labels and swap mining through vLLM against the Transformers engine, on the shared pair.

    python bench/scale_vllm_labels.py                 # 4 prompts per case, fp32, 2 threads (~10 min)

Run with the project's Python (vLLM in its own virtualenv: ``--vllm-python``). Each case runs ``heads-datagen`` on
the same prompts with ``engine=specheads`` (the Transformers target generates and scores) and ``engine=vllm``
(vLLM generates; no Transformers target pass: :mod:`specheads.datagen.vllm_logprobs`, :mod:`.vllm_mining`):

* ``acceptance_greedy`` (recipe ``specdecpp_draft_quickstart``): every row equal, at ``vllm.tensor_parallel=1``
  and at 3 (the shared target's 9 heads and 3 KV heads allow 1 and 3; on two cores vLLM's three workers are bound
  ``0|1|0``);
* ``acceptance_sampled_top_k50`` (temperature 1, top-k 50: ``specdecpp_llama31_8b_70b``'s setting): vLLM's sampled
  responses are not the Transformers engine's draws, so each ``engine=vllm`` row's labels (from vLLM's top-50
  log-probabilities) are compared with those of the Transformers target's teacher-forced pass over the same
  response at the same draft tokens: ``max_abs_diff`` of ``label`` and ``expected_label``;
* ``acceptance_sampled_whole_vocab`` (temperature 1, no top-k: vLLM returns the whole vocabulary), the same way;
* ``judge_swap_mining`` (recipe ``judge_mined_quickstart`` on ARC-train prompts, 16 tokens): ``mined.jsonl`` and
  every row equal; the share of the continuations' prompt tokens vLLM's prefix cache served.

``tokens_per_s``: labelled tokens over each run's whole wall time (models loading and vLLM's start-up included:
at a few prompts on a CPU that start-up dominates). ``measure()`` returns the figures; as a script it prints a
table and writes ``--out`` (default ``bench/results/scale_vllm_labels.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("SPECHEADS_SHARED", str(ROOT.parent / "shared")))
os.environ["SPECHEADS_SHARED"] = str(SHARED)  # the recipes' model and prompt paths, from any directory
sys.path.insert(0, str(ROOT / "bench"))
from _common import rows, run_datagen  # noqa: E402

ACCEPTANCE = "specdecpp_draft_quickstart"
SAMPLED = ["sampling.do_sample=true", "sampling.temperature=1.0", "max_new_tokens=48"]
CASES = {  # recipe, overrides, the engine=vllm runs (tensor-parallel sizes), whether the HF run's rows must equal
    "acceptance_greedy": (ACCEPTANCE, ["max_new_tokens=48"], (1, 3), True),
    "acceptance_sampled_top_k50": (ACCEPTANCE, [*SAMPLED, "sampling.top_k=50"], (1,), False),
    "acceptance_sampled_whole_vocab": (ACCEPTANCE, [*SAMPLED, "sampling.top_k=0"], (1,), False),
    "judge_swap_mining": (
        "judge_mined_quickstart",
        [f"prompts={SHARED}/data/arc_challenge/train.jsonl", "max_new_tokens=16", "judge.mine_max_mismatches=4"],
        (1,),
        True,
    ),
}


def label_gap(cfg, out: Path) -> float:
    """The largest difference between a run's sampled labels and those of the Transformers target's teacher-forced
    pass over the same responses at the same draft tokens (fp32)."""
    import torch
    from transformers import AutoModelForCausalLM

    from specheads.datagen.acceptance_labels import response_logits
    from specheads.shim.core.sampling import probs_from_logits

    def load(spec):
        kw = {"gguf_file": spec.gguf_file} if spec.gguf_file else {}
        return AutoModelForCausalLM.from_pretrained(spec.path, dtype=torch.float32, **kw).eval()

    target, draft = load(cfg.target), load(cfg.draft)
    gap = 0.0
    for r in rows(out):
        x, y = r["input_ids"][: r["response_start"]], r["input_ids"][r["response_start"] :]
        p, q = (probs_from_logits(response_logits(m, [x], [y], 0)[0], cfg.sampling) for m in (target, draft))
        t = torch.tensor(r["draft_token"])[:, None]
        py, qy = p.gather(-1, t).squeeze(-1), q.gather(-1, t).squeeze(-1)
        label = torch.where(qy > 0, (py / qy.clamp_min(1e-30)).clamp(max=1.0), torch.ones_like(py))
        gap = max(gap, float((label - torch.tensor(r["label"])).abs().max()))
        gap = max(gap, float((torch.minimum(p, q).sum(-1) - torch.tensor(r["expected_label"])).abs().max()))
    return gap


def rows_gap(a: list[dict], b: list[dict]) -> tuple[bool, float]:
    """Whether two runs' rows are equal, and the largest difference of their float labels."""
    worst = 0.0
    for x, y in zip(a, b):
        for key in ("label", "expected_label", "labels"):
            if key in x and x[key] is not None and len(x[key]) == len(y[key]):
                worst = max([worst, *(abs(u - v) for u, v in zip(x[key], y[key]))])
    return a == b, worst


def measure(prompts: int = 4, threads: int = 2, vllm_python: str = "/work/vllm-venv/bin/python") -> dict:
    """``vllm_vs_hf_labels`` and ``datagen_tokens_per_s`` per case (see the module docstring)."""
    import torch

    from specheads.config import load_config
    from specheads.datagen.config import DatagenConfig

    torch.set_num_threads(threads)
    common = [f"num_prompts={prompts}", "offset=0", f"threads={threads}", f"vllm.threads={threads}"]
    common += [f"chunk_size={prompts}", f"batch_size={prompts}"]
    labels, speed = {}, {}
    with tempfile.TemporaryDirectory(prefix="scale-vllm-labels-") as tmp:
        for case, (recipe, extra, tps, must_equal) in CASES.items():
            runs = {}
            if must_equal or case.endswith("top_k50"):  # the whole-vocabulary case's HF run is top_k50's
                runs["hf"] = run_datagen(recipe, [*common, *extra], Path(tmp) / f"{case}-hf")
            for tp in tps:
                vllm = ["engine=vllm", f"vllm.python={vllm_python}", f"vllm.tensor_parallel={tp}"]
                runs[f"vllm_tp{tp}"] = run_datagen(recipe, [*common, *extra, *vllm], Path(tmp) / f"{case}-vllm{tp}")
            cfg = load_config(DatagenConfig, "datagen", [f"recipe={recipe}", *common, *extra])
            for tp in tps:
                out = Path(tmp) / f"{case}-vllm{tp}"
                if must_equal:
                    equal, worst = rows_gap(rows(Path(tmp) / f"{case}-hf"), rows(out))
                    entry = {"labels_equal": equal, "max_abs_diff": worst}
                else:
                    worst = label_gap(cfg, out)
                    entry = {"max_abs_diff": worst, "within_1e-4": worst <= 1e-4}
                entry |= {"tensor_parallel": tp, "rows": len(rows(out))}
                if case == "judge_swap_mining":
                    m = runs[f"vllm_tp{tp}"][1]["mining"]
                    entry["mined_equal"] = (Path(tmp) / f"{case}-hf/mined.jsonl").read_text() == (
                        out / "mined.jsonl"
                    ).read_text()
                    entry["mismatches_tried"] = m["mismatches_tried"]
                    entry["prefix_cached_share"] = round(m["vllm_cached_tokens"] / max(m["vllm_prompt_tokens"], 1), 3)
                labels[case if tp == 1 else f"{case}_tp{tp}"] = entry
            speed[case] = {
                name: {
                    "tokens_per_s": round(man["labelled_tokens"] / seconds, 2),
                    "seconds": round(seconds, 1),
                    "labelled_tokens": man["labelled_tokens"],
                }
                for name, (seconds, man) in runs.items()
            }
    return {"prompts_per_case": prompts, "threads": threads, "vllm_vs_hf_labels": labels, "datagen_tokens_per_s": speed}


def table(got: dict) -> list[dict]:
    """One row per case and engine run: its labels against the Transformers engine's, its tokens/s."""
    out = []
    for case, engines in got["datagen_tokens_per_s"].items():
        for name, e in engines.items():
            check = got["vllm_vs_hf_labels"].get(case if name in ("hf", "vllm_tp1") else f"{case}_{name[5:]}", {})
            row = {"case": case, "engine": name, "tensor_parallel": "-", "labels_match": "-", "max_abs_diff": "-"}
            if name != "hf":  # match: equal (greedy, mining) or within 1e-4 (sampled)
                row["tensor_parallel"] = check["tensor_parallel"]
                row["labels_match"] = check.get("labels_equal", check.get("within_1e-4"))
                row["max_abs_diff"] = check["max_abs_diff"]
            out.append(row | {k: e[k] for k in ("labelled_tokens", "seconds", "tokens_per_s")})
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=4, help="prompts per case")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--vllm-python", default="/work/vllm-venv/bin/python")
    ap.add_argument("--out", default=str(ROOT / "bench/results/scale_vllm_labels.json"))
    args = ap.parse_args(argv)
    t = time.perf_counter()
    got = measure(args.prompts, args.threads, args.vllm_python)
    sys.path.insert(0, str(ROOT / "bench"))
    from _common import run_info

    result = {
        **run_info(__file__, argv, f"fp32, {args.threads} threads (torch and vLLM's OMP)"),
        **got,
        "table": table(got),
        "seconds": round(time.perf_counter() - t, 1),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print("case | TP | rows | labels equal / within 1e-4 | max abs diff")
    for case, e in got["vllm_vs_hf_labels"].items():
        ok = e.get("labels_equal", e.get("within_1e-4"))
        print(f"{case} | {e['tensor_parallel']} | {e['rows']} | {ok} | {e['max_abs_diff']:.2e}")
    print("\ncase | engine | labelled tokens | seconds | tokens/s")
    for case, engines in got["datagen_tokens_per_s"].items():
        for name, e in engines.items():
            print(f"{case} | {name} | {e['labelled_tokens']} | {e['seconds']} | {e['tokens_per_s']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
