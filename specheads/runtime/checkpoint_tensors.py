"""The few target tensors an EAGLE head trains with (and the output layer of ``specheads.runtime.target_shell``), read
by name from the checkpoint files.

The head needs of the target only its token embeddings (every step's input), and to start from: its final
norm, the output layer's rows of the kept vocabulary and its last decoder layer. A 405B target is about
800 GB; these are well under 1% of it. :class:`TargetCheckpoint` reads the target's config, computes its
fingerprint as :func:`specheads.shim.load_model` does, and reads the named tensors alone: from
safetensors files with ``safe_open`` (through ``model.safetensors.index.json`` when there is one; the
output rows as slices of the rows kept), from a GGUF file with the ``gguf`` package's memory-mapped reader
(dequantising only those tensors, only those rows; the query and key rows put back in Hugging Face's order).
A Hub id's files come through the Hub cache (``huggingface_hub.hf_hub_download``, from the cache alone when
``HF_HUB_OFFLINE=1``): the index and then only the shards that hold a tensor asked for, at ``revision``.
A tied output layer is the embedding's rows. It counts the bytes it reads (``bytes_read`` of
``bytes_total``, the checkpoint files' size; a Hub id's: its index's ``total_size``). A checkpoint neither
reader knows (``.bin`` files, a GGUF of another architecture than ``llama``) is loaded whole once, with a
warning, and the same tensors taken from the model.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import re
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import torch

from specheads.errors import UserError
from specheads.shim import DTYPES, ModelSpec, fingerprint, load_model, resolve_location

log = logging.getLogger(__name__)

# The last decoder layer's tensors: Hugging Face's name under ``model.layers.N.`` -> GGUF's under ``blk.N.``.
LAYER_PARTS = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}
GGUF_ARCHITECTURES = ("llama",)  # GGUF files whose tensors this reads (the rest: loaded whole)
INDEX = "model.safetensors.index.json"
# The short keys :meth:`TargetCheckpoint.tensors` asks for -> Hugging Face's names (a layer's:
# ``layers.N.<part>`` -> ``model.layers.N.<part>.weight``).
HF_NAMES = {"embed": "model.embed_tokens.weight", "norm": "model.norm.weight", "lm_head": "lm_head.weight"}


class TargetCheckpoint:
    """The target's config, fingerprint and tensors by name (see the module's docstring).

    Args:
        spec: the target's location (``path``, ``gguf_file``, ``revision``) and ``dtype`` (``auto``: the
            stored one, fp32 for a GGUF file; otherwise the tensors are cast to it).
    """

    def __init__(self, spec: ModelSpec, role: str = "target"):
        from transformers import AutoConfig

        self.spec, self.role = spec, role
        path, gguf, is_local = resolve_location(spec, role)
        kwargs = {"revision": spec.revision, "trust_remote_code": spec.trust_remote_code}
        self.config = AutoConfig.from_pretrained(path, **kwargs, **({"gguf_file": gguf} if gguf else {}))
        if gguf:  # what from_pretrained adds to a GGUF model's config (the fingerprint hashes the config)
            import transformers

            if hasattr(transformers, "GgufConfig"):
                self.config.quantization_config = transformers.GgufConfig(gguf_file=gguf)
        self.name = f"{path}/{gguf}" if gguf else path
        self.fingerprint = fingerprint(path, gguf, is_local, SimpleNamespace(config=self.config))
        self.layers = int(self.config.num_hidden_layers)
        self.bytes_read = 0
        self.reader = None
        if is_local:
            root = Path(path)
            fetch, names = (lambda f: root / f), [INDEX] if (root / INDEX).is_file() else _local_shards(root)
        else:
            fetch, names = _hub_files(path, spec.revision, gguf)
        if gguf:
            reader = _GgufReader(fetch(gguf), self.config)
            self.reader = reader if reader.architecture in GGUF_ARCHITECTURES else None
            self.bytes_total = fetch(gguf).stat().st_size
        elif is_local:
            self.reader = _SafetensorsReader(fetch, names) if names else None
            self.bytes_total = sum((root / f).stat().st_size for f in _local_shards(root)) or None
        else:
            self.reader = _SafetensorsReader(fetch, names) if names else None
            self.bytes_total = self.reader.total if self.reader else None

    def tensors(self, vocab_ids: list[int] | None) -> dict[str, torch.Tensor]:
        """``embed`` ``[V, d]``; with ``vocab_ids``, also what starts a head: ``norm``, ``lm_head`` (the
        output layer's rows of ``vocab_ids``, in that order) and the last layer's tensors by
        :data:`LAYER_PARTS`'s keys."""
        if self.reader is None:
            return self._from_whole_model(vocab_ids)
        out = {"embed": self._get("embed")}
        if vocab_ids is None:
            return out
        out["norm"] = self._get("norm")
        if self.reader.has(HF_NAMES["lm_head"]):
            out["lm_head"] = self._get("lm_head", rows=list(vocab_ids))
        else:  # tied: the output layer is the embedding (already read)
            out["lm_head"] = out["embed"][torch.tensor(vocab_ids, dtype=torch.long)]
        last = self.layers - 1
        for part in LAYER_PARTS:
            out[part] = self._get(f"layers.{last}.{part}")
        return out

    def output_layer(self) -> dict[str, torch.Tensor] | None:
        """``norm`` ``[d]`` and the whole output layer ``lm_head`` ``[V, d]`` (a tied one: the embedding);
        None for a checkpoint neither reader knows."""
        if self.reader is None:
            return None
        head = "lm_head" if self.reader.has(HF_NAMES["lm_head"]) else "embed"
        return {"norm": self._get("norm"), "lm_head": self._get(head)}

    def named(self, names: list[str]) -> dict[str, torch.Tensor]:
        """The tensors of ``names`` (Hugging Face state-dict names: ``model.layers.0.mlp.up_proj.weight``)
        that the checkpoint holds, read alone; a checkpoint neither reader knows is loaded whole once (with a
        warning) and they are taken from the model."""
        if self.reader is None:
            state = self._whole_model().state_dict()
            return {n: state[n].detach().clone() for n in names if n in state}
        return {n: self._read(n) for n in names if self.reader.has(n)}

    def _get(self, key: str, rows: list[int] | None = None) -> torch.Tensor:
        """``key``: ``embed``, ``norm``, ``lm_head`` or ``layers.N.<part>``."""
        return self._read(HF_NAMES.get(key) or f"model.{key}.weight", rows)

    def _read(self, name: str, rows: list[int] | None = None) -> torch.Tensor:
        tensor, nbytes = self.reader.get(name, rows)
        self.bytes_read += nbytes
        return self._cast(tensor)

    def _cast(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.spec.dtype == "auto":
            return tensor
        if self.spec.dtype not in DTYPES:
            raise UserError(f"{self.role}.dtype={self.spec.dtype!r} is not one of {sorted(DTYPES) + ['auto']}")
        return tensor.to(DTYPES[self.spec.dtype])

    def _from_whole_model(self, vocab_ids: list[int] | None) -> dict[str, torch.Tensor]:
        return from_model(self._whole_model(), vocab_ids)

    def _whole_model(self):
        log.warning(
            "%s: reading single tensors works on safetensors files and llama GGUF files only; "
            "loading the whole %s once for the tensors it needs",
            self.name,
            self.role,
        )
        loaded = load_model(dataclasses.replace(self.spec, device="cpu"), self.role)
        self.bytes_read = self.bytes_total or 0
        return loaded.model


def from_model(model, vocab_ids: list[int] | None) -> dict[str, torch.Tensor]:
    """:meth:`TargetCheckpoint.tensors` taken from a loaded causal LM (fp32 copies)."""
    grab = lambda p: p.detach().float().clone()  # noqa: E731
    out = {"embed": grab(model.get_input_embeddings().weight)}
    if vocab_ids is None:
        return out
    last = model.model.layers[-1]
    out["norm"] = grab(model.model.norm.weight)
    out["lm_head"] = grab(model.get_output_embeddings().weight[torch.tensor(vocab_ids, dtype=torch.long)])
    for part in LAYER_PARTS:
        out[part] = grab(last.get_submodule(part).weight)
    return out


def _local_shards(root: Path) -> list[str]:
    return [f.name for f in sorted(root.glob("*.safetensors"))]


def _hub_files(repo: str, revision: str | None, gguf: str | None) -> tuple[Callable[[str], Path], list[str]]:
    """A Hub checkpoint's files by name (each fetched once, on first use, through the Hub cache; from the cache
    alone offline) and the safetensors files to start from: the index, else the one ``model.safetensors``
    (none: ``.bin`` files only, read by loading the model)."""
    import huggingface_hub
    from huggingface_hub.errors import EntryNotFoundError

    @functools.cache
    def fetch(name: str) -> Path:
        offline = huggingface_hub.constants.HF_HUB_OFFLINE
        return Path(huggingface_hub.hf_hub_download(repo, name, revision=revision, local_files_only=offline))

    if gguf:
        return fetch, []
    for name in (INDEX, "model.safetensors"):
        try:
            fetch(name)
        except EntryNotFoundError:  # not in the repo (or, offline, not in the cache)
            continue
        return fetch, [name]
    return fetch, []


def _runs(rows: list[int]) -> list[tuple[int, int, int]]:
    """``rows`` as runs of consecutive ids: ``(position in rows, first id, end id)``."""
    runs, i = [], 0
    while i < len(rows):
        j = i + 1
        while j < len(rows) and rows[j] == rows[j - 1] + 1:
            j += 1
        runs.append((i, rows[i], rows[j - 1] + 1))
        i = j
    return runs


class _SafetensorsReader:
    """Tensors by Hugging Face name from safetensors files: ``names`` is the index (then only the shards
    holding a tensor asked for are opened, or fetched) or every file; ``fetch`` gives a file's local path."""

    def __init__(self, fetch: Callable[[str], Path], names: list[str]):
        from safetensors import safe_open

        self.fetch = fetch
        if names == [INDEX]:
            index = json.loads(fetch(INDEX).read_text())
            self.where, self.total = index["weight_map"], index.get("metadata", {}).get("total_size")
        else:
            self.where, self.total = {}, sum(fetch(f).stat().st_size for f in names)
            for f in names:
                with safe_open(str(fetch(f)), framework="pt") as h:
                    self.where.update(dict.fromkeys(h.keys(), f))

    def _name(self, name: str) -> str | None:
        if name in self.where:
            return name
        found = [k for k in self.where if k.endswith("." + name)]  # a prefixed checkpoint (language_model.)
        return found[0] if len(found) == 1 else None

    def has(self, name: str) -> bool:
        return self._name(name) is not None

    def get(self, name: str, rows: list[int] | None) -> tuple[torch.Tensor, int]:
        from safetensors import safe_open

        stored = self._name(name)
        if stored is None:
            raise UserError(f"the target's checkpoint holds no tensor {name!r}")
        with safe_open(str(self.fetch(self.where[stored])), framework="pt") as f:
            if rows is None:
                t = f.get_tensor(stored)
            else:
                part = f.get_slice(stored)
                order = sorted(range(len(rows)), key=rows.__getitem__)
                got = [part[a:b] for _, a, b in _runs([rows[i] for i in order])]
                t = torch.empty_like(torch.cat(got))
                t[torch.tensor(order, dtype=torch.long)] = torch.cat(got)
        return t, t.numel() * t.element_size()


class _GgufReader:
    """Tensors by Hugging Face name from a llama GGUF file (memory-mapped; only what is asked is dequantised)."""

    NAMES = {HF_NAMES["embed"]: "token_embd.weight", HF_NAMES["norm"]: "output_norm.weight"}
    NAMES[HF_NAMES["lm_head"]] = "output.weight"

    def __init__(self, path: Path, config):
        try:
            from gguf import GGUFReader
        except ImportError:
            raise UserError("a GGUF target needs the [gguf] extra: pip install 'specheads[gguf]'") from None
        self.reader = GGUFReader(str(path))
        self.by_name = {t.name: t for t in self.reader.tensors}
        self.architecture = str(self.reader.fields["general.architecture"].contents())
        self.heads = int(config.num_attention_heads)
        self.kv_heads = int(getattr(config, "num_key_value_heads", None) or self.heads)

    def _name(self, name: str) -> str | None:
        if name in self.NAMES:
            return self.NAMES[name]
        layer = re.fullmatch(r"model\.layers\.(\d+)\.(.+)\.weight", name)
        if layer and layer[2] in LAYER_PARTS:
            return f"blk.{layer[1]}.{LAYER_PARTS[layer[2]]}.weight"
        return None

    def has(self, name: str) -> bool:
        return self._name(name) in self.by_name

    def get(self, name: str, rows: list[int] | None) -> tuple[torch.Tensor, int]:
        import numpy as np
        from gguf.quants import dequantize

        t = self.by_name.get(self._name(name))
        if t is None:
            raise UserError(f"the target's GGUF file holds no tensor {self._name(name) or name!r} (for {name})")
        data = t.data if rows is None else t.data[np.asarray(rows, dtype=np.int64)]  # rows: whole blocks
        nbytes = int(data.nbytes)
        w = np.ascontiguousarray(dequantize(data, t.tensor_type), dtype=np.float32)
        w = torch.from_numpy(w if w.flags.writeable else w.copy())  # an F32 tensor is the read-only map itself
        if name.endswith("self_attn.q_proj.weight"):
            w = _unpermute(w, self.heads)
        elif name.endswith("self_attn.k_proj.weight"):
            w = _unpermute(w, self.kv_heads)
        return w, nbytes


def _unpermute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Llama's query/key rows back in Hugging Face's order: llama.cpp's converter stores each head's rows
    interleaved (pairs of the rotary halves side by side) for its own rotary kernel."""
    rows, cols = w.shape
    return w.reshape(heads, rows // heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)
