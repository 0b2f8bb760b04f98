"""The draft and target of :mod:`specheads.hf` as the shim sees them: a pruned draft vocabulary, the
shim's view of a Transformers model (for the head checks) and the width of an output layer."""

from __future__ import annotations

import logging
import os

log = logging.getLogger("specheads.hf")


def prune_draft(draft, vocab_file: str, top_n: int | None, tokenizer=None) -> dict:
    """Prunes ``draft``'s output layer to the ``top_n`` most frequent tokens of ``vocab_file`` (a ``heads-vocab``
    ranking), as ``heads-pipeline`` pruned it for a head trained on a pruned draft (lossless; the head's metadata
    records the subset and the head refuses another). Returns the subset's ``size`` and ``sha256``.

    ``tokenizer`` (the draft's) keeps its special tokens (end of sequence, padding) in the subset whatever their
    rank, as the pipeline does; without it only the ranking decides, and a warning says so."""
    from specheads.shim import ModelSpec, prune_to_vocab_file, vocab_info

    if tokenizer is None:
        log.warning(
            "prune_draft without tokenizer=: the special tokens stay only if %s ranks them in the top %s; "
            "pass the draft's tokenizer to keep them as heads-pipeline does",
            vocab_file,
            top_n,
        )

    prune_to_vocab_file(draft, tokenizer, ModelSpec(path="draft", vocab_file=vocab_file, vocab_top_n=top_n), "draft")
    return vocab_info(draft)


def _loaded(model, gguf_file: str | None):
    """A shim ``LoadedModel`` view of a Transformers model (for the head checks): its fingerprint as the shim
    computes it when the model came from a local directory (or GGUF file), ``hub:<id>@<commit>`` otherwise."""
    from specheads.shim import LoadedModel, ModelSpec, fingerprint

    path = str(getattr(model.config, "_name_or_path", "") or "")
    if gguf_file and path.endswith(".gguf"):
        path = os.path.dirname(path) or "."
    local = bool(path) and os.path.isdir(path)
    fp = fingerprint(path, gguf_file, local, model) if path else "unknown"
    name = f"{path}/{gguf_file}" if gguf_file else path
    return LoadedModel(model, None, ModelSpec(path=path or "unknown", gguf_file=gguf_file), fp, name)


def _width(model) -> int:
    """Rows of the model's output layer (a pruned draft's keeps the full width, the rest at -inf)."""
    out = model.get_output_embeddings()
    return int(getattr(out, "out_features", None) or out.weight.shape[0])
