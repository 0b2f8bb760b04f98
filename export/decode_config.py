"""Schema of ``heads-decode`` (recipe section ``decode``): the run's settings, and one section per
registered policy holding that policy's own ``Settings`` (``policy=judge judge.delta=0.99``).

The schema is built from the policy registry (:func:`decode_schema`), so a policy registered with
``register_policy`` gets its section without touching this module. The flat spellings before 0.2
(``k=``, ``h=``, ``delta=``, ``threshold=`` ...) still work for one release: :func:`policy_settings` moves
them into the chosen policy's section with a warning that shows the new spelling.
"""

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass, field, fields, make_dataclass, replace
from pathlib import Path
from typing import Any

import yaml
from omegaconf import OmegaConf

from specheads.config import to_yaml
from specheads.errors import UserError
from specheads.export.shim import POLICIES, ModelSpec, SamplingConfig, Settings, policy_class
from specheads.outputs import atomic_write_text
from specheads.vllm_options import HELP as VLLM_HELP

UNSET = "<unset>"  # an old flat setting not given

#: The flat settings before 0.2, by name and type: each is now ``<policy>.<name>`` (``threshold``: the
#: policy's threshold under one name).
LEGACY = {
    "k": int,
    "lookahead": int,
    "budget": int,
    "head": str,
    "h": float,
    "eta": float,
    "delta": float,
    "T": float,
    "tau": float,
    "threshold": float,
    "stop": str,
    "max_run": int,
    "k_min": int,
    "k_max": int,
    "tree_width": int,
    "tree_nodes": int,
    "verify_top_k": int,
    "divergence": str,
    "fsd_top_k": int,
    "fsd_rule": str,
    "fsd_dist": str,
}


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
                "sd = its draft_model at k, specdecpp and confidence_stop = the specheads.vllm proposer "
                "at k_max; the GGUF target converted once to a cached Hugging Face directory)"
            )
        },
    )
    vllm_python: str | None = field(
        default=None,
        metadata={"help": "engine=vllm: the python of vLLM's virtualenv (default: this one, when it has vLLM)"},
    )
    vllm_threads: int | None = field(
        default=None, metadata={"help": "engine=vllm: OMP_NUM_THREADS for vLLM on a CPU (default: the machine's cores)"}
    )
    vllm_tensor_parallel: int = field(default=1, metadata={"help": VLLM_HELP["vllm_tensor_parallel"]})
    vllm_pipeline_parallel: int = field(default=1, metadata={"help": VLLM_HELP["vllm_pipeline_parallel"]})
    vllm_executor_backend: str | None = field(default=None, metadata={"help": VLLM_HELP["vllm_executor_backend"]})
    vllm_enforce_eager: bool | None = field(default=None, metadata={"help": VLLM_HELP["vllm_enforce_eager"]})
    vllm_draft_cache_mb: float | None = field(default=None, metadata={"help": VLLM_HELP["vllm_draft_cache_mb"]})
    stream: bool = field(default=False, metadata={"help": "print each completion to stdout as it is generated"})


def _sections() -> tuple[tuple[str, type[Settings]], ...]:
    """The registered policies with settings, in registry order (a name the run's settings use is skipped)."""
    taken = {f.name for f in fields(RunConfig)} | set(LEGACY)
    return tuple((name, cls.Settings) for name, cls in POLICIES.items() if fields(cls.Settings) and name not in taken)


@functools.cache
def _schema(sections: tuple[tuple[str, type[Settings]], ...]) -> type:
    own = [(name, s, field(default_factory=s, metadata={"help": f"policy={name}'s settings"})) for name, s in sections]
    # Typed Any with a sentinel default, so that an explicit null (max_run=null: no cap) is a value given;
    # policy_settings checks each value against its type in LEGACY.
    old = [
        (
            name,
            Any,
            field(
                default=UNSET,
                metadata={
                    "help": f"the spelling before 0.2 (warns): write <policy>.{name}= instead",
                    "old": True,
                    "unset": UNSET,
                },
            ),
        )
        for name in LEGACY
    ]
    return make_dataclass(
        "DecodeConfig", own + old, bases=(RunConfig,), namespace={"__doc__": RunConfig.__doc__, "__module__": __name__}
    )


