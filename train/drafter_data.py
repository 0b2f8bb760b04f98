"""``labels=drafter`` runs read lazily: a process holds the rows of one batch, whatever the data size.

A run's chunk is a Parquet file (``input_ids``, ``response_start``) and a side file of tensors
(:class:`~specheads.dataset.DrafterChunkFiles`: the target's states at every position, its top-k at every
response token, and the offsets that cut them into rows). :class:`DrafterData` keeps, per chunk, only its
two offset vectors (``rows + 1`` integers each); a batch's rows are read when it is built: their states and
top-k rows sliced out of the side file through safetensors' memory map (``safe_open(...).get_slice``, which
reads those bytes only; they are copied out, so the map is closed again), their ids from the chunk's Parquet
file (the last few chunks' ids kept). The training loop's seeded permutation picks the rows, so each process
reads only the rows of its own micro-batches, in the same order on every run with the same seed.
"""

from __future__ import annotations

import bisect
import json
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from specheads.dataset import DRAFTER_COLUMNS, DrafterChunkFiles, require_columns, shard_paths
from specheads.errors import UserError

IDS_CACHE = 8  # chunks whose ids are kept (a chunk's ids are a few KB)


@dataclass
class Sequence:
    """One prompt + response: ``ids`` ``[T]``, ``states`` ``[T, k*d]`` fp16, ``top_ids``/``top_logp``
    ``[R, K]`` for the response's ``R`` tokens, which start at position ``start``."""

    ids: torch.Tensor
    states: torch.Tensor
    top_ids: torch.Tensor
    top_logp: torch.Tensor
    start: int


@dataclass
class _Chunk:
    parquet: Path
    side: Path
    offsets: torch.Tensor  # [rows + 1]: row i's positions in ``states``
    response_offsets: torch.Tensor  # [rows + 1]: row i's response tokens in ``top_ids``/``top_logp``


