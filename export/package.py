"""One ``.safetensors`` file per exported head, its metadata in the header, checked on load.

Header metadata (``__metadata__["specheads"]``, JSON): ``format_version``, ``head_type``,
``head_config`` (constructor arguments), ``hidden_size``, ``feature`` (which model's state
the head reads: ``{"model": "draft"|"target"|"eagle", "state": "pre"|"post", "layer": -1}``; ``eagle``: an
EAGLE head's own state, that head named by ``feature["eagle"]["tensors_sha256"]``),
``draft``/``target`` (``name``, ``fingerprint``), ``sampling``, ``default_threshold``,
``tensors_sha256`` (detects edits of the tensor bytes) and free-form ``extra``.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from specheads.errors import UserError
from specheads.export.header import FORMAT_VERSION
from specheads.export.header import read as read_header
from specheads.export.header import write as write_header
from specheads.export.hub import WEIGHTS, head_file, is_hub_dir
from specheads.export.hub import write as write_hub_files
from specheads.heads import HEADS

log = logging.getLogger(__name__)


@dataclass
class LoadedHead:
    """A head module and the metadata it was exported with; ``checked_for``: the fingerprint of the target an EAGLE
    head was checked against and placed for (``load_eagle``), so that a second use does not check it again."""

    module: torch.nn.Module
    metadata: dict
    checked_for: str | None = None

    @property
    def threshold(self) -> float | None:
        return self.metadata.get("default_threshold")


def _digest(tensors: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().contiguous().cpu()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def save_head(path: str | Path, head: torch.nn.Module, head_type: str, metadata: dict) -> Path:
    """Writes ``head``'s weights and ``metadata`` (see module docstring) to one safetensors file."""
    if head_type not in HEADS:
        raise UserError(f"unknown head_type {head_type!r}; known: {sorted(HEADS)}")
    tensors = {k: v.detach().contiguous().cpu() for k, v in head.state_dict().items()}
    meta = {"format_version": FORMAT_VERSION, "head_type": head_type, **metadata, "tensors_sha256": _digest(tensors)}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    return write_header(path, tensors, meta)


def set_default_threshold(path: str | Path, value: float, chosen_by: dict) -> Path:
    """Rewrites an exported head's ``default_threshold`` (its tensors unchanged), recording how the value
    was chosen (``default_threshold_chosen_by``: e.g. ``heads-eval select=max_drop:0.01`` and its figures)."""
    return rewrite_metadata(path, default_threshold=float(value), default_threshold_chosen_by=chosen_by)


def rewrite_metadata(path: str | Path, **fields) -> Path:
    """Rewrites fields of an exported head's header metadata (its tensors unchanged; a ``format=hf`` directory's
    ``config.json`` and model card follow)."""
    given = Path(path)
    if not given.exists():
        raise UserError(
            f"head {str(path)!r} is not a local file or directory: only a head you exported is rewritten "
            "you exported (a Hub repo's cached copy is not yours to edit; download it and export anew)"
        )
    # a format=hf directory, named itself or by its model.safetensors: its config.json and card follow
    directory = given if is_hub_dir(given) else None
    if given.name == WEIGHTS and is_hub_dir(given.parent):
        directory = given.parent
    path = head_file(path)
    meta = read_metadata(path)
    tensors = load_file(str(path))
    if _digest(tensors) != meta.get("tensors_sha256"):
        raise UserError(f"head file {str(path)!r}: tensors do not match their recorded digest; re-export it")
    meta.update(fields)
    write_header(path, tensors, meta)
    if directory is not None:  # the Hub-style directory's config.json and model card follow
        write_hub_files(directory, meta)
    return path


def outside_gate(meta: dict, sources) -> str | None:
    """Why a lossy head's threshold is unmeasured on prompts of ``sources``: it was chosen by ``heads-eval
    select=`` (``default_threshold_chosen_by``) on competent sources that do not include some of them; None when
    they are all inside its gate, or when no gate chose it."""
    chosen = meta.get("default_threshold_chosen_by")
    if not chosen:
        return None
    gated = set(chosen.get("competent_sources") or [])
    outside = sorted(set(sources) - gated)
    if not outside:
        return None
    return (
        f"its threshold {meta.get('default_threshold')} was chosen by select={chosen.get('gate')} on "
        f"{', '.join(sorted(gated)) or 'no competent source'}; these prompts' {', '.join(outside)} lie outside that "
        "gate, where the answers it changes were never measured"
    )


def read_metadata(path: str | Path) -> dict:
    """The header metadata of an exported head (a file, a ``format=hf`` directory or a Hub repo id), without
    loading tensors."""
    return read_header(head_file(path))


def fill(module: torch.nn.Module, tensors: dict[str, torch.Tensor], misfit: str) -> torch.nn.Module:
    """``module`` holding ``tensors``, in the precision they were exported in; UserError ``misfit: <reason>`` when
    they do not fit it."""
    dtypes = {t.dtype for t in tensors.values() if t.is_floating_point()}
    if len(dtypes) == 1:
        module = module.to(dtypes.pop())
    try:
        module.load_state_dict(tensors)
    except RuntimeError as err:
        reason = " ".join(line.strip() for line in str(err).splitlines() if line.strip())  # every key, one line
        raise UserError(f"{misfit}: {reason}") from err
    return module


