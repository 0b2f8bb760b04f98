"""A trained head inside Hugging Face ``generate``: assisted generation whose drafting stops by the head.

    from specheads.hf import Assistant

    assistant = Assistant(draft, "runs/specdecpp_smollm2-export")      # an exported SpecDec++ head
    out = target.generate(**inputs, assistant_model=draft, custom_generate=assistant, max_new_tokens=128)

:class:`Assistant` is a ``custom_generate`` callable that runs Transformers' own assisted decoding (lossless)
with one change: a candidate generator whose drafting stops by a specheads policy, the object the decoding
shim runs (``policy="specdecpp"``: an exported acceptance head, by threshold or ``stop="cost"``;
``policy="confidence_stop"``: the draft's own probability). The head is checked against the draft and the
call's sampling settings as the shim checks it. Batch size 1; give ``streamer=`` to :class:`Assistant` (a
``custom_generate`` callable does not receive ``generate``'s); one ``generate`` per target model at a time
(its ``_get_candidate_generator`` is replaced while a call runs). Works with the Transformers versions in
:data:`SUPPORTED`, relying on the internals in :data:`INTERNALS` (checked when an :class:`Assistant` is built).
The whole story: docs/python-api.md.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import types

import torch

from specheads.errors import UserError
from specheads.hf.models import _loaded, _width, prune_draft
from specheads.hf.support import INTERNALS, SUPPORTED, Stats, check_transformers

# the module users import (docs/python-api.md): the head inside generate, and what it builds on
__all__ = ["Assistant", "prune_draft", "SUPPORTED", "INTERNALS", "check_transformers"]

log = logging.getLogger(__name__)
POLICIES = ("specdecpp", "confidence_stop")


class _Round:
    """Feeds one drafting round to the policy, one candidate at a time, from the draft's forwards (hooks)."""

    def __init__(self, assistant: "Assistant"):
        self.a = assistant

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        a = self.a
        rnd = a.round
        rnd.tokens.append(input_ids[0, -1])
        rnd.draft_logits.append(a.logits[0, -1])
        if a.capture is not None:
            rnd.draft_hidden.append(getattr(a.capture, a.policy.draft_hidden)[0, -1])
        stop = rnd.n >= rnd.limit or a.policy.stop_drafting(rnd)
        return torch.full((input_ids.shape[0],), bool(stop), dtype=torch.bool, device=input_ids.device)


@functools.cache
def _generator_class():
    from transformers.generation.candidate_generator import AssistedCandidateGenerator
    from transformers.generation.stopping_criteria import StoppingCriteriaList

    class PolicyCandidateGenerator(AssistedCandidateGenerator):
        """Transformers' assisted candidate generator, drafting until the specheads policy stops it."""

        def __init__(self, *args, assistant: "Assistant", **kwargs):
            super().__init__(*args, **kwargs)
            self.assistant = assistant
            # Transformers' own dynamic rule (and its online threshold updates) off: the policy decides.
            # (0, not None: generate fills an unset value from the draft's own generation config, 0.4 by default)
            for cfg in (self.generation_config, self.assistant_generation_config):
                cfg.assistant_confidence_threshold = 0.0
                cfg.num_assistant_tokens_schedule = "constant"
            self.num_assistant_tokens = assistant.policy.max_candidates()

        def _prepare_generation_args(self, input_ids, min_new_tokens, max_new_tokens):
            args = super()._prepare_generation_args(input_ids, min_new_tokens, max_new_tokens)
            self.assistant.start_round(input_ids.shape[-1], max_new_tokens)
            args["stopping_criteria"] = StoppingCriteriaList([_Round(self.assistant)])
            return args

        def update_candidate_strategy(self, input_ids, scores, num_matches):
            # accepted: the appended tokens that equal the candidates (Transformers' num_matches is one short
            # when it crops the round at an accepted end-of-sequence candidate)
            self.assistant.end_round(scores.shape[1] - 1, input_ids)

    return PolicyCandidateGenerator


