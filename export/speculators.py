"""``heads-export format=speculators``: an EAGLE head as the directory vLLM loads as an Eagle-3 draft.

Usage (vLLM >= 0.32)::

    LLM(model=TARGET, speculative_config={"method": "eagle3", "model": DIR, "num_speculative_tokens": K})

What vLLM reads (checked against vLLM 0.32.0's ``transformers_utils/configs/speculators/{base,algos}.py``,
``model_executor/models/llama_eagle3.py``, ``model_executor/models/interfaces.py``,
``v1/spec_decode/llm_base_proposer.py`` and vllm-project/speculators' ``Eagle3SpeculatorConfig``):

``config.json``
    A ``speculators_config`` key makes vLLM treat the directory as the speculators format (model_type
    ``speculators``). ``speculators_model_type: "eagle3"`` picks the Eagle-3 translation, which starts
    from ``transformer_layer_config`` (a Llama config of the draft's layers: ``model_type: llama``,
    ``num_hidden_layers`` (the head's ``num_layers``), ``hidden_size``, ``intermediate_size``, ``num_attention_heads``,
    ``num_key_value_heads``, ``head_dim``, ``rms_norm_eps``, ``rope_theta`` / ``rope_parameters``,
    ``vocab_size`` = the TARGET's vocabulary, ``hidden_act: silu``, no biases, untied) and copies in
    ``draft_vocab_size``, ``target_hidden_size``, ``norm_before_residual``, ``norm_before_fc``,
    ``fc_norm``, ``norm_output`` and ``eagle_aux_hidden_state_layer_ids``; it sets the architecture to
    ``Eagle3LlamaForCausalLM`` (the top-level ``architectures: ["Eagle3Speculator"]`` is the speculators
    library's own name). vLLM 0.32 defaults ``norm_before_residual`` to TRUE when the key is absent (the
    residual would then start from ``hidden_norm(h)``); this head keeps ``h`` itself as the residual, so the
    file says ``false`` explicitly. ``speculators_config`` holds ``algorithm``, ``proposal_methods``
    (``[{"proposal_type": "greedy", "speculative_tokens": K, ...}]``), ``default_proposal_method`` and
    ``verifier`` (``name_or_path``, ``architectures``); vLLM only needs them when the directory itself
    is passed as the model (then ``verifier.name_or_path`` must name the target). ``specheads`` carries
    this project's metadata (ignored by vLLM).

``max_position_embeddings`` (in ``transformer_layer_config``)
    The target's context length (its config's, see :func:`target_positions`): vLLM caps the draft's
    ``max_model_len`` at it, so a smaller number would cut speculation short on long requests.

``eagle_aux_hidden_state_layer_ids``
    vLLM's Llama records ``hidden_states + residual`` for id ``L`` before running decoder layer ``L``
    (id 0: the embeddings), i.e. the residual stream entering layer ``L``: Hugging Face's
    ``hidden_states[L]`` for ``L < num_layers``, the head's own convention. The recorded states are
    concatenated in ascending layer order before ``fc``, so the head's layers must be ascending.
    Without the key vLLM uses ``(2, n // 2, n - 3)``, which is [2, 15, 27] for a 30-layer target.

``model.safetensors``
    ``fc.weight`` [d, k*d]; ``layers.0.{input_layernorm,hidden_norm,post_attention_layernorm}.weight`` [d];
    ``layers.0.self_attn.{q,k,v}_proj.weight`` [heads*hd | kv*hd, 2d]; ``layers.0.self_attn.o_proj.weight``;
    ``layers.0.mlp.{gate,up,down}_proj.weight``; a later layer ``N`` the same without ``hidden_norm``, its
    ``q,k,v`` [.., d] (vLLM's Eagle-3 Llama builds layer ``N >= 1`` over ``d`` and never uses its
    ``hidden_norm``); ``norm.weight``; ``lm_head.weight`` [draft_vocab, d];
    with a pruned vocabulary also ``d2t`` (int64 [draft_vocab]: target id of row i minus i; vLLM scatters
    row i's logit to ``i + d2t[i]``) and ``t2d`` (bool [vocab]: True at the target ids the head scores;
    vLLM skips it, the speculators library keeps it); ``embed_tokens.weight`` [vocab, d], the target's own
    embedding (the head was trained on it), when ``heads-export`` could read it (speculators' loader leaves a
    missing one as zeros, and vLLM uses it as the target's); ``lm_head`` present means it is the head's own. The
    names are the head's ``state_dict`` names (vLLM prefixes ``model.`` to all but ``lm_head``/``d2t``).

The forward vLLM runs matches :class:`specheads.heads.EagleHead`: ``g = fc(states)``; residual ``g``;
attention over ``cat(input_layernorm(embed(next token)), hidden_norm(g))``; ``post_attention_layernorm``
adds the residual; MLP; ``norm`` returns the pre-norm sum that the next draft step feeds back as ``g``.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from specheads.errors import UserError
from specheads.export.header import FORMAT_VERSION
from specheads.export.package import LoadedHead, _digest, fill
from specheads.export.speculators_card import card
from specheads.export.vllm_target import target_architectures, target_positions
from specheads.heads.eagle_head import EagleHead

CONFIG, WEIGHTS = "config.json", "model.safetensors"
FLAGS = {"norm_before_residual": False, "norm_before_fc": False, "fc_norm": False, "norm_output": False}


def is_speculators_dir(path: str | Path) -> bool:
    """Whether ``path`` is a directory whose ``config.json`` has a ``speculators_config``."""
    p = Path(path)
    try:
        return p.is_dir() and "speculators_config" in json.loads((p / CONFIG).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False


def _check(head) -> EagleHead:
    if not isinstance(head, EagleHead):
        raise UserError(
            f"format=speculators writes EAGLE heads only (head_type=eagle); this head is a "
            f"{type(head).__name__}: export it with format=safetensors or format=hf"
        )
    layers = head.layer_ids
    if any(b <= a for a, b in zip(layers, layers[1:])) or min(layers) < 0:
        raise UserError(
            f"the head reads layers {layers}; vLLM concatenates the target's states in ascending "
            "layer order, so format=speculators needs distinct ascending layers (retrain with them)"
        )
    ids = head.vocab_ids.detach().cpu().long()
    if ids.numel() and (bool((ids[1:] <= ids[:-1]).any()) or int(ids[0]) < 0 or int(ids[-1]) >= head.vocab_size):
        raise UserError(
            f"the head's vocab_ids are not distinct ascending target ids below {head.vocab_size}; "
            "re-export it from its training run"
        )
    return head


def tensors(head: EagleHead) -> dict[str, torch.Tensor]:
    """The weights under vLLM's names (the head's own, without ``vocab_ids``) and, for a pruned vocabulary,
    ``d2t``/``t2d``."""
    _check(head)
    out = {k: v.detach().contiguous().cpu() for k, v in head.state_dict().items() if k != "vocab_ids"}
    if head.draft_vocab_size != head.vocab_size:
        ids = head.vocab_ids.detach().cpu().long()
        out["d2t"] = (ids - torch.arange(ids.numel())).contiguous()
        t2d = torch.zeros(head.vocab_size, dtype=torch.bool)
        t2d[ids] = True
        out["t2d"] = t2d
    return out


def _dtype_name(head: EagleHead) -> str:
    return str(head.fc.weight.dtype).removeprefix("torch.")


def config(
    head: EagleHead,
    meta: dict,
    verifier: str | None = None,
    speculative_tokens: int | None = None,
    max_position_embeddings: int | None = None,
) -> dict:
    """The ``config.json`` of the directory (see the module docstring); ``meta``: the head's specheads
    metadata, stored under ``specheads``. ``max_position_embeddings``: the target's (default:
    :func:`target_positions`; one line :class:`UserError` where nothing states it)."""
    _check(head)
    target = meta.get("target") or {}
    name = verifier or target.get("name") or ""
    positions = max_position_embeddings or target_positions(meta, verifier)
    if not positions:
        raise UserError(
            f"format=speculators writes the target's max_position_embeddings, and neither verifier={verifier!r} nor "
            f"the target recorded at training ({target.get('name')!r}) is a model config readable here: pass "
            "verifier=<the target's directory> or max_position_embeddings=<its context length>"
        )
    k = int(speculative_tokens or meta.get("ttt_steps") or 3)
    layer = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "num_hidden_layers": head.num_layers,
        "hidden_size": head.hidden_size,
        "intermediate_size": head.intermediate_size,
        "num_attention_heads": head.num_heads,
        "num_key_value_heads": head.num_kv_heads,
        "head_dim": head.head_dim,
        "rms_norm_eps": head.rms_norm_eps,
        "hidden_act": "silu",
        "rope_theta": head.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": head.rope_theta},
        "max_position_embeddings": int(positions),
        "vocab_size": head.vocab_size,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "num_aux_hidden_states": len(head.layer_ids),
    }
    return {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "dtype": _dtype_name(head),  # transformers 5's name; torch_dtype for older readers
        "torch_dtype": _dtype_name(head),
        "transformer_layer_config": layer,
        "draft_vocab_size": head.draft_vocab_size,
        "target_hidden_size": head.hidden_size,
        **FLAGS,
        "eagle_aux_hidden_state_layer_ids": list(head.layer_ids),
        "speculators_config": {
            "algorithm": "eagle3",
            "default_proposal_method": "greedy",
            "proposal_methods": [
                {"proposal_type": "greedy", "speculative_tokens": k, "verifier_accept_k": 1, "accept_tolerance": 0.0}
            ],
            "verifier": {"name_or_path": name, "architectures": target_architectures(meta, verifier)},
        },
        "specheads": meta,
    }


def write(
    directory: str | Path,
    head: EagleHead,
    meta: dict,
    verifier: str | None = None,
    speculative_tokens: int | None = None,
    max_position_embeddings: int | None = None,
    embed: torch.Tensor | None = None,
) -> Path:
    """Writes ``config.json``, ``model.safetensors`` and ``README.md`` into ``directory``; ``meta``: the head's
    specheads metadata (``head_type``, ``head_config``, ``target``, ...), completed here with
    ``format_version``, ``head_type`` and ``tensors_sha256`` (the digest of the head's own state dict, which
    :func:`read` checks); ``embed``: the target's token embedding, written as ``embed_tokens.weight`` in the
    head's precision (:func:`specheads.export.vllm_target.target_embedding` reads it)."""
    _check(head)
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous().cpu() for k, v in head.state_dict().items()}
    meta = {
        **meta,
        "format_version": FORMAT_VERSION,
        "head_type": "eagle",
        "head_config": head.config(),
        "layout": "speculators",
        "tensors_sha256": _digest(state),
    }
    cfg = config(head, meta, verifier, speculative_tokens, max_position_embeddings)
    tmp = d / (WEIGHTS + ".tmp")
    weights = tensors(head)
    if embed is not None:
        if tuple(embed.shape) != (head.vocab_size, head.hidden_size):
            raise UserError(
                f"the target's embedding is {list(embed.shape)}; the head reads [{head.vocab_size}, {head.hidden_size}]"
            )
        weights["embed_tokens.weight"] = embed.detach().to(head.fc.weight.dtype).contiguous().cpu()
    save_file(weights, str(tmp), metadata={"format": "pt"})
    tmp.replace(d / WEIGHTS)
    for name, text in ((CONFIG, json.dumps(cfg, indent=2, sort_keys=True) + "\n"), ("README.md", card(cfg))):
        (d / (name + ".tmp")).write_text(text, encoding="utf-8")
        (d / (name + ".tmp")).replace(d / name)
    return d


