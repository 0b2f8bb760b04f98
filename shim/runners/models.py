"""Loading a draft/target pair, checking it and fingerprinting it (hidden states: :mod:`.hidden`)."""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from specheads.errors import UserError
from specheads.shim.runners.hidden import output_device
from specheads.shim.runners.kernels import route
from specheads.shim.runners.model_facts import eos_ids, freest_gpu
from specheads.shim.runners.vocab_pruning import prune, read_ranking, subset_from_ranking, vocab_info

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
HETEROGENEOUS_POLICIES = ("tli", "slem", "slrs")
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*(/[\w.\-]+)?$")


@dataclass
class ModelSpec:
    """Where a model comes from and how to place it."""

    path: str = ""
    gguf_file: str | None = field(
        default=None, metadata={"help": "GGUF file name inside path (needs the [gguf] extra)"}
    )
    tokenizer: str | None = field(default=None, metadata={"help": "tokenizer location; defaults to path"})
    dtype: str = field(
        default="auto",
        metadata={"help": "auto (bf16 on a GPU that supports it, else fp32) | float32 | bfloat16 | float16"},
    )
    device: str = field(default="auto", metadata={"help": "cpu | cuda | cuda:N | auto"})
    device_map: str | None = field(
        default=None, metadata={"help": "e.g. auto: shard a large model over the node's GPUs"}
    )
    attn_implementation: str | None = field(default=None, metadata={"help": "sdpa | eager | flash_attention_2"})
    revision: str | None = None
    trust_remote_code: bool = False
    load_in_8bit: bool = field(
        default=False, metadata={"help": "8-bit weights (bitsandbytes, CUDA only): e.g. a 405B target on one node"}
    )
    vocab_file: str | None = field(
        default=None,
        metadata={
            "help": (
                "draft only: a heads-vocab ranking; the draft's output layer scores only its most "
                "frequent tokens (FR-Spec pruning, lossless)"
            )
        },
    )
    vocab_top_n: int | None = field(
        default=None,
        metadata={
            "help": (
                "draft only: keep this many of vocab_file's most frequent tokens (EOS always kept); "
                "null: every ranked token"
            )
        },
    )


@dataclass
class LoadedModel:
    """A model with its tokenizer, fingerprint and the device its inputs go to."""

    model: Any  # a Transformers PreTrainedModel
    tokenizer: Any
    spec: ModelSpec
    fingerprint: str
    name: str

    @property
    def device(self) -> torch.device:
        """Where its inputs go; for a target loaded without its weights (``specheads.runtime.target_shell``): its
        spec's."""
        weight = self.model.get_input_embeddings().weight
        return weight.device if weight.device.type != "meta" else torch.device(resolve_device(self.spec.device))

    @property
    def output_device(self) -> torch.device:
        """Where its logits and final states come out (the last GPU of a split model)."""
        out = output_device(self.model)
        return out if out.type != "meta" else self.device

    @property
    def hidden_size(self) -> int:
        return int(self.model.config.hidden_size)

    @property
    def vocab(self) -> dict | None:
        """The pruned output layer's subset (size, sha256), or None for the full vocabulary."""
        return vocab_info(self.model)


@dataclass
class Pair:
    """A target and (optionally) a draft that share one vocabulary."""

    target: LoadedModel
    draft: LoadedModel | None

    @property
    def tokenizer(self):
        return self.target.tokenizer

    @property
    def eos_token_ids(self) -> list[int]:
        return eos_ids(self.target.model, self.target.tokenizer)


def resolve_location(spec: ModelSpec, role: str) -> tuple[str, str | None, bool]:
    """Returns (path or hub id, gguf file name, is_local); raises UserError for a missing local path."""
    if not spec.path:
        raise UserError(f"{role}.path is empty; set {role}.path=<local dir, hub id or .gguf file>")
    path, gguf = os.path.expanduser(spec.path), spec.gguf_file
    if path.endswith(".gguf") and gguf is None:
        path, gguf = os.path.dirname(path) or ".", os.path.basename(path)
    if os.path.exists(path):
        if gguf is not None and not os.path.isfile(os.path.join(path, gguf)):
            have = sorted(p.name for p in Path(path).glob("*.gguf"))
            raise UserError(f"{role}.gguf_file={gguf!r} not found in {path} (GGUF files there: {have or 'none'})")
        return path, gguf, True
    looks_local = path.startswith(("/", ".", "~")) or path.count("/") > 1 or not _HUB_ID.match(path)
    if looks_local:
        raise UserError(f"{role}.path={spec.path!r} does not exist; point {role}.path at a model directory or a hub id")
    return path, gguf, False


