"""The draft/verify loop and the autoregressive baseline, with exact counting.

Cache invariant between rounds: both caches hold a prefix of the committed sequence ``S``
(prompt + emitted) and each model's next forward consumes the rest. The target holds
``S[:-1]`` after every round (``last = S[-1]`` is fed with the candidates); before the
first round it holds nothing, so the first verification pass is also the prefill. The
draft holds ``S[:d]`` for some ``d <= len(S) - 1`` and consumes ``S[d:]`` (the whole prompt
first, then one token, or two after an all-accepted round: ``y_k`` and the bonus).
Rejected positions are trimmed from the caches, never recomputed.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

import torch

from .kv import make_runner
from .policies import Policy, Round, Verdict
from .sampling import SamplingConfig, probs_from_logits, sample


@dataclass
class GenerationStats:
    """Counts for one prompt (or summed over many). Rates are derived from the sums."""

    prompts: int = 1
    prompt_tokens: int = 0
    new_tokens: int = 0
    target_calls: int = 0
    draft_forwards: int = 0
    drafted: int = 0
    accepted: int = 0
    discarded: int = 0
    rounds: int = 0
    wall_time: float = 0.0
    eos: int = 0
    verifier_calls: int = 0  # learned-verifier evaluations (SPRINTER)
    undrafted_rounds: int = 0  # rounds whose policy chose not to draft (the cost-aware rules' gate)
    target_tokens: int = 0  # tokens after the prompt the target processed (the prompt's prefill is not counted)
    target_context: int = 0  # sum over those tokens of the context each attends to (itself included)
    draft_tokens: int = 0
    draft_context: int = 0
    # {k: target calls over k tokens}: k = the pass's tokens after the prompt's first P - 1 (so the
    # prefill round counts as its candidates + 1, like every other round); see costs.py
    target_pass_sizes: dict[int, int] = field(default_factory=dict)

    def __post_init__(self):
        self.target_pass_sizes = {int(k): int(v) for k, v in self.target_pass_sizes.items()}  # JSON keys are str

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.wall_time if self.wall_time > 0 else 0.0

    @property
    def accepted_per_call(self) -> float:
        """Accepted draft tokens per target call."""
        return self.accepted / self.target_calls if self.target_calls else 0.0

    @property
    def tokens_per_call(self) -> float:
        """Emitted tokens per target call (accepted + 1 per round, less truncation)."""
        return self.new_tokens / self.target_calls if self.target_calls else 0.0

    @property
    def verification_rate(self) -> float:
        """Target calls per emitted token (N_target / N)."""
        return self.target_calls / self.new_tokens if self.new_tokens else 0.0

    @property
    def discard_rate(self) -> float:
        """Drafted tokens not in the output per emitted token (N_discard / N)."""
        return self.discarded / self.new_tokens if self.new_tokens else 0.0

    def to_dict(self) -> dict:
        out = asdict(self)
        for k in ("tokens_per_s", "accepted_per_call", "tokens_per_call", "verification_rate", "discard_rate"):
            out[k] = getattr(self, k)
        return out

    @staticmethod
    def total(stats: list["GenerationStats"]) -> "GenerationStats":
        """Sums counts and times over prompts; the rates of the result are ratios of sums."""
        out = GenerationStats(prompts=0)
        for s in stats:
            for k in COUNTS:
                setattr(out, k, getattr(out, k) + getattr(s, k))
            for k, v in s.target_pass_sizes.items():
                out.target_pass_sizes[k] = out.target_pass_sizes.get(k, 0) + v
        return out


COUNTS = ("prompts", "prompt_tokens", "new_tokens", "target_calls", "draft_forwards", "drafted", "accepted",
          "discarded", "rounds", "wall_time", "eos", "verifier_calls", "undrafted_rounds", "target_tokens", "target_context",
          "draft_tokens", "draft_context")


def _count(stats: GenerationStats, who: str, start: int, n: int) -> None:
    """Adds the tokens fed at positions ``start .. start + n - 1`` that lie after the prompt to ``who``'s
    token and context counts (the prompt's prefill costs every method the same and is left out)."""
    skip = max(0, min(n, stats.prompt_tokens - start))
    start, n = start + skip, n - skip
    setattr(stats, f"{who}_tokens", getattr(stats, f"{who}_tokens") + n)
    setattr(stats, f"{who}_context", getattr(stats, f"{who}_context") + n * start + n * (n + 1) // 2)


@dataclass
class Generation:
    """Output of one prompt: the new token ids and their stats."""

    tokens: list[int]
    stats: GenerationStats


def _pick(logits: torch.Tensor, sampling: SamplingConfig, generator) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Next token (0-dim) from logits ``[V]`` and, when sampling, the warped distribution."""
    if not sampling.do_sample:
        return logits.argmax(-1), None
    q = probs_from_logits(logits, sampling)
    return sample(q, generator), q


class Engine:
    """Speculative decoding over a target and a draft that share a vocabulary.

    Args:
        target, draft: Hugging Face causal LMs in eval mode.
        eos_token_ids: generation stops after any of these.
        vocab_size: common vocabulary size when one model pads its logits.
        fused: run Llama-family models on the fused forward (:mod:`specheads.export.shim.fused`);
            False uses each model's own forward. Outputs are the same either way.
    """

    def __init__(self, target, draft=None, eos_token_ids=(), vocab_size: int | None = None, fused: bool = True):
        self.target, self.draft = target, draft
        self.fused = fused
        self.eos = set(int(i) for i in eos_token_ids)
        if vocab_size is None and draft is not None:
            vt, vd = target.get_output_embeddings().weight.shape[0], draft.get_output_embeddings().weight.shape[0]
            vocab_size = min(vt, vd) if vt != vd else None
        self.vocab_size = vocab_size

    @torch.inference_mode()
    def generate(self, prompt_ids: list[int], policy: Policy, max_new_tokens: int,
                 sampling: SamplingConfig | None = None, generator: torch.Generator | None = None,
                 on_tokens=None, draft_generator: torch.Generator | None = None) -> Generation:
        """Speculative decoding of one prompt under ``policy``.

        Args:
            prompt_ids: token ids of the formatted prompt (at least one).
            policy: decides when to stop drafting and what to accept.
            max_new_tokens: hard cap on emitted tokens.
            sampling: greedy when None or ``do_sample=False``.
            generator: RNG for all draws (seed it for reproducible runs).
            on_tokens: optional callback receiving each round's emitted ids (streaming).
            draft_generator: RNG for the draft's draws when the draft sits on another device
                (defaults to ``generator``).
        """
        if self.draft is None:
            raise ValueError("speculative decoding needs a draft model")
        sampling = sampling or SamplingConfig()
        start = time.perf_counter()
        stats = GenerationStats(prompt_tokens=len(prompt_ids))
        # A round drafts at most min(max_candidates, round_room(remaining)) <= remaining candidates, so
        # the caches never need much beyond prompt + new tokens; an uncapped policy (SPRINTER with
        # max_run=None: max_candidates 2**30) must not size them. The runners grow if ever exceeded.
        extra = max(0, min(policy.max_candidates(), policy.round_room(max_new_tokens), max_new_tokens))
        cap = len(prompt_ids) + max_new_tokens + extra + 2
        target = make_runner(self.target, policy.target_hidden, self.vocab_size, cap, self.fused)
        draft = make_runner(self.draft, policy.draft_hidden, self.vocab_size, cap, self.fused)
        policy.reset()
        verifier_calls = getattr(policy, "verifier_calls", 0)
        seq = list(prompt_ids)
        t_dev, d_dev = target.device, draft.device
        d_gen = draft_generator or generator
        out: list[int] = []
        try:
            while len(out) < max_new_tokens:
                remaining = max_new_tokens - len(out)
                room = policy.round_room(remaining)
                rnd = Round(sampling, generator, limit=min(policy.max_candidates(), room), position=len(seq),
                            eos=frozenset(self.eos))
                drafting = rnd.limit > 0 and policy.draft_round()
                if rnd.limit > 0 and not drafting:
                    stats.undrafted_rounds += 1
                if drafting:
                    pending = torch.tensor([seq[draft.length:]], device=d_dev)
                    while True:
                        _count(stats, "draft", draft.length, pending.shape[1])
                        logits, hid = draft.forward(pending, n_logits=1)
                        tok, q = _pick(logits[0], sampling, d_gen)
                        rnd.tokens.append(tok)
                        rnd.draft_logits.append(logits[0])
                        if q is not None:
                            rnd.q.append(q)
                        if hid is not None:
                            rnd.draft_hidden.append(hid[-1])
                        if rnd.n >= rnd.limit:
                            if policy.may_skip_target:  # it may still keep the last candidate without a target call
                                policy.stop_drafting(rnd)
                            break
                        if policy.stop_drafting(rnd):
                            break
                        pending = tok.view(1, 1)
                n = rnd.n
                cand = rnd.candidates(t_dev)
                if n and not policy.needs_target(rnd):
                    verdict = Verdict(n, None)
                else:
                    # The first round's target pass is also the prompt's prefill.
                    t_in = torch.cat([torch.tensor(seq[target.length:], device=t_dev), cand]).view(1, -1)
                    _count(stats, "target", target.length, t_in.shape[1])
                    size = t_in.shape[1] - max(0, stats.prompt_tokens - 1 - target.length)  # candidates + 1
                    stats.target_pass_sizes[size] = stats.target_pass_sizes.get(size, 0) + 1
                    logits, hid = target.forward(t_in, n_logits=n + 1)
                    stats.target_calls += 1
                    if hid is not None:
                        hid = hid[-(n + 1):]  # aligned with logits: states at last, y_1..y_n
                    verdict = policy.verify(rnd, logits, hid)
                m = verdict.accepted
                new = (cand[:m].tolist() if m else []) + ([verdict.token] if verdict.token is not None else [])
                for i, t in enumerate(new):  # stop after the first EOS
                    if t in self.eos:
                        new = new[: i + 1]
                        stats.eos = 1
                        break
                new = new[:remaining]
                kept_drafts = min(m, len(new))
                stats.rounds += 1
                stats.drafted += n
                stats.accepted += kept_drafts
                stats.discarded += n - kept_drafts
                policy.end_round(n, m)
                seq.extend(new)
                out.extend(new)
                if on_tokens is not None:
                    on_tokens(new)
                if stats.eos:
                    break
                target.trim(len(seq) - 1)
                draft.trim(min(draft.length, len(seq) - 1))
        finally:
            target.close()
            draft.close()
        stats.new_tokens = len(out)
        stats.draft_forwards = draft.forwards
        stats.verifier_calls = getattr(policy, "verifier_calls", 0) - verifier_calls
        stats.wall_time = time.perf_counter() - start
        return Generation(out, stats)

    @torch.inference_mode()
    def generate_ar(self, prompt_ids: list[int], max_new_tokens: int, sampling: SamplingConfig | None = None,
                    generator: torch.Generator | None = None, use_draft: bool = False, on_tokens=None) -> Generation:
        """Plain autoregressive decoding with the target (or, ``use_draft``, the draft).

        Each emitted token costs one forward (the prefill produces the first), counted as
        target calls (draft forwards with ``use_draft``).
        """
        sampling = sampling or SamplingConfig()
        model = self.draft if use_draft else self.target
        start = time.perf_counter()
        stats = GenerationStats(prompt_tokens=len(prompt_ids))
        runner = make_runner(model, None, self.vocab_size, len(prompt_ids) + max_new_tokens + 1, self.fused)
        ids = torch.tensor([prompt_ids], device=runner.device)
        out: list[int] = []
        who = "draft" if use_draft else "target"
        while len(out) < max_new_tokens:
            _count(stats, who, runner.length, ids.shape[1])
            logits, _ = runner.forward(ids, n_logits=1)
            tok, _ = _pick(logits[0], sampling, generator)
            t = int(tok)
            out.append(t)
            if on_tokens is not None:
                on_tokens([t])
            if t in self.eos:
                stats.eos = 1
                break
            ids = tok.view(1, 1)
        stats.new_tokens = len(out)
        if use_draft:
            stats.draft_forwards = runner.forwards
        else:
            stats.target_calls = runner.forwards
            stats.target_pass_sizes = {1: runner.forwards}  # the prefill counts as a 1-token step
        stats.rounds = runner.forwards
        stats.wall_time = time.perf_counter() - start
        return Generation(out, stats)
