"""Speculative decoding across different vocabularies (docs/algorithms/hetero.md): TLI, SLEM and SLRS.

Both methods are lossless and return the TARGET's token ids; the draft works in its own vocabulary.

The methods are policies (:mod:`.policies.hetero`: what each verifies with) run by the one engine
(:mod:`.engine`); this module is their drafting side, the :class:`Bridge` between the vocabularies.

* TLI (token-level intersection): draft and target ids are matched by token string
  (:class:`~.token_text.VocabMap`). The draft's warped distribution ``q`` is restricted to the intersection and
  renormalised to ``q'``; candidates are mapped to target ids and verified with the standard rule
  (section 0) with ``q'`` in the ratio and in the residual. Greedy: the draft's argmax over the
  intersection, kept while it equals the target's argmax.
* SLEM (string-level exact match): the draft drafts freely; its text is re-tokenised with the target
  tokenizer and the target keeps the candidates while they equal its own greedy (or sampled) tokens.
* SLRS (string-level rejection sampling): each step drafts until the first target token of the drafted
  string is determined and proposes it with ``psi``, the exact probability of proposing it; the standard rule
  with ``psi`` verifies (:mod:`.slrs`, :mod:`.slrs_draft`). The draft side commits as SLEM's does.

Text. A token's text is its bytes: byte-level BPE pieces mapped back through the byte alphabet
(``Ġ`` becomes a space), SentencePiece pieces with ``▁`` as a space and ``<0xNN>`` as that byte,
added tokens as their content; special tokens have no text and never match. Each model's committed
ids spell its text (the concatenation of their bytes); ``tokenizer.decode`` is not used because it
drops SentencePiece's leading space, skips special tokens and turns a partial UTF-8 character into
U+FFFD.

Tokenizers that do not round-trip text. ``decode(encode(s)) != s`` (lower-casing, Unicode or space
normalisers, SentencePiece's dummy-prefix space) and ``encode(decode(ids)) != ids`` (a word split
differently) are handled as follows:

1. Committed target ids are never re-tokenised. SLEM's candidates are the tail of
   ``encode(window + draft text)``, where the window is the text of the last ``lookbehind`` committed
   target tokens starting at a word start (a token whose text begins with a space); the tail is used
   only when the encoding reproduces the window's committed ids exactly. Later starts are tried in
   turn, down to the empty window (the draft text alone, which cannot disturb committed ids); with
   nothing encodable (an incomplete character) the round has no candidates (a plain target step).
2. Among those, a tail that spells the draft text exactly is preferred; when the tokenizer rewrites
   the text, the rewritten tail is used as it is. Exact-match verification keeps any candidate
   safe: the output is the target's own tokens, only acceptance can suffer.
3. The draft side keeps its own accepted proposals while their text is a prefix of the committed
   text and re-tokenises the rest with the same look-behind (its window tokens may change; its KV
   cache is trimmed to the longest common prefix of what it holds and its new ids). A draft
   tokenizer that rewrites text leaves the draft conditioned on its rewritten version: this only
   changes proposals, never the output.
4. Text handed to a tokenizer is cut at the last complete UTF-8 character; the rest of the bytes
   waits for the next round.

Counting (:class:`~.stats.GenerationStats`): ``drafted``/``accepted``/``discarded`` are in target tokens
(the candidates verified), ``draft_forwards`` counts the draft's forwards, ``target_calls`` the target's.
"""

from __future__ import annotations

import torch

from specheads.errors import UserError
from specheads.shim.core.sampling import SamplingConfig, probs_from_logits, sample
from specheads.shim.core.stats import GenerationStats, count_tokens
from specheads.shim.loop.engine import Engine, Result
from specheads.shim.policies import POLICIES, Policy, Round
from specheads.shim.policies.hetero_policies import HeteroSettings
from specheads.shim.runners.model_runner import make_runner
from specheads.shim.vocab.slrs_draft import slrs_round
from specheads.shim.vocab.token_text import Side, VocabMap, common_prefix, spell

METHODS = tuple(name for name, policy in POLICIES.items() if policy.bridge)  # tli, slem, slrs


