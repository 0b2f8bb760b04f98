"""Where ``heads-datagen`` gets the target's responses and states, per engine (:mod:`specheads.engines`).

:func:`runtime_of` picks a run's :class:`Runtime` once; ``cli.py`` calls its steps and never asks which
engine it has. ``engine=specheads``: every step is a no-op (the label families generate and run the target
themselves). ``engine=vllm``: responses generated up front in vLLM's own processes (``vllm_responses.py``),
the target's states from vLLM's ``extract_hidden_states`` (``vllm_states.py``).
"""

from __future__ import annotations

from pathlib import Path

from specheads.datagen import vllm_responses, vllm_states
from specheads.engines import TargetEngine, engine_of


class Runtime:
    """``engine=specheads``: the package's own target does every pass; nothing to start, take or clear."""

    def __init__(self, engine: TargetEngine):
        self.engine = engine

    def problems(self, cfg) -> list[str]:
        """What this engine's settings cannot run (one-line messages)."""
        return []

    def target_use(self, cfg, family) -> str:
        """What of the package's own target the run loads (``model``, ``output_layer``, ``config``)."""
        return "model"

    def generate_up_front(self, cfg, out: Path, chunks, local_rank: int) -> None:
        """Before the models load: every response of this process's chunks (``chunks``: ``(chunk, items)``)."""

    def states(self, cfg, job, local_rank: int):
        """The run's states server, or None (the labeller runs the target itself)."""
        return None

    def responses(self, job, items: list, chunk: int) -> dict | None:
        """A chunk's pregenerated responses (``job.pregenerated``), or None: the labeller generates them."""
        return None

    def landed(self, out: Path, chunk: int | None = None) -> None:
        """A chunk (None: the whole run) landed on disk: what was kept for it may go."""

    def manifest(self) -> dict:
        """What the run's manifest records about who generated the target's responses."""
        return {}


class VllmRuntime(Runtime):
    """``engine=vllm``: responses up front in vLLM, states from its hidden-states connector."""

    def problems(self, cfg) -> list[str]:
        return vllm_responses.problems(cfg)

    def target_use(self, cfg, family) -> str:
        return family.target_under_vllm(cfg)

    def generate_up_front(self, cfg, out: Path, chunks, local_rank: int) -> None:
        vllm_responses.generate_up_front(cfg, out, chunks, local_rank)

    def states(self, cfg, job, local_rank: int):
        return vllm_states.server(cfg, job, local_rank)

    def responses(self, job, items: list, chunk: int) -> dict | None:
        return vllm_responses.take(job, items, chunk)

    def landed(self, out: Path, chunk: int | None = None) -> None:
        vllm_responses.finish(out, chunk)

    def manifest(self) -> dict:
        return {"engine": self.engine.name}


RUNTIMES: dict[str, type[Runtime]] = {"specheads": Runtime, "vllm": VllmRuntime}


def runtime_of(cfg) -> Runtime:
    """The run's runtime: the engine's (:func:`~specheads.engines.engine_of` raises for an unknown one)."""
    engine = engine_of(cfg)
    return RUNTIMES[engine.name](engine)
