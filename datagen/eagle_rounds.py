"""``labels=eagle_rounds``: SpecDec++ acceptance labels for an EAGLE drafter, on-policy from decoding.

Per prompt, the target decodes with the EAGLE head ``eagle_rounds.head=`` (an exported ``head_type=eagle`` file,
:class:`specheads.shim.loop.eagle_drafter.EagleDrafter`) under standard SD with a fixed ``eagle_rounds.k``
candidates per round and the run's sampling settings (docs/algorithms/specdecpp.md and eagle.md). The policy
that verifies each round (:class:`RecordingSD`) keeps, before the standard rule decides, the
candidates, the distributions they were drawn from, the head's post-norm states and the target logits
of the verification pass. A candidate ``y_j``'s label is SpecDec++'s, the acceptance of ``y_j`` given
that ``y_1..y_{j-1}`` were accepted: ``min(1, p_j(y_j) / q_j(y_j))`` with ``p_j`` from the verification
pass and ``q_j`` the distribution ``y_j`` was drawn from, both warped by the sampling settings; greedy
(one-hot ``p`` and ``q``): 1 where ``y_j`` is the target's argmax, else 0. The verification pass scores
every candidate, so the candidates after a round's first rejection are labelled too (the stop head met
them while drafting); ``outcome`` says what the rule did with each (1 kept, 0 rejected, -1 not reached).

The feature of ``y_j`` (``eagle_rounds.position=own``, lag 1) is the head's state at ``y_j``'s own position (after
consuming ``y_j``): the state the drafter returns with ``y_{j+1}``, which ``policy=specdecpp`` (reference
order) scores ``y_j`` with. A round's last candidate has none (the round stops before the step that consumes
it; SpecDec++ never scores it either) and is not stored. ``eagle_rounds.position=previous`` (lag 0) stores instead
the state that produced ``y_j`` (the one ``q_j`` came from), for every candidate, the last included: a head on
it scores ``y_j`` as soon as it is drawn. ``q_token`` is ``q_j(y_j)`` (greedy: from the temperature-1
softmax, the draft confidence ``policy=confidence_stop`` reads), ``p_token`` the target's ``p_j(y_j)`` alike;
``q_entropy`` and ``q_margin`` are the entropy and top-1 margin of that same distribution of ``q_j``
(:func:`specheads.heads.acceptance_head.distribution_signals`).

Every prompt decodes at batch 1 (the drafter's), its draws seeded by ``(seed, prompt index)``: a chunk's
bytes do not depend on which process labels it. The Parquet file holds
:data:`~specheads.dataset.EAGLE_ROUNDS_COLUMNS` (one row per prompt, lists per stored candidate); the
states (fp16) go to :class:`~specheads.dataset.DrafterChunkFiles` (``states``, ``offsets``).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import torch

from specheads.datagen.drafter import StatesLabeller
from specheads.datagen.labelling import Job, Labelled, skip_record
from specheads.dataset import EAGLE_ROUNDS_COLUMNS, EAGLE_ROUNDS_SIGNALS, DrafterChunkFiles, chunk_files
from specheads.heads.acceptance_head import distribution_signals
from specheads.shim import Engine, Policy, Round, Verdict, probs_from_logits, standard_verify

PER_CANDIDATE = ("round_start", "step", "draft_token", "q_token", "p_token", "label", "outcome", *EAGLE_ROUNDS_SIGNALS)
POSITIONS = ("own", "previous")


def feature(position: str) -> dict:
    """The stored states' ``feature`` (the manifest's, then the head's): the EAGLE head's post-norm state at the
    candidate's own position (lag 1) or at the one before it (lag 0)."""
    return {"model": "eagle", "state": "post", "layer": -1, "position": position}


@dataclass
class RoundRecord:
    """One verified round: where it started, its candidates' values and the head's states ``[n, d]``."""

    start: int
    tokens: list[int]
    q: list[float]
    p: list[float]
    label: list[float]
    states: torch.Tensor
    accepted: int = 0
    entropy: list[float] | None = None
    margin: list[float] | None = None


