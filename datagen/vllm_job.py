"""What the vLLM child that generates heads-datagen's responses is told of the run: the tokenizer, EOS ids and
context length (no weights)."""

from __future__ import annotations

import os
from types import SimpleNamespace

from specheads.datagen.labelling import Job
from specheads.errors import UserError


def light_job(cfg) -> Job:
    """A :class:`Job` with the tokenizer, EOS ids and context length the labellers will have, from the
    model directories' tokenizer and config files (no weights: vLLM gets the GPUs first)."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    from specheads.shim import context_length, eos_ids

    def files(spec):
        path, gguf = os.path.expanduser(spec.path), spec.gguf_file
        if path.endswith(".gguf") and gguf is None:
            path, gguf = os.path.dirname(path) or ".", os.path.basename(path)
        kw = {"revision": spec.revision, **({"gguf_file": gguf} if gguf else {})}
        return path, gguf, kw

    path, gguf, kw = files(cfg.target)
    try:
        tok = AutoTokenizer.from_pretrained(
            cfg.target.tokenizer or path,
            revision=cfg.target.revision,
            **({"gguf_file": gguf} if gguf and not cfg.target.tokenizer else {}),
        )
        config = AutoConfig.from_pretrained(path, trust_remote_code=cfg.target.trust_remote_code, **kw)
        try:
            gen = GenerationConfig.from_pretrained(path, **kw)
        except (OSError, ValueError, TypeError):
            gen = GenerationConfig.from_model_config(config)
        limits = [context_length(SimpleNamespace(config=config))]
        if cfg.draft.path:  # loaded whenever it is set (cli._load), so its length counts
            d_path, _, d_kw = files(cfg.draft)
            limits.append(context_length(SimpleNamespace(config=AutoConfig.from_pretrained(d_path, **d_kw))))
    except (OSError, ValueError) as err:
        raise UserError(f"engine=vllm: could not read the models' tokenizer and config: {err}") from err
    eos = eos_ids(SimpleNamespace(generation_config=gen), tok)
    limit = min(x for x in (*limits, 1 << 30) if x)
    return Job(cfg, SimpleNamespace(tokenizer=tok), eos[0] if eos else 0, eos, limit)