def resolve_dtype(name: str, device: str) -> torch.dtype:
    """Maps a dtype name to torch; ``auto`` is bf16 on a bf16-capable GPU, else fp32."""
    if name == "auto":
        if device.startswith("cuda") and torch.cuda.is_available() and torch.cuda.is_bf16_supported():
            return torch.bfloat16
        return torch.float32
    if name not in DTYPES:
        raise UserError(f"dtype={name!r} is not one of {sorted(DTYPES) + ['auto']}")
    return DTYPES[name]


def resolve_device(name: str) -> str:
    """``auto`` -> ``cuda`` when a GPU is visible, else ``cpu``; a CUDA device without a GPU is an error."""
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise UserError(f"device={name!r} but no CUDA device is visible; use device=cpu or device=auto")
    return name


def fingerprint(path: str, gguf: str | None, is_local: bool, model) -> str:
    """A content fingerprint of the weights, cheap enough for 405B checkpoints.

    Local: sha256 over the config and, per weight file, its name, size and first and last
    4 MiB. Hub: ``hub:<id>@<commit>``.
    """
    if not is_local:
        return f"hub:{path}@{getattr(model.config, '_commit_hash', None) or 'unknown'}"
    h = hashlib.sha256()
    cfg = model.config.to_dict()
    for k in ("_name_or_path", "transformers_version", "torch_dtype", "dtype", "_commit_hash"):
        cfg.pop(k, None)
    h.update(repr(sorted((k, repr(v)) for k, v in cfg.items())).encode())
    root = Path(path)
    files = [root / gguf] if gguf else sorted(p for ext in ("*.safetensors", "*.bin", "*.pt") for p in root.glob(ext))
    for f in files:
        file_digest(h, f)
    return "sha256:" + h.hexdigest()[:24]


def file_digest(h, path: Path, chunk: int = 4 << 20):
    """Feeds ``h`` (a hashlib object) a weight file's name, size and first and last ``chunk`` bytes."""
    size = path.stat().st_size
    h.update(f"{path.name}:{size}".encode())
    with open(path, "rb") as fh:
        h.update(fh.read(chunk))
        if size > chunk:
            fh.seek(max(chunk, size - chunk))
            h.update(fh.read(chunk))
    return h


