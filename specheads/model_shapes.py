"""A model's shape without loading it: its local ``config.json``, else a table of published shapes.

``heads-datagen plan=true`` and ``heads-train plan=true`` (:mod:`specheads.plan`) size a run from these
figures alone: nothing is loaded and nothing is downloaded. A local directory's ``config.json`` wins; a Hub
name (or a GGUF-only directory such as the shared target) is looked up in :data:`KNOWN` by its last path
component and its GGUF file name, with the ``-Instruct``/``-chat-hf`` suffixes and the ``meta-`` prefix
dropped.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from specheads.errors import UserError


@dataclass(frozen=True)
class Shape:
    """What the plan needs of a decoder-only model.

    Args:
        layers, hidden, intermediate, heads, kv_heads, vocab: the published config's
            ``num_hidden_layers``, ``hidden_size``, ``intermediate_size``, ``num_attention_heads``,
            ``num_key_value_heads`` and ``vocab_size``.
        tied: the output layer is the input embedding (counted once).
        positions: rows of a learned position embedding (GPT-2, GPT-Neo); 0 for rotary models.
        head_dim: width of one attention head (default ``hidden // heads``).
    """

    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    vocab: int
    tied: bool = False
    positions: int = 0
    head_dim: int = 0

    @property
    def dim(self) -> int:
        return self.head_dim or self.hidden // self.heads

    def params(self) -> int:
        """Parameters: embeddings, attention (q, k, v, o), the gated MLP (Llama: 3 matrices; GPT: 2) and the
        norms; biases are left out (under 0.1% of any model here)."""
        h, d = self.hidden, self.dim
        attention = 2 * h * self.heads * d + 2 * h * self.kv_heads * d
        mlp = (2 if self.positions else 3) * h * self.intermediate
        per_layer = attention + mlp + 2 * h
        embeddings = self.vocab * h * (1 if self.tied else 2) + self.positions * h
        return self.layers * per_layer + embeddings + h

    def kv_bytes_per_token(self, dtype_bytes: float) -> float:
        """Bytes of K and V one token adds to a cache (every layer)."""
        return 2 * self.layers * self.kv_heads * self.dim * dtype_bytes


def _llama(layers, hidden, intermediate, heads, kv_heads, vocab, tied=False) -> Shape:
    return Shape(layers, hidden, intermediate, heads, kv_heads, vocab, tied)


def _gpt(layers, hidden, heads, positions, intermediate=0) -> Shape:
    return Shape(layers, hidden, intermediate or 4 * hidden, heads, heads, 50257, True, positions)


#: Published shapes (the models' own config.json files), by normalised name (see :func:`normalise`).
KNOWN: dict[str, Shape] = {
    "llama-3.1-8b": _llama(32, 4096, 14336, 32, 8, 128256),
    "llama-3.1-70b": _llama(80, 8192, 28672, 64, 8, 128256),
    "llama-3.1-405b": _llama(126, 16384, 53248, 128, 8, 128256),
    "llama-2-7b": _llama(32, 4096, 11008, 32, 32, 32000),
    "llama-2-70b": _llama(80, 8192, 28672, 64, 8, 32000),
    "smollm2-135m": _llama(30, 576, 1536, 9, 3, 49152, tied=True),
    "smollm2-draft-4l": _llama(4, 576, 1536, 9, 3, 49152, tied=True),
    "gpt2": _gpt(12, 768, 12, 1024),
    "gpt2-xl": _gpt(48, 1600, 25, 1024),
    "gpt-neo-125m": _gpt(12, 768, 12, 2048),
    "gpt-neo-1.3b": _gpt(24, 2048, 16, 2048),
}


def normalise(name: str) -> str:
    """``meta-llama/Llama-3.1-405B-Instruct`` -> ``llama-3.1-405b``; ``SmolLM2-135M-Instruct.Q4_1.gguf`` ->
    ``smollm2-135m``."""
    name = name.rstrip("/").rsplit("/", 1)[-1].lower()
    name = re.sub(r"(\.q\d\w*)?\.gguf$", "", name)
    name = re.sub(r"-(instruct|chat-hf|chat|hf)$", "", name)
    return name.removeprefix("meta-")


def from_config(config: dict) -> Shape:
    """A shape from a Transformers ``config.json`` (Llama-family keys, or GPT-2's and GPT-Neo's)."""

    def get(*keys, default=None):
        return next((config[k] for k in keys if config.get(k) is not None), default)

    hidden = int(get("hidden_size", "n_embd"))
    heads = int(get("num_attention_heads", "n_head", "num_heads"))
    gpt = config.get("model_type") in ("gpt2", "gpt_neo")
    return Shape(
        layers=int(get("num_hidden_layers", "n_layer", "num_layers")),
        hidden=hidden,
        intermediate=int(get("intermediate_size", "n_inner", default=4 * hidden)),
        heads=heads,
        kv_heads=int(get("num_key_value_heads", default=heads)),
        vocab=int(get("vocab_size")),
        tied=bool(get("tie_word_embeddings", default=gpt)),
        positions=int(get("n_positions", "max_position_embeddings", default=0)) if gpt else 0,
        head_dim=int(get("head_dim", default=0)),
    )


def shape_of(spec, role: str) -> Shape:
    """The shape of a model spec (``path``, ``gguf_file``), read from disk or the table; nothing is loaded.

    Raises:
        UserError: neither a local ``config.json`` nor a known name; the message says how to fix it.
    """
    if not spec.path:
        raise UserError(f"plan: {role}.path is not set; pass {role}.path=<a model directory or Hub name>")
    path = Path(str(spec.path)).expanduser()
    config = path / "config.json"
    if config.is_file():
        try:
            return from_config(json.loads(config.read_text()))
        except (ValueError, TypeError, KeyError) as exc:
            raise UserError(f"plan: cannot read {role}'s shape from {config}: {exc}; fix the file") from None
    for name in (spec.gguf_file or "", str(spec.path)):
        if name and normalise(name) in KNOWN:
            return KNOWN[normalise(name)]
    raise UserError(
        f"plan: the shape of {role}.path={spec.path!r} is unknown (no local config.json, and not one of "
        f"{', '.join(KNOWN)}); download its config.json into a directory (huggingface-cli download "
        f"<repo> config.json --local-dir DIR) and pass {role}.path=DIR"
    )


def safetensors_params(path: str | Path) -> int:
    """Parameters in a safetensors file, from its JSON header alone (no tensor is read)."""
    with open(path, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(size))
    total = 0
    for name, info in header.items():
        if name != "__metadata__":
            n = 1
            for dim in info["shape"]:
                n *= dim
            total += n
    return total
