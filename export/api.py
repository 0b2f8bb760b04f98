"""The Python API of the decoding shim: load a pair, format prompts, generate."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from specheads.errors import UserError

from .package import load_head
from .shim.costs import CostTable, cost_table
from .shim.engine import Engine, Generation, GenerationStats
from .shim.hetero import METHODS as HETERO, HeteroEngine, HeteroMethod
from .shim.models import Pair, context_length
from .shim.policies import BASELINES, FSD, ConfidenceStop, Judge, Policy, SpecDecPP, Sprinter, build_policy
from .shim.sampling import SamplingConfig

log = logging.getLogger(__name__)


def format_prompt(tokenizer, prompt, chat_template: bool = True) -> list[int]:
    """Token ids for a prompt: a string, a list of chat messages, or an object with ``text``/``messages``.

    With ``chat_template`` and a tokenizer that has one, the prompt is rendered as a user turn
    (or the given messages) plus the generation prompt; otherwise the raw text is tokenised.
    """
    messages = getattr(prompt, "messages", None)
    text = getattr(prompt, "text", None)
    if messages is None and text is None:
        messages, text = (prompt, None) if isinstance(prompt, list) else (None, prompt)
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
        raise UserError(f"max_new_tokens={max_new_tokens} leaves no room for a prompt in the model's "
                        f"context of {limit} tokens; lower max_new_tokens")
    return ids[-keep:], len(ids) - keep


@dataclass
class Result:
    """One prompt's completion."""

    text: str
    tokens: list[int]
    stats: GenerationStats
    truncated_prompt_tokens: int = 0


# policy -> (head type, the model whose states it reads, default threshold when the head has none)
_POLICY_HEADS = {"specdecpp": ("acceptance", "draft", 0.7), "sprinter": ("verifier", "draft", 0.5),
                 "judge": ("judge", "target", 0.5)}
DEFAULT_TAU = 0.4  # confidence_stop's tau when none is given: the assistant_confidence_threshold transformers configs carry


def _policy_head(name: str, head: str | None, pair: Pair, sampling, strict: bool, threshold: float | None):
    """Loads and checks the head a policy needs: ``(module in the model's dtype, head metadata, threshold)``."""
    head_type, role, default = _POLICY_HEADS[name]
    if not head:
        raise UserError(f"policy={name} needs head=<exported {head_type} head .safetensors> "
                        f"(heads-train head={head_type}, then heads-export)")
    model = pair.draft if role == "draft" else pair.target
    if model is None:
        raise UserError(f"policy={name} needs a {role} model; set {role}.path")
    loaded = load_head(head, pair=pair, sampling=sampling or SamplingConfig(), strict=strict, device=model.device)
    feature = loaded.metadata.get("feature", {})
    if loaded.metadata.get("head_type") != head_type or feature.get("model", "draft") != role:
        raise UserError(f"{head!r} is a {loaded.metadata.get('head_type')} head on the {feature.get('model', 'draft')}'s "
                        f"states; policy={name} needs a {head_type} head on the {role}'s states")
    if threshold is None:
        threshold = loaded.threshold if loaded.threshold is not None else default
    return loaded.module.to(model.model.dtype), loaded.metadata, threshold


def pair_costs(pair: Pair, max_pass: int, profile: str = "auto", fused: bool = True) -> CostTable:
    """The pair's profiled cost table (:func:`~.shim.costs.cost_table`): cached for this machine and
    settings, measured when absent (``profile="auto"``), re-measured (``"refresh"``) or read from a
    JSON path. ``max_pass`` is the largest target pass needed: the most candidates per round + 1."""
    if pair.draft is None:
        raise UserError("a cost table needs a draft model; set draft.path")
    vt = pair.target.model.get_output_embeddings().weight.shape[0]
    vd = pair.draft.model.get_output_embeddings().weight.shape[0]
    return cost_table(pair.target.model, pair.draft.model, max_pass, pair.target.fingerprint, pair.draft.fingerprint,
                      fused=fused, vocab_size=min(vt, vd) if vt != vd else None, profile=profile)