class Bridge:
    """The vocabularies of a target and a draft whose tokenizers differ, matched once: each draft id's
    target id (and back), and the draft ids each method may draft (TLI: those in the intersection;
    SLEM: those with text). The engine asks it for each prompt's drafter.

    Args:
        target, draft: Hugging Face causal LMs in eval mode.
        target_tokenizer, draft_tokenizer: their (fast) tokenizers.
        vocab_map: a prebuilt :class:`VocabMap` (built from the tokenizers when None).
    """

    def __init__(self, target, draft, target_tokenizer, draft_tokenizer, vocab_map: VocabMap | None = None):
        self.draft, self.target_tokenizer, self.draft_tokenizer = draft, target_tokenizer, draft_tokenizer
        self.vmap = vocab_map or VocabMap.build(draft_tokenizer, target_tokenizer)
        vt, vd = (m.get_output_embeddings().weight.shape[0] for m in (target, draft))
        self.vt = vt
        self.d2t = (self.vmap.draft_to_target + [-1] * vd)[:vd]
        self.t2d = (self.vmap.target_to_draft + [-1] * vt)[:vt]
        dev = draft.get_input_embeddings().weight.device
        d2t = torch.tensor(self.d2t, device=dev)
        self.d_idx = (d2t >= 0).nonzero().view(-1)  # draft ids in the intersection
        self.t_idx = d2t[self.d_idx]  # their target ids
        has_text = [i < len(self.vmap.draft_text) and self.vmap.draft_text[i] is not None for i in range(vd)]
        self.masks = {"tli": d2t >= 0, "slem": torch.tensor(has_text, device=dev)}
        self.masks["slrs"] = self.masks["slem"]
        self.slrs: dict[int, object] = {}  # SLRS processes by lookahead (.slrs.bridge_process)
        self.n_max: int | None = None

    def draft_ids(self, target_ids: list[int]) -> list[int]:
        """The draft's ids of a prompt given as target ids: its text re-encoded."""
        return self.draft_tokenizer(self.target_tokenizer.decode(target_ids, skip_special_tokens=True))["input_ids"]

    def drafter(
        self,
        policy: Policy,
        prompt_ids: list[int],
        draft_prompt_ids: list[int] | None,
        cap: int,
        stats: GenerationStats,
        generator,
        fused: bool,
    ) -> "_Crossing":
        """One prompt's drafter for ``policy`` (its ``bridge``: tli or slem)."""
        if policy.bridge == "tli" and not self.vmap.shared:
            raise UserError(
                ("draft and target vocabularies share no token string; TLI needs an overlap, use method=slem")
            )
        d_ids = list(draft_prompt_ids) if draft_prompt_ids is not None else self.draft_ids(prompt_ids)
        if not d_ids:
            raise UserError("the prompt is empty in the draft's vocabulary; give a non-empty prompt")
        runner = make_runner(self.draft, None, None, cap + len(d_ids), fused)
        return _Crossing(self, policy, runner, list(prompt_ids), d_ids, stats, generator)


class _Crossing:
    """One prompt's drafting across the vocabularies: the draft's committed ids kept in step with the
    target's text; TLI maps the draft's tokens by string, SLEM re-tokenises the draft's text."""

    def __init__(
        self,
        bridge: Bridge,
        policy: Policy,
        runner,
        t_ids: list[int],
        d_ids: list[int],
        stats: GenerationStats,
        generator,
    ):
        self.bridge, self.mode, self.runner, self.stats, self.generator = (
            bridge,
            policy.bridge,
            runner,
            stats,
            generator,
        )
        self.policy = policy
        self.mask = bridge.masks[self.mode]
        self.tgt = Side(bridge.target_tokenizer, bridge.vmap.target_text, t_ids, policy.lookbehind)
        self.drf = Side(bridge.draft_tokenizer, bridge.vmap.draft_text, d_ids, policy.lookbehind)
        self.prompt_tokens = len(d_ids)
        self.held: list[int] = []  # ids in the draft's cache
        self.drafted: list[int] = []  # the round's draft ids

    @property
    def forwards(self) -> int:
        return self.runner.forwards

    def close(self) -> None:
        self.runner.close()

    def draft(self, rnd: Round, seq: list[int], room: int) -> None:
        """Drafts ``rnd.limit`` draft tokens; the round's candidates are their target ids (TLI) or the
        target's tokens of their text, at most ``room`` (SLEM)."""
        if self.mode == "slrs":
            slrs_round(self, rnd)
            return
        keep = min(common_prefix(self.held, self.drf.ids), len(self.drf.ids) - 1)  # the draft consumes >= 1 token
        self.runner.trim(keep)
        del self.held[keep:]
        self._draft(rnd)
        if self.mode == "tli":
            cand = [self.bridge.d2t[d] for d in self.drafted]
        else:
            cand = self.tgt.continuation(self.drf.spell(self.drafted))[:room] if self.drafted else []
        rnd.tokens.extend(torch.tensor(c) for c in cand)

    def _draft(self, rnd: Round) -> None:
        """Draft ids from tokens with text (TLI: in the intersection) and, for TLI sampling, each one's
        ``q'`` pushed onto the target vocabulary ``[V_target]`` (``rnd.q``)."""
        b, runner = self.bridge, self.runner
        self.drafted = []
        pending = self.drf.ids[len(self.held) :]
        for _ in range(rnd.limit):
            count_tokens(self.stats, "draft", runner.length, len(pending), self.prompt_tokens)
            logits, _ = runner.forward(torch.tensor([pending], device=runner.device), n_logits=1)
            self.held.extend(pending)
            if not rnd.sampling.do_sample:
                d = int(logits[0].masked_fill(~self.mask, float("-inf")).argmax())
            else:
                q = probs_from_logits(logits[0], rnd.sampling) * self.mask
                mass = q.sum()
                if not mass > 0:  # the warped draft puts nothing on usable tokens: verify what we have
                    break
                q = q / mass
                d = int(sample(q, self.generator))
                if self.mode == "tli":
                    rnd.q.append(q.new_zeros(b.vt).index_add_(0, b.t_idx, q[b.d_idx]))
            self.drafted.append(d)
            pending = [d]

    def commit(self, seq: list[int], new: list[int], kept: int) -> None:
        """Brings the draft's ids up to the committed text after a round: its own accepted proposals
        (TLI: and the target's token when it is in the intersection) as they are, the rest re-tokenised."""
        self.tgt.append(new)
        drf, drafted = self.drf, self.drafted
        text = spell(self.bridge.vmap.target_text, new)
        ids: list[int] = []
        if drf.pending:  # bytes of an unfinished character wait: re-tokenise everything with them
            pass
        elif self.mode == "tli":
            last = self.bridge.t2d[new[-1]] if len(new) > kept else -1
            ids = drafted[:kept] + ([last] if last >= 0 else [])
        else:
            for d in drafted:
                if not text.startswith(drf.spell(ids + [d])):
                    break
                ids.append(d)
        drf.append(ids)
        done = len(drf.spell(ids))
        if done < len(text):
            drf.extend(text[done:])
        self.drafted = []


