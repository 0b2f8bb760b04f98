"""The header of an exported head's ``.safetensors`` file: write it, read its metadata back.

The metadata is one JSON string under ``__metadata__["specheads"]`` and nothing else: safetensors keeps the
header's metadata in a hash map, so with two or more keys their order (and the file's bytes) would change
from one process to the next; with one key the same head and metadata always give the same bytes.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from specheads.errors import UserError

FORMAT_VERSION = 1
META_KEY = "specheads"


def write(path: Path, tensors: dict[str, torch.Tensor], meta: dict) -> Path:
    """Writes ``tensors`` with ``meta`` in the header, atomically (a ``.tmp`` beside ``path``, then renamed)."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    save_file(tensors, str(tmp), metadata={META_KEY: json.dumps(meta, sort_keys=True)})
    tmp.replace(path)
    return path


def read(path: Path) -> dict:
    """The specheads metadata in ``path``'s header, without loading tensors; UserError in one line when the
    file is missing, is not safetensors, has no specheads metadata, or is newer than this version."""
    if not path.is_file():
        raise UserError(f"head file {str(path)!r} does not exist; pass the .safetensors written by heads-export")
    try:
        with safe_open(str(path), framework="pt") as f:
            raw = (f.metadata() or {}).get(META_KEY)
    except (SafetensorError, OSError, ValueError) as err:
        raise UserError(
            f"head file {str(path)!r} is truncated or not a safetensors file ({err}); re-export it"
        ) from err
    if raw is None:
        raise UserError(f"{str(path)!r} has no specheads metadata; export heads with heads-export")
    meta = json.loads(raw)
    if meta.get("format_version", 0) > FORMAT_VERSION:
        raise UserError(
            f"{str(path)!r} has format_version={meta['format_version']}, newer than this specheads "
            f"({FORMAT_VERSION}); upgrade specheads"
        )
    return meta
