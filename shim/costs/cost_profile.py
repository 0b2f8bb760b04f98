"""Measuring the prices of a cost table (:mod:`.costs`): timed forwards on the runners decoding uses.

:func:`measure` times batch 1 (:func:`~.model_runner.make_runner`); :func:`measure_batches` times ``B`` rows at once on
the batched engine's :class:`~.batch_cache.BatchRunner`, every row after its own ``prefix_tokens``-token prefix.
A warm-up pass per size, then ``reps`` repetitions interleaved over the sizes (so that a drift hits every size
alike); each price is the median.
"""

from __future__ import annotations

import statistics
import time

import torch

from specheads.errors import UserError
from specheads.shim.runners.model_runner import make_runner

PREFIX_TOKENS = 100
REPS = 15
WARMUP = 2


def sync_device(device: torch.device) -> None:
    """Waits for ``device``'s queued work (a CUDA device; a CPU runs eagerly): read a clock only after it."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def measure(
    target,
    draft,
    max_pass: int,
    fused: bool = True,
    vocab_size: int | None = None,
    prefix_tokens: int = PREFIX_TOKENS,
    reps: int = REPS,
    warmup: int = WARMUP,
    seed: int = 0,
) -> tuple[float, list[float]]:
    """``(t_d, [t_t(1) .. t_t(max_pass)])`` in ms on the decoding runners, medians of ``reps``.

    Both models first consume the same random ``prefix_tokens``-token prefix; each timed forward
    is trimmed off again, so every pass sees that prefix. ``draft`` may be an EAGLE head
    (:class:`specheads.heads.EagleHead`): ``t_d`` is then one of its draft steps.
    """
    if max_pass < 1 or prefix_tokens < 1 or reps < 1:
        raise UserError(f"need max_pass, prefix_tokens, reps >= 1, got {max_pass}, {prefix_tokens}, {reps}")
    cap = prefix_tokens + max_pass + 2
    if hasattr(draft, "get_input_embeddings"):
        runners = [make_runner(m, None, vocab_size, cap, fused) for m in (target, draft)]
        vocab = min(m.get_input_embeddings().weight.shape[0] for m in (target, draft))
    else:  # an EAGLE head: one draft step (its own cache, the target's embeddings)
        from specheads.shim.runners.eagle_cache import EagleStepRunner

        runners = [make_runner(target, None, vocab_size, cap, fused), EagleStepRunner(draft, target, cap)]
        vocab = target.get_input_embeddings().weight.shape[0]
    gen = torch.Generator().manual_seed(seed)
    prefix = torch.randint(3, max(vocab, 4), (1, prefix_tokens), generator=gen)
    tokens = torch.randint(3, max(vocab, 4), (1, max_pass), generator=gen)

    def once(runner, k: int) -> float:
        ids = tokens[:, :k].to(runner.device)
        sync_device(runner.device)
        start = time.perf_counter()
        logits, _ = runner.forward(ids, n_logits=k)
        sync_device(logits.device)  # the last shard's device, for a model split over several
        elapsed = time.perf_counter() - start
        runner.trim(prefix_tokens)
        return 1000 * elapsed

    try:
        for r in runners:
            r.forward(prefix.to(r.device), n_logits=0)
        t_run, d_run = runners
        sizes = list(range(1, max_pass + 1))
        for _ in range(warmup):  # first-use costs (allocations, kernel choices, weight copies) stay out
            once(d_run, 1)
            for k in sizes:
                once(t_run, k)
        draft_ms: list[float] = []
        target_ms: dict[int, list[float]] = {k: [] for k in sizes}
        for rep in range(reps):  # interleaved, the order rotating: drifts hit every size alike
            order = sizes[rep % max_pass :] + sizes[: rep % max_pass]
            for k in order:
                draft_ms.append(once(d_run, 1))
                target_ms[k].append(once(t_run, k))
    finally:
        for r in runners:
            r.close()
    return statistics.median(draft_ms), [statistics.median(target_ms[k]) for k in sizes]


def batch_sizes(batch_size: int) -> tuple[int, ...]:
    """The batch sizes a cost table prices for an engine of ``batch_size`` rows: powers of two below it, and it."""
    out, b = [], 2
    while b < batch_size:
        out.append(b)
        b *= 2
    return tuple(out + [batch_size]) if batch_size > 1 else ()


@torch.inference_mode()
def measure_batches(
    target,
    draft,
    max_pass: int,
    batches: list[int],
    vocab_size: int | None = None,
    prefix_tokens: int = PREFIX_TOKENS,
    reps: int = REPS,
    warmup: int = WARMUP,
    seed: int = 0,
) -> tuple[list[float | None], list[list[float]]]:
    """``([t_d(B) for B], [[t_t(B, 1..max_pass)] for B])`` in ms: one forward of ``B`` rows, each ``1`` (``k``)
    new tokens after its own prefix. An EAGLE head as ``draft`` keeps its batch-1 step (``t_d(B) = t_d(1)``:
    the head is one layer, its step far below the target's)."""
    from specheads.shim.runners.batch_cache import BatchRunner

    if not batches or min(batches) < 2 or max_pass < 1:
        raise UserError(f"batch sizes must be >= 2 and max_pass >= 1, got {batches}, {max_pass}")
    eagle = not hasattr(draft, "get_input_embeddings")
    top, cap = max(batches), prefix_tokens + max_pass + 2
    models = [target] if eagle else [target, draft]
    runners = [BatchRunner(m, top, None, vocab_size, cap) for m in models]
    vocab = min(m.get_input_embeddings().weight.shape[0] for m in models)
    gen = torch.Generator().manual_seed(seed)
    prefix = torch.randint(3, max(vocab, 4), (top, prefix_tokens), generator=gen).tolist()
    tokens = torch.randint(3, max(vocab, 4), (top, max_pass), generator=gen).tolist()

    def once(runner, b: int, k: int) -> float:
        sync_device(runner.device)
        start = time.perf_counter()
        out = runner.forward({r: tokens[r][:k] for r in range(b)}, {r: k for r in range(b)})
        sync_device(out[0][0].device)
        elapsed = time.perf_counter() - start
        for r in range(b):
            runner.trim(r, prefix_tokens)
        return 1000 * elapsed

    for r in runners:
        r.prefill({i: prefix[i] for i in range(top)})
    sizes = [(b, k) for b in batches for k in range(1, max_pass + 1)]
    t_d: dict[int, list[float]] = {b: [] for b in batches}
    t_t: dict[tuple[int, int], list[float]] = {s: [] for s in sizes}
    try:
        for rep in range(warmup + reps):
            order = sizes[rep % len(sizes) :] + sizes[: rep % len(sizes)]
            for b, k in order:
                d = once(runners[1], b, 1) if not eagle and k == 1 else None
                t = once(runners[0], b, k)
                if rep >= warmup:
                    t_t[(b, k)].append(t)
                    if d is not None:
                        t_d[b].append(d)
    finally:
        for r in runners:
            r.close()
    return (
        [statistics.median(t_d[b]) if t_d[b] else None for b in batches],
        [[statistics.median(t_t[(b, k)]) for k in range(1, max_pass + 1)] for b in batches],
    )
