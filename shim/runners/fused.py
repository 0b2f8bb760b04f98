"""A lean forward for Llama-family models: fused projections, in-place KV cache, no per-call overhead.

At batch 1 a decoding step is a chain of small matrix-vector products, and a Hugging Face
forward spends a good part of its time around them (module calls, mask and cache bookkeeping).
The fused forward (run by :class:`~specheads.shim.runners.model_runner.FusedRunner`) computes the same
function with

* one ``[q; k; v]`` projection and one ``[gate; up]`` projection per layer (4 GEMVs instead of 7),
* a preallocated per-layer KV buffer that a rejected suffix simply leaves behind (``trim`` moves
  a length counter),
* a rotary table built once from the model's own rotary module (so every rope scaling the model
  supports is honoured), and no hooks: the pre- and post-norm hidden states are at hand.

The fused weights are the model's weights: each original ``q_proj``/``k_proj``/... parameter is
rebound to a view of the fused buffer and the model still works (and trains, saves after
:func:`unfuse`, loads) as before. On CPU every weight is stored column-major (see
:func:`_column_major`), with row-major copies made only for 2-3 row products
(:meth:`_Fused.layers_for`). ``supports`` says which models qualify; everything else runs on
the model's own forward (:class:`~specheads.shim.runners.model_runner.ModelRunner`).
"""

from __future__ import annotations

import os
import weakref

import torch
import torch.nn.functional as F

from specheads.shim.runners import kernels
from specheads.shim.runners.kernels import linear
from specheads.shim.runners.vocab_pruning import PrunedHead

