"""The Python API of the decoding shim: load a pair, format prompts, build a policy, generate.

Building a policy (:func:`make_policy`, the one builder) and the pair's cost table (:func:`pair_costs`) live
in :mod:`.policy_factory` and are re-exported here."""

from __future__ import annotations

import hashlib
import logging
from dataclasses import fields

import torch

from specheads.decode.policy_factory import drafter_id, make_policy, pair_costs
from specheads.errors import UserError
from specheads.export.package import check_stop_drafter
from specheads.prompt_spec import open_user_turn
from specheads.shim import (
    BatchEngine,
    BatchJob,
    Bridge,
    Engine,
    Pair,
    Policy,
    Result,
    SamplingConfig,
    context_length,
    policy_class,
    supports,
    tree_problems,
    tree_target_problem,
)

log = logging.getLogger(__name__)
__all__ = ["Decoder", "Result", "fit_context", "format_prompt", "generate", "make_policy", "pair_costs"]


def format_prompt(tokenizer, prompt, chat_template: bool = True) -> list[int]:
    """Token ids for a prompt: a string, a list of chat messages, or an object with ``text``/``messages``.

    With ``chat_template`` and a tokenizer that has one, the prompt is rendered as a user turn (or the given
    messages) plus the generation prompt, an open last user turn (no content) up to its words; else raw text.
    """
    messages = getattr(prompt, "messages", None)
    text = getattr(prompt, "text", None)
    if messages is None and text is None:
        messages, text = (prompt, None) if isinstance(prompt, list) else (None, prompt)
    if messages and messages[-1] == {"role": "user", "content": None}:
        return open_user_turn(tokenizer, messages)
    if chat_template and getattr(tokenizer, "chat_template", None):
        messages = messages or [{"role": "user", "content": text}]
        rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return tokenizer(rendered, add_special_tokens=False)["input_ids"]
    if text is None:
        text = "\n".join(m["content"] for m in messages)
    return tokenizer(text)["input_ids"]


def fit_context(ids: list[int], max_new_tokens: int, limit: int | None) -> tuple[list[int], int]:
    """Keeps the last prompt tokens so that prompt + new tokens fit ``limit``; returns (ids, dropped)."""
    if limit is None or len(ids) + max_new_tokens <= limit:
        return ids, 0
    keep = limit - max_new_tokens
    if keep < 1:
        raise UserError(
            f"max_new_tokens={max_new_tokens} leaves no room for a prompt in the model's "
            f"context of {limit} tokens; lower max_new_tokens"
        )
    return ids[-keep:], len(ids) - keep


