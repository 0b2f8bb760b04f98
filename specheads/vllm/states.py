"""A vLLM KV connector that hands out a request's hidden states as soon as its prefill is computed.

vLLM's ``extract_hidden_states`` speculative method stores, at every step, the residual stream entering the
layers ``eagle_aux_hidden_state_layer_ids`` of every computed token in a cache-only attention layer
(``[blocks, layers, block_size, hidden]``); a KV connector reads them out. vLLM's example connector copies
through pinned memory and CUDA events (it fails on a CPU build) and writes a request's file only when a
later engine step reports the request finished (an in-process engine that has no later step never writes the
last ones). :class:`StatesConnector` instead copies in the same step: the scheduler side tells the worker,
in the step where a request's prompt is fully computed, that request's blocks; the worker's
``wait_for_save`` (which vLLM calls after the drafter, i.e. after the cache-only layer was written) gathers
the prompt's rows from those blocks with plain indexing (on the CPU or the GPU alike), moves them to the CPU
and writes them atomically to the path the request named in ``kv_transfer_params["states_path"]``. Requests
without that key (a warm-up) are left alone, and no block is kept after a request ends.

Used by :mod:`specheads.vllm.states_child` (``LLM(kv_transfer_config={"kv_connector": "StatesConnector",
"kv_connector_module_path": "specheads.vllm.states", "kv_role": "kv_producer"})``). The file holds
``states``: ``[prompt tokens, len(layers), hidden]`` in vLLM's dtype, layers in increasing order (vLLM
appends them so). Only tensor-parallel rank 0 of the last pipeline stage writes (every rank holds the whole
residual stream). This module needs vLLM, torch and the standard library only.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)

PATH_KEY = "states_path"


@dataclass
class Save:
    """A request whose prompt is computed in this step: its file, blocks and prompt length."""

    path: str
    blocks: list[int]
    length: int


@dataclass
class StatesMetadata(KVConnectorMetadata):
    saves: list[Save] = field(default_factory=list)


@dataclass
class _Tracked:
    path: str
    length: int
    blocks: list[int]


class Schedule:
    """The scheduler side's book of requests that asked for states: their blocks as vLLM hands them out, step
    by step, and which of them the step computes the last prompt token of (:meth:`step`)."""

    def __init__(self, group: int):
        self.group = group
        self.tracked: dict[str, _Tracked] = {}

    def step(self, out) -> list[Save]:
        """The saves of one ``SchedulerOutput``: every tracked request whose prompt ends in this step."""
        computed = {}
        for new in out.scheduled_new_reqs:
            extra = (new.sampling_params.extra_args or {}) if new.sampling_params else {}
            path = (extra.get("kv_transfer_params") or {}).get(PATH_KEY)
            if path is not None:
                self.tracked[new.req_id] = _Tracked(path, len(new.prompt_token_ids), list(new.block_ids[self.group]))
                computed[new.req_id] = new.num_computed_tokens
        cached = out.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            t = self.tracked.get(req_id)
            if t is None:
                continue
            got = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:  # preempted, then resumed: its blocks are all new
                t.blocks = list(got[self.group]) if got else []
            elif got:
                t.blocks.extend(got[self.group])
            computed[req_id] = cached.num_computed_tokens[i]
        saves = []
        for req_id, done in computed.items():
            t = self.tracked[req_id]
            if done < t.length <= done + out.num_scheduled_tokens.get(req_id, 0):
                saves.append(Save(t.path, list(t.blocks), t.length))
                del self.tracked[req_id]
        return saves

    def drop(self, req_id: str) -> None:
        self.tracked.pop(req_id, None)


def states_group(kv_cache_config) -> int:
    """The KV cache group of the cache-only layer that holds the hidden states."""
    from vllm.v1.kv_cache_interface import HiddenStateCacheSpec

    if kv_cache_config is None:
        return 0
    groups = kv_cache_config.kv_cache_groups
    found = [i for i, g in enumerate(groups) if isinstance(g.kv_cache_spec, HiddenStateCacheSpec)]
    if not found and len(groups) == 1:  # one group for every layer (vLLM merged equal specs): its blocks are ours
        return 0
    if len(found) != 1:
        raise ValueError(
            f"StatesConnector needs vLLM's extract_hidden_states method (one hidden-states KV cache group); "
            f"found {len(found)} among {len(groups)} groups"
        )
    return found[0]


def gather(cache: torch.Tensor, blocks: list[int], length: int) -> torch.Tensor:
    """Rows ``0..length-1`` of a request from a ``[blocks, layers, block_size, hidden]`` cache, on the CPU."""
    size = cache.shape[2]
    pos = torch.arange(length, device=cache.device)
    ids = torch.tensor(blocks, dtype=torch.long, device=cache.device)[pos // size]
    return cache[ids, :, pos % size].to("cpu")


def write(path: str, states: torch.Tensor) -> None:
    """``states`` to ``path`` as safetensors, whole or not at all (temporary name, then rename)."""
    from safetensors.torch import save_file

    tmp = f"{path}.{os.getpid()}.tmp"
    save_file({"states": states.contiguous()}, tmp)
    os.replace(tmp, path)


class StatesConnector(KVConnectorBase_V1, SupportsHMA):
    """Store-only connector: each request's prompt states, written in the step that computes its last token."""

    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self._schedule = Schedule(states_group(kv_cache_config))
        self._cache: torch.Tensor | None = None
        self._writer = True

    # scheduler side
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return 0, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        pass

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        return StatesMetadata(self._schedule.step(scheduler_output))

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._schedule.drop(request.request_id)
        return False, None

    def request_finished_all_groups(self, request, block_ids) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished(request, [])

    # worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.config import get_layers_from_vllm_config
        from vllm.distributed.parallel_state import get_pp_group, get_tensor_model_parallel_rank
        from vllm.model_executor.models.extract_hidden_states import CacheOnlyAttentionLayer

        layers = list(get_layers_from_vllm_config(self._vllm_config, CacheOnlyAttentionLayer, list(kv_caches)))
        if len(layers) != 1:
            raise ValueError(f"StatesConnector expects one cache-only layer (extract_hidden_states), got {layers}")
        self._cache = kv_caches[layers[0]]
        self._writer = get_tensor_model_parallel_rank() == 0 and get_pp_group().is_last_rank

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        pass

    def wait_for_layer_load(self, layer_name: str) -> None:
        pass

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs: Any) -> None:
        pass

    def wait_for_save(self) -> None:
        """Called after this step's drafter wrote the cache-only layer: writes the requests it finished."""
        if not self._writer or self._cache is None or not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        if isinstance(meta, StatesMetadata):
            for s in meta.saves:
                write(s.path, gather(self._cache, s.blocks, s.length))
