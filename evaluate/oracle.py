"""The greedy oracle (SpecDec++ Theorem 4.1) and the cost model of docs/algorithms/cost-model.md (at the
profiled prices of :mod:`specheads.shim.costs.cost_table`).

Two ways to the oracle: for a draft model, whose greedy token at a position depends on the prefix alone,
one teacher-forced pass over the target's output (:func:`draft_agreement`, then :func:`oracle_schedule` and
:func:`perfect_head_schedule`); for a drafter whose tokens depend on where the round starts (an EAGLE head,
whose first step reads the target's states), the rounds of standard SD at ``k_max`` recorded while decoding
(:class:`RoundRecorder`, then :func:`rounds_oracle` and :func:`rounds_perfect_head`)."""

from __future__ import annotations

import torch

from specheads.shim import CostTable, GenerationStats, SpecDecPP, StandardSD, make_runner, predict_ms_per_token


def oracle_schedule(agree: list[bool], k_max: int) -> GenerationStats:
    """Rounds of a stopping rule that knows where the draft's greedy token will be wrong.

    ``agree[i]``: the draft's greedy token equals the target's output token ``i`` given the
    target's prefix. Each round drafts the run of agreements ahead (at most ``k_max``, and, as
    in the engine, never the final token, which a target call emits) and stops right before a
    disagreement: nothing is discarded, and each disagreement (plus each ``k_max`` cut and the
    last round) costs one target call, over the round's candidates + 1 (``target_pass_sizes``).
    """
    n = len(agree)
    pos = calls = drafts = 0
    sizes: dict[int, int] = {}
    while pos < n:
        run = 0
        while pos + run < n - 1 and run < k_max and agree[pos + run]:
            run += 1
        calls += 1
        drafts += run
        sizes[run + 1] = sizes.get(run + 1, 0) + 1
        pos += run + 1
    return GenerationStats(new_tokens=n, target_calls=calls, draft_forwards=drafts, target_pass_sizes=sizes)


def perfect_head_schedule(agree: list[bool], k_min: int, k_max: int, lag: int) -> GenerationStats:
    """Rounds of the SpecDec++ stopping rule with a perfect head, under the engine's constraints.

    Unlike :func:`oracle_schedule`, the rule can only judge a candidate after drafting it: the
    head reads a draft state, so a round always drafts at least ``k_min`` candidates and a
    disagreement is only seen once drawn (``lag = 0``, the ``previous``-position head) or one
    forward later (``lag = 1``, the reference order). The head scores agreements 1 and the first
    disagreement 0, and the policy's own rule (``SpecDecPP.threshold_stop``) decides, so the round stops as
    soon as the disagreement is scored. The cost of this schedule bounds what any SpecDec++ head can reach
    with these models on these prompts.

    ``draft_forwards`` counts candidates drafted; discards are ``draft_forwards - accepted``; each
    round's target pass covers its candidates + 1 (``target_pass_sizes``).
    """
    n = len(agree)
    pos = calls = drafts = accepted = 0
    sizes: dict[int, int] = {}
    while pos < n:
        room = min(k_max, n - 1 - pos)  # the final token is always the target's, as in the engine
        run = 0
        while run < room and agree[pos + run]:
            run += 1
        drawn = perfect_head_drawn(run, room, k_min, k_max, lag)
        calls += 1
        drafts += drawn
        sizes[drawn + 1] = sizes.get(drawn + 1, 0) + 1
        accepted += run
        pos += run + 1
    return GenerationStats(
        new_tokens=n, target_calls=calls, draft_forwards=drafts, discarded=drafts - accepted, target_pass_sizes=sizes
    )


def perfect_head_drawn(agreed: int, room: int, k_min: int, k_max: int, lag: int) -> int:
    """Candidates a perfect SpecDec++ head drafts in a round whose first ``agreed`` candidates the target keeps, with
    room for ``room`` (``k_max``, or less at the end of the budget): after ``n`` drafts it has scored the first
    ``n - lag`` (``lag`` 1: the reference order, 0: the ``previous``-position head), each kept one 1 and the first
    rejected one 0, and SpecDec++'s own rule (``SpecDecPP.threshold_stop``, at any threshold in (0, 1)) decides.
    With ``agreed < room`` that is ``min(room, max(k_min, agreed + 1 + lag))``; with ``agreed == room``, ``room``."""
    for n in range(1, room + 1):
        keep = 0.0 if n - lag > agreed else 1.0  # the product of the scores: 0 once the rejected one is scored
        if SpecDecPP.threshold_stop(n, keep, 0.5, k_min, k_max):
            return n
    return room