class Decoder:
    """Decodes prompts one at a time with a fixed policy, sampling settings and RNG stream.

    Args:
        pair: from ``load_pair``.
        policy: a policy name (``"sd"``, ``"ar"``: the target alone, ``"draft"``: the draft alone ...)
            or a ``Policy`` instance (``make_policy`` builds those that need a head).
        max_new_tokens: cap on new tokens per prompt.
        k: candidates per round for a policy built by name.
        sampling: greedy when None.
        seed: with the prompt's index, seeds its draws: the same seed gives the same outputs.
        chat_template: format prompts with the target's chat template when it has one.
        fused_forward: run Llama-family models on the fused forward (same outputs, faster);
            False keeps each model's own forward.
        eagle: an EAGLE head (an exported ``head_type=eagle`` file, or a :class:`LoadedHead` of one): the
            same-vocabulary policies draft with it from the target's own states; no draft model is needed.
        packed: in batches (``decode_many``), each forward's projections run on the rows' real tokens only
            (a row that drafted fewer candidates costs less); False pads every row to the widest.
    """

    def __init__(
        self,
        pair: Pair,
        policy: str | Policy = "sd",
        max_new_tokens: int = 128,
        k: int = 4,
        sampling: SamplingConfig | None = None,
        seed: int = 0,
        chat_template: bool = True,
        fused_forward: bool = True,
        eagle=None,
        packed: bool = True,
    ):
        self.packed = packed
        self.sampling = sampling or SamplingConfig()
        bad = run_problems(max_new_tokens) + self.sampling.problems()
        if bad:
            raise UserError("; ".join(bad))
        eagle = load_eagle(eagle, pair) if eagle is not None else None
        if isinstance(policy, str):
            own = {"k": k} if "k" in {f.name for f in fields(policy_class(policy).Settings)} else {}
            policy = make_policy(policy, pair, sampling=self.sampling, eagle=eagle, **own)
        drafter = eagle.metadata if eagle is not None else None
        if policy.head_feature is not None and policy.head_drafter != drafter_id(drafter):
            check_stop_drafter(policy.head_feature, drafter)  # a policy built for another drafter than this one
        bad = policy_problems(type(policy), eagle is not None, self.sampling, fused_forward, pair.draft is not None)
        if bad:
            raise UserError("; ".join(bad))
        self.pair, self.policy, self.max_new_tokens, self.chat_template = pair, policy, max_new_tokens, chat_template
        bridge = None
        if policy.bridge:  # the draft speaks another vocabulary
            bridge = Bridge(pair.target.model, pair.draft.model, pair.target.tokenizer, pair.draft.tokenizer)
        self.engine = Engine(
            pair.target.model,
            pair.draft.model if pair.draft else None,
            pair.eos_token_ids,
            fused=fused_forward,
            bridge=bridge,
            eagle=eagle.module if eagle is not None else None,
        )
        if getattr(type(policy), "tree", False) and (why := tree_target_problem(self.engine)):
            raise UserError(f"policy=tree runs on the fused forward: {pair.target.name}: {why}")  # before any row
        self.eagle = eagle
        limits = [context_length(m.model) for m in (pair.target, pair.draft) if m is not None]
        self.context = min((x for x in limits if x), default=None)
        self.seed = seed
        self.budgets: dict[str, int] = {}  # prompt source -> a smaller max_new_tokens (heads-eval)
        self.generator = torch.Generator(device=pair.target.device)
        # A draft on another device (a sharded target) draws from its own stream.
        self.draft_generator = None
        if pair.draft is not None and pair.draft.device != pair.target.device:
            self.draft_generator = torch.Generator(device=pair.draft.device)

    def _stream(self, index: int) -> int:
        """The seed of prompt ``index``'s draws: a hash of ``(seed, index)`` in 31 bits (a CPU generator keeps only
        a seed's low 32 bits, so packing the run's seed into the high ones would leave every seed the same
        stream; bit 31 stays free for the draft's own stream)."""
        digest = hashlib.blake2b(f"{self.seed}:{index}".encode(), digest_size=4).digest()
        return int.from_bytes(digest, "little") & 0x7FFFFFFF

    def _tokenizer(self):
        # The draft alone speaks its own tokenizer; every other policy emits the target's tokens.
        return self.pair.draft.tokenizer if self.policy.emitter == "draft" else self.pair.tokenizer

    def _budget(self, prompt) -> int:
        """New tokens at most for ``prompt``: ``max_new_tokens``, or its source's smaller budget."""
        own = self.budgets.get(getattr(prompt, "source", None) or "")
        return min(own, self.max_new_tokens) if own else self.max_new_tokens

    def _prompt_ids(self, prompt, name: str) -> tuple[list[int], int, list[int] | None]:
        """``(ids, dropped, draft_ids)``: the formatted prompt cut to the context, and in the draft's
        vocabulary for policies across vocabularies."""
        ids = format_prompt(self._tokenizer(), prompt, self.chat_template)
        if not ids:
            raise UserError(f"{name} is empty after tokenisation")
        budget = self._budget(prompt)
        ids, dropped = fit_context(ids, budget, self.context)
        if dropped:
            log.warning(
                "%s: %d prompt tokens + max_new_tokens=%d exceed the context of %d; kept the last %d tokens",
                name,
                len(ids) + dropped,
                budget,
                self.context,
                len(ids),
            )
        draft_ids = None
        if self.policy.bridge:  # each model reads the prompt in its own tokenizer and chat template
            draft_ids, _ = fit_context(
                format_prompt(self.pair.draft.tokenizer, prompt, self.chat_template), budget, self.context
            )
        return ids, dropped, draft_ids

    def decode(self, prompt, index: int = 0, on_tokens=None, name: str = "prompt") -> Result:
        """One completion; ``on_tokens(ids)`` receives emitted ids as they are committed.

        The RNG is seeded from ``(seed, index)``, so a prompt's output does not depend on which
        prompts ran before it (a resumed run equals an uninterrupted one).
        """
        stream = self._stream(index)
        self.generator.manual_seed(stream)
        if self.draft_generator is not None:
            self.draft_generator.manual_seed(stream | (1 << 31))
        ids, dropped, draft_ids = self._prompt_ids(prompt, name)
        g = self.engine.generate(
            ids,
            self.policy,
            self._budget(prompt),
            self.sampling,
            self.generator,
            on_tokens,
            self.draft_generator,
            draft_ids,
        )
        g.text, g.truncated_prompt_tokens = self._tokenizer().decode(g.tokens, skip_special_tokens=True), dropped
        return g

    def decode_many(self, prompts, batch_size: int = 1, names=None):
        """Completions of ``prompts`` (``(index, prompt)`` pairs), yielded as ``(index, Result)``.

        ``batch_size=1`` decodes them one at a time, in order. ``batch_size=B`` decodes ``B`` at a time
        (:class:`~.shim.batching.batch_loop.BatchEngine`: a finished prompt's row is taken by the next one),
        yielding each as it finishes; every prompt draws from the same ``(seed, index)`` stream as
        alone, so it makes the same decisions. Same-vocabulary policies on Llama-family models with
        the fused forward, draft and target on one device.
        """
        items = list(prompts)
        names = names or [f"prompt {i}" for i, _ in items]
        if batch_size == 1:
            for (index, prompt), name in zip(items, names):
                yield index, self.decode(prompt, index, name=name)
            return
        problem = self.batch_problem()
        if problem:
            raise UserError(f"batch_size={batch_size}: {problem}")
        jobs, dropped = [], []
        for (index, prompt), name in zip(items, names):
            ids, cut, _ = self._prompt_ids(prompt, name)
            gen = torch.Generator(device=self.pair.target.device).manual_seed(self._stream(index))
            jobs.append(BatchJob(ids, gen, max_new_tokens=self._budget(prompt)))
            dropped.append(cut)
        tok = self._tokenizer()
        for j, g in BatchEngine(self.engine, batch_size, packed=self.packed).generate(
            jobs, self.policy, self.max_new_tokens, self.sampling
        ):
            g.text, g.truncated_prompt_tokens = tok.decode(g.tokens, skip_special_tokens=True), dropped[j]
            yield items[j][0], g

    def batch_problem(self) -> str | None:
        """Why this decoder cannot decode in batches (None: it can); asked once, then remembered."""
        if not hasattr(self, "_batch_problem"):
            self._batch_problem = self._find_batch_problem()
        return self._batch_problem

    def _find_batch_problem(self) -> str | None:
        static = batch_rule(type(self.policy))
        if static:
            return static
        if self.draft_generator is not None:
            return "batched decoding needs the draft and the target on one device"
        models = [self.pair.target] + ([self.pair.draft] if self.pair.draft is not None else [])
        for m in models:
            why = supports(m.model)
            if why is not None or not self.engine.fused:
                return (
                    f"batched decoding runs on the fused forward (fused_forward=true, Llama-family models); "
                    f"{m.name}: {why or 'fused_forward=false'}"
                )
        return None


