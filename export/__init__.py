"""Export and the decoding shim.

Public API::

    from specheads.export import load_pair, generate, ModelSpec, SamplingConfig
    pair = load_pair(ModelSpec(path="target_dir"), ModelSpec(path="draft_dir"))
    results = generate(pair, "What is 2 + 3?", policy="sd", k=4, max_new_tokens=64)
    head = load_head("head.safetensors", pair=pair)   # checked against the pair
"""

from .package import LoadedHead, load_head, read_metadata, save_head
from .api import Decoder, Result, fit_context, format_prompt, generate
from .shim.engine import Engine, Generation, GenerationStats
from .shim.hidden import HiddenCapture
from .shim.models import ModelSpec, Pair, load_model, load_pair
from .shim.policies import POLICIES, Policy, Round, StandardSD, Verdict, build_policy
from .shim.sampling import SamplingConfig

__all__ = [
    "Decoder", "Engine", "LoadedHead", "load_head", "read_metadata", "save_head", "Generation", "GenerationStats", "HiddenCapture", "ModelSpec", "Pair", "POLICIES", "Policy",
    "Result", "Round", "SamplingConfig", "StandardSD", "Verdict", "build_policy", "fit_context",
    "format_prompt", "generate", "load_model", "load_pair",
]
