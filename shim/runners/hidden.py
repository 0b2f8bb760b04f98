"""The last layer's hidden state, read from the forward that runs anyway (a hook on the final norm)."""

from __future__ import annotations

import torch

from specheads.errors import UserError


def final_norm(model) -> torch.nn.Module:
    """The final normalisation module of a decoder (Llama, Mistral, Qwen, Gemma, GPT-2, GPT-Neo(X), ...)."""
    base = getattr(model, "base_model", model)
    for name in ("norm", "ln_f", "final_layer_norm", "final_layernorm", "final_norm"):
        mod = getattr(base, name, None)
        if isinstance(mod, torch.nn.Module):
            return mod
    raise UserError(f"cannot find the final norm of {type(model).__name__}; hidden-state heads need one")


def output_device(model) -> torch.device:
    """Where a model's final states and logits come out: the output layer's device (the last GPU of a target
    split over several by ``device_map``; the embeddings' device otherwise). Tensors that index or are combined
    with its outputs (row/column indices, a head reading its states) belong there, not on the input device."""
    out = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    weight = getattr(out, "weight", None)
    if isinstance(weight, torch.Tensor) and weight.device.type != "meta":
        return weight.device
    return model.get_input_embeddings().weight.device


class HiddenCapture:
    """Captures the last layer's state before (``pre``) and after (``post``) the final norm.

    A forward hook on the final norm reads both from the forward that runs anyway, so no
    extra pass and no ``output_hidden_states`` (which would keep every layer) are needed.
    Shapes after a forward over ``[B, S]`` tokens: ``pre``/``post`` are ``[B, S, d]``.
    """

    def __init__(self, model):
        self.pre: torch.Tensor | None = None
        self.post: torch.Tensor | None = None
        self._handle = final_norm(model).register_forward_hook(self._hook)

    def _hook(self, module, args, output):
        self.pre = args[0]
        self.post = output

    def remove(self) -> None:
        self._handle.remove()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.remove()


def decoder_layer_list(model) -> torch.nn.ModuleList:
    """The decoder layers of a causal LM (Llama family: ``model.model.layers``; GPT-2: ``transformer.h``)."""
    base = getattr(model, "base_model", model)
    for name in ("layers", "h", "blocks"):
        mod = getattr(base, name, None)
        if isinstance(mod, torch.nn.ModuleList):
            return mod
    raise UserError(f"cannot find the decoder layers of {type(model).__name__}; an EAGLE head needs them")


class AuxCapture:
    """Captures the residual stream entering chosen decoder layers (Hugging Face's ``hidden_states[L]``)
    from the forward that runs anyway, by pre-hooks: ``states`` after a forward over ``[B, S]`` tokens is
    ``[B, S, len(layers) * d]``, the layers' states joined in the order given."""

    def __init__(self, model, layers: list[int]):
        blocks = decoder_layer_list(model)
        for i in layers:
            if not 0 < i < len(blocks):
                raise UserError(f"layer {i} is outside the target's decoder layers 1..{len(blocks) - 1}")
        self.layers = [int(i) for i in layers]
        self._seen: dict[int, torch.Tensor] = {}
        self._handles = [blocks[i].register_forward_pre_hook(self._hook(i), with_kwargs=True) for i in self.layers]

    def _hook(self, i: int):
        def hook(module, args, kwargs):
            self._seen[i] = args[0] if args else kwargs["hidden_states"]

        return hook

    @property
    def states(self) -> torch.Tensor:
        """The captured layers joined; layers that live on different GPUs (a split target) meet on the last's."""
        last = self._seen[self.layers[-1]].device
        return torch.cat([self._seen[i].to(last) for i in self.layers], dim=-1)

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