class HeteroEngine:
    """TLI and SLEM with prompts given as text or as target ids: the engine with a :class:`Bridge`, and
    target-alone decoding of the same prompts as the baseline.

    Args:
        target, draft: Hugging Face causal LMs in eval mode.
        target_tokenizer, draft_tokenizer: their (fast) tokenizers.
        eos_token_ids: target ids after which generation stops.
        lookbehind: committed tokens a re-tokenisation window may cover.
        vocab_map: a prebuilt :class:`VocabMap` (built from the tokenizers when None).
        fused: run Llama-family models on the fused forward (same outputs, faster).
    """

    def __init__(
        self,
        target,
        draft,
        target_tokenizer,
        draft_tokenizer,
        eos_token_ids=(),
        lookbehind: int = 8,
        vocab_map: VocabMap | None = None,
        fused: bool = True,
    ):
        HeteroSettings(lookbehind=lookbehind).check()
        self.lookbehind = lookbehind
        self.bridge = Bridge(target, draft, target_tokenizer, draft_tokenizer, vocab_map)
        self.engine = Engine(target, draft, eos_token_ids, fused=fused, bridge=self.bridge)
        self.target_tokenizer, self.draft_tokenizer, self.vmap = target_tokenizer, draft_tokenizer, self.bridge.vmap

    def prompt_ids(
        self, prompt: str | list[int], draft_prompt_ids: list[int] | None = None
    ) -> tuple[list[int], list[int]]:
        """(target ids, draft ids) of a prompt given as text (each tokenizer encodes it) or as target ids
        (the draft gets ``draft_prompt_ids`` or the re-encoded text)."""
        t_ids = self.target_tokenizer(prompt)["input_ids"] if isinstance(prompt, str) else [int(i) for i in prompt]
        if draft_prompt_ids is None:
            draft_prompt_ids = (
                self.draft_tokenizer(prompt)["input_ids"] if isinstance(prompt, str) else self.bridge.draft_ids(t_ids)
            )
        if not t_ids or not draft_prompt_ids:
            raise UserError(f"prompt {str(prompt)[:40]!r} is empty after tokenisation; give a non-empty prompt")
        return t_ids, list(draft_prompt_ids)

    def generate(
        self,
        prompt: str | list[int],
        method: str = "tli",
        k: int = 4,
        max_new_tokens: int = 64,
        sampling: SamplingConfig | None = None,
        generator: torch.Generator | None = None,
        draft_prompt_ids: list[int] | None = None,
    ) -> Result:
        """Speculative decoding of one prompt with ``method`` (``tli`` or ``slem``: ``k`` draft tokens per
        round; ``slrs``: at most ``k`` target tokens per round, default lookahead and budget); the output is
        target ids. ``draft_prompt_ids``: the draft's prompt when ``prompt`` is target ids."""
        if method not in METHODS:
            raise UserError(f"method={method!r}: expected one of {list(METHODS)}")
        if max_new_tokens < 1:
            raise UserError(f"max_new_tokens={max_new_tokens} must be >= 1")
        policy = POLICIES[method](k, self.lookbehind)
        t_ids, d_ids = self.prompt_ids(prompt, draft_prompt_ids)
        return self.engine.generate(t_ids, policy, max_new_tokens, sampling, generator, draft_prompt_ids=d_ids)

    def generate_ar(
        self,
        prompt: str | list[int],
        max_new_tokens: int,
        sampling: SamplingConfig | None = None,
        generator: torch.Generator | None = None,
    ) -> Result:
        """Target-only autoregressive decoding of the same prompt (the baseline)."""
        t_ids = self.target_tokenizer(prompt)["input_ids"] if isinstance(prompt, str) else list(prompt)
        if not t_ids:
            raise UserError(f"prompt {str(prompt)[:40]!r} is empty after tokenisation; give a non-empty prompt")
        return self.engine.generate_ar(t_ids, max_new_tokens, sampling, generator)