class Assistant:
    """A ``custom_generate`` callable: Transformers' assisted decoding, drafting stopped by a specheads policy.

    Args:
        draft: the draft model (the ``assistant_model`` passed to ``generate``).
        head: the exported SpecDec++ acceptance head (``policy="specdecpp"``): a ``.safetensors`` file, a
            ``heads-export format=hf`` directory or a Hub repo id.
        policy: ``specdecpp`` or ``confidence_stop`` (training-free; no head).
        settings: the policy's own settings under their own names, defaults and rules (``SpecDecPPSettings``,
            ``ConfidenceSettings``): ``h`` (SpecDec++'s stop threshold, default the head's ``default_threshold``),
            ``tau`` (``confidence_stop``'s, default 0.4), ``k_min``, ``k_max``, ``stop`` (``threshold`` or ``cost``:
            the cost-aware rule on the pair's profiled cost table), ``gate``, ...
        target: the target model; needed for ``stop="cost"`` (the cost table measures both).
        profile: the cost table: ``auto`` (cached per machine and settings, measured when absent),
            ``refresh`` or a cost-table JSON path.
        strict: refuse a head trained under other sampling settings instead of warning.
        draft_gguf, target_gguf: the GGUF file name when that model was loaded from one (its fingerprint
            covers that file).
        streamer: a Transformers streamer fed the accepted tokens of each round (``generate``'s own
            ``streamer=`` does not reach a ``custom_generate`` callable).
    """

    def __init__(
        self,
        draft,
        head=None,
        *,
        policy: str = "specdecpp",
        target=None,
        profile: str = "auto",
        strict: bool = False,
        draft_gguf: str | None = None,
        target_gguf: str | None = None,
        streamer=None,
        **settings,
    ):
        from specheads.decode.policy_factory import settings_for

        check_transformers()
        if policy not in POLICIES:
            raise UserError(f"policy={policy!r}; choose one of {list(POLICIES)}")
        if policy == "specdecpp" and head is None:
            raise UserError(
                "policy=specdecpp needs head=<exported acceptance head: file, format=hf directory or "
                "repo id>; or use policy='confidence_stop'"
            )
        if policy == "confidence_stop" and head is not None:
            raise UserError("policy=confidence_stop is training-free; drop head= or use policy='specdecpp'")
        own = settings_for(policy, **settings, **({"head": str(head)} if head is not None else {}))
        if own.stop == "cost" and target is None:
            raise UserError("stop='cost' needs target=<the target model> (the cost table times both models)")
        self.draft, self.target, self.head, self.name = draft, target, head, policy
        self.own, self.profile, self.strict = own, profile, strict
        self.draft_gguf, self.target_gguf, self.streamer = draft_gguf, target_gguf, streamer
        self.policy = None
        self.stats = Stats()
        self.round = None
        self.capture = None
        self.logits = None
        self._sampling = None
        self._costs = None

    # -- the policy ---------------------------------------------------------------------------------------
    def _pair(self):
        from specheads.shim import Pair

        target = self.target if self.target is not None else self.draft  # only the draft's states are read
        return Pair(_loaded(target, self.target_gguf), _loaded(self.draft, self.draft_gguf))

    def _build(self, sampling) -> None:
        from specheads.decode import assemble
        from specheads.decode.policy_factory import pair_costs

        if self.policy is not None and sampling == self._sampling:
            return
        pair = self._pair()
        if self.own.stop == "cost" and self._costs is None:
            self._costs = pair_costs(pair, self.own.k_max + 1, self.profile, fused=False)
        models = assemble.Models(pair, costs=self._costs)  # a table only with stop=cost
        self.policy = assemble.policy(self.name, models, self.own, sampling=sampling, strict=self.strict)
        self._sampling = sampling

    # -- rounds (called by the candidate generator) ----------------------------------------------------------
    def start_round(self, position: int, room: int) -> None:
        from specheads.shim import Round

        self.round = Round(self._sampling, None, limit=min(self.policy.max_candidates(), room), position=position)
        self.policy.start_round(self.round)

    def end_round(self, drafted: int, input_ids: torch.Tensor) -> None:
        self.stats.rounds += 1
        if self.round is None:  # a round without drafting (no room left for candidates)
            return
        new = input_ids[0, self.round.position : self.round.position + drafted]
        cands = torch.stack(self.round.tokens[:drafted]).to(new.device) if drafted else new[:0]
        same = (new == cands[: new.shape[0]]).long()
        accepted = int(same.cumprod(0).sum()) if same.numel() else 0
        self.stats.drafted += drafted
        self.stats.accepted += accepted
        self.policy.end_round(drafted, accepted)
        self.round = None

    def _keep_logits(self, module, args, output):
        # the draft's output logits (after any final softcapping), as its own sampling sees them
        self.logits = output.logits if hasattr(output, "logits") else output[0]

    # -- the custom_generate entry point -------------------------------------------------------------------
    def __call__(
        self,
        model,
        input_ids,
        logits_processor,
        stopping_criteria,
        generation_config,
        synced_gpus: bool = False,
        streamer=None,
        **model_kwargs,
    ):
        from transformers.generation.utils import GenerationMixin

        from specheads.shim import HiddenCapture, SamplingConfig

        if input_ids.shape[0] != 1:
            raise UserError(
                f"specheads.hf.Assistant decodes one sequence at a time (batch size 1, as Transformers' "
                f"assisted generation); got {input_ids.shape[0]}"
            )
        if generation_config.num_beams not in (None, 1):
            raise UserError("specheads.hf.Assistant runs greedy or sampled assisted generation; set num_beams=1")
        widths = (_width(model), _width(self.draft))
        if widths[0] != widths[1]:
            raise UserError(
                f"the target's output layer has {widths[0]} tokens and the draft's {widths[1]}: "
                "specheads.hf.Assistant needs one vocabulary (heterogeneous pairs: heads-decode)"
            )
        streamer = streamer if streamer is not None else self.streamer
        sampling = SamplingConfig(
            do_sample=bool(generation_config.do_sample),
            **(
                {
                    "temperature": float(generation_config.temperature or 1.0),
                    "top_k": int(generation_config.top_k or 0),
                    "top_p": float(generation_config.top_p or 1.0),
                }
                if generation_config.do_sample
                else {}
            ),
        )
        self._build(sampling)
        self.policy.reset()
        self.stats = Stats()
        generator_cls = _generator_class()
        draft = self.draft

        def candidate_generator(
            this, generation_config, input_ids, inputs_tensor, logits_processor, model_kwargs, **kwargs
        ):
            return generator_cls(
                input_ids, draft, generation_config, model_kwargs, inputs_tensor, logits_processor, assistant=self
            )

        logits_hook = draft.register_forward_hook(self._keep_logits)
        before = model.__dict__.get("_get_candidate_generator")  # an instance attribute of the caller's, if any
        model._get_candidate_generator = types.MethodType(candidate_generator, model)
        capture = HiddenCapture(draft) if self.policy.draft_hidden else contextlib.nullcontext()
        try:
            with capture as self.capture:
                return GenerationMixin._assisted_decoding(
                    model,
                    input_ids,
                    logits_processor,
                    stopping_criteria,
                    generation_config,
                    synced_gpus=synced_gpus,
                    streamer=streamer,
                    assistant_model=draft,
                    **model_kwargs,
                )
        finally:
            if before is None:
                del model._get_candidate_generator
            else:
                model._get_candidate_generator = before
            logits_hook.remove()
            self.capture = self.logits = self.round = None
