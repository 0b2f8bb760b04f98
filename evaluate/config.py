"""Schema of ``heads-eval`` (recipe section ``eval``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from specheads.shim import DIVERGENCES, ModelSpec, SamplingConfig
from specheads.vllm_config import ServeVllm


@dataclass
class SprinterRows:
    """SPRINTER rows ``s<eta>``: section ``sprinter`` (``sprinter.head=V.safetensors sprinter.etas=[0.5,0.7]``)."""

    head: str | None = field(default=None, metadata={"help": "exported SPRINTER verifier head; none: no SPRINTER rows"})
    etas: list[float] = field(
        default_factory=lambda: [0.5], metadata={"help": "SPRINTER approval thresholds eta to sweep"}
    )
    max_run: int | None = field(default=20, metadata={"help": "most approved tokens in a row (null: no cap)"})


@dataclass
class JudgeRows:
    """judge rows ``j<delta>``: section ``judge`` (``judge.head=J.safetensors judge.deltas=[0.5,0.9]``)."""

    head: str | None = field(default=None, metadata={"help": "exported judge head; none: no judge rows"})
    heads: dict[str, str] = field(
        default_factory=dict,
        metadata={
            "help": (
                "several exported judge heads side by side, by name (e.g. {arith: A.safetensors, mined: "
                "B.safetensors}): rows j-<name>-<delta>, each gated on its own (family judge_<name>)"
            )
        },
    )
    deltas: list[float] = field(
        default_factory=lambda: [0.5], metadata={"help": "judge thresholds delta to sweep (every judge)"}
    )
    head_deltas: dict[str, list[float]] = field(
        default_factory=dict,
        metadata={
            "help": (
                "per named judge (judge.heads), its own deltas instead of judge.deltas (heads trained on other "
                "labels sit on other scales)"
            )
        },
    )
    k: int = field(default=10, metadata={"help": "candidates per round"})


@dataclass
class TopkRows:
    """top-K verification rows ``t<K>``: section ``topk`` (``topk.ks=[2,4]``)."""

    ks: list[int] = field(
        default_factory=list,
        metadata={"help": "top-K verification baselines: the K values (target top-K tokens accepted)"},
    )
    k: int = field(default=4, metadata={"help": "candidates per round"})


@dataclass
class FsdRows:
    """FSD rows ``fsd-<divergence>-<T>``: section ``fsd`` (``fsd.js=[0.1,0.3] fsd.rule=or``)."""

    js: list[float] = field(
        default_factory=list,
        metadata={"help": "FSD thresholds T for the Jensen-Shannon divergence (rows fsd-js-<T>; at most ln 2)"},
    )
    tv: list[float] = field(
        default_factory=list,
        metadata={"help": "FSD thresholds T for the total variation distance (rows fsd-tv-<T>; in [0, 1])"},
    )
    kl: list[float] = field(
        default_factory=list, metadata={"help": "FSD thresholds T for KL(target || draft) (rows fsd-kl-<T>)"}
    )
    kl_rev: list[float] = field(
        default_factory=list, metadata={"help": "FSD thresholds T for KL(draft || target) (rows fsd-kl_rev-<T>)"}
    )
    k: int = field(default=4, metadata={"help": "candidates per round"})
    rule: str = field(
        default="paper",
        metadata={
            "help": (
                "paper (accept while Div < T, else a token from p) | or (SD accepts or Div < T, "
                "else the residual; T=0 is SD)"
            )
        },
    )
    top_k: int = field(
        default=0,
        metadata={
            "help": ("0 = divergences over the whole vocabulary, else the target's top-k tokens plus one bucket")
        },
    )
    dist: str = field(
        default="raw",
        metadata={
            "help": (
                "raw (softmax of unwarped logits) | warped (after temperature/top-k/top-p; same as raw when greedy)"
            )
        },
    )

    def swept(self) -> dict[str, list[float]]:
        """The thresholds to sweep by divergence (``{"js": [0.1, 0.3]}``), in DIVERGENCES' order; empty: no row."""
        return {d: list(getattr(self, d)) for d in DIVERGENCES if getattr(self, d)}


