"""Schema of ``heads-decode`` (recipe section ``decode``): the run's settings, and one section per
registered policy holding that policy's own ``Settings`` (``policy=judge judge.delta=0.99``).

The schema is built from the policy registry (:func:`decode_schema`), so a policy registered with
``register_policy`` gets its section without touching this module. A setting given outside its policy's
section (``k=3``) is an unknown key, and the error names the spelling to use (``sd.k``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, fields, make_dataclass

from specheads.errors import UserError
from specheads.shim import POLICIES, ModelSpec, SamplingConfig, Settings, policy_class
from specheads.vllm_config import ServeVllm


@dataclass
class RunConfig:
    """Run a decoding policy over a prompt file and record outputs and stats."""

    target: ModelSpec = field(default_factory=ModelSpec)
    draft: ModelSpec = field(default_factory=ModelSpec)
    policy: str = field(
        default="sd",
        metadata={
            "help": (
                "the decoding policy (its settings: <policy>.<setting>=, e.g. judge.delta=0.9): sd "
                "(fixed k), specdecpp (an acceptance head stops drafting), sprinter (a verifier head "
                "approves tokens), judge (a judge head accepts what SD rejects), topk_verify, tree (an "
                "EAGLE head's draft tree, greedy; needs eagle=), fsd, confidence_stop, tli / slem / slrs "
                "(a draft with another tokenizer; lossless), ar (target alone), draft (draft alone), or "
                "any policy registered with register_policy"
            )
        },
    )
    eagle: str | None = field(
        default=None,
        metadata={
            "help": (
                "an exported EAGLE head (heads-train head=eagle): the same-vocabulary policies draft "
                "with it from the target's own states instead of with the draft model (batched too; "
                "policy=tree at batch 1)"
            )
        },
    )
    deploy: str | None = field(
        default=None,
        metadata={
            "help": (
                "an exported head that carries the rule heads-eval chose (heads-export deploy=): decode with the "
                "policy and settings it names (this head, when the choice is the learned one; its EAGLE head "
                "unless eagle= is given); a setting given in that policy's section wins"
            )
        },
    )
    profile: str = field(
        default="auto",
        metadata={
            "help": (
                "cost table for stop=cost: auto (cached per machine and settings under "
                "$SPECHEADS_CACHE/costs, default ~/.cache/specheads/costs; measured when absent) | "
                "refresh (measure again) | path to a cost-table JSON"
            )
        },
    )
    strict: bool = field(default=False, metadata={"help": "refuse (not warn) when sampling differs from the head's"})
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    prompts: str = field(
        default="",
        metadata={"help": "JSONL (prompt | messages), GSM8K, Alpaca, MT-Bench or ARC file; several: comma-separated"},
    )
    num_prompts: int | None = field(default=None, metadata={"help": "use only the first N prompts (after offset)"})
    offset: int = field(default=0, metadata={"help": "skip this many prompts first"})
    max_new_tokens: int = 128
    chat_template: bool = field(default=True, metadata={"help": "format prompts with the target's chat template"})
    seed: int = 0
    batch_size: int = field(
        default=1,
        metadata={
            "help": (
                "prompts decoded together (each row its own rounds, one draft and one target forward per "
                "step for all rows); > 1 needs a same-vocabulary policy on Llama-family models with "
                "fused_forward=true; outputs.jsonl is then in the order prompts finish"
            )
        },
    )
    packed: bool = field(
        default=True,
        metadata={
            "help": (
                "batch_size > 1: each forward's projections and MLP run on the rows' real tokens only, packed "
                "(a row that stops drafting early costs fewer rows); false pads every row to the widest"
            )
        },
    )
    fused_forward: bool = field(
        default=True,
        metadata={"help": "Llama-family models run a fused forward (same outputs, faster); false: the model's own"},
    )
    output_dir: str = field(
        default="runs/decode", metadata={"help": "outputs.jsonl, metrics.json, config.yaml, manifest.json"}
    )
    overwrite: bool = field(default=False, metadata={"help": "allow writing into an output_dir that holds another run"})
    engine: str = field(
        default="specheads",
        metadata={
            "help": (
                "specheads (this package's engine) | vllm (vLLM decodes: policy ar = its target alone, "
                "sd = its draft_model at k, specdecpp and confidence_stop = the specheads.vllm.proposer proposer "
                "at k_max; the GGUF target converted once to a cached Hugging Face directory)"
            )
        },
    )
    vllm: ServeVllm = field(
        default_factory=ServeVllm, metadata={"help": "engine=vllm: how vLLM runs the target (vllm.tensor_parallel=8)"}
    )
    stream: bool = field(default=False, metadata={"help": "print each completion to stdout as it is generated"})


def _sections() -> tuple[tuple[str, type[Settings]], ...]:
    """The registered policies with settings, in registry order (a name the run's settings use is skipped)."""
    taken = {f.name for f in fields(RunConfig)}
    return tuple((name, cls.Settings) for name, cls in POLICIES.items() if fields(cls.Settings) and name not in taken)


@functools.cache
def _schema(sections: tuple[tuple[str, type[Settings]], ...]) -> type:
    own = [(name, s, field(default_factory=s, metadata={"help": f"policy={name}'s settings"})) for name, s in sections]
    return make_dataclass(
        "DecodeConfig", own, bases=(RunConfig,), namespace={"__doc__": RunConfig.__doc__, "__module__": __name__}
    )


def decode_schema() -> type:
    """``heads-decode``'s schema for the policies registered now: :class:`RunConfig`'s fields and a section per
    policy with settings."""
    return _schema(_sections())


def policy_settings(cfg) -> Settings:
    """The chosen policy's settings (its section; a policy without settings gets its defaults), checked."""
    cls = policy_class(cfg.policy)
    own = getattr(cfg, cfg.policy, None) if cfg.policy in dict(_sections()) else None
    settings = own if isinstance(own, cls.Settings) else cls.Settings()
    problems = settings.problems({f.name: f"{cfg.policy}.{f.name}" for f in fields(settings)})
    if problems:
        raise UserError("; ".join(problems))
    return settings


DecodeConfig = decode_schema()  # the built-in policies' schema (decode_schema() sees later registrations)
