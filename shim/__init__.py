"""The decoding runtime (the inference shim): model loading, KV caches, policies, the draft/verify loop.

This package's ``__init__`` is its public interface: the rest of specheads (the stages, the root
modules) imports these names from ``specheads.shim`` and never reaches into a subpackage
(``tests/test_layout.py`` checks it). Inside, the parts are:

- ``loop``: the one decoding loop (:class:`Engine`), what a round leaves behind, drafting, sampling,
  divergences, the counts (:class:`GenerationStats`) and tree drafting's loop;
- ``policies``: the :class:`Policy` interface, its :class:`Round` and :class:`Verdict`, every policy
  and the registry (:data:`POLICIES`);
- ``runners``: loading a pair (:class:`ModelSpec`, :func:`load_pair`), the runners and their KV
  caches, the fused Llama forward, the linear kernels timed on this machine, hidden states;
- ``costs``: the cost table (:class:`CostTable`), how it is measured and the rules that decide from it;
- ``batching``: batched decoding (:class:`BatchEngine`), its per-row caches, data generation's batched
  generation and the row proposer a serving engine (vLLM) drives;
- ``vocab``: draft vocabulary pruning and decoding across two vocabularies (TLI, SLEM, SLRS).
"""

from specheads.shim.batching.batch_generate import generate as batch_generate
from specheads.shim.batching.batch_generate import use_fused
from specheads.shim.batching.batch_loop import BatchEngine, BatchJob
from specheads.shim.batching.row_proposer import RowProposer
from specheads.shim.core.divergence import DIVERGENCES, divergence
from specheads.shim.core.sampling import (
    SamplingConfig,
    probs_from_logits,
    sample,
    sample_finite,
    uniform,
    usable_logits,
)
from specheads.shim.core.stats import COUNTS, GenerationStats
from specheads.shim.costs.cost_profile import batch_sizes, sync_device
from specheads.shim.costs.cost_rules import predict_ms_per_token
from specheads.shim.costs.cost_table import PROFILES, CostTable, cost_table, load_table
from specheads.shim.loop.engine import Engine
from specheads.shim.loop.rounds import Result
from specheads.shim.loop.tree_loop import tree_problems, tree_target_problem
from specheads.shim.policies import (
    FSD,
    POLICIES,
    SLEM,
    SLRS,
    STOPS,
    TLI,
    UNSET,
    Check,
    ConfidenceStop,
    DraftOnly,
    EagleTree,
    HeadSpec,
    Judge,
    Policy,
    Round,
    Settings,
    SpecDecPP,
    Sprinter,
    StandardSD,
    TargetOnly,
    TopKVerify,
    Verdict,
    policy_class,
    register_policy,
    settle,
    standard_verify,
)
from specheads.shim.runners.fused import prepare_kernels, supports
from specheads.shim.runners.hidden import AuxCapture, HiddenCapture, final_norm, output_device
from specheads.shim.runners.kernels import describe as describe_kernels
from specheads.shim.runners.kernels import unroute
from specheads.shim.runners.model_facts import context_length, eos_ids, pad_batch
from specheads.shim.runners.model_runner import make_runner
from specheads.shim.runners.models import (
    DTYPES,
    LoadedModel,
    ModelSpec,
    Pair,
    check_same_vocab,
    file_digest,
    fingerprint,
    load_model,
    load_pair,
    prune_to_vocab_file,
    resolve_device,
    resolve_dtype,
    resolve_location,
    same_vocabulary,
)
from specheads.shim.runners.vocab_pruning import FORMAT as VOCAB_FORMAT
from specheads.shim.runners.vocab_pruning import describe as describe_vocab
from specheads.shim.runners.vocab_pruning import read_ranking, same_subset, subset_from_ranking, subset_hash, vocab_info
from specheads.shim.vocab.hetero_loop import Bridge

__all__ = [
    # the loop
    "Engine",
    "Result",
    "GenerationStats",
    "COUNTS",
    "SamplingConfig",
    "probs_from_logits",
    "sample",
    "sample_finite",
    "uniform",
    "usable_logits",
    "DIVERGENCES",
    "divergence",
    "tree_problems",
    "tree_target_problem",
    # policies
    "Policy",
    "Round",
    "Verdict",
    "Settings",
    "Check",
    "UNSET",
    "settle",
    "HeadSpec",
    "POLICIES",
    "STOPS",
    "policy_class",
    "register_policy",
    "standard_verify",
    "StandardSD",
    "SpecDecPP",
    "Sprinter",
    "Judge",
    "TopKVerify",
    "FSD",
    "ConfidenceStop",
    "EagleTree",
    "TLI",
    "SLEM",
    "SLRS",
    "TargetOnly",
    "DraftOnly",
    # models, runners, kernels
    "ModelSpec",
    "Pair",
    "LoadedModel",
    "DTYPES",
    "load_model",
    "load_pair",
    "make_runner",
    "AuxCapture",
    "HiddenCapture",
    "output_device",
    "final_norm",
    "supports",
    "context_length",
    "eos_ids",
    "pad_batch",
    "fingerprint",
    "file_digest",
    "check_same_vocab",
    "same_vocabulary",
    "vocab_info",
    "resolve_device",
    "resolve_dtype",
    "resolve_location",
    "prune_to_vocab_file",
    "describe_kernels",
    "prepare_kernels",
    "unroute",
    # costs
    "CostTable",
    "PROFILES",
    "cost_table",
    "load_table",
    "batch_sizes",
    "sync_device",
    "predict_ms_per_token",
    # batching
    "BatchEngine",
    "BatchJob",
    "RowProposer",
    "batch_generate",
    "use_fused",
    # vocabularies
    "Bridge",
    "VOCAB_FORMAT",
    "describe_vocab",
    "read_ranking",
    "same_subset",
    "subset_from_ranking",
    "subset_hash",
]
