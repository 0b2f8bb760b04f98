"""Replays the stop plugin's rounds (:mod:`specheads.vllm.stop_plugin`, ``trace=True``) through the toolkit's own rule.

vLLM's plugin decides each request's draft length on vLLM's own EAGLE-3 forward. This module recomputes the same
rounds without vLLM: the EAGLE head's drafts from every position of the finished sequence
(:class:`specheads.heads.EagleHead` on the Transformers target's states: tokens, logits over the target's vocabulary,
post-norm states); then the policy of the same settings (:func:`~specheads.vllm.stop_config.rule_policy`, fresh per
request) decides each round in order, fed the batch size vLLM ran it at and vLLM's verdict (the candidates verified
and accepted). A request matches when every round has the length the plugin chose: the plugin read the right
states, the right logits, the right step and batch, and gave the rule the right outcomes. Used by
``bench/vllm_stop.py`` (``drafts_match_shim``) and ``tests/in_vllm``.
"""

from __future__ import annotations

import torch

ROWS = ("c-cost", "c-online-cost", "h-cost")


def reference_rounds(head, target, ids: list[int], k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For every row ``t`` of ``ids``: the head's ``k`` draft steps from state ``s_t`` and token ``x_{t+1}``: tokens
    ``[rows, k]``, logits over the target's vocabulary ``[rows, k, V]`` (``-inf`` outside the head's) and the
    post-norm states that drew them ``[rows, k, d]``."""
    from specheads.heads.eagle_head import unrolled_kept, unrolled_step

    x = torch.tensor(ids)
    embed = target.get_input_embeddings()
    width = target.get_output_embeddings().weight.shape[0]
    with torch.no_grad():
        hs = target(x[None], output_hidden_states=True).hidden_states
        h = head.fuse(torch.cat([hs[j] for j in head.layer_ids], -1))[:, :-1]
        tok, pos, kept = x[None, 1:], torch.arange(len(ids) - 1), unrolled_kept(head)
        toks, logits, states = [], [], []
        for j in range(k):
            cos, sin = head.rope(pos + j)
            h = unrolled_step(head, kept, embed(tok), h, cos, sin, None)
            post = head.norm(h)
            small = head.lm_head(post).float()  # the head's rows, scattered into the target's vocabulary
            scores = small.new_full((*small.shape[:-1], width), float("-inf")).index_copy_(-1, head.vocab_ids, small)
            tok = scores.argmax(-1)
            toks.append(tok[0])
            logits.append(scores[0])
            states.append(post[0])
    return torch.stack(toks, 1), torch.stack(logits, 1), torch.stack(states, 1)


def draft_reference(draft, ids: list[int], k: int):
    """The same as :func:`reference_rounds` for a draft model (``method="draft_model"``), row by row on demand: a
    callable ``t -> (tokens [k], logits [k, V], post-norm states [k, d])``, the draft's ``k`` greedy steps after
    ``ids[: t + 2]``."""

    def at(t: int):
        x = torch.tensor([ids[: t + 2]])
        toks, logits, states = [], [], []
        with torch.no_grad():
            out = draft(x, use_cache=True, output_hidden_states=True)
            for _ in range(k):
                lg, st = out.logits[0, -1].float(), out.hidden_states[-1][0, -1]  # Llama's last state is post-norm
                tok = lg.argmax(-1)
                toks.append(tok)
                logits.append(lg)
                states.append(st)
                out = draft(
                    tok.view(1, 1), past_key_values=out.past_key_values, use_cache=True, output_hidden_states=True
                )
        return torch.stack(toks), torch.stack(logits), torch.stack(states)

    at.rows = len(ids) - 1
    return at


def rounds_of(trace: list[dict]) -> dict[str, list[dict]]:
    """The plugin's trace per request: its rounds in order, each ``{step, batch, draft, verified, accepted}``
    (``verified``/``accepted`` absent for a round vLLM never verified; ``capped`` where the batch cap ended it,
    ``scheduled`` where the batch was above ``rule_max_batch``)."""
    out: dict[str, list[dict]] = {}
    last: dict[str, dict] = {}
    for e in trace:
        if "draft" in e:
            last[e["req"]] = {k: e[k] for k in ("step", "batch", "draft", "capped", "scheduled") if k in e}
            out.setdefault(e["req"], []).append(last[e["req"]])
        elif e["req"] in last:
            last[e["req"]]["verified"], last[e["req"]]["accepted"] = e["verified"], e["accepted"]
    return out


def replay(policy, reference, prompt_len: int, rounds: list[dict], k: int) -> dict:
    """One request's ``rounds`` (:func:`rounds_of`) through ``policy`` (fresh) on ``reference`` (the
    :func:`reference_rounds` of its prompt and output, or :func:`draft_reference`'s callable): ``lengths`` the
    toolkit's, ``vllm`` the plugin's, and ``drafts_differ`` the rounds whose candidates are not the reference's."""
    from specheads.shim import Round, SamplingConfig

    if isinstance(reference, tuple):  # reference_rounds' tensors
        toks_all, logits_all, states_all = reference

        def at(t):
            return toks_all[t], logits_all[t], states_all[t]

        rows = toks_all.shape[0]
    else:  # draft_reference's callable
        at, rows = reference, reference.rows
    policy.reset()
    m, lengths, got, differ = prompt_len, [], [], 0
    for rec in rounds:
        t = m - 1  # the round knows x_0..x_m and drafts from state s_{m-1}, token x_m
        if t >= rows:
            break
        toks, logits, states = at(t)
        # a round the plugin's batch cap ended (B > 1) stops there, unless the rule stops it first
        rnd = Round(sampling=SamplingConfig(), generator=None, limit=k, position=0)
        cap = len(rec["draft"]) if rec.get("capped") else k
        policy.batch = rec["batch"]
        policy.start_round(rnd)
        if rec.get("scheduled"):  # a batch above rule_max_batch: the table's K, read by a rule that learns online
            for j in range(len(rec["draft"])):
                rnd.tokens.append(toks[j])
                rnd.draft_logits.append(logits[j])
                rnd.draft_hidden.append(states[j])
                if getattr(policy, "online", None) is not None:
                    policy.stop_drafting(rnd)
        elif policy.draft_round():
            for j in range(k):
                rnd.tokens.append(toks[j])
                rnd.draft_logits.append(logits[j])
                rnd.draft_hidden.append(states[j])
                if rnd.n >= k or policy.stop_drafting(rnd) or rnd.n >= cap:  # the engine's order (drafting.py)
                    break
        lengths.append(rnd.n)
        got.append(len(rec["draft"]))
        differ += toks[: len(rec["draft"])].tolist() != rec["draft"]
        verified, accepted = rec.get("verified", 0), rec.get("accepted", 0)
        policy.end_round(verified, accepted)
        m += accepted + 1 if verified else 1
    return {"lengths": lengths, "vllm": got, "match": lengths == got, "drafts_differ": differ}