def run_problems(max_new_tokens: int, batch_size: int = 1) -> list[str]:
    """The rules of a decode's budget and batch, whatever its policy (the one place they are written)."""
    out = [] if max_new_tokens >= 1 else [f"max_new_tokens={max_new_tokens} must be >= 1"]
    return out + ([] if batch_size >= 1 else [f"batch_size={batch_size} must be >= 1"])


def batch_rule(cls: type[Policy]) -> str | None:
    """Why a policy runs at batch 1 only, whatever the models (None: it batches)."""
    if getattr(cls, "tree", False):
        return "policy=tree runs at batch 1"
    if cls.bridge:
        return f"policy={cls.name} drafts across vocabularies and runs at batch 1 only"
    return None


def policy_problems(
    cls: type[Policy],
    eagle: bool,
    sampling: SamplingConfig,
    fused_forward: bool = True,
    has_draft: bool | None = None,
    batch_size: int = 1,
) -> list[str]:
    """Why a decode with policy ``cls`` cannot run, from its settings alone (no model loaded): the one place
    these rules live; ``heads-decode`` asks before loading the models, the :class:`Decoder` when built.

    Args:
        eagle: an EAGLE head drafts. sampling, fused_forward: the decode's. has_draft: whether a draft model
        is loaded (None: not known yet). batch_size: rows decoded at once.
    """
    out = tree_problems(eagle, sampling, fused_forward) if getattr(cls, "tree", False) else []
    if eagle and (cls.bridge or cls.emitter == "draft"):
        out.append(f"policy {cls.name!r} does not draft on the target's vocabulary: it cannot use an EAGLE head")
    if has_draft is False and "draft" in cls.models and not eagle:
        out.append(f"policy {cls.name!r} needs a draft model; set draft.path (or eagle=<an EAGLE head>)")
    if batch_size > 1 and (why := batch_rule(cls) or ("" if fused_forward else "fused")):
        out.append(
            f"batch_size={batch_size}: "
            + (why if why != "fused" else "batched decoding runs on the fused forward (fused_forward=true)")
        )
    return out