class RoundRecorder(StandardSD):
    """Standard SD at a fixed ``k`` that records each round's ``(drafted, accepted)`` in ``rounds`` (the
    prompt's rounds: :meth:`reset` clears them before every prompt)."""

    def __init__(self, k: int):
        super().__init__(k)
        self.rounds: list[tuple[int, int]] = []

    def reset(self) -> None:
        self.rounds = []

    def end_round(self, drafted: int, accepted: int) -> None:
        self.rounds.append((drafted, accepted))


def rounds_oracle(rounds: list[tuple[int, int]], new_tokens: int) -> GenerationStats:
    """The greedy oracle from the rounds of SD at ``k_max`` (:class:`RoundRecorder`), for a drafter whose tokens
    depend on the round (an EAGLE head). A stop that knows where the drafter's token will be wrong drafts
    exactly each round's accepted candidates; greedy, its rounds then start where SD's do, so it drafts what SD
    drafted up to there and emits the same tokens: per round ``accepted`` draft forwards, nothing discarded,
    and one target pass over ``accepted + 1`` (as :func:`oracle_schedule` counts)."""
    return _round_stats(rounds, new_tokens, lambda drafted, accepted: accepted)


def rounds_perfect_head(rounds: list[tuple[int, int]], new_tokens: int, k_min: int, lag: int) -> GenerationStats:
    """:func:`perfect_head_schedule` from the rounds of SD at ``k_max`` (:class:`RoundRecorder`): a perfect
    SpecDec++ head stops as soon as it has scored the first rejected candidate, which it sees ``lag`` drafts
    after drawing it and never before ``k_min``; a round whose candidates were all accepted runs to its end
    (``k_max``, or the engine's room at the end of the budget), as SD's did. Greedy, the rounds keep SD's
    boundaries (each still emits its accepted candidates + the target's token), so the perfect head's round
    drafts :func:`perfect_head_drawn` of its ``accepted`` with room for ``drafted`` (``min(drafted, max(k_min,
    accepted + 1 + lag))`` when one was rejected), the first ``accepted`` kept."""
    # SD's round ended at k_max or at the budget's room: either way its drafted is where the rule must stop
    return _round_stats(rounds, new_tokens, lambda d, accepted: perfect_head_drawn(accepted, d, k_min, d, lag))


def _round_stats(rounds: list[tuple[int, int]], new_tokens: int, drawn) -> GenerationStats:
    """The counts of decoding that keeps SD's rounds but drafts ``drawn(drafted, accepted)`` candidates in each
    (the first ``accepted`` kept) and verifies them in one target pass."""
    sizes: dict[int, int] = {}
    drafts = accepted_total = 0
    for drafted, accepted in rounds:
        n = drawn(drafted, accepted)
        drafts += n
        accepted_total += accepted
        sizes[n + 1] = sizes.get(n + 1, 0) + 1
    return GenerationStats(
        new_tokens=new_tokens,
        rounds=len(rounds),
        target_calls=len(rounds),
        draft_forwards=drafts,
        drafted=drafts,
        accepted=accepted_total,
        discarded=drafts - accepted_total,
        target_pass_sizes=sizes,
    )


def eagle_oracle(
    engine, prompts: list[list[int]], max_new_tokens: int, k_max: int, rounds: list | None = None
) -> GenerationStats:
    """The greedy oracle of an engine drafting with an EAGLE head over ``prompts`` (token ids): each prompt
    decoded with SD at ``k_max`` (:class:`RoundRecorder`), its rounds turned into :func:`rounds_oracle`'s
    (and added to ``rounds`` when given: :func:`per_position_acceptance` reads them)."""
    total = GenerationStats(prompts=0)
    for ids in prompts:
        rec = RoundRecorder(k_max)
        out = engine.generate(ids, rec, max_new_tokens)
        total = GenerationStats.total([total, rounds_oracle(rec.rounds, out.stats.new_tokens)])
        if rounds is not None:
            rounds.extend(rec.rounds)
    return total


def per_position_acceptance(rounds: list[tuple[int, int]], steps: int) -> list[float | None]:
    """Per draft step ``j = 1..steps``, the share of SD rounds whose candidate ``j`` was accepted among those that
    drafted it with candidates ``1..j-1`` accepted (None where no round got there): how deep a drafter's
    agreement lasts, from :class:`RoundRecorder`'s ``(drafted, accepted)``."""
    out: list[float | None] = []
    for j in range(1, steps + 1):
        reached = [a for d, a in rounds if d >= j and a >= j - 1]
        out.append(round(sum(a >= j for a in reached) / len(reached), 4) if reached else None)
    return out


