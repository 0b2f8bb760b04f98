"""The Python API of the decoding shim: load a pair, format prompts, generate."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specheads.errors import UserError

from .shim.engine import Engine, Generation, GenerationStats
from .shim.models import Pair, context_length
from .shim.policies import BASELINES, Policy, build_policy
from .shim.sampling import SamplingConfig


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


def generate(pair: Pair, prompts, policy: str | Policy = "sd", max_new_tokens: int = 128, k: int = 4,
             sampling: SamplingConfig | None = None, seed: int = 0, chat_template: bool = True,
             on_tokens=None) -> list[Result]:
    """Generates a completion for each prompt with a policy (``"sd"``), ``"ar"`` or ``"draft"``.

    Args:
        pair: from ``load_pair``.
        prompts: a string, a message list, or a list of those (or of ``Prompt`` objects).
        policy: a policy name or a ``Policy`` instance.
        max_new_tokens: cap on new tokens per prompt.
        k: candidates per round for ``"sd"``.
        sampling: greedy when None.
        seed: seeds the generator; one seed gives the same outputs.
        on_tokens: optional ``callback(prompt_index, token_ids)`` for streaming.
    """
    single = isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], dict))
    items = [prompts] if single else list(prompts)
    sampling = sampling or SamplingConfig()
    engine = Engine(pair.target.model, pair.draft.model if pair.draft else None, pair.eos_token_ids)
    if isinstance(policy, str) and policy not in BASELINES:
        policy = build_policy(policy, k=k)
    if (isinstance(policy, Policy) or policy == "draft") and pair.draft is None:
        raise UserError("this policy needs a draft model; set draft.path")
    limit = min(x for x in (context_length(pair.target.model),
                            context_length(pair.draft.model) if pair.draft else None) if x) \
        if context_length(pair.target.model) else None
    device = pair.target.device
    gen = torch.Generator(device=device).manual_seed(seed)
    results = []
    for i, prompt in enumerate(items):
        ids, dropped = fit_context(format_prompt(pair.tokenizer, prompt, chat_template), max_new_tokens, limit)
        cb = (lambda toks, i=i: on_tokens(i, toks)) if on_tokens else None
        if isinstance(policy, Policy):
            g: Generation = engine.generate(ids, policy, max_new_tokens, sampling, gen, on_tokens=cb)
        else:
            g = engine.generate_ar(ids, max_new_tokens, sampling, gen, use_draft=policy == "draft", on_tokens=cb)
        text = pair.tokenizer.decode(g.tokens, skip_special_tokens=True)
        results.append(Result(text, g.tokens, g.stats, dropped))
    return results