def make_policy(name: str, pair: Pair, k: int = 4, head: str | None = None, threshold: float | None = None,
                k_min: int = 2, k_max: int = 20, sampling: SamplingConfig | None = None,
                strict: bool = False, max_run: int | None = 20, top_k: int = 2, divergence: str = "js",
                fsd_top_k: int = 0, fsd_rule: str = "paper", fsd_dist: str = "raw", stop: str = "threshold",
                costs: CostTable | None = None) -> Policy | str:
    """A policy by name, loading and checking its head when it needs one; baselines stay names.

    Args:
        name: a key of ``POLICIES`` or a baseline (``ar``, ``draft``).
        pair: the loaded pair (heads are checked against it).
        k: candidates per round of ``sd``, ``judge``, ``topk_verify`` and ``fsd``.
        head: exported head for ``specdecpp``, ``sprinter`` and ``judge``; for ``fsd``, optionally an
            acceptance head trained on FSD labels that decides when to stop drafting (``k_min``,
            ``k_max`` and its default threshold ``h`` then apply instead of ``k``).
        threshold: SpecDec++'s stop threshold ``h``, SPRINTER's approval threshold ``eta`` or the
            judge's ``delta`` (default: the head's ``default_threshold``); FSD's divergence threshold
            ``T`` (required); ``confidence_stop``'s ``tau`` (default 0.4, Hugging Face's).
        k_min, k_max: SpecDec++'s bounds on candidates per round; ``k_max`` also caps ``confidence_stop``.
        sampling: the decoding's sampling settings (checked against a head's).
        strict: refuse a head trained under other sampling settings instead of warning.
        max_run: cap on SPRINTER's approved runs.
        top_k: ``topk_verify``'s K.
        divergence, fsd_top_k, fsd_rule, fsd_dist: FSD's settings (see :class:`FSD`).
        stop: ``threshold`` or ``cost``: how ``specdecpp`` and ``confidence_stop`` stop drafting; ``cost``
            ignores ``threshold`` and needs ``costs`` (:func:`pair_costs`).
        costs: the pair's cost table for ``stop="cost"``.
    """
    if name in BASELINES:
        return name
    if name in HETERO:
        return HeteroMethod(name, k)
    if name == "fsd":  # FSD reports every bad setting at once, a missing threshold included
        stopper = None
        if head:  # an acceptance head trained on FSD labels stops the drafting (FSD paper section 7.1)
            module, meta, h = _policy_head("specdecpp", head, pair, sampling, strict, None)
            info = meta.get("fsd")
            if not info:
                log.warning("%s was not trained on FSD labels (heads-datagen labels=fsd): it predicts SD "
                            "acceptance, not FSD's", head)
            elif (info.get("divergence"), float(info.get("threshold", -1))) != (divergence, float(threshold or 0)):
                log.warning("%s predicts FSD acceptance under %s < %s; this decoding verifies with %s < %s",
                            head, info.get("divergence"), info.get("threshold"), divergence, threshold)
            stopper = SpecDecPP(module, h, k_min, k_max, position=meta.get("feature", {}).get("position", "own"))
        return FSD(threshold, divergence, k=k, fsd_top_k=fsd_top_k, rule=fsd_rule, fsd_dist=fsd_dist,
                   stopper=stopper)
    if name == "confidence_stop":
        return ConfidenceStop(DEFAULT_TAU if threshold is None else threshold, k_max, stop=stop, costs=costs)
    if name == "specdecpp":
        module, meta, h = _policy_head(name, head, pair, sampling, strict, threshold)
        return SpecDecPP(module, h, k_min, k_max, position=meta.get("feature", {}).get("position", "own"),
                         stop=stop, costs=costs)
    if name == "sprinter":
        module, meta, eta = _policy_head(name, head, pair, sampling, strict, threshold)
        position = meta.get("feature", {}).get("position", "previous")
        embedding = pair.draft.model.get_input_embeddings() if position == "previous+embedding" else None
        return Sprinter(module, eta, max_run, position, embedding)
    if name == "judge":
        module, _, delta = _policy_head(name, head, pair, sampling, strict, threshold)
        return Judge(module, delta, k)
    if name == "topk_verify":
        return build_policy(name, k=k, top_k=top_k)
    return build_policy(name, k=k)