def head_config(cfg: dict) -> dict:
    """:class:`EagleHead` constructor arguments from a speculators Eagle-3 ``config.json``'s standard fields (the
    layers from ``eagle_aux_hidden_state_layer_ids``, else from the ``specheads`` metadata)."""
    layer = cfg.get("transformer_layer_config") or {}
    layers = cfg.get("eagle_aux_hidden_state_layer_ids") or (cfg.get("specheads") or {}).get("head_config", {}).get(
        "layers"
    )
    if not layers:  # speculators' own default: layers 2, n // 2 and n - 3 of the verifier's n
        n = _verifier_layers(cfg)
        if n is None:
            raise UserError(
                "config.json has no eagle_aux_hidden_state_layer_ids and its verifier's config is not readable "
                "here: the head's target layers are unknown"
            )
        layers = [2, n // 2, n - 3]
    rope = layer.get("rope_theta") or (layer.get("rope_parameters") or {}).get("rope_theta") or 10000.0
    hidden, heads = int(layer["hidden_size"]), int(layer["num_attention_heads"])
    return {
        "hidden_size": hidden,
        "layers": [int(i) for i in layers],
        "draft_vocab_size": int(cfg.get("draft_vocab_size") or layer["vocab_size"]),
        "vocab_size": int(layer["vocab_size"]),
        "num_heads": heads,
        "num_kv_heads": int(layer.get("num_key_value_heads") or heads),
        "head_dim": int(layer.get("head_dim") or hidden // heads),
        "intermediate_size": int(layer["intermediate_size"]),
        "rms_norm_eps": float(layer.get("rms_norm_eps", 1e-6)),
        "rope_theta": float(rope),
        "num_layers": int(layer.get("num_hidden_layers") or 1),
    }


def _verifier_layers(cfg: dict) -> int | None:
    """The verifier's ``num_hidden_layers`` from its local config (never downloads)."""
    name = ((cfg.get("speculators_config") or {}).get("verifier") or {}).get("name_or_path")
    path = Path(name).expanduser() / CONFIG if name else None
    if path is None or not path.is_file():
        return None
    conf = json.loads(path.read_text(encoding="utf-8"))
    return (conf.get("text_config") or conf).get("num_hidden_layers")


def embedding(directory: str | Path) -> torch.Tensor | None:
    """The directory's ``embed_tokens.weight`` (the target's, when this toolkit or speculators wrote it)."""
    with safe_open(str(Path(directory) / WEIGHTS), framework="pt") as f:
        return f.get_tensor("embed_tokens.weight") if "embed_tokens.weight" in f.keys() else None


def read(directory: str | Path, device: torch.device | str = "cpu") -> LoadedHead:
    """Loads a ``format=speculators`` directory back into an :class:`EagleHead` (``vocab_ids = i + d2t[i]``)
    with the metadata it was written with; UserError (one line) for what this head cannot represent or for
    tensors that no longer match the recorded digest."""
    d = Path(directory)
    if not is_speculators_dir(d) or not (d / WEIGHTS).is_file():
        raise UserError(
            f"{str(d)!r} is not a speculators directory (config.json with speculators_config and "
            f"{WEIGHTS}); pass a directory written by heads-export format=speculators"
        )
    cfg = json.loads((d / CONFIG).read_text(encoding="utf-8"))
    if cfg.get("speculators_model_type") != "eagle3":
        raise UserError(f"{d}: speculators_model_type={cfg.get('speculators_model_type')!r}; only eagle3 loads here")
    for key, want in FLAGS.items():
        if bool(cfg.get(key, key == "norm_before_residual")) != want:
            raise UserError(f"{d}: {key}={cfg.get(key, key == 'norm_before_residual')} but an EagleHead has {want}")
    with safe_open(str(d / WEIGHTS), framework="pt") as f:
        loaded = {k: f.get_tensor(k) for k in f.keys()}
    args = head_config(cfg)
    module = EagleHead(**args)
    d2t, t2d = loaded.pop("d2t", None), loaded.pop("t2d", None)
    embed = loaded.pop("embed_tokens.weight", None)  # the target's (speculators writes it; the head reads the target's)
    if embed is not None and tuple(embed.shape) != (args["vocab_size"], args["hidden_size"]):
        raise UserError(f"{d}: embed_tokens.weight is {list(embed.shape)}, not [vocab_size, hidden_size]")
    if d2t is None:
        if args["draft_vocab_size"] != args["vocab_size"]:
            raise UserError(
                f"{d}: draft_vocab_size={args['draft_vocab_size']} < vocab_size={args['vocab_size']} "
                "but the weights hold no d2t mapping"
            )
        ids = torch.arange(args["vocab_size"])
    else:
        ids = torch.arange(d2t.numel()) + d2t.long()
        if t2d is not None and not torch.equal(t2d.nonzero().flatten(), ids.sort().values):
            raise UserError(f"{d}: t2d and d2t name different target tokens; re-export the head")
    loaded["vocab_ids"] = ids
    module = fill(module, loaded, f"{d / WEIGHTS} does not fit an EAGLE head of its config.json")
    verifier = ((cfg.get("speculators_config") or {}).get("verifier") or {}).get("name_or_path")
    meta = dict(  # a directory speculators (or SpecForge) wrote: a head on its verifier's states, by name only
        cfg.get("specheads")
        or {
            "format_version": FORMAT_VERSION,
            "head_type": "eagle",
            "hidden_size": args["hidden_size"],
            "head_config": dict(args),
            "feature": {"model": "target", "state": "aux", "layers": args["layers"]},
            "target": {"name": verifier},
            "written_by": "speculators",
        }
    )
    want = meta.get("tensors_sha256")
    if want and want != _digest({k: v.contiguous() for k, v in module.state_dict().items()}):
        raise UserError(
            f"{d}: the weights were modified after export (they no longer match config.json's "
            "specheads.tensors_sha256); re-export the head"
        )
    return LoadedHead(module.to(device).eval().requires_grad_(False), meta)
