"""``labels=acceptance``: SpecDec++ acceptance labels from teacher-forced target and draft logits
(docs/algorithms/specdecpp.md).

Per prompt, the target's response ``x`` and at every response position ``i`` the draft's token
``y_i ~ q(.|c, x_<i)``, its label ``min(1, p(y_i)/q(y_i))`` and the expected label ``1 - TV(p, q)``
(columns: :data:`specheads.dataset.ACCEPTANCE_COLUMNS`). ``labels=fsd`` (``fsd.py``) runs the same
chunk labelling with its own columns added.
"""

from __future__ import annotations

from pathlib import Path

import torch

from specheads.datagen import shards, vllm_logprobs
from specheads.datagen.labelling import Job, Labelled, Labeller, skip_record
from specheads.dataset import ACCEPTANCE_COLUMNS, chunk_files
from specheads.shim import (
    SamplingConfig,
    batch_generate,
    pad_batch,
    probs_from_logits,
    sample,
    usable_logits,
    use_fused,
)

PER_TOKEN = ("draft_token", "label", "expected_label")  # acceptance_labels' columns, one value per response token
LABEL_BUFFER_BYTES = 1 << 30  # fp32 p, q and min(p, q) of sampled labels: at most this much at once


def acceptance_labels(
    p_logits: torch.Tensor, q_logits: torch.Tensor, sampling: SamplingConfig, generator: torch.Generator | None
) -> dict[str, torch.Tensor]:
    """Samples ``y_i ~ q_i`` and labels it, at every position.

    Both distributions are warped with the decoding settings (labels must match decoding).
    Greedy settings make ``q`` one-hot on the draft's argmax and ``p`` one-hot on the target's,
    so both labels are 1 where the argmaxes agree and 0 elsewhere.

    Args:
        p_logits, q_logits: ``[N, V]`` target and draft logits at the same positions
            (the distributions of the token after each prefix ``c, x_<i``). Greedy only: ``p_logits`` may
            be the target's argmax ``[N]`` itself (token ids: ``engine=vllm``'s greedy response tokens).
        sampling: the deployment sampling settings.
        generator: RNG for the draws.

    Returns:
        ``draft_token`` ``[N]`` (``y_i``), ``label`` ``[N]`` (``min(1, p(y)/q(y))``) and
        ``expected_label`` ``[N]`` (``1 - TV(p, q) = sum_v min(p, q)``).
    """
    if not sampling.do_sample:
        y = q_logits.argmax(-1)
        agree = ((p_logits if p_logits.dim() == 1 else p_logits.argmax(-1)) == y).float()
        return {"draft_token": y, "label": agree, "expected_label": agree.clone()}
    # fp32 p, q and min(p, q) over the full vocabulary, a block of rows at a time: a 128k vocabulary at batch
    # 16 x 512 tokens would otherwise hold about 4 GB per buffer; the draws follow the rows in order either way
    rows = max(1, LABEL_BUFFER_BYTES // (12 * q_logits.shape[-1]))
    if q_logits.shape[0] <= rows:
        return _sampled_labels(p_logits, q_logits, sampling, generator)
    parts = [
        _sampled_labels(p_logits[lo : lo + rows], q_logits[lo : lo + rows], sampling, generator)
        for lo in range(0, q_logits.shape[0], rows)
    ]
    return {k: torch.cat([part[k] for part in parts]) for k in parts[0]}


def _sampled_labels(
    p_logits: torch.Tensor, q_logits: torch.Tensor, sampling: SamplingConfig, generator: torch.Generator | None
) -> dict[str, torch.Tensor]:
    p, q = probs_from_logits(p_logits, sampling), probs_from_logits(q_logits, sampling)
    y = sample(q, generator)
    py = p.gather(-1, y[:, None]).squeeze(-1)
    qy = q.gather(-1, y[:, None]).squeeze(-1)
    label = torch.where(qy > 0, (py / qy.clamp_min(1e-30)).clamp(max=1.0), torch.ones_like(py))
    return {"draft_token": y, "label": label, "expected_label": torch.minimum(p, q).sum(-1)}


@torch.inference_mode()
def teacher_forced_logits(model, seqs: list[list[int]], first: int, pad: int) -> torch.Tensor:
    """One batched forward over right-padded ``seqs``, keeping the logits from position ``first - 1`` on.

    Returns ``[B, T - first + 1, V]``: row ``j`` is the next-token distribution after position
    ``first - 1 + j``, so a sequence whose response starts at position ``L`` finds the
    distribution of its first response token in row ``L - first``.
    """
    device = model.get_input_embeddings().weight.device
    ids, mask = pad_batch(seqs, pad, device)
    keep = ids.shape[1] - first + 1
    return model(input_ids=ids, attention_mask=mask, logits_to_keep=keep).logits[:, -keep:]


def generate_responses(
    model, prompts: list[list[int]], max_new_tokens: int, sampling: SamplingConfig, seed, pad: int, eos, logits=True
) -> tuple[list[list[int]], list[torch.Tensor] | None]:
    """The target's responses to a batch of prompts, generated as one batch.

    Llama-family targets run on the batched fused forward (:mod:`specheads.shim.batching.batch_generate`),
    which also hands back the logits each response token was chosen from: the target's
    teacher-forced distributions along its own response, so labelling needs no second target
    pass. Other models use their own ``generate`` (logits: None). Sampling uses the deployment
    settings and a generator seeded with ``seed``, so a batch's responses depend only on its
    prompts and seed. EOS ends a response (and is kept). ``logits=False``: the tokens alone (logits None).
    """
    device = model.get_input_embeddings().weight.device
    gen = torch.Generator(device=device).manual_seed(seed) if sampling.do_sample else None
    out = batch_generate(model, prompts, max_new_tokens, sampling, gen, eos, pad, record_logits=logits)
    return out if logits else (out, None)


@torch.inference_mode()
def response_logits(model, prompts: list[list[int]], responses: list[list[int]], pad: int) -> list[torch.Tensor]:
    """Per row, the model's logits ``[len(response), V]`` for the response tokens, teacher-forced.

    One batched forward over right-padded ``prompt + response``. On the fused (Llama-family)
    path the output layer runs only at the response positions; otherwise the model's own
    forward keeps the logits from the shortest prompt on.
    """
    seqs = [p + r for p, r in zip(prompts, responses)]
    if not use_fused(model):
        device = model.get_input_embeddings().weight.device
        ids, mask = pad_batch(seqs, pad, device)
        hid = model.model(input_ids=ids, attention_mask=mask).last_hidden_state  # after the final norm
        # indices on the device the states come out on (a target split over GPUs: its last, not its first)
        rows = torch.cat([torch.full((len(r),), b) for b, r in enumerate(responses)]).to(hid.device)
        cols = torch.cat([torch.arange(len(p) - 1, len(p) - 1 + len(r)) for p, r in zip(prompts, responses)])
        cols = cols.to(hid.device)
        logits = model.get_output_embeddings()(hid[rows, cols])
        return list(logits.split([len(r) for r in responses]))
    first = min(len(p) for p in prompts)
    logits = teacher_forced_logits(model, seqs, first, pad)
    return [logits[b, len(p) - first : len(p) - first + len(r)] for b, (p, r) in enumerate(zip(prompts, responses))]


def teacher_forced_pair(
    target,
    draft,
    prompts: list[list[int]],
    responses: list[list[int]],
    pad: int,
    target_logits: list[torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """Target and draft logits at every response position of a batch, one teacher-forced pass per model.

    Row ``i`` of a response (token ``x_i``) holds the logits of ``p(.|c, x_<i)`` and
    ``q(.|c, x_<i)``. ``target_logits`` (from :func:`generate_responses`; or greedy target token ids
    per response, see :func:`acceptance_labels`) replaces the target pass.

    Returns:
        ``p_logits`` ``[N, V]``, ``q_logits`` ``[N, V]`` (on the target's device, cut to the
        shared vocabulary) and the number of rows of each response.
    """
    if target_logits is None:
        target_logits = response_logits(target, prompts, responses, pad)
    q_logits = response_logits(draft, prompts, responses, pad)
    p = torch.cat(target_logits)
    q = torch.cat(q_logits).to(p.device)
    if p.dim() == 1:  # the target's tokens themselves
        return p, q, [len(r) for r in responses]
    vocab = min(p.shape[-1], q.shape[-1])
    return p[:, :vocab], q[:, :vocab], [len(r) for r in responses]


def split_rows(columns: dict[str, torch.Tensor], rows: list[int]) -> list[dict[str, torch.Tensor]]:
    """Per response, its slice (on the CPU) of every ``[N]`` column."""
    return [{k: v.cpu() for k, v in zip(columns, parts)} for parts in zip(*(t.split(rows) for t in columns.values()))]


def label_batch(
    target,
    draft,
    prompts: list[list[int]],
    responses: list[list[int]],
    sampling: SamplingConfig,
    generator: torch.Generator | None,
    pad: int,
    target_logits: list[torch.Tensor] | None = None,
) -> list[dict[str, torch.Tensor]]:
    """Acceptance labels for each response position, one teacher-forced pass per model.

    Position ``i`` of a response (token ``x_i``) gets the draft's ``y_i ~ q(.|c, x_<i)``, the label
    ``min(1, p(y_i)/q(y_i))`` and the expected label ``1 - TV(p, q)``. ``target_logits`` (from
    :func:`generate_responses`) replaces the target pass. All positions of the batch are
    labelled in one call, so the draws depend only on the batch and the generator.
    """
    p, q, rows = teacher_forced_pair(target, draft, prompts, responses, pad, target_logits)
    return split_rows(acceptance_labels(p, q, sampling, generator), rows)


def finite_rows(p_all: torch.Tensor, q_all: torch.Tensor, rows: list[int]) -> list[bool]:
    """Per response, whether every target logit at its positions is finite and the draft's are usable
    (:func:`~specheads.shim.core.sampling.usable_logits`); target token ids ``[N]``: the draft's only."""
    target_ok = torch.isfinite(p_all).all(-1) if p_all.dim() > 1 else torch.ones_like(p_all, dtype=torch.bool)
    finite = (target_ok & usable_logits(q_all)).cpu()  # a pruned draft's -inf is fine
    return [bool(f.all()) for f in finite.split(rows)]


def label_responses(
    job: Job, items: list, chunk: int, extra_columns: tuple[str, ...] = (), extra_labels=None
) -> Labelled:
    """Labels one chunk of prompts: the target's responses, then every response position.

    Args:
        job: the loaded run.
        items: the chunk's prompts.
        chunk: the chunk's number (its seed and first prompt index).
        extra_columns: per-token columns ``extra_labels`` adds, in file order.
        extra_labels: ``(p_logits, q_logits) -> {column: [N] tensor}`` at the same rows, or None.
    """
    cfg, pair = job.cfg, job.pair
    seed = shards.chunk_seed(cfg.seed, chunk)
    gen = torch.Generator(device=pair.target.output_device).manual_seed(seed)  # where p and q meet
    names = (*PER_TOKEN, *extra_columns)
    cols: dict[str, list] = {k: [] for k in (*ACCEPTANCE_COLUMNS, *extra_columns)}
    labelled, skipped = 0, []
    for b in range(0, len(items), cfg.batch_size):
        batch = items[b : b + cfg.batch_size]
        ids = job.prompt_ids(batch)
        if job.pregenerated is None:
            responses, p_logits = generate_responses(
                pair.target.model, ids, cfg.max_new_tokens, cfg.sampling, seed + b, job.pad, job.eos
            )
            vllm_ok = [True] * len(batch)
        else:  # engine=vllm: no target pass (greedy: p's argmax is the response token; sampled: vLLM's logprobs)
            keys = [str(job.first_index(chunk) + b + i) for i in range(len(batch))]
            responses, vllm_ok = map(list, zip(*(job.response(k) for k in keys)))
            if extra_labels is not None:  # labels=fsd: its divergences on the Transformers target's pass
                p_logits = None
            elif not cfg.sampling.do_sample:
                p_logits = [torch.tensor(r, device=pair.target.output_device) for r in responses]
            else:  # None when the run asked vLLM for no log-probabilities (vllm.logprobs=false)
                p_logits = vllm_logprobs.target_logits(job, keys, pair.target.output_device)
        p_all, q_all, rows = teacher_forced_pair(pair.target.model, pair.draft.model, ids, responses, job.pad, p_logits)
        ok = [a and v for a, v in zip(finite_rows(p_all, q_all, rows), vllm_ok)]
        if not all(ok):  # a sample with NaN/Inf logits is counted, never written
            keep = torch.tensor(ok).repeat_interleave(torch.tensor(rows)).to(p_all.device)
            p_all, q_all = p_all[keep], q_all[keep]
            rows = [n for n, good in zip(rows, ok) if good]
        out = acceptance_labels(p_all, q_all, cfg.sampling, gen)  # labels=fsd draws the same tokens
        if extra_labels is not None:
            out |= extra_labels(p_all, q_all)
        del p_all, q_all
        labels = iter(split_rows(out, rows) if rows else [])
        for i, (p, x, r, good) in enumerate(zip(batch, ids, responses, ok)):
            index = job.first_index(chunk) + b + i
            if not good:
                skipped.append(skip_record(p, index, "non-finite logits"))
                continue
            lab = next(labels)
            cols["prompt_id"].append(p.id)
            cols["prompt_index"].append(index)
            cols["input_ids"].append(x + r)
            cols["response_start"].append(len(x))
            for key in names:
                cols[key].append(
                    lab[key].tolist() if key != "expected_label" or cfg.acceptance.expected_label else None
                )
            labelled += len(r)
    return Labelled(cols, labelled, skipped)


def summarise(out: Path) -> dict:
    """Counts and label statistics, streamed chunk by chunk from the files."""
    import pyarrow.parquet as pq

    prompts = tokens = 0
    label_sum = expected_sum = 0.0
    hist = [0] * 10
    for path in chunk_files(out):
        table = pq.read_table(path, columns=["label", "expected_label"])
        for labels, expected in zip(table.column("label").to_pylist(), table.column("expected_label").to_pylist()):
            prompts += 1
            tokens += len(labels)
            label_sum += sum(labels)
            expected_sum += sum(expected or [])
            for v in labels:
                hist[min(int(v * 10), 9)] += 1
    return {
        "prompts": prompts,
        "labelled_tokens": tokens,
        "label_mean": label_sum / tokens if tokens else None,
        "expected_label_mean": expected_sum / tokens if tokens else None,
        "label_histogram_deciles": hist,
    }


class AcceptanceLabeller(Labeller):
    """``labels=acceptance``: SpecDec++ soft labels at every token of the target's responses."""

    def target_under_vllm(self, cfg) -> str:
        # greedy: p is the response token itself; sampled: vLLM's log-probabilities (unless turned off)
        return "config" if not cfg.sampling.do_sample or cfg.vllm.logprobs else "model"

    def label_chunk(self, job: Job, items: list, chunk: int) -> Labelled:
        return label_responses(job, items, chunk)

    def summarise(self, cfg, out: Path, models: dict) -> tuple[dict, dict]:
        return summarise(out), {}
