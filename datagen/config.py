"""Schema of ``heads-datagen`` (recipe section ``datagen``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from specheads.export.shim.models import ModelSpec
from specheads.export.shim.sampling import SamplingConfig


@dataclass
class DatagenConfig:
    """Run target and draft over prompts and write labelled examples."""

    target: ModelSpec = field(default_factory=ModelSpec)
    draft: ModelSpec = field(default_factory=ModelSpec)
    labels: str = field(default="acceptance", metadata={"help": "acceptance (SpecDec++ soft labels)"})
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    prompts: str = field(default="", metadata={"help": "prompt file (JSONL, GSM8K, Alpaca, MT-Bench, ARC); several: comma-separated"})
    num_prompts: int | None = field(default=None, metadata={"help": "use only the first N prompts (after offset)"})
    offset: int = 0
    max_new_tokens: int = field(default=128, metadata={"help": "length of the target's responses"})
    chat_template: bool = True
    batch_size: int = field(default=16, metadata={"help": "prompts per forward (one batch generates and is labelled together)"})
    chunk_size: int = field(default=32, metadata={"help": "prompts per output file (the unit of resumption)"})
    expected_label: bool = field(default=True, metadata={"help": "also store 1 - TV(p, q)"})
    seed: int = 0
    output_dir: str = "runs/datagen"
    overwrite: bool = False