class DrafterData:
    """The sequences of the ``labels=drafter`` runs in ``dirs``, indexed ``0 .. len - 1`` in chunk order.

    Args:
        dirs: the runs' output directories (one set of state layers across them all).
        states: False: the states are never read (each sequence gets an empty ``[0, 0]`` tensor) and runs
            of other layers mix: what a standalone draft trains on.
    """

    def __init__(self, dirs: list[str], states: bool = True):
        self.dirs, self.states = list(dirs), states
        self.layers: list[int] | None = None
        self.chunks: list[_Chunk] = []
        for d in self.dirs:
            manifest = json.loads((Path(d) / "manifest.json").read_text())
            got = (manifest.get("drafter") or {}).get("layers")
            if states and self.layers is not None and got != self.layers:
                raise UserError(
                    f"{d} stores the target's states at layers {got}, {self.dirs[0]} at {self.layers}; mix "
                    "only drafter data of the same layers"
                )
            self.layers = got
            for path in shard_paths(Path(d)):
                require_columns(path, DRAFTER_COLUMNS)
                side = DrafterChunkFiles(Path(d), int(path.stem.split("-")[1])).path
                offsets = _read(side, ("offsets", "response_offsets"))
                self.chunks.append(_Chunk(path, side, offsets["offsets"], offsets["response_offsets"]))
        self.starts = [0]  # starts[c]: the index of chunk c's first row
        for c in self.chunks:
            self.starts.append(self.starts[-1] + len(c.offsets) - 1)
        if len(self) == 0:
            raise UserError(
                f"{', '.join(self.dirs)} holds no sequences; run heads-datagen labels=drafter with more prompts"
            )
        first = next(c for c in self.chunks if len(c.offsets) > 1)
        with _open(first.side) as f:
            self.top_k = int(f.get_slice("top_ids").get_shape()[1])
        self.bytes_read = 0  # side-file bytes read so far (states and top-k rows)
        self._ids: OrderedDict[int, tuple[list, list]] = OrderedDict()

    def __len__(self) -> int:
        return self.starts[-1]

    def longest(self) -> int:
        """The longest sequence's positions."""
        return max((int((c.offsets[1:] - c.offsets[:-1]).max()) for c in self.chunks if len(c.offsets) > 1), default=0)

    def tokens(self) -> int:
        """Positions (prompt and response) over every sequence."""
        return sum(int(c.offsets[-1]) for c in self.chunks)

    def rows(self, indices: list[int]) -> list[Sequence]:
        """The sequences at ``indices``, in that order (each chunk's side file opened once)."""
        by_chunk: dict[int, list[tuple[int, int]]] = {}
        for pos, i in enumerate(indices):
            if not 0 <= i < len(self):
                raise IndexError(f"sequence {i} of {len(self)}")
            c = bisect.bisect_right(self.starts, i) - 1
            by_chunk.setdefault(c, []).append((pos, i - self.starts[c]))
        out: list[Sequence | None] = [None] * len(indices)
        for c, wanted in sorted(by_chunk.items()):
            chunk, (ids, starts) = self.chunks[c], self._chunk_ids(c)
            with _open(chunk.side) as f:
                for pos, r in wanted:
                    a, b = int(chunk.offsets[r]), int(chunk.offsets[r + 1])
                    ra, rb = int(chunk.response_offsets[r]), int(chunk.response_offsets[r + 1])
                    # copies: a slice is a view of the whole file's map, which would stay mapped while it lives
                    states = (
                        f.get_slice("states")[a:b].clone() if self.states else torch.zeros(0, 0, dtype=torch.float16)
                    )
                    top_ids, top_logp = f.get_slice("top_ids")[ra:rb].clone(), f.get_slice("top_logp")[ra:rb].clone()
                    self.bytes_read += sum(x.numel() * x.element_size() for x in (states, top_ids, top_logp))
                    out[pos] = Sequence(torch.tensor(ids[r]), states, top_ids.long(), top_logp, int(starts[r]))
        return out  # type: ignore[return-value]  # every position was filled

    def response_tokens(self) -> Iterator[tuple[list[int], list[int]]]:
        """Per sequence, in order, its response tokens and the target's top-1 at each (no states read)."""
        for c, chunk in enumerate(self.chunks):
            ids, starts = self._chunk_ids(c)
            with _open(chunk.side) as f:
                top1 = f.get_slice("top_ids")[:, 0:1][:, 0].tolist()
            roff = chunk.response_offsets.tolist()
            for r, (row, start) in enumerate(zip(ids, starts)):
                yield row[start:], top1[roff[r] : roff[r + 1]]

    def _chunk_ids(self, c: int) -> tuple[list, list]:
        """Chunk ``c``'s ``input_ids`` and ``response_start`` columns (a few chunks kept, least recent dropped)."""
        if c in self._ids:
            self._ids.move_to_end(c)
            return self._ids[c]
        import pyarrow.parquet as pq

        table = pq.read_table(str(self.chunks[c].parquet), columns=["input_ids", "response_start"])
        got = (table.column("input_ids").to_pylist(), table.column("response_start").to_pylist())
        if len(got[0]) != len(self.chunks[c].offsets) - 1:
            raise UserError(
                f"{self.chunks[c].parquet} holds {len(got[0])} rows but its states file {self.chunks[c].side} "
                f"{len(self.chunks[c].offsets) - 1}; run heads-datagen verify on its output_dir"
            )
        self._ids[c] = got
        while len(self._ids) > IDS_CACHE:
            self._ids.popitem(last=False)
        return got


def _open(path: Path):
    from safetensors import safe_open

    if not path.is_file():
        raise UserError(f"{path} is missing; run heads-datagen verify on its output_dir")
    return safe_open(str(path), framework="pt")


def _read(path: Path, names: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """Copies of the named tensors (a tensor safetensors gives keeps the file mapped while it lives)."""
    with _open(path) as f:
        return {k: f.get_tensor(k).clone() for k in names}