@dataclass
class ConfidenceRows:
    """draft-confidence stop rows ``c<tau>``: section ``confidence`` (``confidence.taus=[0.5]``)."""

    taus: list[float] = field(
        default_factory=list,
        metadata={
            "help": ("draft-confidence stopping baselines: taus in [0, 1] (rows c<tau>; stop drafting when q(y) < tau)")
        },
    )
    k_max: int = field(default=10, metadata={"help": "most candidates per round"})
    estimates: list[str] = field(
        default_factory=lambda: ["q", "online", "entropy"],
        metadata={
            "help": (
                "with confidence.taus and cost_stop: the training-free acceptance estimates the cost rule runs with, "
                "one row each: q (row c-cost: q(y)), online (c-online-cost: a logistic model on logit(max q) "
                "learnt while decoding, vLLM's estimator), entropy (c-entropy-cost: AdaEDL's entropy bound)"
            )
        },
    )


@dataclass
class HeteroRows:
    """heterogeneous-vocabulary rows ``v-<method>-k<k>``: section ``hetero`` (``hetero.methods=[tli,slem]``)."""

    methods: list[str] = field(
        default_factory=list,
        metadata={
            "help": (
                "heterogeneous-vocabulary methods: tli, slem and/or slrs (rows v-<method>-k<hetero.k>); "
                "with a draft whose tokenizer differs from the target's, only these, ar and draft can run"
            )
        },
    )
    k: int = field(
        default=2, metadata={"help": "tli / slem: draft tokens per round; slrs: most target tokens per round"}
    )


