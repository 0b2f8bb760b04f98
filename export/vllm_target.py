"""The target as vLLM reads it (``engine=vllm``): a Hugging Face directory as given, or a GGUF file converted once
(weights dequantised into a plain ``LlamaForCausalLM``, tokenizer beside it) into a cache directory named by a digest
of the GGUF file as the fingerprint takes it (name, size, first and last 4 MiB; ``$SPECHEADS_CACHE/vllm``, default
``~/.cache/specheads/vllm``), reused while the file is the same; and its context length, which an Eagle-3 draft
directory must state (:func:`target_positions`)."""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path

from specheads.errors import UserError
from specheads.shim import ModelSpec, file_digest


def target_dir(spec: ModelSpec) -> Path:
    """The target as a Hugging Face directory vLLM reads (a GGUF file: converted once, cached by its digest)."""
    if not spec.gguf_file:
        return Path(spec.path).resolve()
    gguf = Path(spec.path) / spec.gguf_file
    if not gguf.is_file():
        raise UserError(f"target.gguf_file: {str(gguf)!r} does not exist")
    root = Path(os.environ.get("SPECHEADS_CACHE", Path.home() / ".cache/specheads")) / "vllm"
    out = root / f"{gguf.stem}-{file_digest(hashlib.sha256(), gguf).hexdigest()[:24]}"
    if (out / "config.json").is_file():
        return out
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=root))
    convert_gguf(spec.path, spec.gguf_file, tmp / "model")
    (tmp / "model").rename(out)  # whole or not at all: a crash leaves only the temporary folder
    tmp.rmdir()
    return out


def convert_gguf(path: str, gguf_file: str, out: Path) -> None:
    """Writes a GGUF model, dequantised to fp32, as a plain Hugging Face directory ``out`` (with its tokenizer):
    ``save_pretrained`` refuses a GGUF-loaded model, so its weights are copied into a fresh one of its class."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path, gguf_file=gguf_file)
    src = AutoModelForCausalLM.from_pretrained(path, gguf_file=gguf_file, dtype=torch.float32)
    cfg = src.config
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config
    fresh = type(src)(cfg).to(torch.float32)
    missing, unexpected = fresh.load_state_dict(src.state_dict(), strict=False)
    if unexpected or [m for m in missing if not (m == "lm_head.weight" and cfg.tie_word_embeddings)]:
        raise UserError(
            (f"could not copy the GGUF target into a plain model: missing {missing}, unexpected {unexpected}")
        )
    fresh.tie_weights()
    fresh.save_pretrained(out)
    tok.save_pretrained(out)


def target_positions(meta: dict, verifier: str | None = None) -> int | None:
    """The target's ``max_position_embeddings``, from the first that states it: the config of ``verifier`` (a
    local Hugging Face directory, a GGUF file, or a Hub id already in the local cache), the metadata's
    ``target.max_position_embeddings``, or the config of the target recorded at training (``target.name``)."""
    target = meta.get("target") or {}
    for source in (verifier, target.get("max_position_embeddings"), target.get("name")):
        n = source if isinstance(source, int) else _config_positions(source) if source else None
        if isinstance(n, int) and n > 0:
            return n
    return None


def _config_positions(name: str) -> int | None:
    """``max_position_embeddings`` in a model's config (its text model's, for a multimodal one); never downloads."""
    path = Path(name).expanduser()
    try:
        if path.is_dir() and (path / "config.json").is_file():
            cfg = json.loads((path / "config.json").read_text(encoding="utf-8"))
            return cfg.get("max_position_embeddings") or (cfg.get("text_config") or {}).get("max_position_embeddings")
        from transformers import AutoConfig

        if path.is_file() and path.suffix == ".gguf":
            cfg = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
        else:
            cfg = AutoConfig.from_pretrained(name, local_files_only=True)
    except (OSError, ValueError, ImportError):
        return None
    return getattr(cfg.get_text_config(), "max_position_embeddings", None)


def _local_target(source: str):
    """A ``ModelSpec`` for ``source`` when it is a local model directory or ``.gguf`` file (None otherwise: a Hub id
    is never fetched here)."""
    from specheads.shim import ModelSpec

    path = Path(source).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return ModelSpec(path=str(path.parent), gguf_file=path.name, dtype="float32", device="cpu")
    if path.is_dir() and (path / "config.json").is_file():
        return ModelSpec(path=str(path), dtype="float32", device="cpu")
    return None


def target_embedding(meta: dict, verifier: str | None = None):
    """The target's token embedding ``[V, d]`` (fp32): ``verifier`` first, then the target recorded at training, each
    when it is a local directory (the one tensor read from its safetensors files) or GGUF file (loaded whole: such
    targets are small); UserError when the one found is not the target the head was trained on (its fingerprint);
    None when neither is readable here."""
    from types import SimpleNamespace

    from safetensors import safe_open
    from transformers import AutoConfig

    from specheads.errors import UserError
    from specheads.shim import fingerprint, load_model

    target = meta.get("target") or {}
    for source in (verifier, target.get("name")):
        spec = _local_target(source) if source else None
        if spec is None:
            continue
        root = Path(spec.path)
        name = "model.embed_tokens.weight"
        index = root / "model.safetensors.index.json"
        shard = json.loads(index.read_text())["weight_map"].get(name) if index.is_file() else "model.safetensors"
        if spec.gguf_file or not shard or not (root / shard).is_file():
            loaded = load_model(spec, "target")
            found, embed = loaded.fingerprint, loaded.model.get_input_embeddings().weight.detach()
        else:
            config = SimpleNamespace(config=AutoConfig.from_pretrained(str(root)))
            found = fingerprint(str(root), None, True, config)
            with safe_open(str(root / shard), framework="pt") as f:
                embed = f.get_tensor(name)
        want = target.get("fingerprint")
        if want and found != want:
            raise UserError(
                f"{source!r} is not the target this head was trained on (fingerprint {found}, the head's {want}); "
                "pass verifier=<that target>"
            )
        return embed.float()
    return None


def target_architectures(meta: dict, verifier: str | None = None) -> list[str]:
    """The target's ``architectures`` from its config (``verifier``'s, else the recorded target's; never downloads),
    else ``["LlamaForCausalLM"]`` (the only family the head trains on)."""
    target = meta.get("target") or {}
    for source in (verifier, target.get("name")):
        path = Path(source).expanduser() if source else None
        cfg = path / "config.json" if path is not None and path.is_dir() else None
        if cfg is not None and cfg.is_file():
            names = json.loads(cfg.read_text(encoding="utf-8")).get("architectures")
            if names:
                return list(names)
    return ["LlamaForCausalLM"]
