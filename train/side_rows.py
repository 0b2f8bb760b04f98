"""Rows of one stored tensor spread over chunk side files, read when a batch needs them.

The judge head's features and the EAGLE stop head's states are ``[rows, d]`` tensors in one safetensors side
file per chunk. :class:`SideRows` numbers their rows across the files in order and, for a batch, slices the
asked row ranges out of the files through safetensors' memory map (copied out, so no file stays mapped): a
process holds one batch of them, whatever the data size. Small per-row values (labels, offsets) are read
whole by the callers.
"""

from __future__ import annotations

import bisect
from pathlib import Path

import torch

from specheads.errors import UserError


def open_side(path: Path):
    """A safetensors side file, opened memory-mapped; UserError when it is missing."""
    from safetensors import safe_open

    if not Path(path).is_file():
        raise UserError(f"{path} is missing; run heads-datagen verify on its output_dir")
    return safe_open(str(path), framework="pt")


def read_small(path: Path, names: tuple[str, ...]) -> tuple[dict[str, torch.Tensor], dict[str, list[int]]]:
    """Copies of the named tensors of a side file, and the shapes of all of its tensors."""
    with open_side(path) as f:
        shapes = {k: list(f.get_slice(k).get_shape()) for k in f.keys()}
        return {k: f.get_tensor(k).clone() for k in names}, shapes


class SideRows:
    """The rows of tensor ``name`` over side files added in order (row ``i`` of the whole: a file's row)."""

    def __init__(self, name: str):
        self.name = name
        self.paths: list[Path] = []
        self.starts = [0]  # starts[c]: the first global row of file c
        self.bytes_read = 0

    def add(self, path: Path, rows: int) -> None:
        self.paths.append(Path(path))
        self.starts.append(self.starts[-1] + rows)

    def __len__(self) -> int:
        return self.starts[-1]

    def take(self, spans: list[tuple[int, int]]) -> torch.Tensor:
        """Rows ``a:b`` of each span, in order, joined (each span lies in one file); each file opened once."""
        where: dict[int, list[tuple[int, int, int]]] = {}
        for pos, (a, b) in enumerate(spans):
            c = bisect.bisect_right(self.starts, a) - 1
            if not 0 <= a <= b <= self.starts[c + 1]:
                raise IndexError(f"rows {a}:{b} of {len(self)} do not lie in one file")
            where.setdefault(c, []).append((pos, a - self.starts[c], b - self.starts[c]))
        parts: list[torch.Tensor | None] = [None] * len(spans)
        for c, wanted in sorted(where.items()):
            with open_side(self.paths[c]) as f:
                rows = f.get_slice(self.name)
                for pos, a, b in wanted:
                    parts[pos] = rows[a:b].clone()  # a copy: a slice would keep the whole file mapped
                    self.bytes_read += parts[pos].numel() * parts[pos].element_size()
        return torch.cat(parts)  # type: ignore[arg-type]  # every span was filled
