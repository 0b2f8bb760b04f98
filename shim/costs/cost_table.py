"""A profiled cost table: what one draft forward and one target pass of ``k`` tokens cost here.

The cost model of docs/algorithms/cost-model.md prices a run at ``T = t_d * N_draft + t_t * N_target``.
A target pass over more tokens costs more (on a CPU a 5-token verification pass can cost far more
than a 1-token step), so the table keeps one target price per pass size. Definitions, used by
the engine's counting, ``heads-eval`` and the cost-aware stop rules alike:

* ``t_d``: one draft forward over 1 token after a prefix of ``prefix_tokens`` tokens (1 logit row).
* ``t_t(k)``: one target forward over ``k`` tokens after the same prefix, returning ``k`` logit
  rows: the verification pass of ``k - 1`` candidates (``[last, y_1..y_{k-1}]``); ``k = 1`` is an
  autoregressive step. A round with ``n`` candidates costs ``n * t_d + t_t(n + 1)``.
* ``t_d(B)``, ``t_t(B, k)``: the same forwards over a batch of ``B`` rows, each row ``1`` (``k``) tokens
  after its own prefix (the batched engine's runner, :class:`~.batch_cache.BatchRunner`), measured for the
  sizes in ``batches`` (:mod:`.cost_profile`); between them prices are interpolated in ``B``, beyond the
  largest extended along the last two. The cost rules price a round at the batch it runs in: a batch
  that is compute-bound makes every extra candidate dearer, so drafting shrinks or stops there.
* The prompt's prefill is in neither: the engine counts every target pass as its candidates + 1
  (``GenerationStats.target_pass_sizes``), so predictions leave the prefill out, while measured
  ms/token (wall time / new tokens) includes it, and the loop's own overhead (sampling, syncs).

Times come from the runners decoding uses (:func:`~.model_runner.make_runner`): a warm-up pass per size,
then ``reps`` repetitions interleaved over the sizes; each price is the median. A table is cached
as JSON under ``$SPECHEADS_CACHE/costs/<key>.json`` (default ``~/.cache/specheads``), the key a
hash of every setting that changes the prices (machine, torch, threads, dtypes, devices, runner,
model fingerprints, draft vocabulary subset, kernel policy, prefix and repetitions), written
atomically under a lock; it is measured when absent, too short, or with ``profile="refresh"``.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch

from specheads.errors import UserError
from specheads.machine import cache_dir, cpu_model, locked, read_json, settings_key
from specheads.outputs import atomic_write_json
from specheads.shim.costs.cost_profile import PREFIX_TOKENS, REPS, measure, measure_batches

log = logging.getLogger(__name__)

PROFILES = ("auto", "refresh")  # or a path to a cost-table JSON


@dataclass
class CostTable:
    """Per-forward prices in milliseconds and the settings they were measured under.

    ``t_target_ms[k - 1]`` is ``t_t(k)``, a target pass over ``k`` tokens (see the module docstring).
    """

    t_draft_ms: float
    t_target_ms: list[float]
    machine: str = ""
    torch: str = ""
    threads: int = 0
    target_dtype: str = ""
    draft_dtype: str = ""
    target_device: str = ""
    draft_device: str = ""
    fused: bool = True
    target_runner: str = ""
    draft_runner: str = ""
    target_fingerprint: str = ""
    draft_fingerprint: str = ""
    draft_vocab_hash: str | None = None
    kernels: str | None = None
    prefix_tokens: int = PREFIX_TOKENS
    reps: int = REPS
    batches: list[int] = field(default_factory=list)  # batch sizes > 1 measured (empty: batch 1 only)
    t_draft_batch_ms: list[float] = field(default_factory=list)  # t_d(B) for B in batches
    t_target_batch_ms: list[list[float]] = field(default_factory=list)  # [t_t(B, 1..)] for B in batches
    source: str = field(default="", compare=False)  # measured / a cache file / a given file; not a setting

    def settings(self) -> dict:
        """Every field the prices depend on (all but the prices and ``source``)."""
        out = dataclasses.asdict(self)
        for k in ("t_draft_ms", "t_target_ms", "t_draft_batch_ms", "t_target_batch_ms", "source"):
            out.pop(k)
        return out

    @property
    def key(self) -> str:
        """The cache key: a hash of :meth:`settings`."""
        return settings_key(self.settings())

    @property
    def max_pass(self) -> int:
        """The largest pass size measured."""
        return len(self.t_target_ms)

    def t_target(self, k: int, batch: int = 1) -> float:
        """``t_t(B, k)`` in ms; beyond the measured sizes, the line through the last two."""
        if k < 1:
            raise ValueError(f"a target pass has at least 1 token, got {k}")
        return self._at_batch(batch, [_along(t, k) for t in (self.t_target_ms, *self.t_target_batch_ms)])

    def t_draft(self, batch: int = 1) -> float:
        """``t_d(B)`` in ms."""
        return self._at_batch(batch, [self.t_draft_ms, *self.t_draft_batch_ms])

    def round_ms(self, n: int, batch: int = 1) -> float:
        """Cost of a round with ``n`` candidates at batch ``B``: ``n * t_d(B) + t_t(B, n + 1)``."""
        return n * self.t_draft(batch) + self.t_target(n + 1, batch)

    def _at_batch(self, batch: int, prices: list[float]) -> float:
        """The price at ``batch`` from ``prices`` at ``[1, *batches]``: interpolated, extended past the end."""
        if batch <= 1 or len(prices) < 2:
            return prices[0]
        return _along(prices, batch, [1, *self.batches])

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "key": self.key}

    @classmethod
    def from_dict(cls, data: Mapping) -> "CostTable":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})

    def describe(self, sizes: int = 8) -> str:
        """One line: ``t_d`` and the first ``sizes`` target prices, the machine and where it came from."""
        shown = ", ".join(f"{k}:{t:.3g}" for k, t in enumerate(self.t_target_ms[:sizes], start=1))
        more = f", ... {self.max_pass}:{self.t_target_ms[-1]:.3g}" if self.max_pass > sizes else ""
        more += "".join(
            f"; B={b}: t_d {d:.3g}, t_t(1) {t[0]:.3g}"
            for b, d, t in zip(self.batches, self.t_draft_batch_ms, self.t_target_batch_ms)
        )
        return (
            f"cost table t_d {self.t_draft_ms:.3g} ms, t_t(k) ms {{{shown}{more}}} "
            f"[{self.machine}; {self.target_device}/{self.draft_device}, {self.target_dtype}/{self.draft_dtype}, "
            f"{self.threads} threads; {self.source or 'given'}]"
        )


def _along(values: list[float], x: float, at: list[int] | None = None) -> float:
    """``values`` (at ``at``, default ``1, 2, ...``) at ``x``: interpolated; past the end, the line through the
    last two (never falling)."""
    at = at or list(range(1, len(values) + 1))
    for i, a in enumerate(at):
        if x <= a:
            if i == 0:
                return values[0]
            return values[i - 1] + (values[i] - values[i - 1]) * (x - at[i - 1]) / (a - at[i - 1])
    slope = (values[-1] - values[-2]) / (at[-1] - at[-2]) if len(values) > 1 else 0.0
    return values[-1] + max(slope, 0.0) * (x - at[-1])


def load_table(path: str | Path) -> CostTable:
    """A cost table from a JSON file (one written by :func:`cost_table`, or a hand-made one with at
    least ``t_draft_ms`` and ``t_target_ms``)."""
    data = read_json(Path(path))
    if data is None:
        raise UserError(f"cost table {str(path)!r} is missing or not a JSON object; pass profile=auto to measure one")
    problems = []
    if not isinstance(data.get("t_draft_ms"), (int, float)) or data["t_draft_ms"] < 0:
        problems.append(f"t_draft_ms={data.get('t_draft_ms')!r} must be a number >= 0")
    t = data.get("t_target_ms")
    if not isinstance(t, list) or not t or not all(isinstance(x, (int, float)) and x > 0 for x in t):
        problems.append(f"t_target_ms={t!r} must be a non-empty list of times > 0 (t_t(1), t_t(2), ...)")
    b, bd, bt = (data.get(k) or [] for k in ("batches", "t_draft_batch_ms", "t_target_batch_ms"))
    if not (len(b) == len(bd) == len(bt)) or sorted(set(b)) != list(b) or any(x < 2 for x in b):
        problems.append(
            "batches (increasing sizes >= 2), t_draft_batch_ms and t_target_batch_ms must have one entry per batch size"
        )
    if problems:
        raise UserError(f"cost table {str(path)!r}: " + "; ".join(problems))
    table = CostTable.from_dict(data)
    table.source = str(path)
    return table


def _kernel_policy() -> str | None:
    try:
        from specheads.shim.runners import kernels
    except ImportError:
        return None
    policy = getattr(kernels, "signature", None) or getattr(kernels, "policy", None)
    return policy() if callable(policy) else None


def _settings(
    target,
    draft,
    target_fingerprint: str,
    draft_fingerprint: str,
    fused: bool,
    draft_vocab_hash: str | None,
    prefix_tokens: int,
    reps: int,
) -> CostTable:
    """An empty table holding this machine's settings for the pair."""
    from specheads.shim.runners.fused import use_fused

    eagle = not hasattr(draft, "get_input_embeddings")  # an EAGLE head drafts on the target's embeddings
    if draft_vocab_hash is None and not eagle:  # a draft whose output layer was pruned to a vocabulary subset
        try:
            from specheads.shim.runners.vocab_pruning import vocab_info
        except ImportError:
            vocab_info = None
        info = vocab_info(draft) if vocab_info is not None else None
        draft_vocab_hash = info.get("sha256") if info else None
    devices = [m.get_input_embeddings().weight.device for m in (target, target if eagle else draft)]
    gpus = sorted({torch.cuda.get_device_name(d) for d in devices if d.type == "cuda"})
    return CostTable(
        t_draft_ms=0.0,
        t_target_ms=[],
        machine=" + ".join([cpu_model(), *gpus]),
        torch=torch.__version__,
        threads=torch.get_num_threads(),
        target_dtype=str(target.dtype).removeprefix("torch."),
        draft_dtype=str(next(draft.parameters()).dtype).removeprefix("torch."),
        target_device=str(devices[0]),
        draft_device=str(devices[1]),
        fused=fused,
        target_runner="fused" if fused and use_fused(target) else "model",
        draft_runner="eagle" if eagle else "fused" if fused and use_fused(draft) else "model",
        target_fingerprint=target_fingerprint,
        draft_fingerprint=draft_fingerprint,
        draft_vocab_hash=draft_vocab_hash,
        kernels=_kernel_policy(),
        prefix_tokens=prefix_tokens,
        reps=reps,
    )


