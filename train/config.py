"""Schema of ``heads-train`` (recipe section ``train``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from specheads.plan.inputs import PLAN_HELP
from specheads.shim import ModelSpec
from specheads.vllm_config import DatagenVllm


@dataclass
class AcceptanceSettings:
    """head=acceptance (SpecDec++'s stop head): which label it fits."""

    label: str = field(
        default="soft",
        metadata={
            "help": (
                "soft: min(1, p/q) on the state at y_i, token mixing (SpecDec++); expected: 1 - TV(p, q) "
                "on the state that produced q_i (the target's own prefix, no mixing); fsd: the FSD "
                "decision Div(p, q) < T of labels=fsd data (acceptance.fsd_label), on the same state as expected"
            )
        },
    )
    fsd_label: str = field(
        default="",
        metadata={
            "help": (
                "label=fsd: <divergence>@<threshold>, one the datagen run stored (its manifest's "
                "fsd.label_columns), e.g. js@0.3"
            )
        },
    )
    mix_ratio: float = field(default=0.15, metadata={"help": "label=soft: token mixing ratio r"})


@dataclass
class VerifierSettings:
    """head=verifier and head=eagle_verifier (SPRINTER's verifier): its label and its feature."""

    lam: float = field(default=1.0, metadata={"help": "label 1 when q(x) <= lam * p(x)"})
    feature: str = field(
        default="previous",
        metadata={
            "help": (
                "previous | current | previous+embedding (draft state before x, after x, or before x + x's "
                "input embedding; eagle_verifier: previous or current, as its data stored them)"
            )
        },
    )
    roc_lambdas: list[float] = field(
        default_factory=list,
        metadata={"help": "also train one head per lambda on the same data for the ROC plot (roc.png)"},
    )


@dataclass
class JudgeSettings:
    """head=judge: what the head reads besides the target's state."""

    signals: list[str] = field(
        default_factory=list,
        metadata={
            "help": (
                "the target's verdict on the token beside its state, of logp (log p(y)), gap (log p(y) "
                "minus the largest log p), entropy (of p) and rank (of y under p); needs data with signals"
            )
        },
    )


@dataclass
class EagleSettings:
    """head=eagle (the EAGLE-3-style draft head): its layers, its start, the training-time test."""

    ttt_steps: int = field(
        default=3,
        metadata={"help": "training-time test, draft steps unrolled on the head's own states (1: step 1 only)"},
    )
    ttt_decay: float = field(default=0.8, metadata={"help": "step j's loss weight is ttt_decay ** (j - 1)"})
    decoder_layers: int = field(
        default=1,
        metadata={
            "help": (
                "the head's decoder layers (the first reads the token and the state, each later one is a "
                "plain layer over the one before); an init_head with fewer is grown: its own layers kept, each "
                "new one the target's last layer with its output projections zeroed, so it drafts as before"
            )
        },
    )
    init_head: str | None = field(
        default=None,
        metadata={
            "help": (
                "start from this EAGLE head (a heads-train or heads-export head.safetensors of "
                "the same target and layers; its vocabulary subset is kept) instead of the target's last "
                "layer: continue training on more data"
            )
        },
    )
    states: str = field(
        default="auto",
        metadata={
            "help": "offline (datagen stored them) | online (made each batch) | hybrid (made once, cached) | auto"
        },
    )
    engine: str = field(
        default="specheads",
        metadata={"help": "online/hybrid: specheads (the target in each process) | vllm (streamed, vllm section)"},
    )
    cache_dir: str | None = field(
        default=None, metadata={"help": "hybrid: the states cache (default <output_dir>/state-cache); kept for reruns"}
    )
    cache_gb: float = field(
        default=100.0,
        metadata={"help": "hybrid: the cache's bound in GB over all processes; sequences past it are made each epoch"},
    )


@dataclass
class DistillSettings:
    """head=draft (a standalone draft model distilled on the target's distributions, DistillSpec): its start and
    its divergence. The section is ``distill``: ``draft`` names the draft model (``draft.path``)."""

    init: str | None = field(
        default=None,
        metadata={
            "help": (
                "where the draft starts: truncate:N (the target's embeddings, first N decoder "
                "layers, final norm and output layer) | a Hugging Face model directory to continue from "
                "| null: draft.path"
            )
        },
    )
    divergence: str = field(
        default="fkl",
        metadata={
            "help": (
                "fkl (KL(p||q)) | rkl (KL(q||p)) | js (Jensen-Shannon) | tvd (total variation), "
                "between target p and draft q over the target's top-k tokens plus one bucket for every "
                "other token"
            )
        },
    )
    freeze_embeddings: bool = field(
        default=False,
        metadata={"help": "keep the input embeddings and the output layer (one matrix when tied) as initialised"},
    )


@dataclass
class EagleStopSettings:
    """head=eagle_stop (a SpecDec++ stop head on an EAGLE head's stored states): what it reads."""

    confidence: bool = field(
        default=True,
        metadata={
            "help": (
                "the head reads the drafter's log-probability of the candidate, log q(y), "
                "beside its state (SpecDec++'s features); false: the state alone"
            )
        },
    )
    state: bool = field(
        default=True,
        metadata={
            "help": (
                "the head reads the drafter's state; false (with confidence): log q(y) and signals alone, e.g. "
                "depth=0 eagle_stop.signals=[step] w_rej=1: q calibrated on [log q, step] (Platt)"
            )
        },
    )
    skip: bool = field(
        default=False,
        metadata={
            "help": (
                "(with confidence) the logit is linear in log q(y) and the signals plus the residual "
                "body's correction, which starts at zero: the linear part is first fitted alone (q calibrated on "
                "[log q, signals]), the state corrects it, and the calibrated q is kept instead when it does "
                "better on the held-out rounds: the head is at worst the calibrated q"
            )
        },
    )
    signals: list[str] = field(
        default_factory=list,
        metadata={
            "help": (
                "(with confidence) more features of the distribution the candidate was drawn "
                "from, of entropy (H(q)), margin (top-1 minus top-2 log q) and step (its index in the round)"
            )
        },
    )


#: The flat keys of before the family sections, and their spelling now (a flat key is an error naming it).
MOVED = {
    "label": "acceptance.label",
    "fsd_label": "acceptance.fsd_label",
    "mix_ratio": "acceptance.mix_ratio",
    "lam": "verifier.lam",
    "feature": "verifier.feature",
    "roc_lambdas": "verifier.roc_lambdas",
    "judge_signals": "judge.signals",
    "ttt_steps": "eagle.ttt_steps",
    "ttt_decay": "eagle.ttt_decay",
    "decoder_layers": "eagle.decoder_layers",
    "init_head": "eagle.init_head",
    "draft_init": "distill.init",
    "divergence": "distill.divergence",
    "freeze_embeddings": "distill.freeze_embeddings",
    "stop_confidence": "eagle_stop.confidence",
    "stop_state": "eagle_stop.state",
    "stop_skip": "eagle_stop.skip",
    "stop_signals": "eagle_stop.signals",
}


@dataclass
class TrainConfig:
    """Fit a head on ``heads-datagen`` output: the SpecDec++ acceptance head (weighted soft BCE on
    ``labels=acceptance`` data, or on the FSD decisions of ``labels=fsd`` data), the SPRINTER
    verifier (class-weighted BCE on ``labels=sprinter`` data), the Judge head, an EAGLE-3-style draft
    head or a standalone draft model distilled on the target's own responses (``labels=drafter``).

    The settings of one head family sit in its own section (``acceptance.label=fsd``, ``eagle.ttt_steps=2``,
    ``distill.divergence=js``); the rest hold for every head."""

    MOVED: ClassVar[dict[str, str]] = MOVED  # the error for a flat key of before names its section

    data_dir: str = field(
        default="",
        metadata={
            "help": (
                "output_dir of heads-datagen (head=judge, eagle and draft: several comma-separated data "
                "sets of one target are mixed)"
            )
        },
    )
    draft: ModelSpec = field(default_factory=ModelSpec)
    target: ModelSpec = field(
        default_factory=ModelSpec,
        metadata={
            "help": (
                "head=eagle: the target whose states the head reads (its embeddings, final norm and "
                "output layer initialise the head); head=draft: the target the data was written with "
                "(distill.init=truncate:N copies its layers)"
            )
        },
    )
    head: str = field(
        default="acceptance",
        metadata={
            "help": (
                "acceptance (SpecDec++; alias specdecpp) | verifier (SPRINTER; alias sprinter) | judge "
                "(Judge decoding, on labels=judge data; needs no model) | eagle (an EAGLE-3-style draft "
                "head on the target's states, on labels=drafter data) | draft (a standalone draft model "
                "distilled on the target's top-k distributions along its own responses, DistillSpec; on "
                "labels=drafter data; writes a Hugging Face model directory draft/) | eagle_stop (a "
                "SpecDec++ stop head on an EAGLE head's stored states, on labels=eagle_rounds data; "
                "needs no model; exports head_type=acceptance for policy=specdecpp eagle=...) | eagle_verifier "
                "(SPRINTER's verifier on an EAGLE head's stored states, on labels=eagle_rounds data; needs no model)"
            )
        },
    )
    acceptance: AcceptanceSettings = field(
        default_factory=AcceptanceSettings, metadata={"help": "head=acceptance's settings"}
    )
    verifier: VerifierSettings = field(
        default_factory=VerifierSettings, metadata={"help": "head=verifier's and head=eagle_verifier's settings"}
    )
    judge: JudgeSettings = field(default_factory=JudgeSettings, metadata={"help": "head=judge's settings"})
    eagle: EagleSettings = field(default_factory=EagleSettings, metadata={"help": "head=eagle's settings"})
    distill: DistillSettings = field(default_factory=DistillSettings, metadata={"help": "head=draft's settings"})
    eagle_stop: EagleStopSettings = field(
        default_factory=EagleStopSettings, metadata={"help": "head=eagle_stop's settings"}
    )
    vllm: DatagenVllm = field(
        default_factory=DatagenVllm,
        metadata={"help": "head=eagle eagle.engine=vllm: how vLLM runs the target (vllm.tensor_parallel=4)"},
    )
    vocab_file: str | None = field(
        default=None,
        metadata={
            "help": (
                "eagle: a heads-vocab ranking for the pruned output layer (null: rank the training "
                "responses' tokens); draft: train the draft as it decodes with draft.vocab_file=<this> "
                "(FR-Spec; null: the full vocabulary)"
            )
        },
    )
    vocab_top_n: int = field(
        default=8192,
        metadata={"help": "eagle, draft (with vocab_file): rows of the pruned output layer (EOS always kept)"},
    )
    depth: int = field(
        default=3,
        metadata={
            "help": (
                "residual blocks D (0 = linear; the SPRINTER verifier is linear; eagle_stop with 0: "
                "DSpark's linear confidence head)"
            )
        },
    )
    class_weights: str = field(
        default="balanced",
        metadata={
            "help": (
                "verifier, judge: balanced (weights 1/(2 * class share) from the training labels) | "
                "fixed (w_acc, w_rej)"
            )
        },
    )
    features: str = field(
        default="online",
        metadata={
            "help": ("online: the draft runs inside training; cached: its states are stored once (fp16) and reused")
        },
    )
    cache_dir: str | None = field(
        default=None, metadata={"help": "features=cached: where the files go; default <data_dir>/features"}
    )
    w_acc: float = 1.0
    w_rej: float = 6.0
    lr: float = 5e-5
    weight_decay: float = 0.0
    epochs: int = 3
    batch_size: int = field(default=4, metadata={"help": "sequences per micro-batch (per process)"})
    grad_accum: int = 8
    warmup_ratio: float = 0.03
    eval_fraction: float = 0.1
    patience: int = field(default=1, metadata={"help": "epochs without eval improvement before stopping"})
    max_steps: int | None = field(default=None, metadata={"help": "stop after this many optimizer steps"})
    checkpoint_every: int = field(
        default=0,
        metadata={
            "help": (
                "also checkpoint every this many optimizer steps inside an epoch (0 = at epoch ends "
                "only); a rerun resumes at that data position"
            )
        },
    )
    bf16: bool = field(default=True, metadata={"help": "bf16 autocast where the device supports it"})
    threshold: float = field(
        default=0.7,
        metadata={
            "help": (
                "default threshold stored in the export: acceptance stop threshold h, verifier approval "
                "threshold eta, judge delta"
            )
        },
    )
    threads: int | None = field(
        default=None,
        metadata={
            "help": (
                "torch threads per process (torch.set_num_threads); null: torch's default. Results match "
                "bit for bit only between runs with the same count (see the manifest's numerics)"
            )
        },
    )
    report_to: list[str] = field(
        default_factory=list,
        metadata={
            "help": (
                "experiment trackers (accelerate's): tensorboard | wandb | mlflow | comet_ml | aim | clearml | "
                "dvclive | swanlab | trackio; every metrics.jsonl row is logged to each (empty: none)"
            )
        },
    )
    run_name: str | None = field(
        default=None, metadata={"help": "report_to: the trackers' project/run name (null: output_dir's name)"}
    )
    dist_timeout_s: int = field(
        default=1800,
        metadata={
            "help": (
                "seconds a process waits at a collective (a barrier, a gather) for the others before the "
                "launch fails (the process group's timeout; NCCL's own default is 600)"
            )
        },
    )
    plan: bool = field(default=False, metadata={"help": PLAN_HELP["plan"]})
    nodes: int = field(default=1, metadata={"help": PLAN_HELP["nodes"]})
    gpus: int = field(default=8, metadata={"help": PLAN_HELP["gpus"]})
    gpu_memory_gb: float = field(default=80.0, metadata={"help": PLAN_HELP["gpu_memory_gb"]})
    gpu_bandwidth_gbs: float = field(default=3350.0, metadata={"help": PLAN_HELP["gpu_bandwidth_gbs"]})
    tokens_per_s: float | None = field(default=None, metadata={"help": PLAN_HELP["tokens_per_s"]})
    prompt_tokens: int = field(default=256, metadata={"help": PLAN_HELP["prompt_tokens"]})
    disk_gb: float | None = field(default=None, metadata={"help": PLAN_HELP["disk_gb"]})
    seed: int = 0
    output_dir: str = "runs/train"
    overwrite: bool = False