@dataclass
class EvalConfig:
    """Compare decoding configurations on one prompt set, in one run: target alone, draft alone, fixed-K
    SD, SpecDec++ thresholds (head=) and its cost-aware rule (cost_stop), and per family a section of rows:
    SPRINTER (sprinter.head=), judges (judge.head=), top-K verification (topk.ks=), FSD per divergence
    (fsd.js=, fsd.tv=, fsd.kl=, fsd.kl_rev=), draft-confidence stopping (confidence.taus=) and
    heterogeneous-vocabulary methods (hetero.methods=); with eagle=, the same-vocabulary rows on an EAGLE head."""

    target: ModelSpec = field(default_factory=ModelSpec)
    draft: ModelSpec = field(default_factory=ModelSpec)
    head: str | None = field(default=None, metadata={"help": "exported acceptance head; none: fixed K only"})
    eagle: str | None = field(
        default=None,
        metadata={
            "help": (
                "an exported EAGLE head (heads-train head=eagle): the same-vocabulary rows (k, h, "
                "h-cost, c, c-cost, t, j, fsd) draft with it from the target's own states instead of with the "
                "draft model (tree rows at batch 1; head= then needs a stop head trained on its states, "
                "heads-train head=eagle_stop); no draft model needed (without draft.path no draft row); "
                "not with sprinter.head= (trained on the draft's states) or hetero.methods="
            )
        },
    )
    thresholds: list[float] = field(
        default_factory=lambda: [0.1, 0.3, 0.5, 0.7, 0.9], metadata={"help": "SpecDec++ stop thresholds h to sweep"}
    )
    cost_stop: bool = field(
        default=True,
        metadata={
            "help": (
                "also sweep the cost-aware stop rules (no threshold; draft on while one more candidate "
                "raises expected tokens per ms of the cost table): row h-cost with head=, row c-cost "
                "with confidence.taus"
            )
        },
    )
    profile: str = field(
        default="auto",
        metadata={
            "help": (
                "cost table behind predicted ms/token and the cost-aware rows: auto (cached per machine "
                "and settings under $SPECHEADS_CACHE/costs, default ~/.cache/specheads/costs; measured "
                "when absent) | refresh (measure again) | path to a cost-table JSON"
            )
        },
    )
    ks: list[int] = field(default_factory=lambda: [1, 2, 3, 4, 6, 8], metadata={"help": "fixed candidate lengths K"})
    sprinter: SprinterRows = field(default_factory=SprinterRows, metadata={"help": "SPRINTER rows"})
    judge: JudgeRows = field(default_factory=JudgeRows)
    trees: list[str] = field(
        default_factory=list,
        metadata={
            "help": (
                "with eagle= (greedy): draft trees on the EAGLE head as DEPTHxWIDTHxNODES, e.g. 4x3x8 "
                "(rows tree-4x3x8; policy=tree: the head's best paths, EAGLE-2's dynamic tree, verified "
                "in one target pass); DxWxN-cost sizes each round's tree by the cost table (stop=cost, "
                "at most D levels and N tokens)"
            )
        },
    )
    topk: TopkRows = field(default_factory=TopkRows)
    fsd: FsdRows = field(default_factory=FsdRows)
    confidence: ConfidenceRows = field(default_factory=ConfidenceRows)
    hetero: HeteroRows = field(default_factory=HeteroRows)
    rows: list[dict[str, Any]] = field(
        default_factory=list,
        metadata={
            "help": (
                "more rows, any registered policy: [{policy: NAME, settings: {SETTING: VALUE}, sweep: {SETTING: "
                "[VALUES]}, name: PREFIX}], e.g. [{policy: judge, settings: {head: J, k: 10}, sweep: {delta: "
                "[0.5, 0.9]}}] (rows judge-delta0.5, judge-delta0.9); the fields above are a shorthand for the "
                "built-in policies' rows"
            )
        },
    )
    accuracy: bool = field(
        default=True, metadata={"help": "grade outputs where a grader exists: GSM8K final number, ARC letter"}
    )
    write_default: bool = field(
        default=False,
        metadata={
            "help": (
                "with select=: write each chosen judge / sprinter threshold into its head file as "
                "default_threshold (with how it was chosen)"
            )
        },
    )
    select: str | None = field(
        default=None,
        metadata={
            "help": (
                "max_drop:X, max_disagree:Y or both (max_drop:0.01,max_disagree:0.02): for each lossy policy "
                "(judge, sprinter, topk, fsd), the fastest row whose accuracy drop against the target alone "
                "(on the sources where the target is competent) is <= X and whose share of answers that differ "
                "from the target's is <= Y on every graded source, each at the upper 95% bound on the "
                "even-indexed prompts, reported on the odd-indexed ones (section gated)"
            )
        },
    )
    competence_margin: float = field(
        default=0.1,
        metadata={
            "help": (
                "a graded source is informative when the target alone's accuracy lower bound is at least this "
                "far above chance; max_drop counts only informative sources (section competence)"
            )
        },
    )
    fidelity: bool = field(
        default=True,
        metadata={
            "help": (
                "the target's teacher-forced log-probability of each row's outputs against its own "
                "(fidelity.<row>.logprob_gap; one batched target pass per output that differs)"
            )
        },
    )
    quality: bool = field(
        default=True, metadata={"help": "ROUGE vs target-only outputs and references, FLOPs per token, SPRINTER alpha"}
    )
    k_min: int = field(default=2, metadata={"help": "specdecpp: fewest candidates per round"})
    k_max: int = field(default=20, metadata={"help": "specdecpp (and the oracle): most candidates per round"})
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    prompts: str = field(
        default="",
        metadata={
            "help": (
                "held-out prompt file(s), comma-separated (JSONL, GSM8K, MT-Bench ...); file[500:650] takes rows "
                "500-649 of that file; specheads:facts is the built-in fact questions"
            )
        },
    )
    num_prompts: int | None = field(default=None, metadata={"help": "first N prompts of each file (after offset)"})
    offset: int = 0
    max_new_tokens: int = 128
    max_new_tokens_by_source: dict[str, int] = field(
        default_factory=dict,
        metadata={
            "help": (
                "a smaller budget per prompt source (arc, gsm8k, facts, mt_bench, alpaca, prompt, messages), "
                "e.g. {arc: 16}: ARC needs only the letter"
            )
        },
    )
    chat_template: bool = True
    oracle: bool = field(
        default=True, metadata={"help": "greedy oracle (docs/algorithms/cost-model.md); greedy decoding only"}
    )
    fused_forward: bool = True
    seed: int = 0
    batch_size: int = field(
        default=1,
        metadata={
            "help": (
                "prompts each configuration decodes together (heads-decode batch_size); > 1: "
                "configurations take turns block by block (4 x batch_size prompts), a row's wall_time is "
                "its share of the block's time (tokens/s = throughput) and latency_s its own; tli/slem "
                "rows stay at batch 1"
            )
        },
    )
    packed: bool = field(default=True, metadata={"help": "batch_size > 1: heads-decode packed (real tokens only)"})
    engine: str = field(
        default="specheads",
        metadata={
            "help": (
                "specheads (this package's engine) | vllm (vLLM decodes each row: ar = its target alone, "
                "k<K> = its draft_model, h<h>/h-cost/c<tau>/c-cost = the specheads.vllm.proposer proposer; see "
                "evaluate/vllm_sweep.py)"
            )
        },
    )
    vllm: ServeVllm = field(
        default_factory=ServeVllm, metadata={"help": "engine=vllm: how vLLM runs the target (vllm.tensor_parallel=8)"}
    )
    output_dir: str = field(
        default="runs/eval", metadata={"help": "sweep.json, pareto.png, rows.jsonl, metrics.jsonl ..."}
    )
    overwrite: bool = False