def load_head(
    path: str | Path, pair=None, sampling=None, strict: bool = False, device: torch.device | str = "cpu"
) -> LoadedHead:
    """Loads an exported head and checks it against the loaded pair and sampling settings.

    Args:
        path: the ``.safetensors`` file, a ``heads-export format=hf`` directory, or a Hub repo id.
        pair: when given, the head's hidden size and model fingerprint must match the model
            whose state it reads.
        sampling: when given and different from the settings the head was trained with:
            a warning naming both, or a UserError with ``strict``.
        strict: turn the sampling mismatch warning into an error.
        device: where to put the head.

    Whether a stop head's states come from the drafter decoding uses (the draft model, or one EAGLE head) is
    checked once, where a policy meets its drafter: ``make_policy`` (:func:`check_stop_drafter`).
    """
    path = head_file(path)
    meta = read_metadata(path)
    if meta["head_type"] not in HEADS:
        raise UserError(f"{str(path)!r} holds head_type={meta['head_type']!r}, unknown here; known: {sorted(HEADS)}")
    with safe_open(str(path), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    if _digest(tensors) != meta.get("tensors_sha256"):
        raise UserError(f"head file {str(path)!r} was modified after export (tensor checksum differs); re-export it")
    module = fill(
        HEADS[meta["head_type"]](**meta.get("head_config", {})),
        tensors,
        f"head file {str(path)!r} does not fit head_type={meta['head_type']!r}",
    )
    if pair is not None:
        check_head_against_pair(meta, pair)
    if sampling is not None:
        check_sampling(meta, sampling.to_dict(), strict)
    return LoadedHead(module.to(device).eval().requires_grad_(False), meta)


def check_head_against_pair(meta: dict, pair) -> None:
    """Raises UserError when the head was exported for another model (hidden size or fingerprint); a head on
    an EAGLE head's states is as wide as the target, whose fingerprint it records."""
    role = meta.get("feature", {}).get("model", "draft")
    if role == "eagle":
        role = "target"
    model = pair.draft if role == "draft" else pair.target
    if model is None:
        raise UserError(f"the head reads the {role}'s states but no {role} is loaded; set {role}.path")
    if meta.get("hidden_size") != model.hidden_size:
        raise UserError(
            f"head hidden_size={meta.get('hidden_size')} but {role} hidden_size={model.hidden_size}; "
            f"export the head for this {role} or load the {role} it was trained with"
        )
    want = meta.get(role, {}).get("fingerprint")
    if want and want != model.fingerprint:
        raise UserError(
            f"head was trained on {role} {meta[role].get('name')!r} (fingerprint {want}) but the loaded "
            f"{role} {model.name!r} has fingerprint {model.fingerprint}; load that {role} or retrain the head"
        )
    if role == "draft":
        check_draft_vocab(meta, model.vocab)


def check_stop_drafter(feature: dict, eagle: dict | None) -> None:
    """UserError when a head on drafting states (``feature``) and the drafter disagree: a head on an EAGLE
    head's states (``feature["model"] == "eagle"``) needs that EAGLE head (``eagle``: the metadata of the one
    decoding drafts with, by ``tensors_sha256``); a head on the draft model's states needs no EAGLE head."""
    reads = feature.get("model", "draft")
    if reads == "draft" and eagle is not None:
        raise UserError(
            "the head reads the draft model's states but decoding drafts with an EAGLE head (eagle=); "
            "train one on that head's states (heads-datagen labels=eagle_rounds, heads-train "
            "head=eagle_stop) or drop eagle="
        )
    if reads != "eagle":
        return
    own = feature.get("eagle") or {}
    if eagle is None:
        raise UserError(
            f"the head reads the states of the EAGLE head {own.get('file')!r}; decode with eagle=<that EAGLE head>"
        )
    if own.get("tensors_sha256") != eagle.get("tensors_sha256"):
        raise UserError(
            f"the head was trained on the states of the EAGLE head {own.get('file')!r} (tensors_sha256 "
            f"{str(own.get('tensors_sha256'))[:12]}) but eagle= is another (tensors_sha256 "
            f"{str(eagle.get('tensors_sha256'))[:12]}); pass that EAGLE head or retrain the stop head "
            "(heads-datagen labels=eagle_rounds, heads-train head=eagle_stop)"
        )


def check_draft_vocab(meta: dict, loaded: dict | None) -> None:
    """A head trained on a pruned draft (its labels used that draft's renormalised ``q``) needs the same
    subset: UserError otherwise. Heads whose metadata predates pruning only warn on a pruned draft."""
    from specheads.shim import describe_vocab as describe
    from specheads.shim import same_subset

    draft = meta.get("draft") or {}
    if "vocab" not in draft:
        if loaded is not None:
            log.warning(
                "the head predates draft vocabulary pruning (trained on the full vocabulary) but the draft "
                "is pruned to %s; its acceptance estimates may be off",
                describe(loaded),
            )
        return
    if not same_subset(draft["vocab"], loaded):
        raise UserError(
            f"head was trained with the draft's output layer over {describe(draft['vocab'])} but the "
            f"loaded draft uses {describe(loaded)}; set draft.vocab_file/draft.vocab_top_n as in training "
            f"(or retrain the head)"
        )


def check_sampling(meta: dict, sampling: dict, strict: bool) -> None:
    """Warns (or, with ``strict``, raises) when decode-time sampling differs from training's."""
    trained = meta.get("sampling")
    if trained is None or trained == sampling:
        return
    msg = f"head was trained with sampling {trained} but decoding uses {sampling}"
    if strict:
        raise UserError(msg + "; decode with the head's settings or pass strict=false")
    log.warning("%s; its acceptance estimates may be off", msg)
