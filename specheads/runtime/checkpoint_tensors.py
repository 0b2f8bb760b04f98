"""The few target tensors an EAGLE head trains with (and the output layer of ``specheads.runtime.target_shell``), read
by name from the checkpoint files.

The head needs of the target only its token embeddings (every step's input), and to start from: its final
norm, the output layer's rows of the kept vocabulary and its last decoder layer. A 405B target is about
800 GB; these are well under 1% of it. :class:`TargetCheckpoint` reads the target's config, computes its
fingerprint as :func:`specheads.export.shim.load_model` does, and reads the named tensors alone: from
safetensors files with ``safe_open`` (through ``model.safetensors.index.json`` when there is one; the
output rows as slices of the rows kept), from a GGUF file with the ``gguf`` package's memory-mapped reader
(dequantising only those tensors, only those rows; the query and key rows put back in Hugging Face's order).
A tied output layer is the embedding's rows. It counts the bytes it reads (``bytes_read`` of
``bytes_total``, the checkpoint files' size). A checkpoint neither reader knows (a hub id, ``.bin`` files,
a GGUF of another architecture than ``llama``) is loaded whole once, with a warning, and the same tensors
taken from the model.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from types import SimpleNamespace

import torch

from specheads.errors import UserError
from specheads.export.shim import DTYPES, ModelSpec, fingerprint, load_model, resolve_location

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
        if is_local and gguf:
            reader = _GgufReader(Path(path) / gguf, self.config)
            self.reader = reader if reader.architecture in GGUF_ARCHITECTURES else None
        elif is_local:
            self.reader = _SafetensorsReader(Path(path)) if list(Path(path).glob("*.safetensors")) else None
        files = [Path(path) / gguf] if gguf else sorted(Path(path).glob("*.safetensors")) if is_local else []
        self.bytes_total = sum(f.stat().st_size for f in files) if files else None

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
        if self.reader.has("lm_head"):
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
        return {"norm": self._get("norm"), "lm_head": self._get("lm_head" if self.reader.has("lm_head") else "embed")}

    def _get(self, key: str, rows: list[int] | None = None) -> torch.Tensor:
        tensor, nbytes = self.reader.get(key, rows)
        self.bytes_read += nbytes
        return self._cast(tensor)

    def _cast(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.spec.dtype == "auto":
            return tensor
        if self.spec.dtype not in DTYPES:
            raise UserError(f"{self.role}.dtype={self.spec.dtype!r} is not one of {sorted(DTYPES) + ['auto']}")
        return tensor.to(DTYPES[self.spec.dtype])

    def _from_whole_model(self, vocab_ids: list[int] | None) -> dict[str, torch.Tensor]:
        log.warning(
            "%s: reading single tensors works on local safetensors files and llama GGUF files only; "
            "loading the whole target once for its embeddings and last layer",
            self.name,
        )
        loaded = load_model(dataclasses.replace(self.spec, device="cpu"), self.role)
        self.bytes_read = self.bytes_total or 0
        return from_model(loaded.model, vocab_ids)


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
    """Tensors by Hugging Face name from a directory of safetensors files."""

    NAMES = {"embed": "model.embed_tokens.weight", "norm": "model.norm.weight", "lm_head": "lm_head.weight"}

    def __init__(self, root: Path):
        from safetensors import safe_open

        index = root / "model.safetensors.index.json"
        if index.is_file():
            self.where = {k: root / f for k, f in json.loads(index.read_text())["weight_map"].items()}
        else:
            self.where = {}
            for f in sorted(root.glob("*.safetensors")):
                with safe_open(str(f), framework="pt") as h:
                    self.where.update(dict.fromkeys(h.keys(), f))

    def _name(self, key: str) -> str | None:
        name = self.NAMES.get(key) or f"model.{key}.weight"
        if name in self.where:
            return name
        found = [k for k in self.where if k.endswith("." + name)]  # a prefixed checkpoint (language_model.)
        return found[0] if len(found) == 1 else None

    def has(self, key: str) -> bool:
        return self._name(key) is not None

    def get(self, key: str, rows: list[int] | None) -> tuple[torch.Tensor, int]:
        from safetensors import safe_open

        name = self._name(key)
        if name is None:
            raise UserError(f"the target's checkpoint holds no tensor {key!r} (looked for {self.NAMES.get(key, key)})")
        with safe_open(str(self.where[name]), framework="pt") as f:
            if rows is None:
                t = f.get_tensor(name)
            else:
                part = f.get_slice(name)
                order = sorted(range(len(rows)), key=rows.__getitem__)
                got = [part[a:b] for _, a, b in _runs([rows[i] for i in order])]
                t = torch.empty_like(torch.cat(got))
                t[torch.tensor(order, dtype=torch.long)] = torch.cat(got)
        return t, t.numel() * t.element_size()


class _GgufReader:
    """Tensors by Hugging Face name from a llama GGUF file (memory-mapped; only what is asked is dequantised)."""

    NAMES = {"embed": "token_embd.weight", "norm": "output_norm.weight", "lm_head": "output.weight"}

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

    def _name(self, key: str) -> str:
        if key in self.NAMES:
            return self.NAMES[key]
        _, layer, part = key.split(".", 2)
        return f"blk.{layer}.{LAYER_PARTS[part]}.weight"

    def has(self, key: str) -> bool:
        return self._name(key) in self.by_name

    def get(self, key: str, rows: list[int] | None) -> tuple[torch.Tensor, int]:
        import numpy as np
        from gguf.quants import dequantize

        t = self.by_name.get(self._name(key))
        if t is None:
            raise UserError(f"the target's GGUF file holds no tensor {self._name(key)!r} (for {key})")
        data = t.data if rows is None else t.data[np.asarray(rows, dtype=np.int64)]  # rows: whole blocks
        nbytes = int(data.nbytes)
        w = np.ascontiguousarray(dequantize(data, t.tensor_type), dtype=np.float32)
        w = torch.from_numpy(w if w.flags.writeable else w.copy())  # an F32 tensor is the read-only map itself
        if key.endswith("self_attn.q_proj"):
            w = _unpermute(w, self.heads)
        elif key.endswith("self_attn.k_proj"):
            w = _unpermute(w, self.kv_heads)
        return w, nbytes


def _unpermute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Llama's query/key rows back in Hugging Face's order: llama.cpp's converter stores each head's rows
    interleaved (pairs of the rotary halves side by side) for its own rotary kernel."""
    rows, cols = w.shape
    return w.reshape(heads, rows // heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)
