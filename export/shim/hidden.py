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