# Architectures whose decoder layer is exactly: RMSNorm -> attention(q,k,v[,bias],rope,o) -> residual
# -> RMSNorm -> SiLU-gated MLP -> residual, with full attention in every layer.
_FAMILIES = {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"}
_FUSED: "weakref.WeakKeyDictionary[torch.nn.Module, _Fused]" = weakref.WeakKeyDictionary()


def supports(model) -> str | None:
    """None when the fused forward computes this model exactly; otherwise the reason it does not."""
    name = type(model).__name__
    if name not in _FAMILIES:
        return f"architecture {name} (fused forward covers {', '.join(sorted(_FAMILIES))})"
    cfg = model.config
    if any(t != "full_attention" for t in (getattr(cfg, "layer_types", None) or ())):
        return "sliding-window layers"
    if name == "MistralForCausalLM" and getattr(cfg, "sliding_window", None):
        return "sliding-window attention"
    if getattr(cfg, "mlp_bias", False):
        return "MLP biases"
    if getattr(cfg, "hidden_act", "silu") != "silu":
        return f"activation {cfg.hidden_act}"
    if len({p.device for p in model.parameters()}) != 1:
        return "model sharded over several devices"
    if getattr(cfg, "_attn_implementation", "sdpa") not in ("sdpa", None):
        return f"attn_implementation={cfg._attn_implementation} (fused forward uses SDPA)"
    if getattr(model, "_hf_hook", None) is not None or getattr(model.model, "_hf_hook", None) is not None:
        return "accelerate hooks (offloaded weights)"
    return None


def use_fused(model) -> bool:
    """Whether decoding should run ``model`` on the fused forward: where it computes the model
    exactly (:func:`supports`) and on the CPU, where it is measured faster. On CUDA the model's
    own forward is the default (the fused forward measured 2.7x slower on an H100,
    ``bench/results/gpu_check.md``); ``SPECHEADS_FUSED_CUDA=1`` opts in there."""
    if supports(model) is not None:
        return False
    device = model.get_input_embeddings().weight.device
    return device.type == "cpu" or os.environ.get("SPECHEADS_FUSED_CUDA") == "1"


class _Fused:
    """Per-model fused weights; original parameters rebound to views of them."""

    def __init__(self, model):
        self.model = weakref.ref(model)
        self.layers = []
        # Column-major on CPU unless the smallm kernel is built here: see _column_major.
        emb_w = model.get_input_embeddings().weight
        cm = emb_w.device.type == "cpu" and not _row_major_ok(emb_w.dtype)
        # Normal (not inference-mode) tensors: the rebound parameters must stay usable by autograd.
        with torch.inference_mode(False), torch.no_grad():
            for layer in model.model.layers:
                a, mlp = layer.self_attn, layer.mlp
                qkv = _fuse([a.q_proj, a.k_proj, a.v_proj], "weight", cm)
                qkv_b = _fuse([a.q_proj, a.k_proj, a.v_proj], "bias", False) if a.q_proj.bias is not None else None
                gu = _fuse([mlp.gate_proj, mlp.up_proj], "weight", cm)
                if cm:
                    _column_major(a.o_proj)
                    _column_major(mlp.down_proj)
                o_b = a.o_proj.bias
                self.layers.append(
                    (
                        layer.input_layernorm,
                        qkv,
                        qkv_b,
                        a.o_proj.weight,
                        o_b,
                        layer.post_attention_layernorm,
                        gu,
                        mlp.down_proj.weight,
                    )
                )
            if cm:
                emb, out = model.get_input_embeddings(), model.get_output_embeddings()
                tied = out is not None and out.weight is emb.weight
                _column_major(emb)
                if tied:
                    out.weight = emb.weight
                elif out is not None:
                    _column_major(out)
        self.column_major = cm
        out = model.get_output_embeddings()
        self.lm_weight, self.lm_bias = out.weight, getattr(out, "bias", None)
        self.views = self._pointers(model)

    @staticmethod
    def _pointers(model) -> list[int]:
        out = []
        for layer in model.model.layers:
            a, mlp = layer.self_attn, layer.mlp
            out += [
                m.weight.data_ptr()
                for m in (a.q_proj, a.k_proj, a.v_proj, a.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj)
            ]
        return out + [model.get_output_embeddings().weight.data_ptr()]

    def stale(self, model) -> bool:
        """True when a parameter was replaced (not updated in place) since fusing."""
        return self._pointers(model) != self.views


def _fuse(linears, attr: str, column_major: bool) -> torch.Tensor:
    """Concatenates ``attr`` of ``linears`` row-wise and rebinds each to its slice (shared storage).

    With ``column_major`` the buffer is stored transposed (see :func:`_column_major`); the
    returned ``[out, in]`` tensor and the rebound slices are views of it."""
    parts = [getattr(lin, attr) for lin in linears]
    fused = torch.cat([p.detach() for p in parts])
    fused = fused.t().contiguous().t() if column_major else fused.contiguous()
    start = 0
    for lin, p in zip(linears, parts):
        n = p.shape[0]
        setattr(lin, attr, torch.nn.Parameter(fused[start : start + n], requires_grad=p.requires_grad))
        start += n
    return fused


def _row_major_ok(dtype: torch.dtype = torch.float32) -> bool:
    """Whether CPU weights may stay row-major: where the picker can run a row-major weight on ``smallm`` at
    1-8 rows (:mod:`.smallm`), the reason for :func:`_column_major` is gone, and one layout per weight keeps
    a decoding step from streaming two copies of it (``SPECHEADS_FUSED_LAYOUT=col`` keeps column-major); float32
    only, as smallm is."""
    from specheads.shim.runners import kernels, smallm

    col = os.environ.get("SPECHEADS_FUSED_LAYOUT", "auto") == "col"
    return not col and dtype == torch.float32 and kernels.policy() == "auto" and smallm.available()


def _column_major(module) -> None:
    """Stores ``module.weight`` (``[out, in]``) transposed in memory, as a view with the same shape.

    On CPU, PyTorch's ``F.linear`` with a row-major weight takes a slow path (the weight is
    repacked on every call) as soon as 4 or more rows arrive: a 4-token verification pass cost
    twice a 3-token one. The same product on the transposed storage stays on the fast path at
    every row count (measured on this project's 2-core machine: 576x1728 projection, 4 rows,
    0.73 ms -> 0.09 ms). Values, shapes and autograd are unchanged."""
    w = module.weight
    module.weight = torch.nn.Parameter(w.detach().t().contiguous().t(), requires_grad=w.requires_grad)


def prepare_kernels(model, fused: bool = True) -> None:
    """Takes the kernel choice of every linear product ``model``'s forward runs, at every row-count bucket, now
    (:func:`~.kernels.prepare`): its linear layers, and with ``fused`` (a model the fused forward runs) the fused
    projections, so that no candidate is timed inside a decode being measured."""
    kernels.prepare(model)
    if fused and supports(model) is None and model.get_input_embeddings().weight.device.type == "cpu":
        f = fused_weights(model)
        pairs = [(w, b) for layer in f.layers for w, b in ((layer[1], layer[2]), (layer[3], layer[4]))]
        pairs += [(w, None) for layer in f.layers for w in (layer[6], layer[7])] + [(f.lm_weight, f.lm_bias)]
        kernels.prepare_weights(pairs)


def fused_weights(model) -> _Fused:
    """The model's fused weights, built on first use and rebuilt if a parameter was replaced."""
    f = _FUSED.get(model)
    if f is None or f.stale(model):
        f = _FUSED[model] = _Fused(model)
    return f


class FusedShape:
    """What :func:`~.fused.decoder_layers` needs to know about a model."""

    def __init__(self, model):
        cfg = model.config
        self.weights = fused_weights(model)
        self.heads = cfg.num_attention_heads
        self.kv_heads = getattr(cfg, "num_key_value_heads", None) or self.heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.heads
        self.sizes = [self.heads * self.head_dim, self.kv_heads * self.head_dim, self.kv_heads * self.head_dim]


def unfuse(model) -> None:
    """Gives every projection its own storage again and drops the fused buffers (for code that
    refuses parameters sharing memory, such as ``safetensors.torch.save_file`` on the state dict)."""
    if _FUSED.pop(model, None) is None:
        return
    with torch.inference_mode(False), torch.no_grad():
        mods = []
        for layer in model.model.layers:
            a, mlp = layer.self_attn, layer.mlp
            mods += [a.q_proj, a.k_proj, a.v_proj, a.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj]
        emb, out = model.get_input_embeddings(), model.get_output_embeddings()
        tied = out is not None and out.weight is emb.weight
        mods += [emb] + ([out] if out is not None and not tied else [])
        for mod in mods:
            for attr in ("weight", "bias"):
                p = getattr(mod, attr, None)
                if p is not None:
                    own = p.detach().clone(memory_format=torch.contiguous_format)
                    setattr(mod, attr, torch.nn.Parameter(own, requires_grad=p.requires_grad))
        if tied:
            out.weight = emb.weight


def rms_norm(norm, x: torch.Tensor) -> torch.Tensor:
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
    return norm.weight * h.to(dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def decoder_layers(
    shape,
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    keys: list[torch.Tensor],
    values: list[torch.Tensor],
    start: int,
    end: int,
    mask: torch.Tensor | None,
    causal: bool,
    aux: dict[int, torch.Tensor | None] | None = None,
    pack: torch.Tensor | None = None,
) -> torch.Tensor:
    """All decoder layers on the fused weights, for a batch ``x`` ``[B, S, d]`` at cache slots ``start:end``.

    Args:
        shape: an object with ``weights`` (:class:`_Fused`), ``heads``, ``kv_heads``, ``head_dim``, ``sizes``.
        cos, sin: rotary rows for the new positions, ``[S, hd]`` or ``[B, 1, S, hd]`` (per-row positions).
        keys, values: per-layer ``[B, kv_heads, capacity, hd]`` buffers; slots ``start:end`` are written.
        mask: boolean attention mask broadcastable to ``[B, heads, S, end]`` (True = attend), or None.
        causal: plain causal attention over ``0:end`` (only with ``start == 0`` and no mask).
        aux: layer index ``L`` -> filled with the residual stream entering layer ``L`` (Hugging Face's
            ``hidden_states[L]``), ``[B, S, d]``: the states an EAGLE head reads.
        pack: the positions of ``x.view(B * S, d)`` that hold real tokens (the rest is padding), or None:
            the projections, norms and MLP then run on those rows only, packed together, and only
            attention sees the padded ``[B, S]`` layout (each row on its own cache, under ``mask``); the
            padded positions of the result and of the cache writes are zeros.

    Returns:
        the last layer's output ``[B, S, d]`` (before the final norm).
    """
    b, s = x.shape[:2]
    h, kv_h, hd = shape.heads, shape.kv_heads, shape.head_dim
    if pack is not None:
        x = x.reshape(b * s, -1)[pack]  # [T, d]: the real tokens only
    for i, (n1, qkv, qkv_b, wo, bo, n2, gu, wd) in enumerate(shape.weights.layers):
        if aux is not None and i in aux:
            aux[i] = x if pack is None else _unpack(x, pack, b, s)
        qkv_out = linear(rms_norm(n1, x), qkv, qkv_b)
        if pack is not None:
            qkv_out = _unpack(qkv_out, pack, b, s)
        q, k, v = qkv_out.split(shape.sizes, dim=-1)
        q = _rotate(q.view(b, s, h, hd).transpose(1, 2), cos, sin)
        k = _rotate(k.view(b, s, kv_h, hd).transpose(1, 2), cos, sin)
        keys[i][:, :, start:end] = k
        values[i][:, :, start:end] = v.view(b, s, kv_h, hd).transpose(1, 2)
        o = F.scaled_dot_product_attention(
            q, keys[i][:, :, :end], values[i][:, :, :end], attn_mask=mask, is_causal=causal, enable_gqa=kv_h != h
        )
        o = o.transpose(1, 2).reshape(b, s, h * hd)
        if pack is not None:
            o = o.reshape(b * s, -1)[pack]
        x = x + linear(o, wo, bo)
        gate, up = linear(rms_norm(n2, x), gu).chunk(2, dim=-1)
        x = x + linear(F.silu(gate) * up, wd)
    return x if pack is None else _unpack(x, pack, b, s)


def _unpack(x: torch.Tensor, pack: torch.Tensor, b: int, s: int) -> torch.Tensor:
    """Packed rows ``[T, n]`` back to ``[B, S, n]`` at the positions ``pack`` of ``B * S`` (zeros elsewhere)."""
    out = x.new_zeros(b * s, x.shape[-1])
    out[pack] = x
    return out.view(b, s, -1)


def output_logits(weights: _Fused, x: torch.Tensor) -> torch.Tensor:
    """The output layer on final-norm states ``x`` ``[M, d]`` (kernel chosen for ``M`` rows); a
    pruned draft's :class:`~specheads.shim.runners.vocab_pruning.PrunedHead` scores its subset only."""
    head = weights.model().get_output_embeddings()
    if isinstance(head, PrunedHead):
        return head(x)
    return linear(x, weights.lm_weight, weights.lm_bias)
