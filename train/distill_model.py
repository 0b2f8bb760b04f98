"""The standalone draft being distilled (``head=draft``): where it starts, its training forward, its export.

The draft is a plain Hugging Face causal LM of the target's architecture and vocabulary. It starts
from ``distill.init``: ``truncate:N`` (the target's embeddings, first ``N`` decoder layers, final norm and
output layer, nothing trained: the usual way to start a draft from its target; only those tensors are read
from the target's checkpoint, never the whole model) or a model directory
(e.g. an earlier draft) to continue from. :class:`DraftLM` wraps it for the training loop: one forward
over prompt + response, the output layer only at the scored positions (all of it, or a pruned subset).
The best epoch is written by :func:`save_draft` as a standard model directory (``config.json``,
``model.safetensors``, tokenizer files) that ``specheads.load_pair``, Transformers' assisted
generation and vLLM's ``draft_model`` load as they are, with ``specheads.json`` beside it.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import os
import shutil
from pathlib import Path

import torch

from specheads.errors import UserError
from specheads.outputs import atomic_write_json
from specheads.runtime.checkpoint_tensors import TargetCheckpoint
from specheads.shim import ModelSpec, check_same_vocab, load_model, unroute

log = logging.getLogger(__name__)

META = "specheads.json"
VOCAB = "vocab.json"  # a pruned draft's subset (heads-vocab format)


class DraftLM(torch.nn.Module):
    """A causal LM whose forward gives the logits at chosen positions only.

    ``vocab_ids`` (sorted token ids, or None): the output layer scores only those rows, as the draft
    decodes with ``draft.vocab_file`` (FR-Spec); the gradient still reaches those rows of the weight."""

    def __init__(self, lm: torch.nn.Module, vocab_ids: list[int] | None = None):
        super().__init__()
        self.lm = lm
        ids = torch.tensor(vocab_ids if vocab_ids is not None else [], dtype=torch.long)
        self.register_buffer("vocab_ids", ids, persistent=False)
        self.pruned = vocab_ids is not None

    def forward(self, ids: torch.Tensor, mask: torch.Tensor, sel: torch.Tensor) -> torch.Tensor:
        """``ids``/``mask``/``sel`` ``[B, T]`` -> logits ``[N, V]`` at the ``N`` positions ``sel`` marks (``V``:
        the subset's size when pruned), row-major."""
        h = self.lm.get_decoder()(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state[sel]
        head = self.lm.get_output_embeddings()
        w = head.weight[self.vocab_ids] if self.pruned else head.weight
        b = getattr(head, "bias", None)
        if b is not None and self.pruned:
            b = b[self.vocab_ids]
        return torch.nn.functional.linear(h, w, b)


def parse_init(value: str | None) -> tuple[str, int | str | None]:
    """``("truncate", N)``, ``("path", dir)`` or ``("draft", None)`` (null: ``draft.path``); UserError for
    a malformed ``truncate:``."""
    if value is None or not str(value).strip():
        return "draft", None
    value = str(value).strip()
    if value.startswith("truncate:"):
        n = value.split(":", 1)[1]
        if not n.strip().isdigit() or int(n) < 1:
            raise UserError(f"distill.init={value!r}: write truncate:N with N >= 1 decoder layers of the target")
        return "truncate", int(n)
    return "path", value


def truncated(target, n: int) -> torch.nn.Module:
    """A fresh model of the target's architecture with its first ``n`` decoder layers and everything outside
    the decoder stack (embeddings, final norm, output layer) copied; fp32, on the CPU. ``target``: a
    ``LoadedModel``, e.g. without its weights (``specheads.runtime.target_shell``): only the tensors copied
    are read from its checkpoint, by name (:class:`~specheads.runtime.checkpoint_tensors.TargetCheckpoint`)."""
    have = target.model.config.num_hidden_layers
    if n > have:
        raise UserError(f"distill.init=truncate:{n} but the target has {have} decoder layers; choose N <= {have}")
    from transformers import AutoModelForCausalLM

    cfg = copy.deepcopy(target.model.config)
    cfg.num_hidden_layers = n
    if isinstance(getattr(cfg, "layer_types", None), list):
        cfg.layer_types = cfg.layer_types[:n]
    cfg.dtype = "float32"
    if hasattr(cfg, "quantization_config"):  # a GGUF target's: the copied weights are plain fp32
        del cfg.quantization_config
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    tied = {"lm_head.weight"} if getattr(cfg, "tie_word_embeddings", False) else set()
    checkpoint = TargetCheckpoint(dataclasses.replace(target.spec, dtype="auto"), "target")
    keep = checkpoint.named([k for k in model.state_dict() if k not in tied])
    log.info("truncate:%d: %.1f MB of the target's checkpoint read", n, checkpoint.bytes_read / 1e6)
    missing, unexpected = model.load_state_dict(keep, strict=False)  # cast to the draft's fp32
    if set(missing) - tied or unexpected:
        raise UserError(
            f"cannot truncate {type(model).__name__}: weights missing {sorted(set(missing) - tied)[:3]}, "
            f"unexpected {sorted(unexpected)[:3]}; start from a model directory (distill.init=<dir>)"
        )
    model.tie_weights()
    model.generation_config = copy.deepcopy(target.model.generation_config)
    return model


def initial_draft(cfg, target) -> tuple[torch.nn.Module, object, dict]:
    """The draft ``cfg.distill.init`` names (fp32, trainable), the tokenizer its directory will hold and a
    record of where it came from. ``target``: a ``LoadedModel``, its weights not needed (see :func:`truncated`)."""
    kind, arg = parse_init(cfg.distill.init)
    if kind == "truncate":
        model = truncated(target, arg)
        tok, source = (
            target.tokenizer,
            {"draft_init": f"truncate:{arg}", "from": target.name, "from_fingerprint": target.fingerprint},
        )
    else:
        spec = copy.deepcopy(cfg.draft) if kind == "draft" else ModelSpec(path=arg)
        spec.device, spec.dtype, spec.vocab_file, spec.vocab_top_n = "cpu", "float32", None, None
        if not spec.path:
            raise UserError("head=draft needs distill.init=truncate:N or a model directory (or draft.path)")
        loaded = load_model(spec, "draft")
        check_same_vocab(target, loaded)
        model = loaded.model
        unroute(model)  # the project's CPU kernels are for inference; training runs torch's own
        tok, source = (
            loaded.tokenizer,
            {"draft_init": spec.path, "from": loaded.name, "from_fingerprint": loaded.fingerprint},
        )
    if model.get_input_embeddings().weight.shape[0] != target.model.get_input_embeddings().weight.shape[0]:
        raise UserError(
            f"distill.init={cfg.distill.init!r}: its vocabulary size differs from the target's; "
            "a draft must score the target's tokens"
        )
    model.requires_grad_(True)
    if cfg.distill.freeze_embeddings:
        model.get_input_embeddings().weight.requires_grad_(False)
        if model.get_output_embeddings() is not None:
            model.get_output_embeddings().weight.requires_grad_(False)
    model.config.use_cache = True
    return model.float().train(), tok, source


def save_draft(out: Path, draft: DraftLM, tokenizer, meta: dict) -> Path:
    """Writes ``out/draft/`` (the model with its full output layer, tokenizer, generation config and
    ``specheads.json`` = ``meta``), replacing an earlier one only once the new one is complete. A draft
    trained on a pruned output layer also gets ``vocab.json``, its subset as a ``heads-vocab`` ranking:
    it must decode with ``draft.vocab_file=<that file>`` (its other rows were never trained)."""
    final = Path(out) / "draft"
    tmp = Path(out) / f".draft.tmp{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    lm = draft.lm
    lm.config.specheads = {k: meta[k] for k in ("target", "divergence", "draft_init", "draft_vocab") if k in meta}
    lm.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    atomic_write_json(tmp / META, meta)
    if draft.pruned:
        ids = draft.vocab_ids.tolist()
        atomic_write_json(
            tmp / VOCAB,
            {
                "format": "specheads-vocab",
                "version": 1,
                "vocab_size": lm.config.vocab_size,
                "source": "the output-layer subset heads-train head=draft trained",
                "ranking": ids,
                "counts": [1] * len(ids),
            },
        )
    old = Path(out) / f".draft.old{os.getpid()}"
    if final.exists():
        os.replace(final, old)
    os.replace(tmp, final)
    shutil.rmtree(old, ignore_errors=True)
    return final
