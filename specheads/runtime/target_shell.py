"""The target without its weights, for runs whose target passes all go through vLLM.

With ``engine=vllm`` the target runs inside vLLM, and most label families never call the Transformers
target: acceptance labels take p from vLLM's tokens or log-probabilities, the drafter and the judge take
the target's states from vLLM. Loading the whole target beside vLLM anyway would cost its full size a
second time (about 800 GB at 405B). :func:`load_shell` builds the target from its config on PyTorch's
``meta`` device instead: the config, vocabulary, EOS ids, context length and fingerprint are the loaded
model's (the fingerprint is computed as :func:`~specheads.shim.load_model` computes it), and no
weight is read. With ``output_layer`` it reads the final norm and the output layer alone (SPRINTER's
labels put vLLM's last-layer states through them), on the spec's device.

A pass through the shell is a bug, never a silent meta result: its forward raises.
"""

from __future__ import annotations

import copy
import dataclasses
import logging

import torch

from specheads.errors import UserError
from specheads.runtime.checkpoint_tensors import TargetCheckpoint
from specheads.shim import LoadedModel, ModelSpec, final_norm, load_model, resolve_device, resolve_dtype

log = logging.getLogger(__name__)

# What a run needs of the Transformers target: its forward, its final norm and output layer, or its config alone.
USES = ("model", "output_layer", "config")


def load_target(spec: ModelSpec, use: str) -> LoadedModel:
    """The target as ``use`` (one of :data:`USES`) needs it: the whole model, or a shell (:func:`load_shell`)."""
    if use not in USES:
        raise ValueError(f"use={use!r} is not one of {USES}")
    if use == "model" or spec.load_in_8bit or spec.vocab_file or spec.vocab_top_n is not None:
        return load_model(spec, "target")
    return load_shell(spec, output_layer=use == "output_layer")


def _refuse(module, args, kwargs):
    raise RuntimeError(
        "this target was loaded without its weights (engine=vllm needs no Transformers pass of it for this "
        "family); a pass through it is a bug: load it whole with specheads.shim.load_model"
    )


def load_shell(spec: ModelSpec, output_layer: bool = False) -> LoadedModel:
    """The target built on the ``meta`` device from its config (see the module's docstring).

    A checkpoint whose tensors cannot be read by name (a hub id, ``.bin`` files) is loaded whole with
    a warning when ``output_layer`` is asked for.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    ckpt = TargetCheckpoint(dataclasses.replace(spec, dtype="auto"), "target")
    layer = ckpt.output_layer() if output_layer else None
    if output_layer and layer is None:
        log.warning("%s: its output layer cannot be read alone; loading the whole target", ckpt.name)
        return load_model(spec, "target")
    device = resolve_device(spec.device)
    dtype = resolve_dtype(spec.dtype, device)
    config = copy.deepcopy(ckpt.config)
    if hasattr(config, "quantization_config"):  # a GGUF file's: the fingerprint hashed it; building needs none
        del config.quantization_config
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, trust_remote_code=spec.trust_remote_code)
    path, gguf = ckpt.name.rsplit("/", 1) if ckpt.name.endswith(".gguf") else (ckpt.name, None)
    try:
        if not gguf:  # a GGUF file's EOS ids are its config's, which from_config already took
            model.generation_config = GenerationConfig.from_pretrained(path, revision=spec.revision)
    except OSError:  # no generation_config.json: the config's, as from_pretrained falls back to
        pass
    try:
        tok_kwargs = {"gguf_file": gguf} if gguf and not spec.tokenizer else {}
        tokenizer = AutoTokenizer.from_pretrained(spec.tokenizer or path, revision=spec.revision, **tok_kwargs)
    except (OSError, ValueError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise UserError(f"could not load the target's tokenizer from {spec.path!r}: {first}") from err
    if layer is not None:
        final_norm(model).weight = torch.nn.Parameter(layer["norm"].to(device, dtype), requires_grad=False)
        head = model.get_output_embeddings()
        head.weight = torch.nn.Parameter(layer["lm_head"].to(device, dtype), requires_grad=False)
    model.eval()
    model.register_forward_pre_hook(_refuse, with_kwargs=True)
    return LoadedModel(model, tokenizer, spec, ckpt.fingerprint, ckpt.name)
