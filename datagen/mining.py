"""Swap mining (``heads-datagen labels=judge judge.mining=swap``): which of the draft's mismatches change the answer.

AutoJudge's semi-greedy search (docs/algorithms/judge.md), per prompt:

1. The target answers greedily: the running response ``R`` and its final answer (``checkers.py``).
2. The draft predicts its greedy token at every position of ``R``, teacher-forced along ``R``. A position
   where it differs from ``R``'s token is a mismatch.
3. At the next mismatch ``j`` (left to right), the draft's token is swapped in and the target finishes
   the response greedily from ``R[:j] + [draft token]``. If the final answer changes, the mismatch is
   *important* (label 0: the judge must reject that token there) and ``R`` stays. If it does not, the
   mismatch is *unimportant* (label 1): the swapped response becomes ``R`` and the draft's predictions
   after ``j`` are made again along it.
4. The search goes on after ``j`` until no mismatch is left or the prompt's budget is spent
   (``judge.mine_max_mismatches`` tried, ``judge.mine_max_tokens`` generated in continuations): a budget hit. The
   budget is checked before each try, so the last try may take a prompt past ``judge.mine_max_tokens`` by at
   most one continuation (one response length).

An answer cut off at the length limit gives no trustworthy final answer (its last number moves with
the cut) unless the checker is prefix-stable (ARC's first letter, ``checkers.stable``) and the cut
response gave the same answer a token earlier. A prompt whose own response has no trustworthy answer is
not searched (*unsearchable*), and a swap whose response has none is *undetermined* (no label; ``R`` stays).

Positions before ``j`` never change after step 3, so the final response carries every unimportant
mismatch at its position, and each important one is labelled after the final response's first ``j``
tokens. The prompts of a chunk search in lockstep: each step tries the next mismatch of every prompt
still searching in batched target continuations and makes the stale draft predictions in one batched
draft forward.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from specheads.datagen import checkers, vllm_mining
from specheads.datagen.mined_rows import counts, judge_rows, record
from specheads.datagen.mining_search import Budget, Mark, Search, _groups
from specheads.dataset import JudgeChunkFiles
from specheads.engines import engine_of
from specheads.errors import UserError
from specheads.heads.eagle_head import unrolled_kept, unrolled_step
from specheads.prompt_spec import budget_problems
from specheads.runtime.states import logits_at
from specheads.shim import AuxCapture, SamplingConfig, batch_generate

log = logging.getLogger(__name__)
COUNTS = (
    "prompts",
    "mismatches_tried",
    "important",
    "unimportant",
    "undetermined",
    "unsearchable",
    "budget_hits",
    "continuation_tokens",
)
VLLM_COUNTS = ("prompt_tokens", "cached_tokens")  # engine=vllm: its target calls' prompt tokens, those from its cache


def greedy_tokens(target, draft, eos: list[int], pad: int, remote=None, eagle=None):
    """The two model calls the search makes, on a loaded pair: ``generate(contexts, max_new)`` (the target's
    greedy responses, EOS kept) and ``predict(seqs, positions)`` (the draft's greedy token after each prefix
    ``seq[:t]``, teacher-forced, in one forward). When one model pads its vocabulary, both pick among the
    tokens the two share (as the decoding engine does), so a padding row never becomes a mismatch.
    ``remote`` (``engine=vllm``: :class:`.vllm_mining.TargetServer`) generates the target's tokens instead.
    ``eagle`` (an EAGLE head module on ``target``): ``predict`` is :func:`eagle_predict` and ``draft`` is unused."""
    greedy = SamplingConfig()
    vt = target.get_output_embeddings().weight.shape[0]
    vd = vt if eagle is not None else draft.get_output_embeddings().weight.shape[0]
    vocab = min(vt, vd)

    def generate(contexts: list[list[int]], max_new: int) -> list[list[int]]:
        if remote is not None:
            return remote.generate(contexts, max_new, vocab if vt != vd else None)
        return [
            list(r)
            for r in batch_generate(
                target, contexts, max_new, greedy, None, eos, pad, vocab_size=vocab if vt != vd else None
            )
        ]

    @torch.inference_mode()
    def predict(seqs: list[list[int]], positions: list[list[int]]) -> list[list[int]]:
        return [x[..., :vocab].argmax(-1).tolist() for x in logits_at(draft, seqs, positions, pad)]

    return generate, (eagle_predict(target, eagle, pad) if eagle is not None else predict)


def eagle_predict(target, head, pad: int):
    """``predict(seqs, positions)`` for an EAGLE head: its greedy token at each position ``p`` of ``seq`` given
    ``seq[:p]``, as its first draft step after a target pass over ``seq[:p]`` proposes it. One forward of the
    target's decoder per batch gives the states at the head's layers (on the head's device), and one head
    forward fills its entries as the drafter's cache does (entry ``i``: the target's states at ``i`` and the
    token at ``i + 1``, causal), so entry ``p - 2`` scores position ``p``. A position below 2 has no entry; the
    target's own token is returned there (never a mismatch). The head's linears run as they are (no kernel
    timing: this is labelling, not a timed decode)."""
    embed = target.get_input_embeddings()
    device = embed.weight.device
    dtype = next(head.parameters()).dtype
    vocab = head.vocab_ids.to(device)  # sorted: the first best row is the first best token, as the drafter picks

    @torch.inference_mode()
    def predict(seqs: list[list[int]], positions: list[list[int]]) -> list[list[int]]:
        n_max = max(len(s) for s in seqs)
        if n_max < 3:
            return [[seq[p] for p in ps] for seq, ps in zip(seqs, positions)]
        ids = torch.tensor([s + [pad] * (n_max - len(s)) for s in seqs], device=device)
        mask = torch.tensor([[1] * len(s) + [0] * (n_max - len(s)) for s in seqs], device=device)
        # the head's layers alone, by hooks on the decoder body (no output layer): every layer's states and
        # full-vocabulary logits for the batch would be tens of GB at 405B; a split target's layers meet here
        capture = AuxCapture(target, list(head.layer_ids))
        try:
            getattr(target, "base_model", target)(input_ids=ids, attention_mask=mask, use_cache=False)
            states = capture.states
        finally:
            capture.remove()
        g = head.fuse(states[:, :-1].to(device, dtype))
        cos, sin = head.rope(torch.arange(n_max - 1, device=device))
        # one causal step through every layer; right padding: the real entries never see it
        a = unrolled_step(head, unrolled_kept(head), embed(ids[:, 1:]).to(dtype), g, cos, sin, None)
        out = []
        for b, (seq, ps) in enumerate(zip(seqs, positions)):
            rows = torch.tensor([max(p - 2, 0) for p in ps], device=device)
            best = vocab[head.logits(a[b, rows]).float().argmax(-1)].tolist()
            out.append([t if p >= 2 else seq[p] for p, t in zip(ps, best)])
        return out

    return predict


def mine(
    generate,
    predict,
    decode,
    prompts: list,
    prompt_ids: list[list[int]],
    checker,
    budget: Budget,
    eos: list[int],
    batch_size: int,
    limits: list[int] | None = None,
) -> list[Search]:
    """Runs the search on a list of prompts (see the module docstring); returns one :class:`Search` each.

    Args:
        generate, predict: the target's greedy continuations and the draft's greedy predictions
            (:func:`greedy_tokens`).
        decode: token ids -> text (the tokenizer's, special tokens skipped).
        prompts: the prompts (what ``checker`` reads besides the response).
        prompt_ids: each prompt's token ids as the models read it.
        checker: ``(prompt, text) -> answer`` (``checkers.resolve``).
        budget: the per-prompt limits.
        eos: the ids that end a response.
        batch_size: rows per target generation and draft forward.
        limits: each prompt's response length (default ``budget.max_new_tokens``).
    """
    limits = limits or [budget.max_new_tokens] * len(prompts)

    def answered(prompt, response: list[int], answer) -> bool:  # the response's answer can be trusted
        if answer is None or not response:
            return False
        if response[-1] in eos:
            return True
        return checkers.stable(checker, prompt) and checker(prompt, decode(response[:-1])) == answer

    searches: list[Search] = []
    for group in _groups(list(range(len(prompts))), batch_size):
        answers = generate([prompt_ids[i] for i in group], max(limits[i] for i in group))
        for i, r in zip(group, answers):
            s = Search(
                prompts[i], prompt_ids[i], r[: limits[i]], checker(prompts[i], decode(r[: limits[i]])), limits[i]
            )
            s.searchable = answered(s.prompt, s.response, s.answer)
            s.done = not s.searchable
            searches.append(s)
    while True:
        active = [s for s in searches if not s.done]
        for group in _groups([s for s in active if s.draft is None], batch_size):
            preds = predict(
                [s.prompt_ids + s.response for s in group],
                [list(range(len(s.prompt_ids), len(s.prompt_ids) + len(s.response))) for s in group],
            )
            for s, p in zip(group, preds):
                s.draft = p
        tries = []
        for s in active:
            j = s.next_mismatch()
            if j is None:
                s.done = True
            elif len(s.marks) >= budget.max_mismatches or s.generated >= budget.max_tokens:
                s.done = s.budget_hit = True
            else:
                tries.append((s, j))
        if not tries:
            return searches
        continuations = {}
        go_on = [(s, j) for s, j in tries if s.draft[j] not in eos and s.limit - j - 1 > 0]
        for group in _groups(go_on, batch_size):
            most = max(s.limit - j - 1 for s, j in group)
            outs = generate([s.prompt_ids + s.response[:j] + [s.draft[j]] for s, j in group], most)
            continuations.update({id(s): o[: s.limit - j - 1] for (s, j), o in zip(group, outs)})
        for s, j in tries:
            cont = continuations.get(id(s), [])
            swapped = s.response[:j] + [s.draft[j]] + cont
            after = checker(s.prompt, decode(swapped))
            important = after != s.answer if answered(s.prompt, swapped, after) else None
            s.marks.append(Mark(j, s.response[j], s.draft[j], important, after))
            s.generated += len(cont)
            if important is False:
                s.response, s.draft = swapped, None
            s.position = j + 1


def problems(cfg) -> list[str]:
    """One line per invalid ``judge.mining=swap`` setting."""
    out = []
    if cfg.judge.tuples:
        out.append("judge.mining=swap searches the loaded pair's answers to prompts; it cannot read judge.tuples=")
    for key in ("mine_max_mismatches", "mine_max_tokens"):
        if getattr(cfg.judge, key) < 1:
            out.append(f"judge.{key}={getattr(cfg.judge, key)} must be >= 1")
    out += budget_problems("judge.mine_max_new_tokens_by_source", cfg.judge.mine_max_new_tokens_by_source or {})
    if cfg.judge.mine_eagle:
        try:
            holds = engine_of(cfg).holds_target
        except UserError:
            holds = False  # an unknown engine is reported by the engine's own check
        if holds:
            out.append(
                "judge.mine_eagle reads the target's layers for the EAGLE head, which the vLLM shell does not hold: "
                "set engine=specheads"
            )
        if not Path(cfg.judge.mine_eagle).is_file():
            out.append(f"judge.mine_eagle={cfg.judge.mine_eagle}: no such file (an exported EAGLE head)")
    try:
        checkers.resolve(cfg.judge.checker)
    except UserError as exc:
        out.append(str(exc))
    return out


def chunk_rows(job, items: list, chunk: int) -> tuple[list[dict], list[str], dict[str, int], dict]:
    """A chunk's swap mining for ``labels=judge``: its judge rows, its ``mined.jsonl`` lines, the run-wide prompt
    index of each row's ``tuple_id`` and its counts (``items`` and :data:`COUNTS`)."""
    cfg, pair = job.cfg, job.pair
    tok = pair.tokenizer
    remote = vllm_mining.server_for(cfg)
    before = dict(remote.stats) if remote else {}
    head = job.eagle_head(cfg.judge.mine_eagle).module if cfg.judge.mine_eagle else None
    draft = None if head is not None else pair.draft.model
    generate, predict = greedy_tokens(pair.target.model, draft, job.eos, job.pad, remote, eagle=head)
    if cfg.judge.checker == "auto":
        loose = sorted({p.source for p in items} - {"gsm8k", "arc", "facts", "extract"})
        if loose:
            log.warning(
                "judge.checker=auto compares the whole normalised text for %s prompts: almost every swap changes "
                "it, so almost every mismatch counts as important; name a checker for them",
                loose,
            )
    by_source = dict(cfg.judge.mine_max_new_tokens_by_source or {})
    searches = mine(
        generate,
        predict,
        lambda ids: tok.decode(ids, skip_special_tokens=True),
        items,
        job.prompt_ids(items),
        checkers.resolve(cfg.judge.checker),
        Budget(cfg.max_new_tokens, cfg.judge.mine_max_mismatches, cfg.judge.mine_max_tokens),
        job.eos,
        cfg.batch_size,
        [min(cfg.max_new_tokens, by_source.get(p.source, cfg.max_new_tokens)) for p in items],
    )
    lo = job.first_index(chunk)
    rows, lines, index_of = [], [], {}
    for i, (p, s) in enumerate(zip(items, searches)):
        tid = f"{p.id}-m"
        index_of[tid] = lo + i
        rows += judge_rows(s, tid, cfg.judge.mine_label_matches)
        lines.append(json.dumps(record(s, p, lo + i, lambda t: tok.decode([t])), ensure_ascii=False))
    served = {f"vllm_{k}": remote.stats[k] - before[k] for k in VLLM_COUNTS} if remote else {}
    return rows, lines, index_of, {"items": len(items), **counts(searches), **served}


def summary(totals: dict, out) -> dict:
    """The manifest's ``mining`` block: the run's counts and mismatches tried per minute of labelling time
    (the chunks' ``seconds`` in ``metrics.jsonl``: the search and the feature pass; chunks rebuilt after a kill
    have none and are left out of the rate)."""
    seconds, tried = 0.0, 0
    path = Path(out) / "metrics.jsonl"
    per_chunk = {}
    for line in path.read_text(encoding="utf-8").splitlines() if path.is_file() else []:
        row = json.loads(line)
        if row.get("seconds") is not None:
            per_chunk[row["chunk"]] = row["seconds"]
    for chunk, sec in per_chunk.items():
        seconds += sec
        tried += JudgeChunkFiles(Path(out), chunk).counts().get("mismatches_tried", 0)
    block = {k: totals.get(k, 0) for k in COUNTS}
    if "vllm_prompt_tokens" in totals:  # engine=vllm: how much of the continuations' prefill the cache saved
        block |= {f"vllm_{k}": totals[f"vllm_{k}"] for k in VLLM_COUNTS}
    block["mismatches_per_minute"] = round(tried / (seconds / 60), 2) if seconds else None
    return block
