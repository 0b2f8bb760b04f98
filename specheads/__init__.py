"""specheads: training toolkit for the learned heads of speculative decoding.

The public Python API (docs/python-api.md) is these names, imported on first use so that
``import specheads`` stays light::

    import specheads

    pair = specheads.load_pair(specheads.ModelSpec(path="target"), specheads.ModelSpec(path="draft"))
    head = "runs/specdecpp_draft_quickstart-export/head.safetensors"
    print(specheads.load_head(head, pair=pair).metadata["head_type"])     # checked against the pair
    policy = specheads.make_policy("specdecpp", pair, head=head, h=0.7)
    for result in specheads.generate(pair, ["What is 2 + 3?"], policy=policy, max_new_tokens=64):
        print(result.text, result.stats.tokens_per_call)

- loading: :func:`load_pair`, :class:`ModelSpec`, :func:`load_head`, :func:`load_eagle`, :class:`SamplingConfig`;
- decoding: :func:`generate`, :class:`Decoder`, :class:`Result`, :func:`make_policy` (the one way to build
  a policy) and :data:`POLICIES`;
- writing a policy: :class:`Policy` (its required and optional hooks: ``Policy.REQUIRED_HOOKS``,
  ``Policy.OPTIONAL_HOOKS``), :class:`Round`, :class:`Verdict`, :class:`Settings`, :func:`register_policy`;
- Hugging Face ``generate``: :class:`Assistant`.

Everything else is internal: the stages' modules and the runtime under ``specheads.shim``.
"""

__version__ = "0.3.0"

_API = {
    "load_pair": "specheads.shim:load_pair",
    "ModelSpec": "specheads.shim:ModelSpec",
    "SamplingConfig": "specheads.shim:SamplingConfig",
    "load_head": "specheads.export.package:load_head",
    "load_eagle": "specheads.decode.api:load_eagle",
    "generate": "specheads.decode.api:generate",
    "Decoder": "specheads.decode.api:Decoder",
    "Result": "specheads.shim:Result",
    "make_policy": "specheads.decode.policy_factory:make_policy",
    "POLICIES": "specheads.shim:POLICIES",
    "Policy": "specheads.shim:Policy",
    "Round": "specheads.shim:Round",
    "Verdict": "specheads.shim:Verdict",
    "Settings": "specheads.shim:Settings",
    "register_policy": "specheads.shim:register_policy",
    "Assistant": "specheads.hf:Assistant",
}
__all__ = sorted(_API)


def __getattr__(name: str):
    if name in _API:  # imported on first use: ``import specheads`` stays light
        import importlib

        module, _, attr = _API[name].partition(":")
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(f"module 'specheads' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_API])
