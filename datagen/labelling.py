"""What a label family gives ``heads-datagen``: the :class:`Labeller` interface and the :class:`Job` it labels in.

``cli.py`` loads the models once into a :class:`Job`, then hands every chunk of items (prompts, or
imported tuples) it owns to the run's labeller (``registry.py`` maps ``labels=`` to one); at the
end ``manifest.py`` asks the same labeller for the run's statistics. A labeller decides nothing
about sharding, resumption or files: chunk ``c`` of a run is labelled from its items and the
seed ``shards.chunk_seed(seed, c)`` alone, so any process count gives the same bytes.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from specheads.datagen.config import DatagenConfig
from specheads.decode.api import fit_context, format_prompt, load_eagle
from specheads.prompts import iter_prompt_files
from specheads.shim import Pair

log = logging.getLogger(__name__)


@dataclass
class Job:
    """One process's loaded run: its settings and the models every chunk is labelled with.

    Args:
        cfg: the run's settings.
        pair: the target and (when the family needs one) the draft, one vocabulary.
        pad: the padding token id.
        eos: the token ids that end a response.
        limit: the shortest context length of the loaded models.
        pregenerated: ``engine=vllm``: the chunk's side file (the target's responses vLLM generated, by key:
            ``vllm_responses.requests_for``); None: the labeller generates them.
        states: ``engine=vllm``: the vLLM child that gives the target's hidden states
            (:class:`specheads.vllm.child.StatesServer`; drafter, judge, sprinter); None: the labeller
            runs the Transformers target.
    """

    cfg: DatagenConfig
    pair: Pair
    pad: int
    eos: list[int]
    limit: int
    pregenerated: dict | None = None
    states: object | None = None
    eagle: object | None = None  # the run's EAGLE head, once :meth:`eagle_head` has loaded it

    def eagle_head(self, path: str):
        """The EAGLE head at ``path`` (an exported file), checked against the target: loaded once per process, so
        a family calls this in ``check_models`` (a head for another target fails before any chunk) and per chunk."""
        if self.eagle is None:
            self.eagle = load_eagle(path, self.pair)
        return self.eagle

    def response(self, key: str) -> tuple[list[int], bool]:
        """A pre-generated target response (``engine=vllm``) and whether its log-probabilities were finite."""
        return list(self.pregenerated["responses"][key]), bool(self.pregenerated["finite"][key])

    def prompt_ids(self, prompts) -> list[list[int]]:
        """Each prompt's token ids (chat template per ``chat_template``), cut to leave room for the response."""
        return [
            fit_context(
                format_prompt(self.pair.tokenizer, p, self.cfg.chat_template), self.cfg.max_new_tokens, self.limit
            )[0]
            for p in prompts
        ]

    def first_index(self, chunk: int) -> int:
        """The run-wide index (``offset`` included) of a chunk's first item."""
        return self.cfg.offset + chunk * self.cfg.chunk_size


@dataclass
class Labelled:
    """One chunk's result: its Parquet columns, its number of labelled tokens and the skipped samples."""

    columns: dict[str, list]
    tokens: int
    skipped: list[dict]


def skip_record(prompt, index: int, reason: str) -> dict:
    """A prompt left out (e.g. its logits hold NaN/Inf): logged, and kept in the chunk's footer."""
    log.warning("prompt %d (%s) skipped: %s", index, prompt.id, reason)
    return {"prompt_index": index, "prompt_id": str(prompt.id), "reason": reason}


class Labeller:
    """One ``labels=`` family. Subclasses implement :meth:`label_chunk` and :meth:`summarise`;
    the other hooks have the defaults of a family that labels prompts with both models."""

    def problems(self, cfg: DatagenConfig) -> list[str]:
        """One line per invalid setting of this family (empty when valid)."""
        return [] if cfg.prompts else ["prompts is not set; pass prompts=<file>"]

    def needs_draft(self, cfg: DatagenConfig) -> bool:
        return True

    def target_under_vllm(self, cfg: DatagenConfig) -> str:
        """What ``engine=vllm`` still needs of the Transformers target (one of
        :data:`specheads.runtime.target_shell.USES`): ``model`` (a pass of it), ``output_layer`` or ``config``."""
        return "model"

    def check_models(self, job: Job) -> None:
        """Raises UserError when a setting does not fit the loaded models (checked before any chunk)."""

    def items(self, cfg: DatagenConfig):
        """The run's items, one at a time: JSONL is streamed, never held whole."""
        return iter_prompt_files(cfg.prompts, limit=cfg.num_prompts, offset=cfg.offset)

    def count(self, cfg: DatagenConfig) -> int:
        """Reads (and so validates) every item once, keeping none: bad rows fail before any labelling."""
        return sum(1 for _ in self.items(cfg))

    def label_chunk(self, job: Job, items: list, chunk: int) -> Labelled:
        """Labels chunk ``chunk``, whose items are ``items``."""
        raise NotImplementedError

    def side_files(self, out: Path, chunk: int) -> tuple[Path, ...]:
        """Files a chunk may write before its Parquet file (which marks it done); ``merge`` copies those there first."""
        return ()

    def shard_entry(self, out: Path, chunk: int) -> dict:
        """Entries the manifest's ``shards`` item of a finished chunk gets besides its data file."""
        return {}

    def summarise(self, cfg: DatagenConfig, out: Path, models: dict) -> tuple[dict, dict]:
        """``(statistics, settings)`` of a finished run for its manifest, streamed from the chunk files.

        The statistics hold at least ``prompts``, ``labelled_tokens`` and ``label_mean``.
        """
        raise NotImplementedError
