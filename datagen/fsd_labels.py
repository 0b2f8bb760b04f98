"""FSD labels: the divergence between target and draft at every drafted token (docs/algorithms/fsd.md).

Fuzzy speculative decoding accepts candidate ``y_i`` iff ``Div(p_i, q_i) < T``. The decision
depends only on the two next-token distributions at the candidate's prefix, so it is a
deterministic label that a head can learn from draft features (FSD paper, section 7.1).

``labels=fsd`` runs the ``labels=acceptance`` pipeline unchanged (``acceptance.py``: the target's
response ``x``, teacher-forced ``p_i = p(.|c, x_<i)`` and ``q_i = q(.|c, x_<i)``, the draft's
token ``y_i`` drawn greedily or per ``sampling`` from the same generator, so the same seed gives
the same ``draft_token`` and SD ``label`` as ``labels=acceptance``) and adds per token:

* ``div_<name>``: ``Div(p_i, q_i)`` for each divergence of ``fsd.divergences`` (fp32, natural
  log, :func:`specheads.shim.core.divergence.divergence`, with ``fsd.top_k``);
* ``fsd_<name>@<T>``: the FSD decision ``Div(p_i, q_i) < T`` (bool) for each threshold of
  ``fsd.thresholds``. The stored fp32 divergence is compared with ``T`` in fp64, so reading the
  Parquet value back and comparing it with the threshold gives exactly the stored label.

Which distributions (``fsd.dist``): ``raw`` is the softmax of the unwarped logits (the FSD
paper's and its public code's choice, and the only meaningful one for greedy drafting);
``warped`` applies the decoding temperature / top-k / top-p first (sampling only: greedy warping
is one-hot and makes every threshold the same label).

Positions after a rejection are KEPT, and the label of a position is its own decision
``Div(p_i, q_i) < T``, not "accepted and every earlier one accepted". The data has no draft
blocks: every position is teacher-forced on the target's own prefix ``c, x_<i``, which is the
state FSD decoding is in at the start of a round, and under SD (or FSD) verification of a greedy
target the state after every accepted candidate. The head predicts, like the SpecDec++ head, the
conditional acceptance of ``y_i`` given that every earlier candidate was accepted; the stopping
policy multiplies these conditionals itself. Masking what follows the first rejection of an
imagined block would only drop data and bias the head towards early positions.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from specheads.datagen import acceptance_labels as acceptance
from specheads.datagen.labelling import Job, Labelled, Labeller
from specheads.dataset import chunk_files
from specheads.shim import DIVERGENCES, SamplingConfig, divergence, probs_from_logits

DISTS = ("raw", "warped")
ROWS_PER_STEP = 256  # rows of [N, V] probabilities processed at once (bounds the temporaries)


def divergence_column(name: str) -> str:
    """Parquet column of the divergence ``name``."""
    return f"div_{name}"


def label_column(name: str, threshold: float) -> str:
    """Parquet column of the FSD decision ``Div < threshold``."""
    return f"fsd_{name}@{threshold:g}"


def problems(
    divergences: list[str], thresholds: list[float], top_k: int, dist: str, sampling: SamplingConfig
) -> list[str]:
    """One line per invalid FSD setting (empty when valid).

    Args:
        divergences: names from ``fsd.divergences``.
        thresholds: ``fsd.thresholds``.
        top_k: ``fsd.top_k`` (0: the whole vocabulary).
        dist: ``fsd.dist``.
        sampling: the decoding settings (``warped`` needs sampling).
    """
    out = []
    bad = [d for d in divergences if d not in DIVERGENCES]
    if bad or not divergences:
        out.append(f"fsd.divergences={list(divergences)}: choose one or more of {list(DIVERGENCES)}")
    if len(set(divergences)) != len(divergences):
        out.append(f"fsd.divergences={list(divergences)} lists a divergence twice")
    if not thresholds:
        out.append("fsd.thresholds is empty; give at least one threshold T (label: Div < T), e.g. [0.1, 0.3]")
    if any(not math.isfinite(t) or t < 0 for t in thresholds):
        out.append(f"fsd.thresholds={list(thresholds)}: every threshold must be finite and >= 0")
    if len({f"{t:g}" for t in thresholds}) != len(thresholds):
        out.append(f"fsd.thresholds={list(thresholds)} lists a threshold twice")
    if top_k < 0:
        out.append(f"fsd.top_k={top_k} must be >= 0 (0: the whole vocabulary)")
    if dist not in DISTS:
        out.append(f"fsd.dist={dist!r}: choose raw (softmax of the logits) or warped (the sampling settings)")
    elif dist == "warped" and not sampling.do_sample:
        out.append(
            "fsd.dist=warped with greedy sampling compares one-hot distributions; use fsd.dist=raw "
            "or sampling.do_sample=true"
        )
    return out


def distributions(logits: torch.Tensor, sampling: SamplingConfig, dist: str) -> torch.Tensor:
    """fp32 probabilities ``[N, V]`` from logits ``[N, V]``: ``raw`` softmax or ``warped`` by ``sampling``."""
    if dist == "warped":
        return probs_from_logits(logits, sampling)
    return logits.float().softmax(-1)


def fsd_labels(
    p_logits: torch.Tensor,
    q_logits: torch.Tensor,
    sampling: SamplingConfig,
    divergences: list[str],
    thresholds: list[float],
    top_k: int = 0,
    dist: str = "raw",
) -> dict[str, torch.Tensor]:
    """Divergences and FSD decisions at every row.

    Args:
        p_logits, q_logits: ``[N, V]`` target and draft logits at the same prefixes.
        sampling: the decoding settings (used by ``dist="warped"``).
        divergences: names, see :data:`DIVERGENCES`.
        thresholds: ``T`` values; the decision is ``Div < T``.
        top_k: the divergences' top-k-plus-rest restriction (0: none).
        dist: ``raw`` or ``warped`` (module docstring).

    Returns:
        ``{div_<name>: [N] fp32, fsd_<name>@<T>: [N] bool}`` on the logits' device.
    """
    parts: dict[str, list[torch.Tensor]] = {divergence_column(d): [] for d in divergences}
    for lo in range(0, p_logits.shape[0], ROWS_PER_STEP):
        p = distributions(p_logits[lo : lo + ROWS_PER_STEP], sampling, dist)
        q = distributions(q_logits[lo : lo + ROWS_PER_STEP], sampling, dist)
        for d in divergences:
            parts[divergence_column(d)].append(divergence(d, p, q, top_k))
    empty = torch.empty(0, dtype=torch.float32, device=p_logits.device)
    out = {k: torch.cat(v) if v else empty for k, v in parts.items()}
    for d in divergences:
        div = out[divergence_column(d)].double()  # fp64: the stored fp32 value vs T, exactly as a reader compares
        for t in thresholds:
            out[label_column(d, t)] = div < t
    return out


def manifest_block(out: Path, divergences: list[str], thresholds: list[float], top_k: int, dist: str) -> dict:
    """The manifest's ``fsd`` entry: the settings, the column names and :func:`summarise`'s statistics."""
    return {
        "rule": "accept y_i iff Div(p_i, q_i) < T (paper rule; fp32 divergence, natural log, compared with T in fp64)",
        "divergences": divergences,
        "thresholds": thresholds,
        "top_k": top_k,
        "dist": dist,
        "positions_after_rejection": "kept",
        "divergence_columns": {d: divergence_column(d) for d in divergences},
        "label_columns": {f"{d}@{t:g}": label_column(d, t) for d in divergences for t in thresholds},
        **summarise(out, divergences, thresholds),
    }


def summarise(out: Path, divergences: list[str], thresholds: list[float]) -> dict:
    """The manifest's ``fsd`` statistics, streamed from the chunk files.

    Returns tokens, per divergence its mean and quantiles, and per ``(divergence, threshold)``
    the accepted token count and the label mean (the share FSD accepts).
    """
    import pyarrow.parquet as pq

    cols = [divergence_column(d) for d in divergences]
    values: dict[str, list[torch.Tensor]] = {d: [] for d in divergences}
    for path in chunk_files(out):
        table = pq.read_table(path, columns=cols)
        for d, c in zip(divergences, cols):
            flat = [v for row in table.column(c).to_pylist() for v in row]
            values[d].append(torch.tensor(flat, dtype=torch.float64))
    tokens = 0
    keys = ("divergence_mean", "divergence_quantiles", "non_finite_divergences", "accepted_tokens", "label_mean")
    stats: dict[str, dict] = {k: {} for k in keys}
    levels = torch.tensor([0.1, 0.25, 0.5, 0.75, 0.9], dtype=torch.float64)
    for d in divergences:
        v = torch.cat(values[d]) if values[d] else torch.empty(0, dtype=torch.float64)
        tokens = int(v.numel())
        finite = v[torch.isfinite(v)]
        stats["divergence_mean"][d] = float(finite.mean()) if finite.numel() else None
        stats["non_finite_divergences"][d] = tokens - int(finite.numel())
        fits = 0 < tokens <= 1 << 24  # torch.quantile's input limit
        stats["divergence_quantiles"][d] = (
            {f"{q:g}": float(x) for q, x in zip(levels.tolist(), v.quantile(levels))} if fits else None
        )
        accepted = {f"{t:g}": int((v < t).sum()) for t in thresholds}
        stats["accepted_tokens"][d] = accepted
        stats["label_mean"][d] = {k: (n / tokens if tokens else None) for k, n in accepted.items()}
    return {"tokens": tokens, **stats}


class FsdLabeller(Labeller):
    """``labels=fsd``: ``labels=acceptance``'s data plus the divergences and FSD decisions per token."""

    def problems(self, cfg) -> list[str]:
        return super().problems(cfg) + problems(
            list(cfg.fsd.divergences), list(cfg.fsd.thresholds), cfg.fsd.top_k, cfg.fsd.dist, cfg.sampling
        )

    def label_chunk(self, job: Job, items: list, chunk: int) -> Labelled:
        cfg = job.cfg
        divs, thresholds = list(cfg.fsd.divergences), list(cfg.fsd.thresholds)
        columns = (*(divergence_column(d) for d in divs), *(label_column(d, t) for d in divs for t in thresholds))
        return acceptance.label_responses(
            job,
            items,
            chunk,
            columns,
            lambda p, q: fsd_labels(p, q, cfg.sampling, divs, thresholds, cfg.fsd.top_k, cfg.fsd.dist),
        )

    def summarise(self, cfg, out: Path, models: dict) -> tuple[dict, dict]:
        block = manifest_block(out, list(cfg.fsd.divergences), list(cfg.fsd.thresholds), cfg.fsd.top_k, cfg.fsd.dist)
        return acceptance.summarise(out), {"fsd": block}
