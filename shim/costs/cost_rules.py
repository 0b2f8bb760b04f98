"""Decisions taken from a cost table (:mod:`.costs`): predicted ms per token, the cost-aware stop
rule and the draft gate that lets a round skip the draft."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from specheads.errors import UserError
from specheads.shim.costs.cost_table import CostTable


def pass_counts(rounds_by_size: Mapping[int, int] | Iterable[int]) -> dict[int, int]:
    """``{pass size: target calls}`` from such a mapping or from a list of each call's pass size."""
    if isinstance(rounds_by_size, Mapping):
        return {int(k): int(v) for k, v in rounds_by_size.items()}
    out: dict[int, int] = {}
    for k in rounds_by_size:
        out[int(k)] = out.get(int(k), 0) + 1
    return out


def predict_ms_per_token(
    table: CostTable, draft_forwards: int, rounds_by_size: Mapping[int, int] | Iterable[int], new_tokens: int
) -> float:
    """``(t_d * N_draft + sum_k t_t(k) * count_k) / N`` in ms (the prompt's prefill left out).

    Args:
        table: the prices.
        draft_forwards: ``N_draft``.
        rounds_by_size: ``{k: target calls over k tokens}``, or each target call's pass size.
        new_tokens: ``N``.
    """
    if not new_tokens:
        return float("nan")
    target = sum(table.t_target(k) * c for k, c in pass_counts(rounds_by_size).items())
    return (table.t_draft_ms * draft_forwards + target) / new_tokens


def draft_more(
    table: CostTable, n: int, scored: int, survival: float, survival_sum: float, beta: float, batch: int = 1
) -> bool:
    """Whether drafting candidate ``n + 1`` raises the round's expected tokens per unit of cost.

    With ``S_i = prod_{j<=i} beta_j`` the chance that ``y_1..y_i`` are all accepted, a round with
    ``n`` candidates yields ``E(n) = 1 + sum_{i<=n} S_i`` tokens and costs
    ``C(n) = n * t_d(B) + t_t(B, n + 1)`` at the round's batch size ``B`` (as if every row of the batch drafted
    alike); draft on iff ``E(n+1) / C(n+1) > E(n) / C(n)``.
    ``E`` is concave in ``n`` (``S_i`` never grows), so where ``t_t`` is convex this stops at the
    argmax of ``E / C``.

    Args:
        table: the prices.
        n: candidates drafted so far.
        scored: how many of them have an acceptance estimate (``n`` or ``n - 1``).
        survival: ``S_scored`` (1 when none is scored).
        survival_sum: ``sum_{i<=scored} S_i``.
        beta: the estimate for every candidate without one (the unscored newest and the next).
        batch: the rows the engine runs this round (prices at that batch size).
    """
    e_n, s = 1.0 + survival_sum, survival
    for _ in range(n - scored):
        s *= beta
        e_n += s
    gain = s * beta  # S_{n+1}
    return (e_n + gain) * table.round_ms(n, batch) > e_n * table.round_ms(n + 1, batch)


class DraftGate:
    """Decides at each round's start whether to draft at all (the cost-aware rules' zero-candidate round).

    Before the draft runs nothing it will say is known, so the gate judges by the prompt's recent
    rounds. A drafted round that kept ``m`` of ``n`` candidates emitted ``m + 1`` tokens for
    ``C_B(n) = n t_d(B) + t_t(B, n + 1)`` at batch size ``B``, where the target alone would have emitted
    ``C_B(n) / t_t(B, 1)``: its surplus is ``m + 1 - C_B(n) / t_t(B, 1)`` tokens. The estimate is the mean
    surplus of the drafted rounds, each weighing ``(1 - 1/memory)`` less per newer one, from a prior of
    ``prior`` worth ``prior_weight`` rounds, priced at the batch size of the round about to run (the gate
    keeps the rounds' tokens and sizes, not their surpluses, so a batch that grows closes it and one that
    shrinks opens it again). A round drafts while the estimate is positive; otherwise the target steps
    alone (one token, no draft forward; the draft catches up on its next forward). So that an estimate
    which fell can rise again, a round drafts anyway (a probe) after ``probe_every`` skipped rounds in a
    row; each probe that leaves the gate closed doubles that wait (up to ``max_probe_every``), and the gate
    opening on its own resets it. The surplus measures the whole round as the policy's own stop rule shaped
    it, so the gate needs no model of that rule.

    Args:
        table: the pair's cost table.
        memory: rounds after which an old one weighs ``1/e`` as much.
        probe_every: rounds skipped in a row before a probe, at first.
        max_probe_every: the longest wait between probes.
        prior, prior_weight: the surplus assumed at a prompt's start and its weight in rounds.
    """

    def __init__(
        self,
        table: CostTable,
        memory: float = 16.0,
        probe_every: int = 8,
        max_probe_every: int = 64,
        prior: float = 0.5,
        prior_weight: float = 2.0,
    ):
        if memory < 1 or not 1 <= probe_every <= max_probe_every or prior_weight <= 0:
            raise UserError(
                f"draft gate needs memory >= 1, 1 <= probe_every <= max_probe_every, prior_weight > 0; "
                f"got {memory}, {probe_every}, {max_probe_every}, {prior_weight}"
            )
        self.table = table
        self.memory, self.prior, self.prior_weight = memory, prior, prior_weight
        self.probe_every, self.max_probe_every = probe_every, max_probe_every
        self.reset()

    def reset(self) -> None:
        """A new prompt: back to the prior."""
        self._sizes: dict[int, float] = {}
        self._prior_w, self._tokens, self._weight = self.prior_weight, 0.0, 0.0
        self._idle, self._wait = 0, self.probe_every

    def estimate(self, batch: int = 1) -> float:
        """Recent drafted rounds' mean surplus in tokens over the target alone at the same cost, at ``batch``."""
        alone = self.table.round_ms(0, batch)
        cost = sum(w * self.table.round_ms(n, batch) / alone for n, w in self._sizes.items())
        return (self.prior * self._prior_w + self._tokens - cost) / (self._prior_w + self._weight)

    def open(self, batch: int = 1) -> bool:
        """True to draft this round (run at batch size ``batch``); False: the target steps alone."""
        if self.estimate(batch) > 0:
            self._idle, self._wait = 0, self.probe_every
            return True
        if self._idle >= self._wait:  # a probe
            self._idle, self._wait = 0, min(2 * self._wait, self.max_probe_every)
            return True
        self._idle += 1
        return False

    def observe(self, drafted: int, accepted: int) -> None:
        """A verified round: ``accepted`` of ``drafted`` candidates kept (none drafted: nothing learnt)."""
        if drafted <= 0:
            return
        keep = 1.0 - 1.0 / self.memory
        self._prior_w *= keep
        self._tokens = self._tokens * keep + accepted + 1
        self._sizes = {n: w * keep for n, w in self._sizes.items()}
        self._sizes[drafted] = self._sizes.get(drafted, 0.0) + 1.0
        self._weight = self._weight * keep + 1.0
