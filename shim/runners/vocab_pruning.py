"""Draft vocabulary pruning (FR-Spec, Zhao et al. 2025): the draft's output layer over frequent tokens only.

A small draft spends much of each forward in its output layer (the shared 4-layer draft: 7.8 of
12.7 ms for 49,152 tokens). Most of the target's text uses few of them, so the draft scores only
the ``N`` tokens most frequent in the target's responses (a ranking written by ``heads-vocab``)
and the rest get logit ``-inf``:

* the draft's distribution ``q`` is its softmax renormalised over the subset, ``q = 0`` outside;
  the draft samples from exactly that ``q`` and the SD rule uses exactly that ``q``, so
  speculative decoding stays lossless (a token the target wants outside the subset is emitted
  from the residual ``max(0, p - q)``, which is ``p`` there);
* logits keep the full width (``-inf`` outside the subset), so every policy, sampler and label
  computation works unchanged;
* the model's own ``lm_head`` is replaced by :class:`PrunedHead` (same weight, tied or not), so
  the model's forward, ``generate``, the fused forward and batched data generation all see the
  pruned layer.

The subset is identified by its size and a hash of its sorted ids (:func:`vocab_info`); heads
trained on a pruned draft record it and refuse a draft pruned otherwise.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from specheads.errors import UserError
from specheads.shim.runners.kernels import linear

FORMAT = "specheads-vocab"


class PrunedHead(torch.nn.Module):
    """An output layer that scores only ``ids`` and gives every other token logit ``-inf``.

    ``weight``/``bias`` are the original layer's parameters (a tied embedding stays tied); the
    rows of the subset are copied once (and again if the weight changes)."""

    ids: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor | None

    def __init__(self, head: torch.nn.Module, ids: torch.Tensor, info: dict):
        super().__init__()
        self.weight = head.weight  # type: ignore[assignment]  # a Linear's weight
        self.bias = getattr(head, "bias", None)
        self.original = [head]  # a list: not a registered submodule (no duplicate parameters)
        self.register_buffer("ids", ids.to(torch.long).to(self.weight.device), persistent=False)
        self.out_features = self.weight.shape[0]
        self.info = info
        self._rows: tuple | None = None

    def rows(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The subset's weight rows ``[N, d]`` (and bias), contiguous."""
        w = self.weight
        stamp = (w.data_ptr(), 0 if w.is_inference() else w._version)
        if self._rows is None or self._rows[0] != stamp:
            with torch.inference_mode(False), torch.no_grad():
                sub_w = w.detach().index_select(0, self.ids).contiguous()
                sub_b = self.bias.detach().index_select(0, self.ids) if self.bias is not None else None
            self._rows = (stamp, sub_w, sub_b)
        return self._rows[1], self._rows[2]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w, b = self.rows()
        small = linear(x, w, b)
        out = small.new_full((*small.shape[:-1], self.out_features), float("-inf"))
        return out.index_copy_(out.dim() - 1, self.ids, small)


def subset_hash(ids: torch.Tensor) -> str:
    """A short hash of a token subset (sorted ids as int64)."""
    ids = torch.unique(ids.to(torch.long).cpu())
    return hashlib.sha256(ids.numpy().tobytes()).hexdigest()[:16]


def vocab_info(model) -> dict | None:
    """``{"size", "sha256", "full", "source"}`` of the model's pruned output layer, or None (full vocabulary)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return dict(head.info) if isinstance(head, PrunedHead) else None


def same_subset(a: dict | None, b: dict | None) -> bool:
    """Whether two :func:`vocab_info` records describe the same subset (None = full vocabulary)."""
    if a is None or b is None:
        return a is None and b is None
    return a.get("size") == b.get("size") and a.get("sha256") == b.get("sha256")


def describe(info: dict | None) -> str:
    return "the full vocabulary" if info is None else f"a {info['size']}-token subset (sha256 {info['sha256']})"


def prune(model, ids, source: str = "") -> dict:
    """Restricts ``model``'s output layer to ``ids`` (in place); returns its :func:`vocab_info`."""
    cfg = model.config
    for key in ("final_logit_softcapping", "logit_scale"):
        if getattr(cfg, key, None) not in (None, 1, 1.0):
            raise UserError(
                f"draft vocabulary pruning covers output layers without {key}; "
                f"{type(model).__name__} has {key}={getattr(cfg, key)}: unset draft.vocab_file"
            )
    head = model.get_output_embeddings()
    if isinstance(head, PrunedHead):
        head = head.original[0]
    if head is None or not hasattr(head, "weight"):
        raise UserError(f"{type(model).__name__} has no output layer to prune; unset draft.vocab_file")
    full = head.weight.shape[0]
    ids = torch.unique(torch.as_tensor(list(ids), dtype=torch.long))
    if ids.numel() == 0 or int(ids.min()) < 0 or int(ids.max()) >= full:
        raise UserError(
            f"draft vocabulary subset has ids outside 0..{full - 1} (or none); "
            f"the ranking was written for another tokenizer: rebuild it with heads-vocab"
        )
    info = {"size": int(ids.numel()), "sha256": subset_hash(ids), "full": int(full), "source": source}
    model.set_output_embeddings(PrunedHead(head, ids, info))
    return info


def unprune(model) -> None:
    """Puts the full output layer back."""
    head = model.get_output_embeddings()
    if isinstance(head, PrunedHead):
        model.set_output_embeddings(head.original[0])


def read_ranking(path: str | Path) -> dict:
    """A ranking file written by ``heads-vocab`` (checked)."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"vocabulary ranking {str(path)!r} does not exist; write one with heads-vocab")
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise UserError(f"vocabulary ranking {str(path)!r} is not JSON ({err}); rebuild it with heads-vocab") from err
    if not isinstance(obj, dict) or obj.get("format") != FORMAT or not isinstance(obj.get("ranking"), list):
        raise UserError(f"{str(path)!r} is not a heads-vocab ranking (format {FORMAT!r}); rebuild it with heads-vocab")
    return obj


def subset_from_ranking(ranking: dict, top_n: int | None, always: list[int], vocab_size: int) -> list[int]:
    """The ``top_n`` most frequent ids of ``ranking`` with ``always`` (EOS) included; None: every ranked id."""
    if ranking.get("vocab_size") not in (None, vocab_size):
        raise UserError(
            f"the vocabulary ranking was written for a {ranking.get('vocab_size')}-token vocabulary, "
            f"the draft has {vocab_size}; rebuild it with heads-vocab for this tokenizer"
        )
    ranked = [int(i) for i in ranking["ranking"]]
    n = len(ranked) + len(always) if top_n is None else int(top_n)
    if n < 1:
        raise UserError(f"draft.vocab_top_n={top_n} must be >= 1 (or null: every ranked token)")
    chosen = list(dict.fromkeys([int(i) for i in always if 0 <= int(i) < vocab_size]))
    seen = set(chosen)
    for i in ranked:
        if len(chosen) >= n:
            break
        if i not in seen and 0 <= i < vocab_size:
            chosen.append(i)
            seen.add(i)
    return chosen