def decode_schema() -> type:
    """``heads-decode``'s schema for the policies registered now: :class:`RunConfig`'s fields, a section per
    policy with settings and the old flat spellings."""
    return _schema(_sections())


def _typed(key: str, value):
    """An old flat setting's value checked against its type (null stays null: ``max_run=null``)."""
    tp = LEGACY[key]
    if value is None or (isinstance(value, tp) and not isinstance(value, bool)):
        return value
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    raise UserError(f"bad value for {key!r}: {value!r} is not {'an integer' if tp is int else 'a ' + tp.__name__}")


def policy_settings(cfg) -> Settings:
    """The chosen policy's settings: its section, with any old flat spelling moved in (a warning shows the new
    spelling; one the policy does not have is ignored, as before, with a warning). Checked."""
    cls = policy_class(cfg.policy)
    own = getattr(cfg, cfg.policy, None) if cfg.policy in dict(_sections()) else None
    settings = own if isinstance(own, cls.Settings) else cls.Settings()
    names = {f.name for f in fields(settings)}
    given = {k: _typed(k, v) for k in LEGACY if (v := getattr(cfg, k, UNSET)) != UNSET}
    values: dict = {}
    for key, value in given.items():
        name = cls.Settings.THRESHOLD if key == "threshold" else key
        if name not in names and key == "stop" and value != "threshold":  # the cost rule: never silently dropped
            cost = [n for n, c in POLICIES.items() if "stop" in {f.name for f in fields(c.Settings)}]
            raise UserError(f"stop={value} applies to policy={' or '.join(cost)}, not policy={cfg.policy}")
        if name not in names:
            warnings.warn(
                f"{key}={value} is not a setting of policy={cfg.policy}: ignored (and {key}= is the "
                f"spelling before 0.2)",
                FutureWarning,
                stacklevel=2,
            )
            continue
        warnings.warn(
            f"{key}={value} is the spelling before 0.2: write {cfg.policy}.{name}={value}", FutureWarning, stacklevel=2
        )
        if values.get(name, value) != value:
            raise UserError(
                f"threshold={given['threshold']} and {name}={values[name]} disagree; set only {cfg.policy}.{name}"
            )
        default = getattr(cls.Settings(), name)
        if getattr(settings, name) not in (default, value):
            raise UserError(
                f"{key}={value} and {cfg.policy}.{name}={getattr(settings, name)} disagree; set only "
                f"{cfg.policy}.{name}"
            )
        values[name] = value
    settings = replace(settings, **values)
    problems = settings.problems({n: f"{cfg.policy}.{n}" for n in names})
    if problems:
        raise UserError("; ".join(problems))
    return settings


def normalize(cfg) -> Settings:
    """Moves the old flat spellings into the chosen policy's section (:func:`policy_settings`) and clears
    them, so that the run's ``config.yaml`` holds the one spelling; returns the policy's settings."""
    settings = policy_settings(cfg)
    if cfg.policy in dict(_sections()):
        setattr(cfg, cfg.policy, settings)
    for key in LEGACY:
        setattr(cfg, key, UNSET)
    return settings


def upgrade_saved_config(output_dir: str | Path, config_yaml: str) -> bool:
    """An output directory written before 0.2 (its ``config.yaml`` in the flat spelling) holding the run that
    ``config_yaml`` describes: its config is rewritten in the new spelling, so the run resumes there. True
    when it was upgraded."""
    path = Path(output_dir) / "config.yaml"
    if not path.is_file() or path.read_text(encoding="utf-8") == config_yaml:
        return False
    try:
        old = yaml.safe_load(path.read_text(encoding="utf-8"))
        if not isinstance(old, dict) or not any(k in old for k in LEGACY):
            return False
        schema = decode_schema()
        cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(schema), old))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            normalize(cfg)
    except Exception:  # noqa: BLE001 - not a config this version reads: another run
        return False
    if to_yaml(cfg) != config_yaml:
        return False
    atomic_write_text(path, config_yaml)
    return True


DecodeConfig = decode_schema()  # the built-in policies' schema (decode_schema() sees later registrations)
