"""The one decoding loop, with exact counting: every method is a policy run here.

A round: the policy may draft candidates (through a drafter: the draft model on the target's
vocabulary, an EAGLE head on the target's own states (:mod:`.eagle`), or :class:`~.hetero_loop.Bridge`'s
across vocabularies), the verifying model makes one pass
over the uncached committed tokens and the candidates, the policy gives its verdict, and the round is
committed: the accepted candidates and the verdict's token, cut after the first EOS and at the length
limit. The target alone (``ar``) is a policy without candidates; the draft alone (``draft``) one whose
verifying model is the draft.

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

import torch

from specheads.shim.core.sampling import SamplingConfig
from specheads.shim.core.stats import GenerationStats, count_tokens
from specheads.shim.loop.drafting import take_candidate
from specheads.shim.loop.eagle_drafter import EagleDrafter, check_head
from specheads.shim.loop.rounds import Result, commit_round, emit
from specheads.shim.loop.tree_loop import generate_tree
from specheads.shim.policies import DraftOnly, Policy, Round, TargetOnly, Verdict
from specheads.shim.runners.model_runner import make_runner


class _SameVocabulary:
    """Drafts with the draft model on the target's vocabulary: one forward per candidate, until the
    policy stops (or the round's limit)."""

    def __init__(self, runner, policy: Policy, stats: GenerationStats, generator):
        self.runner, self.policy, self.stats, self.generator = runner, policy, stats, generator

    @property
    def forwards(self) -> int:
        return self.runner.forwards

    def draft(self, rnd: Round, seq: list[int], room: int) -> None:
        runner, policy = self.runner, self.policy
        pending = torch.tensor([seq[runner.length :]], device=runner.device)
        while True:
            count_tokens(self.stats, "draft", runner.length, pending.shape[1])
            logits, hid = runner.forward(pending, n_logits=1)
            if not take_candidate(rnd, policy, logits[0], hid[-1] if hid is not None else None, self.generator):
                break
            pending = rnd.tokens[-1].view(1, 1)

    def commit(self, seq: list[int], new: list[int], kept: int) -> None:
        self.runner.trim(min(self.runner.length, len(seq) - 1))

    def close(self) -> None:
        self.runner.close()


class Engine:
    """Decoding with a target and a draft: the one loop every policy runs in.

    Args:
        target, draft: Hugging Face causal LMs in eval mode (no draft: the target alone only).
        eos_token_ids: generation stops after any of these.
        vocab_size: common vocabulary size when one model pads its logits.
        fused: run Llama-family models on the fused forward (:mod:`specheads.shim.runners.fused`);
            False uses each model's own forward. Outputs are the same either way.
        bridge: a :class:`~.hetero_loop.Bridge` between the two vocabularies, for the policies that draft
            across them (TLI, SLEM).
        eagle: an EAGLE head (:class:`specheads.heads.EagleHead`): same-vocabulary policies draft with it,
            from the target's own states (:mod:`.eagle`), instead of with ``draft``.
    """

    def __init__(
        self,
        target,
        draft=None,
        eos_token_ids=(),
        vocab_size: int | None = None,
        fused: bool = True,
        bridge=None,
        eagle=None,
    ):
        self.target, self.draft, self.fused, self.bridge, self.eagle = target, draft, fused, bridge, eagle
        if eagle is not None:
            check_head(eagle, target)
        self.eos = frozenset(int(i) for i in eos_token_ids)
        if vocab_size is None and draft is not None and bridge is None and eagle is None:
            vt, vd = target.get_output_embeddings().weight.shape[0], draft.get_output_embeddings().weight.shape[0]
            vocab_size = min(vt, vd) if vt != vd else None
        self.vocab_size = vocab_size

    @torch.inference_mode()
    def generate(
        self,
        prompt_ids: list[int],
        policy: Policy,
        max_new_tokens: int,
        sampling: SamplingConfig | None = None,
        generator: torch.Generator | None = None,
        on_tokens=None,
        draft_generator: torch.Generator | None = None,
        draft_prompt_ids: list[int] | None = None,
    ) -> Result:
        """Decodes one prompt under ``policy``.

        Args:
            prompt_ids: token ids of the formatted prompt (at least one).
            policy: decides what to draft, when to stop and what to accept.
            max_new_tokens: hard cap on emitted tokens.
            sampling: greedy when None or ``do_sample=False``.
            generator: RNG for all draws (seed it for reproducible runs).
            on_tokens: optional callback receiving each round's emitted ids (streaming).
            draft_generator: RNG for the draft's draws when the draft sits on another device
                (defaults to ``generator``).
            draft_prompt_ids: the prompt in the draft's vocabulary (policies across vocabularies;
                default: the prompt's text re-encoded).
        """
        sampling = sampling or SamplingConfig()
        if getattr(policy, "tree", False):  # a draft tree, not a chain: its own loop
            return generate_tree(self, prompt_ids, policy, max_new_tokens, sampling, on_tokens)
        start = time.perf_counter()
        stats = GenerationStats(prompt_tokens=len(prompt_ids))
        d_gen = draft_generator or generator
        who = policy.emitter
        # A round drafts at most min(max_candidates, round_room(remaining)) <= remaining candidates, so
        # the caches never need much beyond prompt + new tokens; an uncapped policy (SPRINTER with
        # max_run=None: max_candidates 2**30) must not size them. The runners grow if ever exceeded.
        extra = max(0, min(policy.max_candidates(), policy.round_room(max_new_tokens), max_new_tokens))
        cap = len(prompt_ids) + max_new_tokens + extra + 2
        eagle = self.eagle is not None and policy.bridge is None and who == "target"
        verifier = make_runner(
            self.draft if who == "draft" else self.target,
            policy.target_hidden,
            self.vocab_size,
            cap,
            self.fused,
            aux=self.eagle.layer_ids if eagle else None,
        )
        try:
            drafter = (
                self._drafter(policy, prompt_ids, draft_prompt_ids, cap, stats, d_gen, verifier) if extra else None
            )
        except BaseException:
            verifier.close()
            raise
        policy.reset()
        seq = list(prompt_ids)
        gen = d_gen if who == "draft" else generator
        out: list[int] = []
        try:
            while len(out) < max_new_tokens:
                remaining = max_new_tokens - len(out)
                room = policy.round_room(remaining)
                rnd = Round(sampling, gen, limit=min(policy.max_candidates(), room), position=len(seq), eos=self.eos)
                policy.start_round(rnd)
                if rnd.limit > 0:
                    if policy.draft_round():
                        assert drafter is not None  # a policy that drafts has a drafter
                        drafter.draft(rnd, seq, room)
                    else:
                        stats.undrafted_rounds += 1
                n = rnd.n
                cand = rnd.candidates(verifier.device)
                if n and not policy.needs_target(rnd):
                    verdict = Verdict(n, None)
                else:
                    verdict = policy.verify(rnd, *self._pass(verifier, who, seq, cand, stats))
                new = commit_round(stats, self.eos, cand, verdict, remaining)
                policy.end_round(n, verdict.accepted)
                emit(seq, out, new, on_tokens)
                if stats.eos:
                    break
                verifier.trim(len(seq) - 1)
                if drafter is not None:
                    drafter.commit(seq, new, min(verdict.accepted, len(new)))
        finally:
            verifier.close()
            if drafter is not None:
                drafter.close()
        stats.new_tokens = len(out)
        stats.draft_forwards = verifier.forwards if who == "draft" else drafter.forwards if drafter else 0
        stats.fold(policy.counters())
        stats.wall_time = time.perf_counter() - start
        return Result(out, stats, policy.trace())

    def generate_ar(
        self,
        prompt_ids: list[int],
        max_new_tokens: int,
        sampling: SamplingConfig | None = None,
        generator: torch.Generator | None = None,
        use_draft: bool = False,
        on_tokens=None,
    ) -> Result:
        """Plain autoregressive decoding with the target (or, ``use_draft``, the draft): one forward per
        token (the prefill produces the first), counted as target calls (draft forwards with ``use_draft``)."""
        return self.generate(
            prompt_ids, DraftOnly() if use_draft else TargetOnly(), max_new_tokens, sampling, generator, on_tokens
        )

    def _drafter(
        self, policy: Policy, prompt_ids, draft_prompt_ids, cap: int, stats: GenerationStats, generator, verifier
    ):
        if self.eagle is not None and policy.bridge is None:
            return EagleDrafter(self.eagle, self.target, verifier, policy, stats, generator, cap)
        if self.draft is None:
            raise ValueError("speculative decoding needs a draft model")
        if policy.bridge is None:
            runner = make_runner(self.draft, policy.draft_hidden, self.vocab_size, cap, self.fused)
            return _SameVocabulary(runner, policy, stats, generator)
        if self.bridge is None:
            raise ValueError(
                f"policy {policy.name} drafts in another vocabulary: give the engine a bridge "
                "(specheads.shim.vocab.hetero_loop.Bridge)"
            )
        return self.bridge.drafter(policy, prompt_ids, draft_prompt_ids, cap, stats, generator, self.fused)

    @staticmethod
    def _pass(runner, who: str, seq: list[int], cand: torch.Tensor, stats: GenerationStats):
        """The verifying model's one forward over the uncached committed tokens and the ``n`` candidates:
        logits ``[n+1, V]`` and, when captured, hidden states ``[n+1, d]`` at ``last, y_1..y_n``."""
        n = cand.shape[0]
        # The first round's pass is also the prompt's prefill.
        ids = torch.cat([torch.tensor(seq[runner.length :], device=runner.device), cand]).view(1, -1)
        count_tokens(stats, who, runner.length, ids.shape[1])
        if who == "target":
            size = ids.shape[1] - max(0, stats.prompt_tokens - 1 - runner.length)  # candidates + 1 (costs.py)
            stats.target_pass_sizes[size] = stats.target_pass_sizes.get(size, 0) + 1
            stats.target_calls += 1
        logits, hid = runner.forward(ids, n_logits=n + 1)
        return logits, (hid[-(n + 1) :] if hid is not None else None)