class Decoder:
    """Decodes prompts one at a time with a fixed policy, sampling settings and RNG stream.

    Args:
        pair: from ``load_pair``.
        policy: a policy name (``"sd"``), ``"ar"`` (target alone), ``"draft"`` (draft alone)
            or a ``Policy`` instance (``make_policy`` builds those that need a head).
        max_new_tokens: cap on new tokens per prompt.
        k: candidates per round for a policy built by name.
        sampling: greedy when None.
        seed: with the prompt's index, seeds its draws: the same seed gives the same outputs.
        chat_template: format prompts with the target's chat template when it has one.
        fused_forward: run Llama-family models on the fused forward (same outputs, faster);
            False keeps each model's own forward.
    """

    def __init__(self, pair: Pair, policy: str | Policy | HeteroMethod = "sd", max_new_tokens: int = 128, k: int = 4,
                 sampling: SamplingConfig | None = None, seed: int = 0, chat_template: bool = True,
                 fused_forward: bool = True):
        if max_new_tokens < 1:
            raise UserError(f"max_new_tokens={max_new_tokens} must be >= 1")
        self.sampling = sampling or SamplingConfig()
        bad = self.sampling.problems()
        if bad:
            raise UserError("; ".join(bad))
        if isinstance(policy, str):
            policy = make_policy(policy, pair, k=k, sampling=self.sampling)
        if (isinstance(policy, (Policy, HeteroMethod)) or policy == "draft") and pair.draft is None:
            raise UserError(f"policy {getattr(policy, 'name', policy)!r} needs a draft model; set draft.path")
        self.pair, self.policy, self.max_new_tokens, self.chat_template = pair, policy, max_new_tokens, chat_template
        self.engine = Engine(pair.target.model, pair.draft.model if pair.draft else None, pair.eos_token_ids,
                             fused=fused_forward)
        self.hetero = None
        if isinstance(policy, HeteroMethod):
            self.hetero = HeteroEngine(pair.target.model, pair.draft.model, pair.target.tokenizer,
                                       pair.draft.tokenizer, pair.eos_token_ids, policy.lookbehind,
                                       fused=fused_forward)
        limits = [context_length(m.model) for m in (pair.target, pair.draft) if m is not None]
        self.context = min((x for x in limits if x), default=None)
        self.seed = seed
        self.generator = torch.Generator(device=pair.target.device)
        # A draft on another device (a sharded target) draws from its own stream.
        self.draft_generator = None
        if pair.draft is not None and pair.draft.device != pair.target.device:
            self.draft_generator = torch.Generator(device=pair.draft.device)

    @property
    def policy_name(self) -> str:
        return self.policy if isinstance(self.policy, str) else self.policy.name

    def decode(self, prompt, index: int = 0, on_tokens=None, name: str = "prompt") -> Result:
        """One completion; ``on_tokens(ids)`` receives emitted ids as they are committed.

        The RNG is seeded from ``(seed, index)``, so a prompt's output does not depend on which
        prompts ran before it (a resumed run equals an uninterrupted one).
        """
        stream = ((self.seed & 0xFFFFFFFF) << 32) | (index & 0x7FFFFFFF)
        self.generator.manual_seed(stream)
        if self.draft_generator is not None:
            self.draft_generator.manual_seed(stream | (1 << 31))
        # The draft alone speaks its own tokenizer; every other policy emits the target's tokens.
        tokenizer = self.pair.draft.tokenizer if self.policy == "draft" else self.pair.tokenizer
        ids = format_prompt(tokenizer, prompt, self.chat_template)
        if not ids:
            raise UserError(f"{name} is empty after tokenisation")
        ids, dropped = fit_context(ids, self.max_new_tokens, self.context)
        if dropped:
            log.warning("%s: %d prompt tokens + max_new_tokens=%d exceed the context of %d; kept the last %d tokens",
                        name, len(ids) + dropped, self.max_new_tokens, self.context, len(ids))
        if self.hetero is not None:  # each model reads the prompt in its own tokenizer and chat template
            d_ids, _ = fit_context(format_prompt(self.pair.draft.tokenizer, prompt, self.chat_template),
                                   self.max_new_tokens, self.context)
            g = self.hetero.generate(ids, self.policy.name, self.policy.k, self.max_new_tokens, self.sampling,
                                     self.generator, draft_prompt_ids=d_ids)
            if on_tokens is not None:
                on_tokens(g.tokens)
        elif isinstance(self.policy, Policy):
            g: Generation = self.engine.generate(ids, self.policy, self.max_new_tokens, self.sampling,
                                                 self.generator, on_tokens, self.draft_generator)
        else:
            use_draft = self.policy == "draft"
            gen = self.draft_generator if use_draft and self.draft_generator is not None else self.generator
            g = self.engine.generate_ar(ids, self.max_new_tokens, self.sampling, gen, use_draft=use_draft,
                                        on_tokens=on_tokens)
        text = tokenizer.decode(g.tokens, skip_special_tokens=True)
        return Result(text, g.tokens, g.stats, dropped)


def generate(pair: Pair, prompts, policy: str | Policy = "sd", max_new_tokens: int = 128, k: int = 4,
             sampling: SamplingConfig | None = None, seed: int = 0, chat_template: bool = True) -> list[Result]:
    """Completions for a prompt or a list of prompts (strings, message lists or ``Prompt`` objects).

    See ``Decoder`` for the arguments. Returns one ``Result`` per prompt.
    """
    single = isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], dict))
    items = [prompts] if single else list(prompts)
    decoder = Decoder(pair, policy, max_new_tokens, k, sampling, seed, chat_template)
    return [decoder.decode(p, i, name=f"prompt {i}") for i, p in enumerate(items)]
