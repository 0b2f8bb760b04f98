"""SpecDec++ acceptance labels from teacher-forced target and draft logits (ALGORITHMS.md section 1)."""

from __future__ import annotations

import torch

from specheads.export.shim.models import pad_batch
from specheads.export.shim.sampling import SamplingConfig, probs_from_logits, sample


def acceptance_labels(p_logits: torch.Tensor, q_logits: torch.Tensor, sampling: SamplingConfig,
                      generator: torch.Generator | None) -> dict[str, torch.Tensor]:
    """Samples ``y_i ~ q_i`` and labels it, at every position.

    Both distributions are warped with the decoding settings (labels must match decoding).
    Greedy settings make ``q`` one-hot on the draft's argmax and ``p`` one-hot on the target's.

    Args:
        p_logits, q_logits: ``[N, V]`` target and draft logits at the same positions
            (the distributions of the token after each prefix ``c, x_<i``).
        sampling: the deployment sampling settings.
        generator: RNG for the draws.

    Returns:
        ``draft_token`` ``[N]`` (``y_i``), ``label`` ``[N]`` (``min(1, p(y)/q(y))``) and
        ``expected_label`` ``[N]`` (``1 - TV(p, q) = sum_v min(p, q)``).
    """
    if sampling.do_sample:
        p, q = probs_from_logits(p_logits, sampling), probs_from_logits(q_logits, sampling)
        y = sample(q, generator)
    else:
        v = p_logits.shape[-1]
        p = torch.nn.functional.one_hot(p_logits.argmax(-1), v).float()
        q = torch.nn.functional.one_hot(q_logits.argmax(-1), v).float()
        y = q_logits.argmax(-1)
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


@torch.inference_mode()
def generate_responses(model, prompts: list[list[int]], max_new_tokens: int, sampling: SamplingConfig,
                       seed: int, pad: int, eos: list[int]) -> list[list[int]]:
    """The target's responses to a batch of prompts (left-padded batched ``generate``).

    Sampling uses the deployment settings and draws from torch's RNG seeded with ``seed``, so a
    batch's responses depend only on its prompts and seed. EOS ends a response (and is kept).
    """
    ids, mask = pad_batch(prompts, pad, model.get_input_embeddings().weight.device, left=True)
    width = ids.shape[1]
    kwargs = {"do_sample": False}
    if sampling.do_sample:
        kwargs = {"do_sample": True, "temperature": sampling.temperature, "top_k": sampling.top_k or None,
                  "top_p": sampling.top_p}
    torch.manual_seed(seed)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                         pad_token_id=pad, eos_token_id=eos or None, **kwargs)
    responses = []
    for row in out[:, width:].tolist():
        cut = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
        responses.append(row[:cut])
    return responses


def label_batch(target, draft, prompts: list[list[int]], responses: list[list[int]], sampling: SamplingConfig,
                generator: torch.Generator | None, pad: int) -> list[dict[str, torch.Tensor]]:
    """Acceptance labels for each response position, one teacher-forced pass per model.

    Position ``i`` of a response (token ``x_i``) gets the draft's ``y_i ~ q(.|c, x_<i)``, the label
    ``min(1, p(y_i)/q(y_i))`` and the expected label ``1 - TV(p, q)``. All positions of the batch
    are labelled in one call, so the draws depend only on the batch and the generator.
    """
    seqs = [p + r for p, r in zip(prompts, responses)]
    first = min(len(p) for p in prompts)
    p_logits = teacher_forced_logits(target, seqs, first, pad)
    q_logits = teacher_forced_logits(draft, seqs, first, pad)
    rows, sel_p, sel_q = [], [], []
    for b, (prompt, resp) in enumerate(zip(prompts, responses)):
        lo = len(prompt) - first  # logits row of the distribution of the first response token
        sel_p.append(p_logits[b, lo: lo + len(resp)])
        sel_q.append(q_logits[b, lo: lo + len(resp)].to(p_logits.device))
        rows.append(len(resp))
    vocab = min(p_logits.shape[-1], q_logits.shape[-1])
    out = acceptance_labels(torch.cat(sel_p)[:, :vocab], torch.cat(sel_q)[:, :vocab], sampling, generator)
    return [{k: v.cpu() for k, v in zip(out, parts)} for parts in zip(*(t.split(rows) for t in out.values()))]