class RecordingSD(Policy):
    """Standard SD with ``k`` candidates per round that records each round before the standard rule decides."""

    name = "eagle_rounds"
    draft_hidden = "post"  # what policy=specdecpp reads

    def __init__(self, k: int):
        super().__init__(k)
        self.rounds: list[RoundRecord] = []
        self.finite = True

    def reset(self) -> None:
        self.rounds, self.finite = [], True

    def verify(self, rnd: Round, logits: torch.Tensor, hidden: torch.Tensor | None) -> Verdict:
        record = record_round(rnd, logits) if rnd.n else None
        if record is not None:
            self.finite &= bool(torch.isfinite(logits[: rnd.n].float()).all() and torch.isfinite(record.states).all())
        verdict = standard_verify(rnd, logits)  # the same draws as policy=sd: the record takes none
        if record is not None:
            record.accepted = verdict.accepted
            self.rounds.append(record)
        return verdict


def record_round(rnd: Round, logits: torch.Tensor) -> RoundRecord:
    """The round's candidates with ``q_j(y_j)``, ``p_j(y_j)`` and their label (module docstring), from the
    target logits ``[n+1, V]`` of its verification pass."""
    n = rnd.n
    cand = rnd.candidates(logits.device)
    idx = torch.arange(n, device=logits.device)
    target = logits[:n].float()
    if rnd.sampling.do_sample:
        p = probs_from_logits(target, rnd.sampling)[idx, cand]
        q = torch.stack(rnd.q).to(logits.device).float()[idx, cand]
        label = torch.where(q > 0, (p / q.clamp_min(1e-30)).clamp(max=1.0), torch.ones_like(p))
        logq = torch.stack(rnd.q).to(logits.device).float().log()
    else:
        draft = torch.stack(rnd.draft_logits).to(logits.device).float()
        p, q = target.softmax(-1)[idx, cand], draft.softmax(-1)[idx, cand]
        label = (target.argmax(-1) == cand).float()
        logq = draft.log_softmax(-1)
    ent, margin = distribution_signals(logq)
    states = torch.stack(rnd.draft_hidden).to(torch.float16).cpu()
    return RoundRecord(
        rnd.position, cand.tolist(), q.tolist(), p.tolist(), label.tolist(), states, 0, ent.tolist(), margin.tolist()
    )


def prompt_rows(rounds: list[RoundRecord], width: int, position: str = "own") -> tuple[dict[str, list], torch.Tensor]:
    """A prompt's stored candidates and their states ``[M, width]``: ``own``, those with an own-position state
    (every one but a round's last); ``previous``, every candidate with the state that drew it."""
    out: dict[str, list] = {k: [] for k in PER_CANDIDATE}
    states = []
    lag = 1 if position == "own" else 0
    for r in rounds:
        for j in range(len(r.tokens) - lag):  # own: y_{j+1}'s own state came with y_{j+2}
            out["round_start"].append(r.start)
            out["step"].append(j + 1)
            out["draft_token"].append(r.tokens[j])
            out["q_token"].append(r.q[j])
            out["p_token"].append(r.p[j])
            out["label"].append(r.label[j])
            out["outcome"].append(1 if j < r.accepted else 0 if j == r.accepted else -1)
            out["q_entropy"].append(r.entropy[j])
            out["q_margin"].append(r.margin[j])
        states.append(r.states[lag : len(r.tokens)])
    return out, torch.cat(states) if states else torch.zeros(0, width, dtype=torch.float16)


def stream(seed: int, index: int) -> int:
    """The RNG seed of prompt ``index`` (run-wide, ``offset`` included): hashed, because the CPU generator
    (mt19937) keeps only a seed's low 32 bits, so ``seed`` must reach them."""
    return int.from_bytes(hashlib.sha256(f"eagle_rounds:{seed}:{index}".encode()).digest()[:8], "little") >> 1


