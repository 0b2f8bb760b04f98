"""Schema of ``heads-datagen`` (recipe section ``datagen``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from specheads.plan.inputs import PLAN_HELP
from specheads.shim import ModelSpec, SamplingConfig
from specheads.vllm_config import DatagenVllm

PROG = "heads-datagen"


@dataclass
class AcceptanceOptions:
    """``labels=acceptance`` and ``labels=fsd`` (section ``acceptance``)."""

    expected_label: bool = field(default=True, metadata={"help": "also store 1 - TV(p, q)"})


@dataclass
class SprinterOptions:
    """``labels=sprinter`` (section ``sprinter``: ``sprinter.mix_prob=0.3``)."""

    lambdas: list[float] = field(
        default_factory=lambda: [1.0, 1.2, 1.5],
        metadata={
            "help": (
                "thresholds whose label shares the manifest reports (the raw ratio is stored, "
                "any lambda can be trained)"
            )
        },
    )
    mix_prob: float = field(default=0.5, metadata={"help": "share of the mixed category's tokens taken from the draft"})


@dataclass
class FsdOptions:
    """``labels=fsd`` (section ``fsd``: ``fsd.thresholds=[0.1,0.3]``)."""

    divergences: list[str] = field(
        default_factory=lambda: ["js", "tv"], metadata={"help": "divergences stored per token (kl, kl_rev, js, tv)"}
    )
    thresholds: list[float] = field(
        default_factory=lambda: [0.05, 0.1, 0.2, 0.3, 0.5],
        metadata={
            "help": ("thresholds T whose decisions Div < T are stored (and trainable with heads-train label=fsd)")
        },
    )
    top_k: int = field(
        default=0,
        metadata={"help": "divergences on the target's top-k tokens plus a rest bucket (0: whole vocabulary)"},
    )
    dist: str = field(
        default="raw",
        metadata={
            "help": (
                "raw (softmax of the logits, the paper's) | warped (temperature/top-k/top-p of "
                "sampling; needs sampling.do_sample=true)"
            )
        },
    )


@dataclass
class JudgeOptions:
    """``labels=judge`` (section ``judge``: ``judge.mining=swap``)."""

    tuples: str | None = field(
        default=None,
        metadata={
            "help": ("import this tuple JSONL (schema in datagen/tuples.py) instead of generating answers to prompts")
        },
    )
    answer_models: list[str] = field(
        default_factory=lambda: ["target", "draft"], metadata={"help": "the models that answer each prompt"}
    )
    answer_samples: int = field(
        default=1, metadata={"help": "sampled answers per model and prompt, besides the greedy one"}
    )
    answer_temperature: float = field(default=0.8, metadata={"help": "temperature of the sampled answers"})
    mining: str = field(
        default="arith",
        metadata={
            "help": (
                "where the wrong tokens come from: arith (graded answers of answer_models; the "
                "arithmetic checker localises a wrong answer's first false step) | swap (AutoJudge: each "
                "draft token that differs from the target's greedy one is swapped in and the target "
                "finishes; it is important when the final answer changes)"
            )
        },
    )
    checker: str = field(
        default="auto",
        metadata={
            "help": (
                "judge.mining=swap: how a response's final answer is read: auto (by prompt source) | "
                "gsm8k (final number) | arc (letter) | exact (normalised text) | module:function (your "
                "callable (prompt, text) -> answer)"
            )
        },
    )
    mine_max_mismatches: int = field(
        default=16, metadata={"help": "judge.mining=swap: most mismatches tried per prompt (then a budget hit)"}
    )
    mine_max_tokens: int = field(
        default=2048,
        metadata={
            "help": ("judge.mining=swap: most continuation tokens the target generates per prompt (then a budget hit)")
        },
    )
    mine_max_new_tokens_by_source: dict[str, int] = field(
        default_factory=dict,
        metadata={
            "help": ("judge.mining=swap: a shorter response per prompt source (e.g. {arc: 16}: the letter comes first)")
        },
    )
    mine_eagle: str | None = field(
        default=None,
        metadata={
            "help": (
                "judge.mining=swap: mine this exported EAGLE head's mismatches (its first draft step, teacher-forced "
                "along the response on the target's states) instead of the draft's; engine=specheads"
            )
        },
    )
    mine_label_matches: bool = field(
        default=False,
        metadata={
            "help": (
                "judge.mining=swap: also label every other token of the final response 1 (default: only "
                "the tried mismatches are labelled)"
            )
        },
    )


@dataclass
class DrafterOptions:
    """``labels=drafter`` (section ``drafter``: ``drafter.layers=[2,15,27]``)."""

    layers: list[int] = field(
        default_factory=list,
        metadata={
            "help": (
                "the target layers whose entering residual stream is stored (Hugging Face "
                "hidden_states indices; empty: 2, n/2, n-3 of n layers)"
            )
        },
    )
    top_k: int = field(
        default=20, metadata={"help": "most likely tokens of the target's distribution stored per response token"}
    )
    turn: int = field(
        default=1,
        metadata={
            "help": (
                "messages rows: the assistant turn this part regenerates (1: each conversation's first user "
                "message; t: the t-th, after the target's own earlier answers, datagen/turns.py)"
            )
        },
    )
    history: list[str] = field(
        default_factory=list,
        metadata={"help": "drafter.turn=t: the output_dir of the parts of turns 1 .. t-1, in turn order"},
    )
    store_states: bool = field(
        default=True,
        metadata={
            "help": (
                "false: the states are not stored (ids and top-k only, about 2 x 4 x top_k bytes a response token): "
                "heads-train head=eagle makes them while it trains (eagle.states=online or hybrid)"
            )
        },
    )


@dataclass
class SelfPromptOptions:
    """``labels=prompts`` (section ``self_prompts``: ``self_prompts.kinds=[writing,code]``)."""

    kinds: list[str] = field(
        default_factory=lambda: ["writing", "reasoning", "code", "extraction", "facts", "chat"],
        metadata={
            "help": "the kinds of request the target writes, in turn (writing, reasoning, code, extraction, "
            "facts, chat; also roleplay, math, stem, humanities; or name:<system message>)"
        },
    )
    min_tokens: int = field(default=8, metadata={"help": "shortest user turn kept, in tokens"})


@dataclass
class PassageOptions:
    """``labels=passages`` (section ``passages``: ``passages.sources=[runs/a,runs/b]``)."""

    sources: list[str] = field(
        default_factory=list,
        metadata={
            "help": (
                "what the passages are made of: labels=drafter output directories (the target's responses) or "
                "JSON / JSONL files of documents (each row's passages.text_field)"
            )
        },
    )
    text_field: str = field(
        default="text", metadata={"help": "the text field of a file source's rows (Alpaca's reference answers: output)"}
    )
    rows: int | None = field(
        default=None, metadata={"help": "at most this many rows of each file source, its first (null: all)"}
    )
    tasks: list[str] = field(
        default_factory=lambda: [
            "extract",
            "summarise",
            "list",
            "rewrite",
            "question",
            "keywords",
            "title",
            "classify",
        ],
        metadata={
            "help": "the task kinds, in turn: extract, summarise, list, rewrite, question, keywords, title, classify"
        },
    )
    min_tokens: int = field(default=200, metadata={"help": "shortest passage, in target tokens"})
    max_tokens: int = field(default=450, metadata={"help": "longest passage, in target tokens (cut at a sentence)"})


@dataclass
class EagleRoundsOptions:
    """``labels=eagle_rounds`` (section ``eagle_rounds``: ``eagle_rounds.head=HEAD.safetensors``)."""

    head: str = field(
        default="",
        metadata={"help": ("the exported EAGLE head (heads-train head=eagle, then heads-export) that drafts")},
    )
    k: int = field(
        default=8,
        metadata={"help": ("candidates per SD round (every one labelled but a round's last, which has no head state)")},
    )
    position: str = field(
        default="own",
        metadata={
            "help": (
                "which head state a candidate is stored with: own (after consuming it; the lag-1 "
                "SpecDec++ head, every candidate but a round's last) | previous (the state that drew it; a lag-0 "
                "head scores every candidate as soon as it is drawn)"
            )
        },
    )


@dataclass
class DatagenConfig:
    """Run target and draft over prompts and write labelled examples; `heads-datagen ... verify` checks a
    finished output_dir, `heads-datagen merge from=DIR,DIR output_dir=DIR` joins per-node outputs."""

    target: ModelSpec = field(default_factory=ModelSpec)
    draft: ModelSpec = field(default_factory=ModelSpec)
    labels: str = field(
        default="acceptance",
        metadata={
            "help": (
                "acceptance (SpecDec++ soft labels) | fsd (acceptance data plus FSD divergences and Div "
                "< T decisions) | sprinter (ratio-threshold labels, four prefix categories) | judge "
                "(correct/wrong tuples, token labels, target features) | drafter (the target's "
                "responses, its states at chosen layers and top-k distributions: what heads-train "
                "head=eagle and head=draft learn from) | prompts (user turns the target writes itself, "
                "Magpie-style: output_dir/prompts.jsonl) | passages (instructions over passages made of earlier "
                "responses, no model run: output_dir/prompts.jsonl) | eagle_rounds (SpecDec++ labels of an EAGLE "
                "head's candidates, from SD decoding with it: what heads-train head=eagle_stop learns "
                "from)"
            )
        },
    )
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    prompts: str = field(
        default="", metadata={"help": "prompt file (JSONL, GSM8K, Alpaca, MT-Bench, ARC); several: comma-separated"}
    )
    num_prompts: int | None = field(default=None, metadata={"help": "use only the first N prompts (after offset)"})
    offset: int = 0
    max_new_tokens: int = field(default=128, metadata={"help": "length of the target's responses"})
    chat_template: bool = True
    batch_size: int = field(
        default=16, metadata={"help": "prompts per forward (one batch generates and is labelled together)"}
    )
    chunk_size: int = field(default=32, metadata={"help": "prompts per output file (the unit of resumption)"})
    acceptance: AcceptanceOptions = field(
        default_factory=AcceptanceOptions,
        metadata={"help": "labels=acceptance (and fsd, which stores the same columns)"},
    )
    sprinter: SprinterOptions = field(default_factory=SprinterOptions, metadata={"help": "labels=sprinter"})
    fsd: FsdOptions = field(default_factory=FsdOptions, metadata={"help": "labels=fsd"})
    judge: JudgeOptions = field(default_factory=JudgeOptions, metadata={"help": "labels=judge"})
    drafter: DrafterOptions = field(default_factory=DrafterOptions, metadata={"help": "labels=drafter"})
    self_prompts: SelfPromptOptions = field(default_factory=SelfPromptOptions, metadata={"help": "labels=prompts"})
    passages: PassageOptions = field(default_factory=PassageOptions, metadata={"help": "labels=passages"})
    eagle_rounds: EagleRoundsOptions = field(
        default_factory=EagleRoundsOptions, metadata={"help": "labels=eagle_rounds"}
    )
    engine: str = field(
        default="specheads",
        metadata={
            "help": (
                "specheads (this package generates the target's responses with Transformers) | vllm "
                "(vLLM generates every response the run needs, all chunks in one offline run up front, "
                "and judge.mining=swap's continuations; labels=acceptance, fsd, sprinter, drafter, judge; greedy "
                "responses are the specheads engine's, sampled ones are seeded per prompt and differ)"
            )
        },
    )
    vllm: DatagenVllm = field(
        default_factory=DatagenVllm, metadata={"help": "engine=vllm: how vLLM runs the target (vllm.tensor_parallel=8)"}
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
    seed: int = 0
    output_dir: str = "runs/datagen"
    overwrite: bool = False
