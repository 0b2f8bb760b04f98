"""specheads: training toolkit for the learned heads of speculative decoding.

``specheads.load_head(path_or_repo_id, pair=None)`` loads an exported head (a ``.safetensors`` file, a
``heads-export format=hf`` directory or a Hub repo id); the rest lives in ``specheads.export``.
"""

__version__ = "0.1.0"


def __getattr__(name: str):
    if name == "load_head":  # imported on first use: ``import specheads`` stays light
        from specheads.export.package import load_head

        return load_head
    raise AttributeError(f"module 'specheads' has no attribute {name!r}")
