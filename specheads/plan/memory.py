"""The arithmetic of a plan (:mod:`specheads.plan`): one process's memory, the disk and the tokens of a run.

Every figure is a product of shapes (:mod:`specheads.model_shapes`) and settings, in bytes:

* weights: parameters x bytes per parameter (the model's dtype; ``load_in_8bit``/FP8: 1);
* activations: the tensors one forward holds at a time, per layer ``rows x (4 hidden + 3 intermediate)``
  values (the residual stream, its norm, attention's output, the MLP's gate, up and product), at the
  largest model a process runs; training keeps them for every trained layer;
* KV cache: ``rows x 2 x layers x kv_heads x head_dim`` per model that runs with a cache;
* label buffers: what a family holds besides (acceptance/FSD/SPRINTER: both models' logits over the
  full vocabulary for ``batch x max_new_tokens`` rows, and fp32 ``p``, ``q``, ``min(p, q)`` when the
  labels need probabilities: sampled acceptance builds them a block of rows at a time, at most 1 GiB);
* disk: the stored states (``rows x width x 2`` bytes, fp16) and the label columns (4 bytes a value).

``rows`` is ``batch_size x (prompt_tokens + max_new_tokens)``. Settings are read by name from the CLI's
config (this module imports no stage).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from specheads.engines import ENGINES, engine_of
from specheads.errors import UserError
from specheads.model_shapes import Shape, safetensors_params, shape_of

DTYPE_BYTES = {"float32": 4, "float": 4, "fp32": 4, "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2, "half": 2}
LABEL_COLUMNS = {"acceptance": 3, "fsd": 3, "sprinter": 5, "drafter": 1, "judge": 1, "eagle_rounds": 6}
ALIASES = {"specdecpp": "acceptance", "sprinter": "verifier"}


@dataclass
class Memory:
    """One process's memory in bytes; ``sharded`` of it is spread evenly over its ``gpus``."""

    weights: dict[str, float]
    activations: float
    kv_cache: float
    label_buffers: float
    optimizer: float = 0.0
    sharded: float = 0.0
    gpus: int = 1
    notes: list[str] = field(default_factory=list)

    def total(self) -> float:
        return sum(self.weights.values()) + self.activations + self.kv_cache + self.label_buffers + self.optimizer

    def fullest_gpu(self) -> float:
        """The GPU that holds the unsharded rest besides its share (the first: draft, buffers)."""
        return self.sharded / self.gpus + self.total() - self.sharded


def dtype_bytes(spec, fp8: bool = False) -> float:
    """Bytes per parameter of a model spec on a GPU (``auto``: bf16)."""
    if fp8 or getattr(spec, "load_in_8bit", False):
        return 1
    dtype = str(spec.dtype).removeprefix("torch.")
    if dtype == "auto":
        return 2
    if dtype not in DTYPE_BYTES:
        raise UserError(f"plan: dtype={spec.dtype!r} unknown; use float32, bfloat16, float16 or auto")
    return DTYPE_BYTES[dtype]


def layer_values(shape: Shape) -> int:
    """Values per row one decoder layer's forward holds (see the module docstring)."""
    return 4 * shape.hidden + 3 * shape.intermediate


def needs_draft(cfg) -> bool:
    """Whether ``heads-datagen`` loads the draft for this family (the labellers' ``needs_draft``)."""
    if cfg.labels in ("drafter", "eagle_rounds"):
        return False
    if cfg.labels == "judge":
        return cfg.judge.mining == "swap" or not (cfg.judge.tuples or "draft" not in cfg.judge.answer_models)
    return True


def target_under_vllm(cfg) -> str:
    """What ``heads-datagen engine=vllm`` loads of the Transformers target beside vLLM (the labellers'
    ``target_under_vllm``): ``model``, ``output_layer`` or ``config`` (no weight)."""
    if cfg.labels == "drafter":
        return "config"
    if cfg.labels in ("sprinter", "judge"):
        return "output_layer"
    if cfg.labels == "acceptance" and (not cfg.sampling.do_sample or cfg.vllm.logprobs):
        return "config"
    return "model"


def eagle_head_params(shape: Shape, vocab: int, n_layers: int = 3) -> int:
    """An EAGLE-3 head on ``shape``: the fuse layer, one decoder layer over ``2 x hidden`` and its output layer."""
    h, d = shape.hidden, shape.dim
    attention = 2 * h * shape.heads * d + 2 * 2 * h * shape.kv_heads * d + shape.heads * d * h
    return n_layers * h * h + attention + 3 * h * shape.intermediate + 4 * h + vocab * h