def load_eagle(head, pair: Pair):
    """An EAGLE head (a path or a loaded head), checked against the pair's target, on its device and in its dtype
    (a head exported in bf16 to keep the file small drafts in the target's precision)."""
    from specheads.export import speculators
    from specheads.export.package import LoadedHead, check_head_against_pair, load_head

    spec_dir = not isinstance(head, LoadedHead) and speculators.is_speculators_dir(head)
    if spec_dir:  # an Eagle-3 directory (heads-export format=speculators, speculators, SpecForge)
        loaded = speculators.read(head)
    else:
        loaded = head if isinstance(head, LoadedHead) else load_head(head, device=pair.target.device)
    if loaded.checked_for is not None and loaded.checked_for == pair.target.fingerprint:
        return loaded  # loaded once for this target (heads-decode, then its Decoder)
    embed = speculators.embedding(head) if spec_dir else None
    if embed is not None:  # the head reads the target's embedding: one trained on its own would draft wrong
        mine = pair.target.model.get_input_embeddings().weight.detach().float().cpu()
        if embed.shape != mine.shape or not torch.allclose(embed.float(), mine, rtol=1e-2, atol=1e-3):
            raise UserError(
                f"{head}: its embed_tokens.weight is not the target's (a head trained with its own embedding); "
                "this toolkit's EAGLE head reads the target's embedding"
            )
    if loaded.metadata.get("head_type") != "eagle":
        raise UserError(
            f"eagle= needs an EAGLE head (heads-train head=eagle); this one is "
            f"head_type={loaded.metadata.get('head_type')!r}"
        )
    check_head_against_pair(loaded.metadata, pair)
    loaded.module.to(device=pair.target.device, dtype=pair.target.model.dtype)
    loaded.checked_for = pair.target.fingerprint
    return loaded


def generate(pair: Pair, prompts, policy: str | Policy = "sd", *, batch_size: int = 1, **decoding) -> list[Result]:
    """Completions for a prompt or a list of prompts (strings, message lists or ``Prompt`` objects).

    ``decoding``: the :class:`Decoder`'s arguments by name (``max_new_tokens``, ``k``, ``sampling``, ``seed``,
    ``chat_template``, ``eagle``: an EAGLE head drafts instead of the draft model ...); ``batch_size`` as in
    :meth:`Decoder.decode_many`. Returns one ``Result`` per prompt, in order.
    """
    if bad := run_problems(decoding.get("max_new_tokens", 128), batch_size):
        raise UserError("; ".join(bad))
    single = isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], dict))
    items = [prompts] if single else list(prompts)
    decoder = Decoder(pair, policy, **decoding)
    done = dict(decoder.decode_many(enumerate(items), batch_size))
    return [done[i] for i in range(len(items))]