class EagleRoundsLabeller(StatesLabeller):
    """``labels=eagle_rounds``: per prompt, SD with the EAGLE head at ``k = eagle_rounds.k``; every candidate's label,
    draft and target probabilities, and the head's state at its position."""

    def problems(self, cfg) -> list[str]:
        out = super().problems(cfg)
        if not cfg.eagle_rounds.head:
            out.append(
                "labels=eagle_rounds needs eagle_rounds.head=<an exported EAGLE head> (heads-train head=eagle, "
                "then heads-export)"
            )
        if cfg.eagle_rounds.position not in POSITIONS:
            out.append(f"eagle_rounds.position={cfg.eagle_rounds.position!r}: choose own (lag 1) or previous (lag 0)")
        elif cfg.eagle_rounds.k < (2 if cfg.eagle_rounds.position == "own" else 1):
            out.append(
                f"eagle_rounds.k={cfg.eagle_rounds.k} must be >= 2 with eagle_rounds.position=own (a round's last "
                "candidate has no own-position state to label)"
                if cfg.eagle_rounds.position == "own"
                else f"eagle_rounds.k={cfg.eagle_rounds.k} must be >= 1"
            )
        return out

    def needs_draft(self, cfg) -> bool:
        return False

    def check_models(self, job: Job) -> None:
        job.eagle_head(job.cfg.eagle_rounds.head)

    def label_chunk(self, job: Job, items: list, chunk: int) -> Labelled:
        cfg, target = job.cfg, job.pair.target
        head = job.eagle_head(cfg.eagle_rounds.head)
        engine = Engine(target.model, None, job.eos, eagle=head.module)
        policy = RecordingSD(cfg.eagle_rounds.k)
        gen = torch.Generator(device=target.device)
        cols: dict[str, list] = {k: [] for k in (*EAGLE_ROUNDS_COLUMNS, *EAGLE_ROUNDS_SIGNALS)}
        states, lengths, skipped = [], [], []
        labelled = 0
        first = job.first_index(chunk)
        for i, (prompt, ids) in enumerate(zip(items, job.prompt_ids(items))):
            gen.manual_seed(stream(cfg.seed, first + i))
            out = engine.generate(ids, policy, cfg.max_new_tokens, cfg.sampling, gen)
            if not policy.finite:
                skipped.append(skip_record(prompt, first + i, "non-finite logits or head states"))
                continue
            rows, st = prompt_rows(policy.rounds, head.module.hidden_size, cfg.eagle_rounds.position)
            cols["prompt_id"].append(prompt.id)
            cols["prompt_index"].append(first + i)
            cols["input_ids"].append(ids + out.tokens)
            cols["response_start"].append(len(ids))
            for k, v in rows.items():
                cols[k].append(v)
            states.append(st)
            lengths.append(st.shape[0])
            labelled += st.shape[0]
        offsets = torch.zeros(len(lengths) + 1, dtype=torch.int64)
        if lengths:
            offsets[1:] = torch.tensor(lengths, dtype=torch.int64).cumsum(0)
        width = head.module.hidden_size
        DrafterChunkFiles(cfg.output_dir, chunk).write(
            {"states": torch.cat(states) if states else torch.zeros(0, width, dtype=torch.float16), "offsets": offsets}
        )
        return Labelled(cols, labelled, skipped)

    def summarise(self, cfg, out: Path, models: dict) -> tuple[dict, dict]:
        from specheads.export.package import read_metadata

        stats = summarise(out)
        meta = read_metadata(cfg.eagle_rounds.head)
        eagle = {
            "file": Path(cfg.eagle_rounds.head).name,
            "tensors_sha256": meta.get("tensors_sha256"),
            "target": meta.get("target"),
        }
        return stats, {
            "hidden_size": models["hidden_size"],
            "eagle_rounds": {"k": cfg.eagle_rounds.k, "eagle": eagle, "feature": feature(cfg.eagle_rounds.position)},
        }


def summarise(out: Path) -> dict:
    """Counts, the mean label, the mean label and the share kept per step, streamed from the chunk files."""
    import pyarrow.parquet as pq

    prompts = tokens = 0
    total = 0.0
    per_step: dict[int, list] = {}  # step -> candidates, label sum, kept
    for path in chunk_files(out):
        table = pq.read_table(str(path), columns=["step", "label", "outcome"])
        prompts += table.num_rows
        for steps, labels, outcomes in zip(*(table.column(c).to_pylist() for c in ("step", "label", "outcome"))):
            for j, y, o in zip(steps, labels, outcomes):
                s = per_step.setdefault(j, [0, 0.0, 0])
                s[0], s[1], s[2] = s[0] + 1, s[1] + y, s[2] + (o == 1)
                tokens, total = tokens + 1, total + y
    return {
        "prompts": prompts,
        "labelled_tokens": tokens,
        "label_mean": total / tokens if tokens else None,
        "per_step": {
            str(j): {
                "candidates": n,
                "label_mean": round(t / n, 6) if n else None,
                "kept_share": round(kept / n, 6) if n else None,
            }
            for j, (n, t, kept) in sorted(per_step.items())
        },
    }