@torch.inference_mode()
def draft_agreement(
    draft, prompt_ids: list[int], output: list[int], fused: bool = True, vocab_size: int | None = None
) -> list[bool]:
    """For each output token: does the draft's greedy choice, given prompt + the output before
    it (one teacher-forced pass), equal it?"""
    if not output:
        return []
    runner = make_runner(draft, None, vocab_size, len(prompt_ids) + len(output) + 1, fused)
    device = draft.get_input_embeddings().weight.device
    ids = torch.tensor([prompt_ids + output[:-1]], device=device)
    logits, _ = runner.forward(ids, n_logits=len(output))
    return (logits.argmax(-1).cpu() == torch.tensor(output)).tolist()


def cost_per_token(draft_forwards: int, target_calls: int, new_tokens: int, t_d: float, t_t: float) -> float:
    """``T / N = (t_d * N_draft + t_t * N_target) / N`` (SpecDec++ Lemma 3.1), counts measured."""
    return (t_d * draft_forwards + t_t * target_calls) / new_tokens if new_tokens else float("nan")


def predicted_ms_per_token(stats: GenerationStats, table: CostTable) -> float | None:
    """The cost model at the profiled prices, ``(t_d N_draft + sum_k t_t(k) count_k) / N`` in ms, over the
    pass sizes the run actually used; None when its target calls were not counted by size (TLI / SLEM)."""
    if not stats.new_tokens or sum(stats.target_pass_sizes.values()) != stats.target_calls:
        return None
    return predict_ms_per_token(table, stats.draft_forwards, stats.target_pass_sizes, stats.new_tokens)


def _r(x: float | None, digits: int = 4) -> float | None:
    return None if x is None or x != x else round(x, digits)


def cost_figures(tot: GenerationStats, table: CostTable | None, t_d: float, t_t: float) -> dict:
    """Predicted (cost table, the row's own pass sizes) and measured ms/token, their ratio, and
    ``model_cost_ms_per_token`` (the predicted one; the scalar model at the baselines' times without a table)."""
    predicted = predicted_ms_per_token(tot, table) if table is not None else None
    measured = 1000 * tot.wall_time / tot.new_tokens if tot.new_tokens and tot.wall_time else None
    model = (
        predicted
        if table is not None
        else 1000 * cost_per_token(tot.draft_forwards, tot.target_calls, tot.new_tokens, t_d, t_t)
    )
    return {
        "predicted_ms_per_token": _r(predicted),
        "measured_ms_per_token": _r(measured),
        "predicted_over_measured": _r(predicted / measured) if predicted is not None and measured else None,
        "model_cost_ms_per_token": _r(model),
    }


def ideal_figures(counts: GenerationStats, t_d: float, t_t: float, table: CostTable | None = None) -> dict:
    """The counts and cost-model figures of a schedule that was never timed (the oracle, the perfect head)."""
    cost = cost_figures(counts, table, t_d, t_t)
    ms = cost["model_cost_ms_per_token"]
    return {
        "tokens": counts.new_tokens,
        "target_calls": counts.target_calls,
        "draft_forwards": counts.draft_forwards,
        "verification_rate": round(counts.verification_rate, 4),
        "discard_rate": round(counts.discard_rate, 4),
        "target_pass_sizes": dict(sorted(counts.target_pass_sizes.items())),
        "predicted_ms_per_token": cost["predicted_ms_per_token"],
        "model_cost_ms_per_token": ms,
        "predicted_tokens_per_s": round(1000 / ms, 3) if ms else None,
    }


def below_curve(points: list[tuple[float, float]], v: float, d: float, tol: float = 1e-9) -> bool | None:
    """Whether (verification rate ``v``, discard rate ``d``) lies on or below the piecewise-linear
    curve through ``points``; None when ``v`` is outside the curve's verification-rate range."""
    pts = sorted(points)
    if not pts or v < pts[0][0] - tol or v > pts[-1][0] + tol:
        return None
    for (v0, d0), (v1, d1) in zip(pts, pts[1:]):
        if v0 - tol <= v <= v1 + tol:
            at = d0 if v1 == v0 else d0 + (d1 - d0) * (v - v0) / (v1 - v0)
            return d <= at + tol
    return d <= pts[0][1] + tol  # a single point
