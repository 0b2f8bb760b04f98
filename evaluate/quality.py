"""Output quality and cost for approximate (not lossless) decoding: ROUGE, FLOPs, and SPRINTER's alpha.

* ROUGE-1/2/L F-measures (``rouge-score``) of each configuration's outputs against the target-only
  outputs and against the data set's reference responses where the prompts carry them.
* FLOPs per generated token in the convention of Kaplan et al. that the SPRINTER paper's appendix
  uses: a forward costs ``2 N`` per processed token (``N``: the parameters used as matmuls, i.e. all
  but an untied input embedding) plus ``2 n_layer c d_attn`` for attending to ``c`` positions; a
  verifier call costs ``2 N_verifier``. The prompt's prefill, the same for every method, is left out.
* ``alpha``: the share of the verifier's decisions on truly unacceptable tokens (``q(x) > p(x)``,
  the ``lambda = 1`` ground truth) that approved the token, measured on the decoded outputs, and the
  per-step total-variation bound ``alpha * TV(p, q)`` it implies (docs/algorithms/sprinter.md).
"""

from __future__ import annotations

import torch

from specheads.runtime.ratio import label_distributions
from specheads.runtime.states import logits_at


def rouge(candidates: list[str], references: list[str | None]) -> dict | None:
    """Mean ROUGE-1/2/L F-measures over the pairs whose reference is not None (None if none is)."""
    from rouge_score import rouge_scorer

    pairs = [(c, r) for c, r in zip(candidates, references) if r is not None]
    if not pairs:
        return None
    scorer = rouge_scorer.RougeScorer(["rouge1", "rouge2", "rougeL"], use_stemmer=True)
    sums = {"rouge1": 0.0, "rouge2": 0.0, "rougeL": 0.0}
    for cand, ref in pairs:
        scores = scorer.score(ref, cand)
        for k in sums:
            sums[k] += scores[k].fmeasure
    return {k: round(v / len(pairs), 4) for k, v in sums.items()} | {"pairs": len(pairs)}


def matmul_parameters(model) -> int:
    """Parameters a forward multiplies with: all of them but an untied input embedding (an EAGLE head has
    none of its own: it reads the target's)."""
    total = sum(p.numel() for p in model.parameters())
    if not hasattr(model, "get_input_embeddings"):
        return total
    emb, out = model.get_input_embeddings(), model.get_output_embeddings()
    tied = out is not None and out.weight.data_ptr() == emb.weight.data_ptr()
    return total if tied else total - emb.weight.numel()


def attention_width(model) -> tuple[int, int]:
    """``(n_layer, d_attn)`` from a Hugging Face config, or an EAGLE head's own shape (one decoder layer)."""
    if hasattr(model, "layer_ids"):  # heads.EagleHead
        return len(model.layers), int(model.num_heads * model.head_dim)
    cfg = model.config
    layers = getattr(cfg, "num_hidden_layers", None) or getattr(cfg, "n_layer")
    heads = getattr(cfg, "num_attention_heads", None) or getattr(cfg, "n_head")
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    return int(layers), int(heads * head_dim)


def flops(model, tokens: int, context: int) -> float:
    """Forward FLOPs for ``tokens`` processed tokens attending to ``context`` positions in all."""
    layers, d_attn = attention_width(model)
    return 2.0 * matmul_parameters(model) * tokens + 2.0 * layers * d_attn * context


def flops_per_token(stats, target, draft, verifier_params: int = 0) -> float | None:
    """Model FLOPs per generated token of a configuration's summed stats."""
    if not stats.new_tokens:
        return None
    total = flops(target, stats.target_tokens, stats.target_context)
    if draft is not None and stats.draft_tokens:
        total += flops(draft, stats.draft_tokens, stats.draft_context)
    total += 2.0 * verifier_params * stats.verifier_calls
    return total / stats.new_tokens


@torch.no_grad()
def verifier_errors(
    target,
    draft,
    prompt_ids: list[list[int]],
    outputs: list[list[int]],
    decisions: list[list[tuple[int, int, bool]]],
    sampling,
    pad: int,
    batch_size: int = 8,
) -> dict:
    """Judges every verifier decision of a set of outputs against ``q(x) <= p(x)``.

    ``decisions[b]`` holds ``(position, token, approved)``: the candidate ``token`` drafted after
    the first ``position`` tokens of ``prompt_ids[b] + outputs[b]``. One teacher-forced pass per
    model gives ``p`` and ``q`` there (warped as at decoding; raw for greedy decoding, as the labels),
    ``batch_size`` outputs at a time.

    Returns counts, ``alpha`` (approved share of ``q(x) > p(x)``), the approval rate on the
    acceptable ones, the mean ``TV(p, q)`` over decisions and the per-step bound ``alpha * TV``.
    """
    rows = [(p + o, d) for p, o, d in zip(prompt_ids, outputs, decisions) if d]
    if not rows:
        return {"decisions": 0, "alpha": None}
    tvs, bads, oks = [], [], []
    for i in range(0, len(rows), batch_size):  # bounded memory: a batch's full-vocabulary logits at a time
        part = rows[i : i + batch_size]
        seqs = [s for s, _ in part]
        positions = [[pos for pos, _, _ in d] for _, d in part]
        p_logits = torch.cat(logits_at(target, seqs, positions, pad))
        q_logits = torch.cat(logits_at(draft, seqs, positions, pad)).to(p_logits.device)
        vocab = min(p_logits.shape[-1], q_logits.shape[-1])
        x = torch.tensor([t for _, d in part for _, t, _ in d], device=p_logits.device)
        dist = label_distributions(p_logits[:, :vocab], q_logits[:, :vocab], sampling, None, x=x)
        tvs.append(dist["tv"].cpu())
        bads.append((dist["q_token"] > dist["p_token"]).cpu())
        oks.append(torch.tensor([a for _, d in part for _, _, a in d]))
    tv, bad, approved = torch.cat(tvs), torch.cat(bads), torch.cat(oks)
    n_bad, n_good = int(bad.sum()), int((~bad).sum())
    alpha = float((approved & bad).sum()) / n_bad if n_bad else None
    mean_tv = float(tv.mean())
    return {
        "decisions": int(len(approved)),
        "approved": int(approved.sum()),
        "unacceptable": n_bad,
        "alpha": round(alpha, 4) if alpha is not None else None,
        "approval_rate_acceptable": round(float((approved & ~bad).sum()) / n_good, 4) if n_good else None,
        "mean_tv": round(mean_tv, 4),
        "tv_bound_per_step": round(alpha * mean_tv, 4) if alpha is not None else None,
    }
