"""An EAGLE-3-style draft head: a decoder layer (or a few) over the target's own states (Li et al. 2025).

The head drafts from what the target computed anyway. At position ``t`` it reads the target's
residual stream at three depths (low, middle, high: ``layers``, counted as Hugging Face's
``hidden_states`` index, i.e. the input of that decoder layer), fuses them with one linear layer
(``fc``: ``3d -> d``) into ``g_t`` and runs one Llama decoder layer whose attention reads the
next token's embedding joined to that state: ``[norm(e(x_{t+1})); norm(g_t)]`` (``2d`` wide). A head of
``num_layers`` > 1 stacks plain Llama layers on that one's output. The last layer's output before the final
norm, ``a_t``, is the head's own state; after ``norm`` and
``lm_head`` (a pruned output layer over ``vocab_ids``, the FR-Spec subset) it scores ``x_{t+2}``.
The next draft step feeds ``a_t`` in place of ``g`` (no ``fc``: it is already ``d`` wide), so the
head rolls its own state forward for as many steps as it drafts.

The layout is the speculators / vLLM ``Eagle3`` one (``layers.0.*``, ``fc``, ``norm``, ``lm_head``),
so ``heads-export format=speculators`` only renames the vocabulary mapping. The token embedding is
the target's (never stored here); attention and its cache live with the caller (training unrolls
the steps with :meth:`EagleHead.qkv` and :meth:`EagleHead.finish`; decoding keeps a KV cache), and every
caller attends through :meth:`EagleHead.attend`. Its shape is an :class:`EagleConfig`, saved in the exported
head's metadata as ``head_config``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn

from specheads.errors import UserError


@dataclass(frozen=True)
class EagleConfig:
    """The EAGLE head's architecture: what it reads of the target, the shape of its decoder layers and its
    output vocabulary. Saved in the exported metadata as ``head_config`` (:meth:`to_dict`) and read back by
    :class:`EagleHead` (``EagleHead(**head_config)``).

    Attributes:
        hidden_size: the target's width ``d`` (the head's too).
        layers: the target's ``hidden_states`` indices it fuses (low, middle, high: ``fc`` is ``len(layers) * d``
            wide).
        draft_vocab_size: rows of the pruned output layer (the FR-Spec subset); ``vocab_size`` for the whole one.
        vocab_size: the target's vocabulary size.
        num_heads, num_kv_heads, head_dim, intermediate_size: the decoder layers' shape (the target's).
        rms_norm_eps, rope_theta: as the target's.
        num_layers: decoder layers. The first reads the joined embedding and state (``2d``); each later one is a
            plain Llama layer over the state before it (``d``), as vLLM's ``Eagle3`` draft stacks them.
    """

    hidden_size: int
    layers: tuple[int, ...]
    draft_vocab_size: int
    vocab_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    num_layers: int = 1

    def __post_init__(self) -> None:
        object.__setattr__(self, "layers", tuple(int(i) for i in self.layers))
        problems = [
            f"{k}={getattr(self, k)} must be >= 1"
            for k in (
                "hidden_size",
                "draft_vocab_size",
                "vocab_size",
                "num_heads",
                "num_kv_heads",
                "head_dim",
                "num_layers",
            )
            if getattr(self, k) < 1
        ]
        if not self.layers or min(self.layers) < 0:
            problems.append(f"layers={list(self.layers)}: the head reads at least one target layer, indices >= 0")
        if self.draft_vocab_size > self.vocab_size:
            problems.append(f"draft_vocab_size={self.draft_vocab_size} is larger than vocab_size={self.vocab_size}")
        if self.num_kv_heads >= 1 and self.num_heads % self.num_kv_heads:
            problems.append(f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
        if problems:
            raise UserError("EAGLE head config: " + "; ".join(problems))

    @classmethod
    def for_target(
        cls, config, layers: list[int], draft_vocab_size: int, vocab_size: int | None = None, num_layers: int = 1
    ) -> EagleConfig:
        """The head of a Hugging Face Llama-style target ``config`` reading ``layers``, with an output layer of
        ``draft_vocab_size`` rows (``vocab_size``: the target's embedding rows, when they differ from the
        config's count) and ``num_layers`` decoder layers."""
        heads = config.num_attention_heads
        params = getattr(config, "rope_parameters", None) or {}
        theta = params.get("rope_theta") if isinstance(params, dict) else None
        return cls(
            hidden_size=config.hidden_size,
            layers=tuple(layers),
            draft_vocab_size=draft_vocab_size,
            vocab_size=vocab_size or config.vocab_size,
            num_heads=heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
            intermediate_size=config.intermediate_size,
            rms_norm_eps=float(config.rms_norm_eps),
            rope_theta=float(theta or getattr(config, "rope_theta", None) or 10000.0),
            num_layers=num_layers,
        )

    def to_dict(self) -> dict:
        """The ``head_config`` an exported head records (``layers`` as a list: JSON)."""
        return {**dataclasses.asdict(self), "layers": list(self.layers)}


class RMSNorm(nn.Module):
    """Llama's RMSNorm (computed in fp32)."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * h.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int, width: int):
        super().__init__()
        self.q_proj = nn.Linear(width, heads * head_dim, bias=False)
        self.k_proj = nn.Linear(width, kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(width, kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=False)


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """A decoder layer. The first (``joined``) attends ``2d -> d`` over the joined embedding and state and
    norms the state with ``hidden_norm``; a later one is a plain Llama layer over the state before it."""

    def __init__(
        self, hidden: int, heads: int, kv_heads: int, head_dim: int, intermediate: int, eps: float, joined: bool
    ):
        super().__init__()
        self.input_layernorm = RMSNorm(hidden, eps)
        if joined:
            self.hidden_norm = RMSNorm(hidden, eps)
        self.self_attn = Attention(hidden, heads, kv_heads, head_dim, 2 * hidden if joined else hidden)
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.mlp = MLP(hidden, intermediate)


class EagleHead(nn.Module):
    """The draft head of an :class:`EagleConfig` (given whole, or as its fields: ``EagleHead(**head_config)``)."""

    def __init__(self, config: EagleConfig | None = None, **fields):
        super().__init__()
        if config is not None and fields:
            raise TypeError(f"EagleHead takes a config or its fields, not both (got {sorted(fields)} too)")
        c = self.cfg = config if config is not None else EagleConfig(**fields)
        self.hidden_size, self.layer_ids = c.hidden_size, list(c.layers)
        self.draft_vocab_size, self.vocab_size = c.draft_vocab_size, c.vocab_size
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.intermediate_size, self.rms_norm_eps, self.rope_theta = c.intermediate_size, c.rms_norm_eps, c.rope_theta
        self.fc = nn.Linear(len(self.layer_ids) * c.hidden_size, c.hidden_size, bias=False)
        self.num_layers = c.num_layers
        self.layers = nn.ModuleList(
            DecoderLayer(
                c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size, c.rms_norm_eps, i == 0
            )
            for i in range(c.num_layers)
        )
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = nn.Linear(c.hidden_size, c.draft_vocab_size, bias=False)
        # vocab_ids[i]: the target id of output row i (sorted, so the mapping is monotone)
        self.register_buffer("vocab_ids", torch.arange(c.draft_vocab_size, dtype=torch.long))

    def config(self) -> dict:
        """Its :class:`EagleConfig`, as the exported metadata's ``head_config``."""
        return self.cfg.to_dict()

    @property
    def layer(self) -> DecoderLayer:
        return self.layers[0]

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotary ``cos, sin`` ``[*positions.shape, head_dim]`` (default rope, ``rope_theta``)."""
        half = self.head_dim // 2
        inv = 1.0 / (self.rope_theta ** (torch.arange(half, device=positions.device, dtype=torch.float32) / half))
        ang = positions.float()[..., None] * inv
        ang = torch.cat([ang, ang], dim=-1)
        dtype = self.fc.weight.dtype
        return ang.cos().to(dtype), ang.sin().to(dtype)

    def fuse(self, states: torch.Tensor) -> torch.Tensor:
        """``g``: the target's states at the head's layers, ``[..., len(layers) * d]`` -> ``[..., d]``."""
        return self.fc(states)

    def qkv(self, emb: torch.Tensor, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layer: int = 0):
        """Queries ``[B, heads, S, hd]`` and keys/values ``[B, kv_heads, S, hd]`` (rotated) of decoder layer
        ``layer`` for the token embeddings ``emb`` and states ``h`` ``[B, S, d]`` (the layer's input: the
        first layer joins both, a later one reads ``h`` alone); ``cos``/``sin`` ``[S, hd]`` or ``[B, S, hd]``."""
        ly = self.layers[layer]
        a = ly.self_attn
        x = torch.cat([ly.input_layernorm(emb), ly.hidden_norm(h)], dim=-1) if layer == 0 else ly.input_layernorm(h)
        b, s = x.shape[:2]
        q = a.q_proj(x).view(b, s, self.num_heads, self.head_dim).transpose(1, 2)
        k = a.k_proj(x).view(b, s, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = a.v_proj(x).view(b, s, self.num_kv_heads, self.head_dim).transpose(1, 2)
        if cos.dim() == 3:
            cos, sin = cos[:, None], sin[:, None]
        return rotate(q, cos, sin), rotate(k, cos, sin), v

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """The decoder layer's attention, ``[B, heads, S, hd]``, of queries ``q`` over keys/values ``k``, ``v``
        ``[B, kv_heads, L, hd]`` under the boolean ``mask`` (True = attend; None: every key): the one place it
        is computed, for training (:func:`unrolled_attention`), the KV-cached drafter and the batched one."""
        gqa = self.num_kv_heads != self.num_heads
        return nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)

    def finish(self, attn: torch.Tensor, h: torch.Tensor, layer: int = 0) -> torch.Tensor:
        """Decoder layer ``layer``'s output ``[B, S, d]`` from its attention output ``[B, heads, S, hd]`` and
        its input state ``h`` (the residual stream starts at ``h``); the last layer's is the head's state
        ``a`` (before the final norm)."""
        ly = self.layers[layer]
        b, _, s, _ = attn.shape
        x = h + ly.self_attn.o_proj(attn.transpose(1, 2).reshape(b, s, -1))
        return x + ly.mlp(ly.post_attention_layernorm(x))

    def logits(self, a: torch.Tensor) -> torch.Tensor:
        """Scores over the pruned vocabulary ``[..., draft_vocab_size]`` from states ``a``."""
        return self.lm_head(self.norm(a))

    def forward(
        self, states: torch.Tensor, embeds: torch.Tensor, key_mask: torch.Tensor | None, rows: list[torch.Tensor]
    ) -> list[torch.Tensor]:
        """Training's forward (through the data-parallel wrapper): :func:`unrolled_forward`."""
        return unrolled_forward(self, states, embeds, key_mask, rows)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def unrolled_attention(
    head: EagleHead,
    qs: list[torch.Tensor],
    ks: list[torch.Tensor],
    vs: list[torch.Tensor],
    key_mask: torch.Tensor | None,
) -> torch.Tensor:
    """Training-time test attention of step ``j = len(qs)`` (EAGLE-3): row ``t``'s query sees the first
    step's keys at positions ``<= t`` (the states the target fed) and, of every later step, only its own
    row's key (what it drafted itself on the way), as it does while decoding.

    One :meth:`EagleHead.attend` call over the steps' keys joined along the
    sequence (``j * T`` keys) under a boolean mask: causal over the first step's, the diagonal of every later
    step's. The ``[B, heads, T, T]`` scores are left to the kernel (which need not hold them); the mask is
    ``[T, j*T]`` (``[B, 1, T, j*T]`` with a ``key_mask``).

    Args:
        head: the head whose attention it is (:meth:`EagleHead.attend`).
        qs, ks, vs: per step so far, ``[B, heads, T, hd]`` queries (only the last is used) and
            ``[B, kv_heads, T, hd]`` keys/values.
        key_mask: ``[B, T]`` bool, False at padding (None: no padding); it masks the first step's keys only.

    Returns:
        ``[B, heads, T, hd]``.
    """
    q = qs[-1]
    t = q.shape[2]
    steps = len(ks)
    first = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
    if key_mask is not None:
        first = first[None, None] & key_mask.to(q.device)[:, None, None, :]
    own = torch.eye(t, dtype=torch.bool, device=q.device).expand(*first.shape[:-2], t, t)
    mask = torch.cat([first, *[own] * (steps - 1)], dim=-1)  # [T, steps*T] or [B, 1, T, steps*T]
    k = torch.cat(ks, dim=2) if steps > 1 else ks[0]
    v = torch.cat(vs, dim=2) if steps > 1 else vs[0]
    return head.attend(q, k, v, mask)


def unrolled_forward(
    head: EagleHead, states: torch.Tensor, embeds: torch.Tensor, key_mask: torch.Tensor | None, rows: list[torch.Tensor]
) -> list[torch.Tensor]:
    """The head unrolled for ``len(rows)`` draft steps over whole sequences (training-time test).

    Step ``j`` (from 0) reads, at row ``t``, the embedding of token ``x_{t+j+1}`` (``embeds[j]``) and the
    state of the step before (step 0: the fused target states), sits at rotary position ``t + j`` and
    scores ``x_{t+j+2}``; each layer's attention is :func:`unrolled_attention` over that layer's keys.

    Args:
        states: the target's joined states ``[B, T, len(layers) * d]``.
        embeds: ``[steps, B, T, d]`` token embeddings per step.
        key_mask: ``[B, T]`` bool, False at padding (or None).
        rows: per step, ``[B, T]`` bool: the rows whose scores are returned.

    Returns:
        per step, the scores ``[rows[j].sum(), draft_vocab_size]`` of the selected rows.
    """
    h = head.fuse(states)
    positions = torch.arange(states.shape[1], device=states.device)
    kept = unrolled_kept(head)
    out = []
    for j, sel in enumerate(rows):
        cos, sin = head.rope(positions + j)
        h = unrolled_step(head, kept, embeds[j], h, cos, sin, key_mask)
        out.append(head.logits(h[sel]))
    return out


def unrolled_kept(head: EagleHead) -> list[tuple[list, list, list]]:
    """Per decoder layer, the queries, keys and values of the steps run so far (:func:`unrolled_step` fills it)."""
    return [([], [], []) for _ in range(head.num_layers)]


def unrolled_step(
    head: EagleHead,
    kept: list[tuple[list, list, list]],
    emb: torch.Tensor,
    h: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    key_mask: torch.Tensor | None,
) -> torch.Tensor:
    """One draft step over whole sequences through every decoder layer: the embeddings ``emb`` and states ``h``
    ``[B, T, d]`` in, the head's states out. Each layer's queries, keys and values join ``kept``
    (:func:`unrolled_kept`) and its attention is :func:`unrolled_attention` over them; the first step's is
    causal, so one step alone is the head's causal pass over a sequence."""
    for layer, (qs, ks, vs) in enumerate(kept):
        q, k, v = head.qkv(emb, h, cos, sin, layer)
        qs.append(q)
        ks.append(k)
        vs.append(v)
        h = head.finish(unrolled_attention(head, qs, ks, vs, key_mask), h, layer)
    return h
