"""Schema of ``heads-export`` (recipe section ``export``)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ExportConfig:
    """Package a trained head as one self-describing ``.safetensors`` file."""

    train_dir: str = field(default="", metadata={"help": "output_dir of heads-train"})
    checkpoint: str = field(
        default="best", metadata={"help": "best (the best eval epoch) | latest | a checkpoint-<step> dir"}
    )
    threshold: float | None = field(
        default=None, metadata={"help": "default stop threshold h stored in the file; default: training's"}
    )
    dtype: str = field(
        default="float32", metadata={"help": "float32 | bfloat16 | float16: precision of the exported weights"}
    )
    seed: int = field(default=0, metadata={"help": "seed of the round-trip check's random inputs"})
    format: str = field(
        default="safetensors",
        metadata={
            "help": (
                "safetensors: output_dir/head.safetensors | hf: a Hub-style directory "
                "(model.safetensors, config.json, README.md model card) that load_head(dir or repo id) "
                "reads | speculators (EAGLE heads): the vllm-project/speculators Eagle-3 directory vLLM "
                "loads with speculative_config={'method': 'eagle3', 'model': output_dir}"
            )
        },
    )
    verifier: str = field(
        default="",
        metadata={
            "help": (
                "format=speculators: the target's name_or_path written to speculators_config.verifier; "
                "default: the target name recorded at training"
            )
        },
    )
    max_position_embeddings: int | None = field(
        default=None,
        metadata={
            "help": (
                "format=speculators: the context length written into the Eagle-3 layer's config; default: the "
                "target's (the config of verifier=, else of the target recorded at training)"
            )
        },
    )
    embed_tokens: bool = field(
        default=True,
        metadata={
            "help": (
                "format=speculators: write the target's token embedding (read from verifier=, else the target "
                "recorded at training, a local directory or .gguf file) as speculators' own loader needs it; false "
                "leaves it out (vLLM shares the target's, but speculators' loader then holds zeros)"
            )
        },
    )
    deploy: str = field(
        default="",
        metadata={
            "help": (
                "a heads-eval output_dir: the rule it names to deploy (a fixed K, a training-free rule with its "
                "constants, or this head) is packaged in the header, and heads-decode deploy= and the vLLM stop "
                "plugin run it by default"
            )
        },
    )
    output_dir: str = field(
        default="runs/export",
        metadata={
            "help": (
                "head.safetensors (format=hf or speculators: model.safetensors, config.json, README.md), "
                "config.yaml, manifest.json, metrics.jsonl"
            )
        },
    )
    overwrite: bool = False
