"""Schema of ``heads-decode`` (recipe section ``decode``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from .shim.models import ModelSpec
from .shim.sampling import SamplingConfig


@dataclass
class DecodeConfig:
    """Run a decoding policy over a prompt file and record outputs and stats."""

    target: ModelSpec = field(default_factory=ModelSpec)
    draft: ModelSpec = field(default_factory=ModelSpec)
    policy: str = field(default="sd", metadata={"help": "sd (fixed k), specdecpp (needs head=), sprinter (needs a verifier head=), judge (needs a judge head=; k candidates), ar (target alone), draft (draft alone)"})
    k: int = field(default=4, metadata={"help": "candidates per round for policy=sd and judge"})
    head: str | None = field(default=None, metadata={"help": "exported head (.safetensors) for policy=specdecpp or sprinter"})
    threshold: float | None = field(default=None, metadata={"help": "specdecpp stop threshold h / sprinter approval threshold eta / judge delta; default: the head's"})
    max_run: int | None = field(default=20, metadata={"help": "sprinter: most verifier-approved tokens in a row before the target is called (null: no cap)"})
    k_min: int = field(default=2, metadata={"help": "specdecpp: fewest candidates per round"})
    k_max: int = field(default=20, metadata={"help": "specdecpp: most candidates per round"})
    strict: bool = field(default=False, metadata={"help": "refuse (not warn) when sampling differs from the head's"})
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    prompts: str = field(default="", metadata={"help": "JSONL (prompt | messages), GSM8K, Alpaca, MT-Bench or ARC file; several: comma-separated"})
    num_prompts: int | None = field(default=None, metadata={"help": "use only the first N prompts (after offset)"})
    offset: int = field(default=0, metadata={"help": "skip this many prompts first"})
    max_new_tokens: int = 128
    chat_template: bool = field(default=True, metadata={"help": "format prompts with the target's chat template"})
    seed: int = 0
    fused_forward: bool = field(default=True, metadata={"help": "Llama-family models run a fused forward (same outputs, faster); false: the model's own"})
    output_dir: str = field(default="runs/decode", metadata={"help": "outputs.jsonl, metrics.json, config.yaml, manifest.json"})
    overwrite: bool = field(default=False, metadata={"help": "allow writing into an output_dir that holds another run"})
    stream: bool = field(default=False, metadata={"help": "print each completion to stdout as it is generated"})
