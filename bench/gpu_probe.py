"""GPU probes for ``bench/gpu_smoke.sh``: figures the CUDA tests do not give (run on a GPU machine only).

``python bench/gpu_probe.py WORKDIR [all|none|NAME,...]``: writes the smoke's tiny pair
(``WORKDIR/pair/{target,draft}``, word-level tokenizer, nothing downloaded) and its prompt files, then prints
one ``PASS``/``FAIL`` line per probe: the fused forward against the model's own on CUDA (agreement and ms per
one-token forward), the batched row proposer's host time per call by batch, and the EAGLE head's
training-time-test peak memory at Llama-3.1-8B head shape by sequence length."""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from conftest import make_tokenizer  # noqa: E402  (the tests' word-level tokenizer)
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

TOK = make_tokenizer()
V = len(TOK)
WORDS = "the cat sat on a mat and ran to big red blue sun moon one two three four five six".split()


def llama(layers=4, hidden=128, heads=2, kv=1, inter=256, vocab=V, seed=0, device="cpu", dtype=torch.float32):
    """A Llama from a config (head_dim 64, which every CUDA attention backend takes)."""
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        max_position_embeddings=2048,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
        tie_word_embeddings=False,
        initializer_range=0.3 if vocab == V else 0.02,
    )
    torch.manual_seed(seed)
    with torch.device(device):
        model = LlamaForCausalLM(cfg)
    return model.to(dtype).eval()


def write_pair(work: Path) -> None:
    """The tiny target, a perturbed copy as its draft, a prompt file and a judge tuple file."""
    target, draft = llama(), llama()
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(0.05 * torch.randn_like(p))
    for name, m in (("target", target), ("draft", draft)):
        m.save_pretrained(work / "pair" / name)
        TOK.save_pretrained(work / "pair" / name)
    with open(work / "p.jsonl", "w") as f:
        for i in range(16):
            f.write(json.dumps({"prompt": " ".join(WORDS[i % 7 : i % 7 + 5])}) + "\n")
    with open(work / "gsm.jsonl", "w") as f:  # graded questions (GSM8K's fields) for the judge's answers
        for i in range(8):
            f.write(json.dumps({"question": " ".join(WORDS[i : i + 6]), "answer": "one two #### 3"}) + "\n")
    tuples = [
        {"question": "what is one two", "correct": "three four", "wrong": "two three five six", "error": [4, 9]},
        {"question": "why is the sun red", "correct": "the sun is red", "wrong": "", "error": None},
        {"question": "who ran up", "correct": "the dog ran up", "wrong": "a cat sat down", "error": [0, 1]},
        {"question": "is the moon big", "correct": "the moon is big", "wrong": "the sun is red", "error": [4, 7]},
    ] * 2
    with open(work / "tuples.jsonl", "w") as f:
        f.writelines(json.dumps(t) + "\n" for t in tuples)


def run(name: str, fn) -> None:
    start = time.perf_counter()
    try:
        info, status = fn(), "PASS"
    except Exception as err:  # a probe reports its failure and the others still run
        info, status = f"{type(err).__name__}: {(str(err).splitlines() or [''])[0][:200]}", "FAIL"
        traceback.print_exc()
    print(f"{status:6s} probe:{name:22s} {time.perf_counter() - start:5.1f}s  {info}", flush=True)


def fused_vs_hf() -> str:
    """Both shapes: 8 layers 2048 wide (a 1B-class draft) and the shared target's (30 layers, 576 wide)."""
    return " | ".join(_fused_vs_hf(*shape) for shape in ((8, 2048, 16, 8, 5632, 32000), (30, 576, 9, 3, 1536, 49152)))


def _fused_vs_hf(layers: int, hidden: int, heads: int, kv: int, inter: int, vocab: int) -> str:
    from specheads.shim.runners.model_runner import FusedRunner, ModelRunner

    mid = llama(layers, hidden, heads, kv, inter, vocab, device="cuda", dtype=torch.bfloat16)
    ids = torch.randint(3, vocab, (1, 100), device="cuda")
    runners = {"hf": ModelRunner(mid, capacity=256), "fused": FusedRunner(mid, capacity=256)}
    lh, _ = runners["hf"].forward(ids, n_logits=100)
    lf, _ = runners["fused"].forward(ids, n_logits=100)
    agree = float((lh.argmax(-1) == lf.argmax(-1)).float().mean())
    ms = {}
    for name, r in runners.items():
        for _ in range(3):
            r.forward(ids[:, :1], 1)
            r.trim(100)
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(30):
            r.forward(ids[:, :1], 1)
            r.trim(100)
        torch.cuda.synchronize()
        ms[name] = round((time.perf_counter() - t) / 30 * 1e3, 2)
    if agree <= 0.9:
        raise AssertionError(f"argmax agreement {agree:.2f}")
    return f"{layers} layers {hidden} wide bf16: argmax agreement {agree:.3f}, ms per one-token forward {ms}"


def row_proposer() -> str:
    from specheads.shim import RowProposer, StandardSD

    out = {}
    for b in (16, 64, 128):
        prop = RowProposer(llama(device="cuda", dtype=torch.bfloat16), StandardSD(3), b, eos=[2])
        g = torch.Generator().manual_seed(b)
        seqs = {i: torch.randint(3, V, (800,), generator=g).tolist() for i in range(b)}
        prop.propose(seqs)
        seqs = {i: s + [5] for i, s in seqs.items()}
        torch.cuda.synchronize()
        t = time.perf_counter()
        prop.propose(seqs)
        out[b] = round(time.perf_counter() - t, 3)
    return f"s per steady propose() by batch {out}"


def eagle_ttt_memory() -> str:
    from specheads.heads.eagle_head import EagleHead, unrolled_forward

    head = EagleHead(
        hidden_size=4096,
        layers=[2, 16, 29],
        draft_vocab_size=32000,
        vocab_size=128256,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        intermediate_size=14336,
        rms_norm_eps=1e-5,
        rope_theta=5e5,
    ).to("cuda", torch.bfloat16)
    res = {}
    for t in (512, 1024, 2048):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        st = torch.randn(1, t, 3 * 4096, device="cuda", dtype=torch.bfloat16)
        emb = torch.randn(3, 1, t, 4096, device="cuda", dtype=torch.bfloat16)
        rows = [torch.ones(1, t, dtype=torch.bool, device="cuda")] * 3
        sum(x.float().logsumexp(-1).sum() for x in unrolled_forward(head, st, emb, None, rows)).backward()
        head.zero_grad(set_to_none=True)
        res[t] = round(torch.cuda.max_memory_allocated() / 2**30, 1)
    return f"peak GiB at batch 1 by sequence length {res} (Llama-3.1-8B head shape, 3 TTT steps)"


def main(argv: list[str] | None = None) -> int:
    probes = {"fused_vs_hf_cuda": fused_vs_hf, "row_proposer_cuda": row_proposer, "eagle_ttt_memory": eagle_ttt_memory}
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("workdir", help="where the tiny pair and its prompt files are written")
    ap.add_argument("probes", nargs="?", default="all", help=f"all, none, or some of {','.join(probes)}")
    args = ap.parse_args(argv)
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    write_pair(work)
    wanted = args.probes.split(",") if args.probes != "all" else list(probes)
    if not torch.cuda.is_available() or wanted == ["none"]:
        print("SKIP   probes: " + ("none asked for" if torch.cuda.is_available() else "no CUDA device"))
        return 0
    for name in wanted:
        run(name, probes[name])
    return 0


if __name__ == "__main__":
    sys.exit(main())
