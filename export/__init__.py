"""The exported head's file format: one ``.safetensors`` file per head with its metadata in the header
(:mod:`.package`), the Hub-style directory (:mod:`.hub`), the speculators layout vLLM reads (:mod:`.speculators`)
and ``heads-export`` (:mod:`.cli`). Decoding with a head is :mod:`specheads.decode`; the runtime
:mod:`specheads.shim`; the public API is at the top of the package (``import specheads``; docs/python-api.md).
"""

from specheads.export.package import LoadedHead, load_head, read_metadata, save_head

__all__ = ["LoadedHead", "load_head", "read_metadata", "save_head"]
