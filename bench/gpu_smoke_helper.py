"""Two helpers of ``bench/gpu_smoke.sh``.

``python bench/gpu_smoke_helper.py split heads-decode key=value ...`` runs that console script in this process,
where a target loaded with ``target.device_map=auto`` is placed over two devices. With two GPUs or more, ``auto``
is left to Transformers (accelerate balances the layers over the GPUs). With one GPU, ``auto`` would keep a small
model whole on it, so the map is made explicit: the embeddings and the first half of the layers on cuda:0, the
rest (with the final norm and the output layer) on the CPU, as a ``max_memory`` too small for the model would.
Without a GPU (``SMOKE_DEVICE=cpu``, the dry run) both halves are on the CPU: the same command lines, through the
``device_map`` path. Llama-family models (``model.layers.N``). The placement is printed to stderr.

``python bench/gpu_smoke_helper.py check WORK LOGS`` checks what the steps wrote beyond their exit codes (only
the outputs present): heads-eval's fidelity section covers every row, the tree rows are there, the cost-aware
decodes ran ``stop=cost``, the batched ones at their batch, and on a GPU the split target's layers were placed on
two devices."""

from __future__ import annotations

import json
import re
import sys
from importlib.metadata import entry_points
from pathlib import Path

import torch

PLACED = "gpu_smoke_helper: placed "


def split_map(config) -> dict[str, str]:
    """Embeddings and the first half of the layers on the first device, the rest on the second."""
    first, second = ("cuda:0", "cpu") if torch.cuda.is_available() else ("cpu", "cpu")
    n = config.num_hidden_layers
    out = {"model.embed_tokens": first, "model.rotary_emb": first}
    out.update({f"model.layers.{i}": first if i < n // 2 else second for i in range(n)})
    out.update({"model.norm": second, "lm_head": second})
    return out


def patch() -> None:
    """``from_pretrained(device_map="auto")`` over two devices where there are fewer than two GPUs."""
    from transformers import AutoConfig, AutoModelForCausalLM

    load = AutoModelForCausalLM.from_pretrained.__func__

    def from_pretrained(cls, path, *args, **kwargs):
        if kwargs.get("device_map") == "auto" and torch.cuda.device_count() < 2:
            extra = {k: kwargs[k] for k in ("gguf_file", "revision", "trust_remote_code") if k in kwargs}
            kwargs["device_map"] = split_map(AutoConfig.from_pretrained(path, **extra))
        model = load(cls, path, *args, **kwargs)
        if kwargs.get("device_map"):
            placed = getattr(model, "hf_device_map", None) or kwargs["device_map"]
            print(PLACED + json.dumps({k: str(v) for k, v in placed.items()}), file=sys.stderr, flush=True)
        return model

    AutoModelForCausalLM.from_pretrained = classmethod(from_pretrained)


def split(name: str, argv: list[str]) -> int:
    (script,) = [e for e in entry_points(group="console_scripts") if e.name == name]
    patch()
    sys.argv = [name, *argv]
    return script.load()()


def check(work: Path, logs: Path) -> list[str]:
    """What is wrong in the outputs present (empty: nothing); prints what it checked."""
    bad = []

    def expect(ok: bool, what: str) -> None:
        print(("ok      " if ok else "WRONG   ") + what)
        if not ok:
            bad.append(what)

    for name in ("eval", "eval_eagle", "eval_split", "vllm_eval"):
        f = work / name / "sweep.json"
        if f.exists():
            sweep = json.loads(f.read_text())
            rows = [r["config"] for r in sweep["table"]]
            missing = [r for r in rows if r not in ("ar", "draft") and r not in (sweep.get("fidelity") or {})]
            expect(not missing, f"{name}: fidelity covers every row of {rows} (missing {missing})")
            if name == "eval_eagle":
                expect({"tree-2x2x3", "tree-3x2x4-cost"} <= set(rows), f"{name}: the tree rows are in {rows}")
    for name, key, want in (
        ("dec_tree", "policy", "tree"),
        ("dec_tree_cost", "stop", "cost"),
        ("dec_specdecpp_cost", "stop", "cost"),
        ("dec_conf_cost", "stop", "cost"),
        ("dec_batched", "batch_size", 4),
        ("dec_batched_eagle", "batch_size", 4),
    ):
        f = work / name / "metrics.json"
        if f.exists():
            got = json.loads(f.read_text()).get(key)
            expect(got == want, f"{name}: metrics.json {key}={got!r} (want {want!r})")
    if torch.cuda.is_available():
        for log in sorted(logs.glob("*split*.log")):
            maps = [json.loads(m) for m in re.findall(re.escape(PLACED) + r"(\{.*\})", log.read_text())]
            devices = sorted({d for m in maps for d in m.values()})
            expect(bool(maps) and len(devices) >= 2, f"{log.stem}: the target placed on {devices}")
    return bad


def main() -> int:
    if sys.argv[1] == "split":
        return split(sys.argv[2], sys.argv[3:])
    return 1 if check(Path(sys.argv[2]), Path(sys.argv[3])) else 0


if __name__ == "__main__":
    sys.exit(main())