def datagen_memory(cfg, batch: int, fp8: bool = False, span: int | None = None) -> Memory:
    """One ``heads-datagen`` process at ``batch`` prompts per forward.

    Args:
        cfg: the run's DatagenConfig (read by name).
        batch: prompts per forward.
        fp8: plan the target (and draft) with 1-byte weights.
        span: GPUs the target is sharded over (default: the node's ``gpus`` under ``target.device_map``,
            else 1).
    """
    target = shape_of(cfg.target, "target")
    draft = shape_of(cfg.draft, "draft") if needs_draft(cfg) else None
    tb, db = dtype_bytes(cfg.target, fp8), dtype_bytes(cfg.draft, fp8) if draft else 0
    act_b = 2 if tb < 2 else tb  # 8-bit weights still compute in bf16
    if cfg.labels == "eagle_rounds":
        batch = 1  # SD decoding, one prompt at a time
    new = cfg.max_new_tokens
    rows = batch * (cfg.prompt_tokens + new)
    weights = {"target": target.params() * tb, "draft": draft.params() * db if draft else 0.0, "head": 0.0}
    use = target_under_vllm(cfg) if engine_of(cfg).holds_target else "model"  # the engine's copy: plan.py counts it
    if use != "model":
        weights["target"] = (target.vocab + 1) * target.hidden * tb if use == "output_layer" else 0.0
    if cfg.labels == "eagle_rounds":  # the exported head's own count when it is here, else a full-vocabulary one
        here = Path(cfg.eagle_rounds.head).is_file() if cfg.eagle_rounds.head else False
        weights["head"] = (
            safetensors_params(cfg.eagle_rounds.head) if here else eagle_head_params(target, target.vocab)
        ) * act_b
    models = ([(target, act_b)] if use == "model" else []) + ([(draft, max(db, 2))] if draft else [])
    activations = max((rows * layer_values(s) * b for s, b in models), default=0.0)
    kv_target = rows * target.kv_bytes_per_token(act_b) if use == "model" else 0.0
    kv = kv_target + (rows * draft.kv_bytes_per_token(max(db, 2)) if draft else 0.0)
    gpus = span or (cfg.gpus if cfg.target.device_map else 1)
    return Memory(
        weights,
        activations,
        kv,
        label_buffers(cfg, target, batch, act_b),
        sharded=(weights["target"] + kv_target) if gpus > 1 else 0.0,
        gpus=gpus,
    )


ACCEPTANCE_BLOCK_BYTES = 1 << 30  # datagen/acceptance_labels.py's LABEL_BUFFER_BYTES (a stage: not imported)


def label_buffers(cfg, target: Shape, batch: int, act_b: float) -> float:
    """What a family holds besides the forwards (module docstring)."""
    new, v, h = cfg.max_new_tokens, target.vocab, target.hidden
    n = batch * new  # labelled rows per batch
    if cfg.labels in ("acceptance", "fsd", "sprinter"):
        logits = 2 * n * v * act_b
        if cfg.labels == "fsd":  # probabilities in steps of 256 rows (fsd_labels.ROWS_PER_STEP)
            return logits + 3 * min(n, 256) * v * 4
        if cfg.labels == "sprinter":
            return logits + 3 * n * v * 4
        # sampled acceptance: fp32 p, q, min(p, q) a block of rows at a time, at most 1 GiB together
        # (datagen/acceptance_labels.py, LABEL_BUFFER_BYTES)
        return logits + (min(3 * n * v * 4, ACCEPTANCE_BLOCK_BYTES) if cfg.sampling.do_sample else 0.0)
    if cfg.labels == "drafter":  # the responses' logits, then one sequence's fp32 log-softmax and states
        layers = len(cfg.drafter.layers) or 3
        return n * v * act_b + new * v * 4 + (cfg.prompt_tokens + new) * layers * h * 4
    if cfg.labels == "judge":  # the pre-norm states of a batch of answers
        return batch * (cfg.prompt_tokens + new) * h * act_b
    return (cfg.prompt_tokens + new) * v * 4  # eagle_rounds: a round's logits over the sequence at most


def datagen_rows(cfg, prompts: int) -> dict:
    """Target tokens the run processes and the rows it stores, at most."""
    new = cfg.max_new_tokens
    if cfg.labels == "judge" and cfg.judge.mining == "swap":
        labelled = prompts * (cfg.judge.mine_max_mismatches + (new if cfg.judge.mine_label_matches else 0))
        target_tokens = prompts * (new + cfg.judge.mine_max_tokens)
    elif cfg.labels == "judge":
        answers = 1 if cfg.judge.tuples else len(cfg.judge.answer_models) * (1 + cfg.judge.answer_samples)
        labelled = target_tokens = prompts * answers * new
    elif cfg.labels == "eagle_rounds":
        labelled, target_tokens = prompts * new * max(cfg.eagle_rounds.k - 1, 1), prompts * new
    else:
        labelled = target_tokens = prompts * new
    return {"prompts": prompts, "target_tokens": target_tokens, "labelled_tokens": labelled}


