"""Export and the decoding shim.

The public API is at the top of the package (``import specheads``; docs/python-api.md)::

    import specheads
    pair = specheads.load_pair(specheads.ModelSpec(path="target_dir"), specheads.ModelSpec(path="draft_dir"))
    results = specheads.generate(pair, "What is 2 + 3?", policy="sd", k=4, max_new_tokens=64)

This module offers the same names under ``specheads.export``, and the engine's parts beside them.
"""

from specheads.export.api import Decoder, generate, make_policy
from specheads.export.package import LoadedHead, load_head, read_metadata, save_head  # noqa: F401  (importable, not in __all__)
from specheads.export.shim import (  # noqa: F401  (importable, not in __all__: the engine and its parts)
    POLICIES,
    Engine,
    GenerationStats,
    HiddenCapture,
    ModelSpec,
    Pair,
    Policy,
    Result,
    Round,
    SamplingConfig,
    Settings,
    StandardSD,
    Verdict,
    load_model,
    load_pair,
    register_policy,
)

__all__ = [
    "Decoder",
    "LoadedHead",
    "ModelSpec",
    "POLICIES",
    "Policy",
    "Result",
    "Round",
    "SamplingConfig",
    "Settings",
    "Verdict",
    "generate",
    "load_head",
    "load_pair",
    "make_policy",
    "register_policy",
]
