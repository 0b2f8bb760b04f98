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
    policy: str = field(default="sd", metadata={"help": "sd (fixed k), specdecpp (needs head=; h=), sprinter (needs a verifier head=; eta=), judge (needs a judge head=; delta=, k candidates), topk_verify (k candidates, verify_top_k), tree (an EAGLE head's draft tree, greedy; needs eagle=; k depth, tree_width, tree_nodes), fsd (k candidates, T=, divergence ...), confidence_stop (tau=, k_max), tli / slem / slrs (a draft with another tokenizer; lossless; slrs: string-level rejection sampling, lookahead=, budget=), ar (target alone), draft (draft alone)"})
    k: int = field(default=4, metadata={"help": "candidates per round for policy=sd, judge, topk_verify and fsd; the draft tree's depth for tree; draft tokens per round for tli and slem; most target tokens per round for slrs"})
    lookahead: int = field(default=0, metadata={"help": "policy=slrs: most draft tokens per step (0: the pair's n_max, computed from the two vocabularies and cached)"})
    budget: int = field(default=64, metadata={"help": "policy=slrs: most prefix-tree nodes (draft positions evaluated; one draft forward per tree level on the CPU's fused forward) per step to compute psi; a larger tree falls back to the target's own token for that step (lossless, counted as slrs_fallbacks)"})
    eagle: str | None = field(default=None, metadata={"help": "an exported EAGLE head (heads-train head=eagle): the same-vocabulary policies draft with it from the target's own states instead of with the draft model (batched too; policy=tree at batch 1)"})
    head: str | None = field(default=None, metadata={"help": "exported head (.safetensors) for policy=specdecpp, sprinter or judge; for fsd optionally an acceptance head trained on FSD labels that stops the drafting (k_min, k_max, its own threshold h)"})
    h: float | None = field(default=None, metadata={"help": "specdecpp: stop threshold in (0, 1) (default: the head's); not used with stop=cost"})
    eta: float | None = field(default=None, metadata={"help": "sprinter: approval threshold in [0, 1] (default: the head's)"})
    delta: float | None = field(default=None, metadata={"help": "judge: threshold in [0, 1] (default: the head's; 1 is SD)"})
    T: float | None = field(default=None, metadata={"help": "fsd: divergence threshold >= 0 (required)"})
    tau: float | None = field(default=None, metadata={"help": "confidence_stop: draft-confidence threshold in [0, 1] (default 0.4); not used with stop=cost"})
    threshold: float | None = field(default=None, metadata={"help": "the policy's threshold under one name: h (specdecpp), eta (sprinter), delta (judge), T (fsd) or tau (confidence_stop)"})
    stop: str = field(default="threshold", metadata={"help": "specdecpp and confidence_stop: threshold (stop at h / tau, see threshold) | cost (no threshold: draft on while one more candidate raises the round's expected tokens per ms of the profiled cost table, see profile)"})
    profile: str = field(default="auto", metadata={"help": "cost table for stop=cost: auto (cached per machine and settings under $SPECHEADS_CACHE/costs, default ~/.cache/specheads/costs; measured when absent) | refresh (measure again) | path to a cost-table JSON"})
    max_run: int | None = field(default=20, metadata={"help": "sprinter: most verifier-approved tokens in a row before the target is called (null: no cap)"})
    k_min: int = field(default=2, metadata={"help": "specdecpp: fewest candidates per round"})
    k_max: int = field(default=20, metadata={"help": "specdecpp and confidence_stop: most candidates per round"})
    tree_width: int = field(default=3, metadata={"help": "tree (with eagle=): children per expanded node and leaves expanded per level of the draft tree"})
    tree_nodes: int = field(default=8, metadata={"help": "tree (with eagle=): draft tokens the target verifies per round (the tree's size; k is its depth)"})
    verify_top_k: int = field(default=2, metadata={"help": "topk_verify: a candidate is accepted while it is among the target's verify_top_k most likely tokens"})
    divergence: str = field(default="js", metadata={"help": "fsd: kl (KL(p||q)) | kl_rev (KL(q||p)) | js | tv, natural log, p target, q draft"})
    fsd_top_k: int = field(default=0, metadata={"help": "fsd: 0 = divergence over the whole vocabulary, else over the target's top fsd_top_k tokens plus one bucket for the rest"})
    fsd_rule: str = field(default="paper", metadata={"help": "fsd: paper (accept while Div < T, else a token from p) | or (accept when SD accepts or Div < T, else the SD residual; T=0 is SD)"})
    fsd_dist: str = field(default="raw", metadata={"help": "fsd: raw (softmax of the unwarped logits) | warped (after sampling.temperature/top_k/top_p; greedy decoding warps nothing: same as raw)"})
    strict: bool = field(default=False, metadata={"help": "refuse (not warn) when sampling differs from the head's"})
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    prompts: str = field(default="", metadata={"help": "JSONL (prompt | messages), GSM8K, Alpaca, MT-Bench or ARC file; several: comma-separated"})
    num_prompts: int | None = field(default=None, metadata={"help": "use only the first N prompts (after offset)"})
    offset: int = field(default=0, metadata={"help": "skip this many prompts first"})
    max_new_tokens: int = 128
    chat_template: bool = field(default=True, metadata={"help": "format prompts with the target's chat template"})
    seed: int = 0
    batch_size: int = field(default=1, metadata={"help": "prompts decoded together (each row its own rounds, one draft and one target forward per step for all rows); > 1 needs a same-vocabulary policy on Llama-family models with fused_forward=true; outputs.jsonl is then in the order prompts finish"})
    fused_forward: bool = field(default=True, metadata={"help": "Llama-family models run a fused forward (same outputs, faster); false: the model's own"})
    output_dir: str = field(default="runs/decode", metadata={"help": "outputs.jsonl, metrics.json, config.yaml, manifest.json"})
    overwrite: bool = field(default=False, metadata={"help": "allow writing into an output_dir that holds another run"})
    engine: str = field(default="specheads", metadata={"help": "specheads (this package's engine) | vllm (vLLM decodes: policy ar = its target alone, sd = its draft_model at k, specdecpp and confidence_stop = the specheads.vllm proposer at k_max; the GGUF target converted once to a cached Hugging Face directory)"})
    vllm_python: str | None = field(default=None, metadata={"help": "engine=vllm: the python of vLLM's virtualenv (default: this one, when it has vLLM)"})
    vllm_threads: int | None = field(default=None, metadata={"help": "engine=vllm: OMP_NUM_THREADS for vLLM on a CPU (default: the machine's cores)"})
    stream: bool = field(default=False, metadata={"help": "print each completion to stdout as it is generated"})
