"""The decode front: from settings to a :class:`~.api.Decoder` (the pair, an EAGLE head, the cost table, the policy
with its head), ``heads-decode`` (:mod:`.decode_cli`) and its vLLM engine (:mod:`.vllm_engine`). It builds on the
runtime (:mod:`specheads.shim`) and the head format (:mod:`specheads.export`); the serving integrations
(:mod:`specheads.vllm`, :mod:`specheads.hf`) and the stages build on it.
"""

from specheads.decode.api import Decoder, generate, load_eagle, make_policy

__all__ = ["Decoder", "generate", "load_eagle", "make_policy"]