def datagen_disk(cfg, rows: dict) -> dict:
    """Bytes on disk: stored states (fp16) and label columns."""
    target = shape_of(cfg.target, "target")
    seq = rows["prompts"] * (cfg.prompt_tokens + cfg.max_new_tokens)
    states = 0.0
    if cfg.labels == "drafter":
        width = (len(cfg.drafter.layers) or 3) * target.hidden
        states = seq * width * 2 if cfg.drafter.store_states else 0.0
        states += rows["labelled_tokens"] * cfg.drafter.top_k * 8  # + top-k ids, log-probs
    elif cfg.labels in ("judge", "eagle_rounds"):
        states = rows["labelled_tokens"] * target.hidden * 2
    labels = seq * 4 + rows["labelled_tokens"] * LABEL_COLUMNS.get(cfg.labels, 3) * 4
    return {"states": states, "labels": labels}


def head_params(cfg, target: Shape | None, draft: Shape | None, data) -> int:
    """Trainable parameters of ``heads-train``'s head (``head=draft``: the draft model's)."""
    head = ALIASES.get(cfg.head, cfg.head)
    if head == "eagle":
        return eagle_head_params(target, min(cfg.vocab_top_n, target.vocab), len(data.get("layers") or [0] * 3))
    if head == "draft":
        return draft.params() - (
            draft.vocab * draft.hidden * (1 if draft.tied else 2) if cfg.distill.freeze_embeddings else 0
        )
    width = {
        "acceptance": draft.hidden if draft else 0,
        "verifier": (2 if cfg.verifier.feature == "previous+embedding" else 1) * (draft.hidden if draft else 0),
        "judge": target.hidden if target else 0,
        "eagle_stop": (target.hidden if target else 0) + int(cfg.eagle_stop.confidence),
    }[head]
    return cfg.depth * (width * width + width) + width + 1


def train_memory(cfg, data: dict, world: int, zero: int = 0, batch: int | None = None) -> Memory:
    """One ``heads-train`` process (DDP; ``zero=2``/``3``: DeepSpeed ZeRO over ``world`` processes) at ``batch``
    sequences per micro-batch (default ``batch_size``)."""
    head = ALIASES.get(cfg.head, cfg.head)
    uses_draft = head in ("acceptance", "verifier", "draft")
    uses_target = head in ("eagle", "judge", "eagle_stop")
    target = shape_of(cfg.target, "target") if head == "eagle" or (uses_target and cfg.target.path) else None
    if uses_target and target is None:
        target = data.get("target_shape")
    draft = shape_of(cfg.draft, "draft") if uses_draft else None
    params = head_params(cfg, target, draft, data)
    act_b = 2 if cfg.bf16 else 4
    rows = (batch or cfg.batch_size) * data["sequence_tokens"]
    weights = {"target": 0.0, "draft": 0.0, "head": params * 4.0}
    if head == "eagle":  # the target's embeddings, fp32 on the device (never trained)
        weights["target"] = target.vocab * target.hidden * 4.0
    if head in ("acceptance", "verifier"):
        weights["draft"] = draft.params() * dtype_bytes(cfg.draft)
    optimizer = params * 12.0  # fp32 gradients and Adam's two moments
    if zero >= 2:
        optimizer /= world
    if zero >= 3:
        weights["head"] /= world
    if head == "eagle":
        steps = cfg.eagle.ttt_steps
        vocab = min(cfg.vocab_top_n, target.vocab)
        activations = steps * rows * (layer_values(target) * act_b + 2 * vocab * 4)
    elif head == "draft":
        activations = rows * (draft.layers * layer_values(draft) * act_b + 2 * draft.vocab * 4)
    else:
        width = (draft or target).hidden
        activations = rows * width * 4 * (2 * cfg.depth + 2)
        if head in ("acceptance", "verifier"):  # the frozen draft's forward (online features)
            activations += rows * layer_values(draft) * act_b
    buffers = rows * (data.get("top_k", 0) * 8 + 8)
    mem = Memory(weights, activations, 0.0, buffers, optimizer=optimizer)
    if head == "eagle" and eagle_mode(cfg, data) != "offline":
        _state_maker(cfg, mem, target, rows, act_b)
    return mem


def eagle_mode(cfg, data: dict) -> str:
    """The states an EAGLE run takes (``eagle.states``; ``auto``: offline when its data stores them)."""
    mode = cfg.eagle.states
    return ("offline" if data.get("stores_states", True) else "online") if mode == "auto" else mode


def _state_maker(cfg, mem: Memory, target: Shape, rows: int, act_b: float) -> None:
    """What makes an online EAGLE run's states, added to one process: the target in it (its weights, one forward's
    activations and KV cache over a micro-batch), or the vLLM engine beside it (the target's weights and a KV cache
    for ``rows`` tokens, over its ``vllm.tensor_parallel x pipeline_parallel`` GPUs, which the process shares)."""
    weights = target.params() * dtype_bytes(cfg.target)
    kv = rows * target.kv_bytes_per_token(dtype_bytes(cfg.target))
    if ENGINES[cfg.eagle.engine].holds_target:
        mem.gpus = max(cfg.vllm.tensor_parallel, 1) * max(cfg.vllm.pipeline_parallel, 1)
        mem.sharded = weights + kv
    mem.weights["target"] += weights
    mem.kv_cache += kv
    mem.activations = max(mem.activations, rows * layer_values(target) * act_b)  # never at the same time