def load_model(spec: ModelSpec, role: str = "model") -> LoadedModel:
    """Loads one causal LM and its tokenizer from a local directory, a hub id or a GGUF file.

    Args:
        spec: location and placement.
        role: ``"target"`` or ``"draft"``; used in error messages.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path, gguf, is_local = resolve_location(spec, role)
    device = resolve_device(spec.device)
    dtype = resolve_dtype(spec.dtype, device)
    kwargs: dict[str, Any] = {"dtype": dtype, "revision": spec.revision, "trust_remote_code": spec.trust_remote_code}
    if gguf:
        missing = [m for m in ("gguf", "accelerate") if importlib.util.find_spec(m) is None]  # transformers needs both
        if missing:
            raise UserError(
                f"{role}.gguf_file needs the [gguf] extra (not installed: {', '.join(missing)}): "
                "pip install 'specheads[gguf]'"
            )
        kwargs["gguf_file"] = gguf
    if spec.attn_implementation:
        kwargs["attn_implementation"] = spec.attn_implementation
    if spec.device_map:
        kwargs["device_map"] = spec.device_map
    if spec.load_in_8bit:
        if not torch.cuda.is_available() or importlib.util.find_spec("bitsandbytes") is None:
            raise UserError(
                f"{role}.load_in_8bit needs CUDA GPUs and the bitsandbytes package "
                "(pip install bitsandbytes); unset it on this machine"
            )
        from transformers import BitsAndBytesConfig

        kwargs["quantization_config"] = BitsAndBytesConfig(load_in_8bit=True)
        kwargs.setdefault("device_map", "auto")
    try:
        model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
        tok_path = spec.tokenizer or path
        tok_kwargs = {"gguf_file": gguf} if gguf and not spec.tokenizer else {}
        tokenizer = AutoTokenizer.from_pretrained(tok_path, revision=spec.revision, **tok_kwargs)
    except (OSError, ValueError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        where = "local directory" if is_local else "hub id (needs network or a local cache)"
        raise UserError(f"could not load {role} from {spec.path!r} as a {where}: {first}") from err
    if not spec.device_map and not spec.load_in_8bit:
        model = model.to(device)  # type: ignore[arg-type]  # a device, not a model
    model.eval()
    model.requires_grad_(False)
    if model.get_input_embeddings().weight.device.type == "cpu":
        route(model)  # every linear on the kernel measured fastest on this CPU (see kernels.py)
    if spec.vocab_file or spec.vocab_top_n is not None:
        prune_to_vocab_file(model, tokenizer, spec, role)
    name = f"{path}/{gguf}" if gguf else path
    return LoadedModel(model, tokenizer, spec, fingerprint(path, gguf, is_local, model), name)


def prune_to_vocab_file(model, tokenizer, spec: ModelSpec, role: str) -> None:
    """Restricts the draft's output layer to ``spec.vocab_file``'s top ``spec.vocab_top_n`` tokens."""
    if role != "draft":
        raise UserError(
            f"{role}.vocab_file/vocab_top_n: only the draft's output layer can be pruned "
            "(the target's distribution must stay whole); unset them"
        )
    if not spec.vocab_file:
        raise UserError(
            "draft.vocab_top_n is set but draft.vocab_file is not; write a ranking with heads-vocab "
            "and pass draft.vocab_file=<its vocab.json>"
        )
    rows = model.get_output_embeddings().weight.shape[0]
    ids = subset_from_ranking(read_ranking(spec.vocab_file), spec.vocab_top_n, eos_ids(model, tokenizer), rows)
    info = prune(model, ids, source=os.path.basename(spec.vocab_file))
    log.info(
        "draft output layer pruned to %d of %d tokens (%s, sha256 %s)",
        info["size"],
        rows,
        spec.vocab_file,
        info["sha256"],
    )


def same_vocabulary(tok_a, tok_b) -> bool:
    """True when both tokenizers map every token string to the same id."""
    return tok_a.get_vocab() == tok_b.get_vocab()


def check_same_vocab(target: LoadedModel, draft: LoadedModel) -> None:
    """Raises UserError naming the heterogeneous-vocabulary policies when the vocabularies differ."""
    if same_vocabulary(target.tokenizer, draft.tokenizer):
        return
    nt, nd = len(target.tokenizer), len(draft.tokenizer)
    raise UserError(
        f"draft and target tokenizers differ (target {target.name}: {nt} tokens, draft {draft.name}: {nd} tokens); "
        f"same-vocabulary policies need one vocabulary: use a policy for heterogeneous vocabularies "
        f"({', '.join(HETEROGENEOUS_POLICIES)}) or a draft with the target's tokenizer"
    )


def load_pair(
    target: ModelSpec, draft: ModelSpec | None, same_vocab: bool = True, loaded: LoadedModel | None = None
) -> Pair:
    """Loads target and draft; with ``same_vocab`` checks they share a vocabulary. ``loaded``: the target,
    already loaded (e.g. without its weights, ``specheads.runtime.target_shell``)."""
    t = loaded if loaded is not None else load_model(target, "target")
    if draft is not None and draft.path and draft.device == "auto" and (target.device_map or target.load_in_8bit):
        draft = replace(draft, device=freest_gpu())  # not cuda:0 by default, which the split target may fill
    d = load_model(draft, "draft") if draft is not None and draft.path else None
    if d is not None and same_vocab:
        check_same_vocab(t, d)
    return Pair(t, d)
