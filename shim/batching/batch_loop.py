"""Batched speculative decoding: ``B`` prompts at a time, each row its own round.

Every row runs the same loop as :class:`~.engine.Engine` (draft until its policy stops, one target
pass, the policy's verdict, commit with EOS and length limits), with its own policy instance
(:meth:`~.policies.Policy.fork`), its own RNG, its own stats and its own EOS and length limit. What
rows share is the model forwards: each draft step is one draft forward over every row still
drafting, each round one target forward over every row, on per-model caches that let each row keep
and trim its own tokens (:class:`~.batch_cache.BatchRunner`). A row that finishes leaves the batch and
the next waiting prompt takes its place (its prompt prefilled in a forward of the joining rows
alone).

Per row, the draws and the counts are the batch-1 engine's: a row draws from its own generator in
the same order (draft samples, then the verdict's uniforms and correction), the first round's pass
counts as the prefill's, and ``draft_forwards`` counts the draft steps the row took part in. The
logits differ from batch 1 only by floating-point rounding (batched products, masked attention).

With an EAGLE head on the engine, same-vocabulary policies draft with it (:mod:`.batch_eagle`: one head
forward per step over the rows drafting, on the target states each row's passes captured).

Same-vocabulary policies only; TLI and SLEM (drafting across vocabularies) run at batch 1, and so do
draft trees.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import cast

import torch

from specheads.shim.batching.batch_eagle_drafter import BatchEagleDrafter
from specheads.shim.core.sampling import SamplingConfig
from specheads.shim.core.stats import GenerationStats, count_tokens
from specheads.shim.loop.engine import Engine, Result, commit_round, take_candidate
from specheads.shim.policies import Policy, Round, Verdict
from specheads.shim.runners.batch_cache import BatchRunner


@dataclass
class BatchJob:
    """One prompt for :meth:`BatchEngine.generate`: its token ids, its RNG, an optional streaming
    callback receiving each round's emitted ids and an optional budget of new tokens below the run's."""

    prompt_ids: list[int]
    generator: torch.Generator | None = None
    on_tokens: Callable[[list[int]], None] | None = None
    max_new_tokens: int | None = None


@dataclass
class _Row:
    job: int
    policy: Policy
    seq: list[int]
    stats: GenerationStats
    generator: torch.Generator | None
    on_tokens: Callable[[list[int]], None] | None
    start: float
    budget: int  # new tokens at most
    forwards: int = 0  # the verifying draft's passes (the draft alone) or the row's draft steps
    rnd: Round | None = None

    @property
    def produced(self) -> int:
        """New tokens committed so far."""
        return len(self.seq) - self.stats.prompt_tokens


class BatchEngine:
    """Runs the :class:`~.engine.Engine`'s loop for up to ``rows`` prompts at once.

    Args:
        engine: the batch-1 engine whose models, EOS ids and vocabulary size are used.
        rows: the batch size ``B``.
        capacity: initial cache slots per row (default ``2 * max_new_tokens + 256``); the caches compact
            and grow as needed.
        packed: each forward's projections and MLP run on the rows' real tokens only, packed together, so a
            row that drafted fewer candidates (or is not fed) costs fewer rows of the products
            (:class:`~.batch_cache.BatchRunner`); False pads every row to the widest.
    """

    def __init__(self, engine: Engine, rows: int, capacity: int | None = None, packed: bool = True):
        if rows < 1:
            raise ValueError(f"batch rows must be >= 1, got {rows}")
        self.engine, self.rows, self.capacity, self.packed = engine, rows, capacity, packed

    @torch.inference_mode()
    def generate(
        self, jobs: Iterable[BatchJob], policy: Policy, max_new_tokens: int, sampling: SamplingConfig | None = None
    ) -> Iterator[tuple[int, Result]]:
        """Decodes every job under (a fork of) ``policy``, each to at most ``max_new_tokens`` (or its own
        smaller budget); yields ``(job position, Result)`` as rows finish (not in job order)."""
        if policy.bridge is not None:
            raise ValueError(f"policy {policy.name} drafts across vocabularies and runs at batch 1 only")
        if getattr(policy, "tree", False):
            raise ValueError("draft trees run at batch 1")
        sampling = sampling or SamplingConfig()
        eng, who = self.engine, policy.emitter
        drafts = policy.max_candidates() > 0 and "draft" in policy.models and who == "target"
        eagle = eng.eagle is not None and drafts
        if (drafts and not eagle or who == "draft") and eng.draft is None:
            raise ValueError("speculative decoding needs a draft model")
        capacity = self.capacity or 2 * max_new_tokens + 256
        verifier = BatchRunner(
            eng.draft if who == "draft" else eng.target,
            self.rows,
            policy.target_hidden,
            eng.vocab_size,
            capacity,
            aux=eng.eagle.layer_ids if eagle else None,
            packed=self.packed,
        )
        drafter = (
            BatchEagleDrafter(eng.eagle, eng.target, verifier, self.rows, capacity)
            if eagle
            else BatchRunner(eng.draft, self.rows, policy.draft_hidden, eng.vocab_size, capacity, packed=self.packed)
            if drafts
            else None
        )
        waiting = iter(enumerate(jobs))
        rows: list[_Row | None] = [None] * self.rows
        while True:
            self._fill(rows, waiting, policy, verifier, drafter, max_new_tokens)
            active = [r for r in range(self.rows) if rows[r] is not None]
            if not active:
                return
            drafting = [r for r in active if self._start_round(cast(_Row, rows[r]), sampling, len(active))]
            if isinstance(drafter, BatchEagleDrafter):
                drafter.draft(rows, drafting)
            elif drafter is not None:
                self._draft(rows, drafting, drafter)
            verdicts, cands = self._verify(rows, active, verifier, who)
            for r in active:
                row = cast(_Row, rows[r])  # an active row
                if self._commit(row, cands[r], verdicts[r]):
                    yield row.job, self._finish(row, who)
                    rows[r] = None
                    verifier.clear(r)
                    if drafter is not None:
                        drafter.clear(r)
                    continue
                verifier.trim(r, len(row.seq) - 1)
                if isinstance(drafter, BatchEagleDrafter):
                    drafter.take(r, row.seq)
                elif drafter is not None:
                    drafter.trim(r, min(drafter.length(r), len(row.seq) - 1))

    def _fill(
        self,
        rows,
        waiting,
        policy: Policy,
        verifier: BatchRunner,
        drafter: BatchRunner | BatchEagleDrafter | None,
        max_new_tokens: int,
    ) -> None:
        """Free rows take the next waiting prompts; their prompts (all but the last token) are prefilled."""
        joins: dict[int, list[int]] = {}
        for r in range(self.rows):
            if rows[r] is not None:
                continue
            nxt = next(waiting, None)
            if nxt is None:
                break
            i, job = nxt
            if not job.prompt_ids:
                raise ValueError(f"job {i}: empty prompt")
            budget = min(job.max_new_tokens or max_new_tokens, max_new_tokens)
            row = _Row(
                i,
                policy.fork(),
                list(job.prompt_ids),
                GenerationStats(prompt_tokens=len(job.prompt_ids)),
                job.generator,
                job.on_tokens,
                time.perf_counter(),
                budget,
            )
            row.policy.reset()
            rows[r] = row
            joins[r] = row.seq[:-1]
        if joins:
            verifier.prefill(joins)
            if isinstance(drafter, BatchEagleDrafter):
                for r in joins:
                    drafter.join(r, rows[r].seq)
            elif drafter is not None:
                drafter.prefill(joins)

    def _start_round(self, row: _Row, sampling: SamplingConfig, batch: int) -> bool:
        """Opens the row's round in a batch of ``batch`` rows (the cost rules price at it); True when it drafts."""
        policy = row.policy
        policy.batch = batch
        remaining = row.budget - row.produced
        room = policy.round_room(remaining)
        rnd = Round(
            sampling,
            row.generator,
            limit=min(policy.max_candidates(), room),
            position=len(row.seq),
            eos=self.engine.eos,
        )
        policy.start_round(rnd)
        row.rnd = rnd
        if rnd.limit <= 0:
            return False
        if not policy.draft_round():
            row.stats.undrafted_rounds += 1
            return False
        return True

    def _draft(self, rows, drafting: list[int], drafter: BatchRunner) -> None:
        """Draft steps until every row's policy stops: one draft forward per step over the rows still drafting."""
        while drafting:
            feed = {}
            for r in drafting:
                row = rows[r]
                pending = row.seq[drafter.length(r) :] if row.rnd.n == 0 else row.rnd.tokens[-1].view(1)
                count_tokens(row.stats, "draft", drafter.length(r), len(pending))
                feed[r] = pending
            out = drafter.forward(feed, {r: 1 for r in drafting})
            still = []
            for r in drafting:
                row, (logits, hid) = rows[r], out[r]
                row.forwards += 1
                if take_candidate(row.rnd, row.policy, logits[0], hid[-1] if hid is not None else None, row.generator):
                    still.append(r)
            drafting = still

    def _verify(
        self, rows, active: list[int], verifier: BatchRunner, who: str
    ) -> tuple[dict[int, Verdict], dict[int, torch.Tensor]]:
        """One pass of the verifying model over every row that needs it; each row's policy decides."""
        verdicts, feed, want, cands = {}, {}, {}, {}
        for r in active:
            row = rows[r]
            rnd = row.rnd
            cand = cands[r] = rnd.candidates(verifier.device)
            n = cand.shape[0]
            if n and not row.policy.needs_target(rnd):
                verdicts[r] = Verdict(n, None)
                continue
            ids = row.seq[verifier.length(r) :] + cand.tolist()
            count_tokens(row.stats, who, verifier.length(r), len(ids))
            if who == "target":
                size = len(ids) - max(0, row.stats.prompt_tokens - 1 - verifier.length(r))
                row.stats.target_pass_sizes[size] = row.stats.target_pass_sizes.get(size, 0) + 1
                row.stats.target_calls += 1
            else:
                row.forwards += 1
            feed[r], want[r] = ids, n + 1
        out = verifier.forward(feed, want)
        for r in feed:
            logits, hid = out[r]
            verdicts[r] = rows[r].policy.verify(rows[r].rnd, logits, hid)
        return verdicts, cands

    def _commit(self, row: _Row, cand: torch.Tensor, verdict: Verdict) -> bool:
        """Commits the row's round (the batch-1 engine's rule); True when the row is finished."""
        remaining = row.budget - row.produced
        new = commit_round(row.stats, self.engine.eos, cand, verdict, remaining)
        row.policy.end_round(cand.shape[0], verdict.accepted)
        row.seq.extend(new)
        if row.on_tokens is not None:
            row.on_tokens(new)
        return bool(row.stats.eos) or row.produced >= row.budget

    def _finish(self, row: _Row, who: str) -> Result:
        stats = row.stats
        out = row.seq[stats.prompt_tokens :]
        stats.new_tokens = len(out)
        stats.draft_forwards = row.forwards
        stats.fold(row.policy.counters())
        stats.wall_time = time.perf_counter() - row.start
        return Result(out, stats, row.policy.trace())
