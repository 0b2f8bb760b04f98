"""A trained stop head inside vLLM: a proposer for vLLM's ``custom_class`` speculative method.

    from vllm import LLM, SamplingParams
    from specheads.vllm.proposer import speculative_config

    spec = speculative_config(draft="path/to/draft", policy="specdecpp", head="runs/x-export/head.safetensors",
                              k_max=6)
    llm = LLM(model="path/to/target", speculative_config=spec, max_num_seqs=16)

vLLM builds ``Proposer(vllm_config)`` in its model runner, and each step calls
``propose(sampled_token_ids, num_tokens_no_spec, token_ids_cpu)`` with every running request's token ids
under its batch row; it verifies the returned candidates with the target (lossless: greedy output equals
the target alone's, sampled output follows it). The proposer drafts with the draft model and stops each
request's drafting by its policy: ``specdecpp`` (an exported SpecDec++ acceptance head on the draft's
states; ``stop="threshold"`` at ``threshold``, or ``stop="cost"`` with a cost table), ``confidence_stop``
(training-free: the draft's probability of its own candidate below ``threshold``, or the cost rule) or
``sd`` (always ``k_max``). The work is :class:`~specheads.shim.batching.row_proposer.RowProposer`: one batched
draft forward per step over the rows still drafting, and draft KV caches kept by content, since vLLM
gives the proposer neither request ids nor notice of joins, finishes or preemption.

**How the settings reach it.** vLLM instantiates the class itself, from a dotted path, with its own config
only. :func:`speculative_config` checks the settings and returns the ``speculative_config`` dict for ``LLM``
(``num_speculative_tokens = k_max``) with the settings inside it, under
``draft_load_config.model_loader_extra_config["specheads"]`` (the extra settings of the draft's loader, a field
of vLLM's ``SpeculativeConfig`` that its ``custom_class`` method leaves unused). vLLM sends its config to every
worker, Ray workers on other nodes included, so the settings arrive wherever a proposer is built; nothing is
read from the environment. A mistake (no head for ``specdecpp``, a head trained on another draft, a draft with
another vocabulary, a bad threshold, a cache budget too small) is a one-line ``UserError`` when ``LLM(...)``
starts (vLLM wraps it into its own one-line ``RuntimeError``).

The draft runs in vLLM's worker process on the fused Llama forward (Llama-family drafts, as
``heads-decode``), on the device vLLM runs on, in ``dtype`` (``auto``: the dtype vLLM runs the target in), with
one cache row per request vLLM may batch (``max_num_seqs``; each draft step computes the leading rows in use).
The cache is allocated whole when the proposer is built, before vLLM measures its memory, so on a GPU vLLM's
own KV cache takes what is left within ``gpu_memory_utilization``: ``cache_mb`` (MiB per worker) bounds it, and
a request longer than its share then drafts from its latest tokens; without it, every row has room for
``max_model_len`` tokens (refused at start-up when that does not fit the free memory). Under tensor
parallelism every worker of the last pipeline stage builds its own proposer (the same draft and cache). A
pruned draft output layer (``vocab_file``/``vocab_top_n``, as ``draft.vocab_file`` elsewhere) works.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, fields

from specheads.errors import UserError
from specheads.vllm.options import cache_tokens
from specheads.vllm_config import DTYPES

POLICIES = ("specdecpp", "confidence_stop", "sd")
CLASS_PATH = "specheads.vllm.proposer.Proposer"
SECTION = "specheads"  # the key of the settings in the draft loader's extra config


@dataclass
class ProposerSettings:
    """What the proposer drafts with and how it stops (see :func:`speculative_config`)."""

    draft: str
    policy: str = "confidence_stop"
    head: str | None = None
    k_max: int | None = None  # None: the policy's own default (sd: its k)
    k_min: int | None = None
    threshold: float | None = None
    stop: str = "threshold"
    costs: str | None = None
    vocab_file: str | None = None
    vocab_top_n: int | None = None
    gate: bool | None = None
    dtype: str = "auto"
    cache_mb: float | None = None

    def policy_settings(self):
        """The policy's own settings (its names, defaults and rules) from these: ``threshold`` is its threshold
        (SpecDec++'s ``h``, ``confidence_stop``'s ``tau``), ``k_max`` SD's ``k``; the gate is on with ``stop=cost``
        unless told otherwise."""
        from specheads.decode.policy_factory import settings_for

        if self.policy == "sd":
            return settings_for("sd", k=self.k_max)
        gate = self.stop == "cost" if self.gate is None else self.gate
        own = dict(k_min=self.k_min, k_max=self.k_max, stop=self.stop, gate=gate)
        return settings_for(self.policy, self.threshold, head=self.head, **own)

    def problems(self) -> list[str]:
        out = []
        if self.dtype not in DTYPES:
            out.append(f"dtype={self.dtype!r}; choose one of {list(DTYPES)}")
        if self.cache_mb is not None and not self.cache_mb > 0:
            out.append(f"cache_mb={self.cache_mb} must be > 0 (MiB) or None")
        if self.policy not in POLICIES:
            out.append(f"policy={self.policy!r}; choose one of {list(POLICIES)}")
        if not self.draft or not os.path.isdir(self.draft):
            out.append(f"draft={self.draft!r} is not a local Hugging Face model directory")
        if self.policy == "specdecpp" and not self.head:
            out.append("policy=specdecpp needs head=<an exported SpecDec++ acceptance head>")
        if self.head and not os.path.exists(self.head):
            out.append(f"head={self.head!r} does not exist")
        if self.head and self.policy != "specdecpp":
            out.append(f"policy={self.policy} takes no head; drop head= or use policy='specdecpp'")
        if self.stop == "cost" and not self.costs:
            out.append("stop='cost' needs costs=<a cost-table JSON> (the engine's pass times by size)")
        if self.stop == "cost" and self.policy == "sd":
            out.append("policy=sd drafts k_max every round; stop='cost' is for specdecpp and confidence_stop")
        if self.policy in POLICIES and not (self.stop == "cost" and self.policy == "sd"):
            try:  # the policy's own rules (k_min <= k_max, the threshold's range, stop, gate)
                self.policy_settings()
            except UserError as err:
                out.append(str(err))
        return out


def speculative_config(
    draft: str,
    policy: str = "confidence_stop",
    head: str | None = None,
    k_max: int | None = None,
    k_min: int | None = None,
    threshold: float | None = None,
    stop: str = "threshold",
    costs: str | None = None,
    vocab_file: str | None = None,
    vocab_top_n: int | None = None,
    gate: bool | None = None,
    dtype: str = "auto",
    cache_mb: float | None = None,
) -> dict:
    """Checks the proposer's settings and returns the ``speculative_config`` for ``vllm.LLM`` that carries them to
    vLLM's workers (under ``draft_load_config.model_loader_extra_config["specheads"]``).

    Args:
        draft: the draft model's local Hugging Face directory (same tokenizer as the target).
        policy: ``specdecpp``, ``confidence_stop`` or ``sd``.
        head: the exported SpecDec++ acceptance head (``specdecpp``), trained on this draft.
        k_max, k_min: most and fewest candidates per round (``k_max`` is vLLM's ``num_speculative_tokens``; SD's
            ``k``); None: the policy's own defaults (``SpecDecPPSettings``, ``ConfidenceSettings``, ``SDSettings``).
        threshold: SpecDec++'s ``h`` (default: the head's own) or ``confidence_stop``'s ``tau``.
        stop: ``threshold`` or ``cost`` (the cost-aware rule; needs ``costs``).
        costs: a cost-table JSON (``CostTable.to_dict``: the draft step and the target pass by size and batch),
            measured in vLLM: :func:`specheads.decode.vllm_costs.vllm_cost_table` (``heads-decode engine=vllm
            stop=cost`` makes and caches it).
        vocab_file, vocab_top_n: prune the draft's output layer to a ``heads-vocab`` ranking.
        gate: with ``stop="cost"`` (its default there), a round may draft nothing: the draft gate
            (:class:`~specheads.shim.costs.cost_rules.DraftGate`) prices the request's recent rounds at the
            batch about to run, so drafting stops where verification no longer pays (a large batch).
        dtype: the draft's dtype: ``auto`` (the one vLLM runs the target in), ``float32``, ``bfloat16`` or ``float16``.
        cache_mb: the draft's KV cache, MiB per vLLM worker (default: room for every row at ``max_model_len``).
    """
    settings = ProposerSettings(
        os.path.abspath(draft) if draft else "",
        policy,
        head,
        None if k_max is None else int(k_max),
        None if k_min is None else int(k_min),
        threshold,
        stop,
        costs,
        vocab_file,
        vocab_top_n,
        gate,
        dtype,
        cache_mb,
    )
    bad = settings.problems()
    if bad:
        raise UserError("; ".join(bad))
    own = settings.policy_settings()  # the policy's defaults, written into the settings vLLM's workers read
    settings.k_max = own.k if settings.policy == "sd" else own.k_max
    settings.k_min = getattr(own, "k_min", None)
    return {
        "method": "custom_class",
        "model": CLASS_PATH,
        "num_speculative_tokens": settings.k_max,
        "draft_load_config": {"model_loader_extra_config": {SECTION: asdict(settings)}},
    }


def read_settings(spec) -> ProposerSettings:
    """The proposer's settings from vLLM's ``SpeculativeConfig`` (or the dict given to ``LLM``), checked."""

    def part(obj, name: str):
        return obj.get(name) if isinstance(obj, dict) else getattr(obj, name, None)

    raw = part(part(part(spec, "draft_load_config"), "model_loader_extra_config"), SECTION)
    if not isinstance(raw, dict):
        raise UserError(
            f"{CLASS_PATH} found no settings in the speculative config: build it with "
            "specheads.vllm.proposer.speculative_config(draft=..., ...)"
        )
    unknown = sorted(set(raw) - {f.name for f in fields(ProposerSettings)})
    if unknown or "draft" not in raw:
        raise UserError(f"the proposer's settings {sorted(raw)} are not this specheads version's (unknown: {unknown})")
    settings = ProposerSettings(**raw)
    bad = settings.problems()
    if bad:
        raise UserError("; ".join(bad))
    return settings


class Proposer:
    """vLLM's ``custom_class`` proposer (built by vLLM: ``Proposer(vllm_config)``)."""

    def __init__(self, vllm_config):
        from specheads.decode import assemble
        from specheads.shim import ModelSpec, Pair, RowProposer, eos_ids, load_model, load_table

        settings = read_settings(vllm_config.speculative_config)
        k = int(vllm_config.speculative_config.num_speculative_tokens)
        if k != settings.k_max:
            raise UserError(
                f"num_speculative_tokens={k} but the proposer's k_max={settings.k_max}: build "
                "speculative_config with specheads.vllm.proposer.speculative_config"
            )
        device = str(getattr(vllm_config.device_config, "device", "cpu") or "cpu")
        dtype = settings.dtype
        if dtype == "auto":  # the target's, as vLLM runs it
            dtype = str(getattr(vllm_config.model_config, "dtype", "float32")).removeprefix("torch.")
        draft = load_model(
            ModelSpec(
                path=settings.draft,
                device=device,
                dtype=dtype,
                vocab_file=settings.vocab_file,
                vocab_top_n=settings.vocab_top_n,
            ),
            "draft",
        )
        target_vocab = int(vllm_config.model_config.get_vocab_size())
        rows = draft.model.config.vocab_size
        if rows != target_vocab:
            raise UserError(
                f"the draft's vocabulary has {rows} tokens and the target's {target_vocab}: the "
                "proposer drafts on the target's vocabulary (same tokenizer)"
            )
        pair = Pair(target=draft, draft=draft)  # the head reads the draft's states: checked against the draft
        costs = load_table(settings.costs) if settings.stop == "cost" else None
        models = assemble.Models(pair, costs=costs)
        policy = assemble.policy(settings.policy, models, settings.policy_settings())
        self.settings, self.max_len = settings, int(vllm_config.model_config.max_model_len)
        slots = int(vllm_config.scheduler_config.max_num_seqs)
        tokens = cache_tokens(settings.cache_mb, RowProposer.bytes_per_token(draft.model), slots, self.max_len, device)
        try:
            self.core = RowProposer(
                draft.model, policy, slots, eos_ids(draft.model, draft.tokenizer), max_tokens=tokens
            )
        except ValueError as err:
            raise UserError(f"cache_mb={settings.cache_mb}: {err}; raise cache_mb or lower max_num_seqs") from err

    def load_model(self, *args, **kwargs) -> None:
        """The draft was loaded when the proposer was built (nothing of the target's is needed)."""

    def propose(self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings=None, **_) -> list[list[int]]:
        """Candidates per batch row; rows without new tokens (a prefill in progress) or at the length limit
        get none."""
        seqs, limits = {}, {}
        for i, sampled in enumerate(sampled_token_ids):
            n = int(num_tokens_no_spec[i])
            if sampled and n < self.max_len:
                seqs[i], limits[i] = token_ids_cpu[i, :n], self.max_len - n - 1
        out = self.core.propose(seqs, limits)
        return [out.get(i, []) for i in range(len(sampled_token_ids))]

    @property
    def stats(self) -> dict:
        """Calls, rows, candidates, draft forwards, prefills, matched cache tokens and seconds in ``propose``."""
        return dict(self.core.stats)


# ---- the proposer's counts, read from vLLM's workers (``llm.collective_rpc(_proposer_stats)``) -------------------


def _proposer_stats(worker) -> dict | None:
    drafter = getattr(worker.model_runner, "drafter", None)  # only the last pipeline stage has one
    return dict(drafter.stats) if drafter is not None else None


def first_stats(per_worker: list) -> dict:
    """The first worker's proposer counts among those that hold a proposer."""
    return next(s for s in per_worker if s is not None)
