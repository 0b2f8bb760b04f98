"""``heads-datagen engine=vllm``: the target's hidden states from vLLM, so drafter, judge and SPRINTER labels run
no Transformers target pass.

One vLLM child per run (:class:`specheads.vllm.child.StatesServer`), started when a labeller first asks for
states and kept until the run ends. Each sequence runs as a prompt (a teacher-forced prefill), the pass the
Transformers engine runs.

What each family takes:

* ``drafter``: the stream entering ``drafter.layers`` at every position of prompt + response, and the
  target's ``drafter.top_k`` most likely tokens at every response token (vLLM's ``prompt_logprobs``);
* ``judge``: the last layer's output before the final norm at the labelled answer tokens;
* ``sprinter``: the same state at the kept prefixes; the target's final norm and output layer turn it into
  the distribution ``p`` (SPRINTER's TV needs all of it, which ``prompt_logprobs`` does not give).

States come back in vLLM's dtype (fp32 on a CPU by default; ``target.dtype`` as the Transformers engine
resolves it) and equal the Transformers engine's to float rounding.
"""

from __future__ import annotations

import torch

from specheads.datagen.vllm_logprobs import top_k_only
from specheads.vllm.child import StatesServer

FAMILIES = ("drafter", "judge", "sprinter")


def server(cfg, job, local_rank: int = 0) -> StatesServer | None:
    """The ``engine=vllm`` run's states server when the family needs the target's states, else None."""
    if cfg.labels not in FAMILIES or top_k_only(cfg):  # drafter without states: the top-k come with the responses
        return None
    return StatesServer(cfg, job.limit, local_rank)


def drafter_states(job, seqs: list[list[int]], layers: list[int], responses: list[int], top_k: int):
    """Per sequence (prompt + response, the response ``responses[i]`` tokens long): the stream entering
    ``layers`` at every position, ``[T, len(layers) * d]`` fp16, the target's top ``top_k`` at each response
    token (``(ids [n, k] int32, logp [n, k] fp32)``) and whether both are finite."""
    out = []
    for seq, n, (st, (ids, logp)) in zip(seqs, responses, job.states.states(seqs, layers, top_k)):
        ids, logp = ids[len(seq) - n - 1 :], logp[len(seq) - n - 1 :]  # row p: the token at position p + 1
        ok = bool(torch.isfinite(st).all()) and bool(torch.isfinite(logp).all())
        out.append((st.reshape(st.shape[0], -1).to(torch.float16), (ids, logp), ok))
    return out


def final_states(job, seqs: list[list[int]]) -> list[torch.Tensor]:
    """Per sequence, the target's last-layer output before its final norm at every position, ``[T, d]``."""
    n = job.pair.target.model.config.num_hidden_layers
    return [st[:, 0] for st, _ in job.states.states(seqs, [n])]


def target_logits(job, seqs: list[list[int]], positions: list[list[int]]) -> list[torch.Tensor]:
    """Per row, the target's logits ``[len(positions[b]), V]`` after each prefix ``seqs[b][:t]`` (as
    :func:`specheads.runtime.states.logits_at`): vLLM's final states through the target's final norm and output
    layer."""
    from specheads.shim import final_norm, output_device

    model = job.pair.target.model
    norm, head, device = final_norm(model), model.get_output_embeddings(), output_device(model)
    out = []
    with torch.inference_mode():
        for st, pos in zip(final_states(job, seqs), positions):
            rows = st[torch.tensor(pos, dtype=torch.long) - 1].to(device=device, dtype=head.weight.dtype)
            out.append(head(norm(rows)))
    return out


def judge_features(job, rows: list[dict]):
    """:func:`specheads.datagen.judge_labels.target_features` from vLLM's states: features ``[M, d]`` fp16 at
    the labelled answer tokens, their labels, tokens per kept row, the rows left out (non-finite states) and the
    target's verdict on each token (signals ``[M, 4]``, through the target's final norm and output layer)."""
    from specheads.datagen.judge_features import gather_features, verdicts_from
    from specheads.shim import final_norm

    model = job.pair.target.model
    norm = final_norm(model)
    states = final_states(job, [r["input_ids"] for r in rows])

    def post(i: int) -> torch.Tensor:
        return norm(states[i].to(dtype=model.get_output_embeddings().weight.dtype))

    got = gather_features(
        rows, lambda i: states[i] if bool(torch.isfinite(states[i]).all()) else None, verdicts_from(model, post)
    )
    if not got[0].numel():
        return (torch.empty(0, job.pair.target.hidden_size, dtype=torch.float16), *got[1:])
    return got
