"""Training that streams, measured: EAGLE training's peak memory on 4x the data over 1x, and the target bytes it reads.

    python bench/scale_train.py                     # a table; ~5 minutes on 2 cores, ~6.5 GB of scratch disk
    python bench/scale_train.py --out train.json    # the same figures as JSON

:func:`measure` gives ``bench/results/scale.json``'s two training entries:

* ``eagle_train_peak_rss_4x_over_1x``: the peak resident memory (``ru_maxrss``) of a ``heads-train head=eagle``
  process on four data sets (``data_dir=a,b,c,d``) over the same command on the first alone, same settings.
  The data are synthetic ``labels=drafter`` runs of the shared target's shape (states at its layers 2, 15, 27:
  ``3 x 576`` fp16 per position; top-20 per response token; 64 sequences per chunk; token ids drawn from
  one Zipf-like ranking), each of at least ``--tokens`` positions (default 363k, the committed head's data):
  producing that much real data takes the target about 11 hours on this CPU. Every sequence is 88 positions
  long (the committed data's mean; the prompt 16 to 40 of them), so that every batch of both runs has one
  shape: with lengths drawn at random the peak follows the longest batch the permutation happens to
  draw, not the data's size (measured: 1,243 MB and 1,503 MB for batches up to 172 and 187 positions). The
  manifest names the shared target's real fingerprint, so the run reads its tensors as a real one does.
* ``eagle_target_bytes_read_over_total``: the bytes of target tensors the 1x run read (its manifest's
  ``target_bytes_read``: the embeddings, dequantised from the GGUF file's memory map) over the size of
  the shared GGUF target file.

Each training run is its own child process (the figure is that process's own peak); the data are written
by another. Only the run's size differs between the two runs: a fixed ``max_steps``, so the work per step
is the same and the held-out set (``eval_fraction``) and the pass that ranks the vocabulary grow with the data.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("SPECHEADS_SHARED", ROOT.parent / "shared"))
TARGET = SHARED / "models" / "smollm2-135m-instruct"
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
LAYERS = [2, 15, 27]  # datagen's default for 30 layers
TOP_K, CHUNK = 20, 64
LENGTH = 88  # positions per sequence: the committed head's data average 87 (363k over 4,160 prompts)
TRAIN = ["eagle.ttt_steps=3", "vocab_top_n=8192", "batch_size=8", "grad_accum=1", "lr=1.5e-3", "max_steps=8"]
TRAIN += ["epochs=1", "eval_fraction=0.01", "checkpoint_every=0", "threads=2", "seed=0"]


def write_synthetic(out: Path, tokens: int, seed: int, target: dict) -> dict:
    """A ``labels=drafter`` run in ``out`` of at least ``tokens`` positions with random states and top-k;
    returns its size."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import torch

    from specheads.dataset import DrafterChunkFiles, chunk_path

    gen = torch.Generator().manual_seed(seed)
    vocab, width = target["vocab_size"], len(LAYERS) * target["hidden_size"]
    # one Zipf-like ranking of token ids for every part (as real text shares its frequent tokens)
    order = torch.randperm(vocab, generator=torch.Generator().manual_seed(1234))
    weights = 1.0 / (torch.arange(vocab, dtype=torch.float64) + 10.0) ** 1.1
    total, rows, shards, chunk = 0, 0, [], 0
    while total < tokens:
        ids, starts, states_n, top_ids, top_logp, offs, roffs = [], [], 0, [], [], [0], [0]
        for _ in range(CHUNK):
            p = int(torch.randint(16, 41, (1,), generator=gen))
            r = LENGTH - p
            seq = order[torch.multinomial(weights, p + r, replacement=True, generator=gen)]
            ids.append(seq.tolist())
            starts.append(p)
            ti = order[torch.multinomial(weights, r * TOP_K, replacement=True, generator=gen)].view(r, TOP_K)
            ti[:, 0] = seq[p:]
            logits = torch.randn(r, TOP_K, generator=gen).sort(dim=-1, descending=True).values * 2
            top_ids.append(ti.int())
            top_logp.append(torch.log_softmax(torch.cat([logits, torch.zeros(r, 1)], -1), -1)[:, :TOP_K])
            states_n += p + r
            offs.append(states_n)
            roffs.append(roffs[-1] + r)
        states = torch.randn(states_n, width, generator=gen).to(torch.float16)
        DrafterChunkFiles(out, chunk).write(
            {
                "states": states,
                "offsets": torch.tensor(offs, dtype=torch.int64),
                "top_ids": torch.cat(top_ids),
                "top_logp": torch.cat(top_logp).float(),
                "response_offsets": torch.tensor(roffs, dtype=torch.int64),
                "layers": torch.tensor(LAYERS, dtype=torch.int64),
            }
        )
        table = pa.table(
            {
                "prompt_id": [f"synthetic-{seed}-{rows + i}" for i in range(CHUNK)],
                "prompt_index": list(range(rows, rows + CHUNK)),
                "input_ids": ids,
                "response_start": starts,
            }
        )
        path = chunk_path(out, chunk)
        path.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(table, str(path))
        shards.append({"file": str(path.relative_to(out)), "chunk": chunk, "rows": CHUNK, "bytes": path.stat().st_size})
        total, rows, chunk = total + states_n, rows + CHUNK, chunk + 1
    manifest = {
        "command": "bench/scale_train.py (synthetic states and top-k of the shared target's shape)",
        "labels": "drafter",
        "schema_version": 2,
        "drafter": {"layers": LAYERS, "top_k": TOP_K, "hidden_size": target["hidden_size"]},
        "target": {"name": target["name"], "fingerprint": target["fingerprint"]},
        "sampling": {"do_sample": False},
        "seed": seed,
        "chunks": chunk,
        "prompts": rows,
        "state_positions": total,
        "shards": shards,
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1))
    return {"sequences": rows, "tokens": total, "chunks": chunk}