def cost_table(
    target,
    draft,
    max_pass: int,
    target_fingerprint: str = "",
    draft_fingerprint: str = "",
    fused: bool = True,
    vocab_size: int | None = None,
    profile: str = "auto",
    draft_vocab_hash: str | None = None,
    prefix_tokens: int = PREFIX_TOKENS,
    reps: int = REPS,
    batches: tuple[int, ...] = (),
) -> CostTable:
    """The pair's cost table for pass sizes ``1..max_pass`` (at least), and batch sizes ``batches``.

    Args:
        target, draft: the models (as loaded for decoding).
        max_pass: the largest target pass needed (the most candidates per round + 1).
        target_fingerprint, draft_fingerprint: the models' content fingerprints (part of the key).
        fused: whether decoding may run the fused forward (as ``Engine(fused=...)``).
        vocab_size: common vocabulary size when one model pads its logits (as the engine's).
        profile: ``auto`` (the cached table; measured when absent or shorter than ``max_pass``),
            ``refresh`` (measured again and cached), or a path to a cost-table JSON (used as is).
        draft_vocab_hash: a hash of the draft's vocabulary subset when it is pruned (default: read from
            the draft's pruned output layer, :func:`~.vocab_pruning.vocab_info`).
        prefix_tokens, reps: measurement settings (part of the key).
        batches: batch sizes > 1 to price too (:func:`~.cost_profile.batch_sizes`; part of the key).
    """
    if profile not in PROFILES:
        table = load_table(profile)
        if table.max_pass < max_pass:
            log.info(
                "cost table %s covers passes up to %d tokens; larger ones are extrapolated", profile, table.max_pass
            )
        return table
    table = _settings(
        target, draft, target_fingerprint, draft_fingerprint, fused, draft_vocab_hash, prefix_tokens, reps
    )
    table.batches = sorted({int(b) for b in batches if int(b) > 1})
    path = cache_dir("costs") / f"{table.key}.json"
    with locked(path):
        cached = read_json(path) if profile == "auto" else None
        if cached is not None and len(cached.get("t_target_ms") or []) >= max_pass:
            out = CostTable.from_dict(cached)
            out.source = str(path)
            return out
        log.info("profiling per-forward costs (draft 1 token, target 1..%d tokens) -> %s", max_pass, path)
        table.t_draft_ms, table.t_target_ms = measure(target, draft, max_pass, fused, vocab_size, prefix_tokens, reps)
        if table.batches:
            drafts, table.t_target_batch_ms = measure_batches(
                target, draft, max_pass, table.batches, vocab_size, prefix_tokens, max(3, reps // 2)
            )
            table.t_draft_batch_ms = [table.t_draft_ms if d is None else d for d in drafts]
        table.source = "measured"
        atomic_write_json(path, {**table.to_dict(), "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S")})
    return table
