"""Where an EAGLE head's training states come from (``eagle.states``): stored, made while it trains, or both.

* ``offline``: the states ``heads-datagen labels=drafter`` stored (``[T, layers x d]`` fp16 a sequence, read
  lazily by :class:`~specheads.train.drafter_data.DrafterData`): about ``6 d`` bytes a token, 48 KiB at 70B width.
* ``online``: made for each micro-batch from the sequences' ids and dropped after it (:class:`Maker`): nothing is
  stored but the ids and the top-k (``heads-datagen drafter.store_states=false``). ``eagle.engine=specheads`` runs the
  target in this process (:func:`specheads.runtime.states.sequence_states`, the pass datagen's Transformers engine
  stores, so the states are the stored ones bit for bit); each process of ``accelerate launch`` makes the states of
  its own micro-batches. ``eagle.engine=vllm`` asks a vLLM engine running ``extract_hidden_states`` with the ``vllm``
  section's parallelism (:class:`specheads.vllm.child.StatesServer`, one per process, the datagen engine's: states
  equal to those ``engine=vllm`` stores), for targets that do not fit beside the head.
* ``hybrid``: online, and each sequence's states, once made, kept in an on-disk cache (:class:`Cache`) bounded by
  ``eagle.cache_gb``: the first epoch makes them, the later ones read them back; sequences past the bound are made
  every epoch. The cache is keyed by the data, the layers, the target's fingerprint and the engine, so a rerun
  (a resumed run included) reads what an earlier one made.

The states a step sees are the same in every mode (the cache holds the fp16 tensors the maker gave), so the loss
curve and the head are too, to the stored states' rounding (``bench/eagle_online.py`` measures it).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import replace
from pathlib import Path

import torch

from specheads.engines import ENGINES
from specheads.errors import UserError

MODES = ("auto", "offline", "online", "hybrid")
GB = 1e9


def problems(cfg) -> list[str]:
    """What is wrong with the ``eagle`` section's states settings, one line each."""
    e, out = cfg.eagle, []
    if e.states not in MODES:
        out.append(f"eagle.states={e.states!r}; choose one of {list(MODES)}")
    engine = ENGINES.get(e.engine)
    if engine is None:
        out.append(f"eagle.engine={e.engine!r}; choose one of {list(ENGINES)}")
    elif engine.own_python:
        out += cfg.vllm.problems()
    if e.cache_gb < 0:
        out.append(f"eagle.cache_gb={e.cache_gb} must be >= 0")
    return out


def resolve(mode: str, stored: bool, dirs: list[str]) -> str:
    """The mode a run takes: ``auto`` is offline when every data set stores its states, else online."""
    if mode == "auto":
        return "offline" if stored else "online"
    if mode == "offline" and not stored:
        raise UserError(
            f"eagle.states=offline but {', '.join(dirs)} stores no states (heads-datagen drafter.store_states="
            "false); use eagle.states=online or hybrid, or regenerate the data with drafter.store_states=true"
        )
    return mode


class Maker:
    """Makes a batch's states from its sequences' ids: ``make(seqs) -> [T, len(layers) x d]`` fp16 on the CPU each.

    Args:
        cfg: the run's ``TrainConfig`` (``target``, ``eagle.engine``, the ``vllm`` section, ``seed``,
            ``output_dir``).
        layers: the target layers the data's states are taken at.
        device: this process's device (the target's, when ``target.device`` is ``auto`` and no ``device_map``).
        limit: the longest sequence it will be asked (vLLM's ``max_model_len``).
        local_rank: this process's index on its node (its vLLM's GPUs).
    """

    def __init__(self, cfg, layers: list[int], device, limit: int, local_rank: int = 0):
        self.layers, self.engine = list(layers), cfg.eagle.engine
        self.tokens, self.seconds = 0, 0.0
        if ENGINES[self.engine].own_python:  # vLLM, in its own Python
            from specheads.vllm.child import StatesServer

            self.server = StatesServer(cfg, limit + 1, local_rank)  # a prompt and the one token vLLM asks room for
            self.model = None
        else:
            from specheads.shim import load_model

            spec = cfg.target
            if spec.device == "auto" and not spec.device_map:
                spec = replace(spec, device=str(device))
            self.model = load_model(spec, "target").model.eval()
            self.server = None

    def make(self, seqs: list[list[int]]) -> list[torch.Tensor]:
        start = time.perf_counter()
        if self.server is not None:
            got = [st.reshape(st.shape[0], -1).to(torch.float16) for st, _ in self.server.states(seqs, self.layers)]
        else:
            from specheads.runtime.states import sequence_states

            got = sequence_states(self.model, seqs, self.layers)
        for seq, st in zip(seqs, got):
            if not bool(torch.isfinite(st).all()):
                raise UserError(
                    f"engine {self.engine}: the target's states of a {len(seq)}-token sequence are not finite; "
                    "check target.dtype (fp16 overflows on some targets: use bfloat16 or float32)"
                )
        self.seconds += time.perf_counter() - start
        self.tokens += sum(len(s) for s in seqs)
        return got

    def close(self) -> None:
        if self.server is not None:
            self.server.close()


