"""Export and the decoding shim.

Public API::

    from specheads.export import load_pair, generate, ModelSpec, SamplingConfig
    pair = load_pair(ModelSpec(path="target_dir"), ModelSpec(path="draft_dir"))
    results = generate(pair, "What is 2 + 3?", policy="sd", k=4, max_new_tokens=64)
"""

from .api import Result, fit_context, format_prompt, generate
from .shim.engine import Engine, Generation, GenerationStats
from .shim.models import HiddenCapture, ModelSpec, Pair, load_model, load_pair
from .shim.policies import POLICIES, Policy, Round, StandardSD, Verdict, build_policy
from .shim.sampling import SamplingConfig

__all__ = [
    "Engine", "Generation", "GenerationStats", "HiddenCapture", "ModelSpec", "Pair", "POLICIES", "Policy",
    "Result", "Round", "SamplingConfig", "StandardSD", "Verdict", "build_policy", "fit_context",
    "format_prompt", "generate", "load_model", "load_pair",
]