def _generate(root: Path, tokens: int, parts: int) -> dict:
    """Child: the shared target's fingerprint and shape (loaded as datagen loads it), then ``parts`` data sets."""
    from specheads.shim import ModelSpec, load_model

    loaded = load_model(ModelSpec(path=str(TARGET), gguf_file=GGUF, device="cpu", dtype="float32"), "target")
    c = loaded.model.config
    target = {"name": loaded.name, "fingerprint": loaded.fingerprint, "vocab_size": c.vocab_size}
    target["hidden_size"] = c.hidden_size
    del loaded
    return {f"part{i}": write_synthetic(root / f"part{i}", tokens, seed=i, target=target) for i in range(parts)}


def _train(argv: list[str]) -> dict:
    """Child: one ``heads-train`` run in this process; its peak RSS and what its manifest records."""
    import resource

    from specheads.train.cli import main

    start = time.perf_counter()
    code = main(argv)
    seconds = time.perf_counter() - start
    out = next(a.split("=", 1)[1] for a in argv if a.startswith("output_dir="))
    manifest = json.loads((Path(out) / "manifest.json").read_text()) if code == 0 else {}
    return {
        "exit_code": code,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,  # Linux: KiB
        "seconds": round(seconds, 1),
        "target_bytes_read": manifest.get("target_bytes_read"),
        "target_bytes_total": manifest.get("target_bytes_total"),
        "train_data": manifest.get("train_data"),
    }


def _child(kind: str, payload) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "2", "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run(
        [sys.executable, __file__, f"--child-{kind}", json.dumps(payload)], capture_output=True, text=True, env=env
    )
    if done.returncode != 0:
        raise RuntimeError(f"{kind} child failed ({done.returncode}): {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def measure(tokens: int = 363_000, workdir: str | None = None) -> dict:
    """The two training figures (see the module docstring); ``workdir`` keeps the data (default: removed)."""
    with tempfile.TemporaryDirectory(prefix="scale-train-", dir=workdir) as tmp:
        root = Path(tmp)
        sizes = _child("generate", {"root": str(root), "tokens": tokens, "parts": 4})
        common = ["head=eagle", f"target.path={TARGET}", f"target.gguf_file={GGUF}", "target.dtype=float32"]
        common += ["target.device=cpu", *TRAIN]
        runs = {}
        for name, parts in (("1x", ["part0"]), ("4x", ["part0", "part1", "part2", "part3"])):
            data = ",".join(str(root / p) for p in parts)
            argv = [f"data_dir={data}", f"output_dir={root / ('train-' + name)}", *common]
            runs[name] = _child("train", argv)
            if runs[name]["exit_code"] != 0:
                raise RuntimeError(f"the {name} training run failed with exit code {runs[name]['exit_code']}")
    one, four = runs["1x"], runs["4x"]
    return {
        "eagle_train_peak_rss_4x_over_1x": round(four["peak_rss_mb"] / one["peak_rss_mb"], 3),
        "eagle_target_bytes_read_over_total": round(one["target_bytes_read"] / one["target_bytes_total"], 4),
        "runs": runs,
        "data": sizes,
        "settings": common,
        "synthetic_data": (
            "states and top-k drawn at random in the shared target's shape (layers 2, 15, 27 of 576 wide, "
            f"top-{TOP_K}, {CHUNK} sequences per chunk, {LENGTH} positions each); real data of this size takes "
            "the target ~11 h on this CPU"
        ),
    }


def table(result: dict) -> str:
    r = result["runs"]
    lines = [
        f"{'run':<5}{'sequences':>10}{'tokens':>10}{'peak RSS MB':>13}{'seconds':>9}{'target MB read':>16}",
        *(
            f"{k:<5}{v['train_data']['sequences']:>10}{v['train_data']['tokens']:>10}{v['peak_rss_mb']:>13.0f}"
            f"{v['seconds']:>9.0f}{v['target_bytes_read'] / 2**20:>16.1f}"
            for k, v in r.items()
        ),
        f"eagle_train_peak_rss_4x_over_1x     {result['eagle_train_peak_rss_4x_over_1x']} (must be <= 1.2)",
        f"eagle_target_bytes_read_over_total  {result['eagle_target_bytes_read_over_total']} (must be < 0.5; "
        f"of {r['1x']['target_bytes_total'] / 2**20:.1f} MB)",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args and args[0] in ("--child-generate", "--child-train"):
        payload = json.loads(args[1])
        if args[0] == "--child-generate":
            got = _generate(Path(payload["root"]), payload["tokens"], payload["parts"])
        else:
            got = _train(payload)
        print(json.dumps(got))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=363_000, help="positions per data set (the 1x set)")
    parser.add_argument("--workdir", help="where the scratch data go (default: the system's temporary folder)")
    parser.add_argument("--out", help="also write the figures as JSON here")
    a = parser.parse_args(args)
    result = measure(a.tokens, a.workdir)
    print(table(result))
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