class Cache:
    """``hybrid``: each sequence's states in a file of its own (``<root>/<key>/<i // 1000>/<i>.safetensors``, written
    atomically), up to ``budget`` bytes for this process; what an earlier run left under the same key counts."""

    def __init__(self, root: Path, key: str, budget: float):
        self.dir, self.budget = Path(root) / key, budget
        self.dir.mkdir(parents=True, exist_ok=True)
        self.used = sum(p.stat().st_size for p in self.dir.rglob("*.safetensors"))
        self.hits = self.writes = 0
        self.full = self.used >= budget

    def _path(self, i: int) -> Path:
        return self.dir / f"{i // 1000:06d}" / f"{i}.safetensors"

    def get(self, i: int) -> torch.Tensor | None:
        path = self._path(i)
        if not path.is_file():
            return None
        from safetensors.torch import load_file

        self.hits += 1
        return load_file(str(path))["states"]

    def put(self, i: int, states: torch.Tensor) -> None:
        size = states.numel() * states.element_size() + 128  # the header's bytes, about
        if self.full or self.used + size > self.budget:
            self.full = True
            return
        from safetensors.torch import save_file

        path = self._path(i)
        path.parent.mkdir(exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        save_file({"states": states.contiguous()}, str(tmp))
        os.replace(tmp, path)
        self.used += path.stat().st_size
        self.writes += 1


def cache_key(manifests: list[dict], dirs: list[str], layers: list[int], engine: str) -> str:
    """What a cached file is the states of: the data sets (their paths and chunk digests), layers, target, engine."""
    what = {
        "dirs": [str(Path(d).resolve()) for d in dirs],
        "shards": [m.get("shards") for m in manifests],
        "layers": list(layers),
        "target": (manifests[0].get("target") or {}).get("fingerprint"),
        "engine": engine,
    }
    return hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()[:16]


class States:
    """The run's states for :meth:`fill` (online or hybrid): cached ones read, the rest made and, hybrid, cached."""

    def __init__(self, mode: str, maker: Maker, cache: Cache | None):
        self.mode, self.maker, self.cache = mode, maker, cache

    def fill(self, indices: list[int], seqs: list) -> None:
        """Sets ``seqs[j].states`` to the states of sequence ``indices[j]``."""
        todo = []
        for i, s in zip(indices, seqs):
            got = self.cache.get(i) if self.cache is not None else None
            if got is None:
                todo.append((i, s))
            else:
                s.states = got
        if not todo:
            return
        for (i, s), st in zip(todo, self.maker.make([s.ids.tolist() for _, s in todo])):
            s.states = st
            if self.cache is not None:
                self.cache.put(i, st)

    def report(self) -> dict:
        out = {"made_tokens": self.maker.tokens, "make_seconds": round(self.maker.seconds, 3)}
        if self.cache is not None:
            out |= {"cache_hits": self.cache.hits, "cache_writes": self.cache.writes, "cache_bytes": self.cache.used}
        return out

    def close(self) -> None:
        self.maker.close()
