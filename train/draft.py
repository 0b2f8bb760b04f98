"""The frozen draft whose states the acceptance head and the SPRINTER verifier read, and their cache."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from specheads.errors import UserError
from specheads.shim import HiddenCapture, load_model
from specheads.train import zero
from specheads.train.config import TrainConfig
from specheads.train.features import FeatureCache, cache_key
from specheads.train.task import EVAL_EPOCH

log = logging.getLogger(__name__)


@dataclass
class Draft:
    """The draft model, the hook that captures its states, and what a task needs to know of it."""

    model: torch.nn.Module
    capture: HiddenCapture
    pad: int
    device: torch.device | str
    hidden: int
    name: str
    fingerprint: str


def draft_device(requested: str, acc) -> str:
    """Where this process's draft goes: ``auto`` is the process's own device (accelerate's ``acc.device``). With
    several processes a GPU the recipe names (``cuda``, ``cuda:0``) is the process's own too, with a warning: one
    setting is every process's, and every copy of the draft on one GPU is never what a launch means. ``cpu``
    and, with one process, any device named are kept."""
    if requested == "auto":
        return str(acc.device)
    if acc.num_processes > 1 and requested.startswith("cuda") and requested != str(acc.device):
        log.warning(
            "draft.device=%s under %d processes: this process's draft goes to its own device %s "
            "(draft.device=auto says so without this warning)",
            requested,
            acc.num_processes,
            acc.device,
        )
        return str(acc.device)
    return requested


def load_draft(cfg: TrainConfig, acc, manifest: dict) -> Draft:
    """Loads ``cfg.draft`` (whole, also under ZeRO-3) on this process's device (:func:`draft_device`) and
    checks it is the draft the data was labelled with."""
    cfg.draft.device = draft_device(cfg.draft.device, acc)
    with zero.unpartitioned(acc):
        draft = load_model(cfg.draft, "draft")
    if draft.fingerprint != manifest["draft"]["fingerprint"]:
        raise UserError(
            f"draft {draft.name!r} (fingerprint {draft.fingerprint}) is not the draft the data was "
            f"labelled with ({manifest['draft']['name']!r}, {manifest['draft']['fingerprint']}); "
            "set draft.path to that model"
        )
    tok = draft.tokenizer
    pad = tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)
    return Draft(
        draft.model, HiddenCapture(draft.model), pad, draft.device, draft.hidden_size, draft.name, draft.fingerprint
    )


def feature_cache(
    cfg: TrainConfig,
    acc,
    draft: Draft,
    label: str,
    mix_ratio: float,
    compute: Callable,
    epochs: int,
    train_examples: list,
    eval_examples: list,
) -> FeatureCache:
    """``features=cached``: the draft's features of the first ``epochs`` epochs and of the held-out set, each
    file computed once, by one process (file ``i`` by process ``i mod world``), the others waiting for it on
    the file system: a build longer than the process group's timeout (``dist_timeout_s``) would end a
    collective wait. ``label`` and ``mix_ratio`` enter the cache key with the draft, seed and split."""
    key = cache_key(draft.fingerprint, mix_ratio, cfg.seed, label, cfg.eval_fraction)
    root = Path(cfg.cache_dir or Path(cfg.data_dir) / "features") / key
    cache = FeatureCache(root, compute, cfg.batch_size)
    files = [(epoch, train_examples) for epoch in range(epochs)] + [(EVAL_EPOCH, eval_examples)]
    for i, (epoch, examples) in enumerate(files):
        if i % acc.num_processes == acc.process_index:
            cache.build(epoch, examples, show=acc.is_main_process)
    waiting = [cache.path(epoch) for epoch, _ in files]
    while not all(p.is_file() for p in waiting):  # a peer that fails ends the launch (torchrun stops us all)
        time.sleep(0.5)
    acc.wait_for_everyone()
    log.info("cached features: %s (%.1f MB)", root, cache.nbytes() / 1e6)
    return cache
