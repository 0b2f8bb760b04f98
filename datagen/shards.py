"""Resumable, rank-independent output: one Parquet file per chunk of prompts (layout: :mod:`specheads.dataset`).

Chunk ``c`` holds the examples of prompts ``[c*S, (c+1)*S)``; its random draws are seeded from
``(seed, c)``, so its content does not depend on which process labels it. The processes of a launch
hand the chunks out dynamically (:func:`share_chunks`): a process takes the next chunk that has no
file and that no process of this launch has claimed, claiming it by creating
``.claims/chunk-N.claim`` with ``O_CREAT | O_EXCL`` in the output directory, so a slow process holds
up the others by one chunk at most, never by its whole share. A launch removes the claims of earlier
launches before it claims anything (a process killed mid-chunk left its claim there), so a restart,
with any process count, labels every unfinished chunk exactly once. Processes that do not share
the output directory's filesystem (nodes without a shared disk: each writes its own copy, joined
by ``heads-datagen merge``) find each other out at the start and split the chunks between their
filesystems statically, chunk ``c`` to group ``c % groups``. A chunk file appears atomically
(written under a temporary name, fsynced, then renamed, its directory fsynced) and only when the
whole chunk is labelled, so a killed run loses at most the chunks in flight. Each file carries its
own record in the Parquet footer, from which the finished run's ``manifest.json`` is built
(``manifest.py``).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from specheads.dataset import FOOTER_KEY, SCHEMA_VERSION, chunk_files, chunk_path
from specheads.outputs import durable_replace

#: The folder of a launch's claim files and of its processes' presence marks (removed when the run finishes).
CLAIMS = ".claims"


def num_chunks(num_prompts: int, chunk_size: int) -> int:
    return (num_prompts + chunk_size - 1) // chunk_size


def pending_chunks(out_dir: Path, num_prompts: int, chunk_size: int) -> list[int]:
    """Chunks without a finished file."""
    return [c for c in range(num_chunks(num_prompts, chunk_size)) if not chunk_path(out_dir, c).exists()]


def owner(chunk: int, world: int) -> int:
    """The process of ``world`` that labels ``chunk`` when the chunks are split statically (``engine=vllm``)."""
    return chunk % world


def my_chunks(out_dir: Path, total: int, rank: int, world: int) -> list[int]:
    """This process's unfinished chunks of a static split (a function of the rank, the count and its own files)."""
    return [c for c in range(rank, total, world) if not chunk_path(out_dir, c).exists()]


def chunk_seed(seed: int, chunk: int) -> int:
    """The RNG seed of one chunk (independent of which process labels it)."""
    return ((seed & 0xFFFFFFFF) << 20) + chunk


#: ``exchange(obj)``: every process of the launch passes one object and gets the list of all of them,
#: indexed by rank (a collective: it returns once every process has called it).
Exchange = Callable[[object], list]


def launch_exchange(world: int) -> Exchange:
    """The :data:`Exchange` of the running ``accelerate`` launch (one process: no communication)."""
    if world == 1:
        return lambda obj: [obj]
    from accelerate.utils import gather_object

    return lambda obj: gather_object([obj])


class ChunkShare:
    """The chunks one process may label in one launch, handed out by claim files or by a static split.

    Args:
        out: the output directory.
        chunks: the chunks this process may take (its filesystem group's unfinished chunks, or its static share).
        claims: the claim folder (``None``: a static share, every chunk of ``chunks`` is this process's).
        leader: whether this process removes the claim folder when the run is over.
        label: what a claim file says of its process (for a person reading the folder).
    """

    def __init__(self, out: Path, chunks: list[int], claims: Path | None, leader: bool, label: str = ""):
        self.out, self.claims, self.leader, self.label = out, claims, leader, label
        self.chunks = frozenset(chunks)
        self._finished, self._listed = 0, float("-inf")

    def take(self, chunk: int) -> bool:
        """Whether this process labels ``chunk`` (claimed now, atomically, when the chunks are handed out)."""
        if chunk not in self.chunks:
            return False
        if self.claims is None:
            return True
        try:  # O_EXCL: of all processes that try, exactly one creates the file
            fd = os.open(self.claims / f"chunk-{chunk:06d}.claim", os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as fh:
            fh.write(self.label)
        return True

    def finished(self, every_s: float = 10.0) -> int:
        """How many of :attr:`chunks` have their file (one directory listing, at most every ``every_s`` seconds:
        a run of 100k chunks must not list its folder after every chunk)."""
        if time.monotonic() - self._listed >= every_s:
            self._listed = time.monotonic()
            self._finished = sum(1 for p in chunk_files(self.out) if int(p.stem.split("-")[1]) in self.chunks)
        return self._finished

    def close(self) -> None:
        """After the launch's last barrier: the claims are of no use to anyone any more."""
        if self.leader:
            shutil.rmtree(self.out / CLAIMS, ignore_errors=True)


def share_chunks(out: Path, total: int, rank: int, world: int, exchange: Exchange, dynamic: bool = True) -> ChunkShare:
    """Every process of a launch calls this together, before any of them writes a chunk.

    Finds which processes share this process's filesystem (each writes a presence mark holding the
    launch's id, then reads which marks it sees), has the first process of each such group remove what
    earlier launches left behind (their claims and half-written temporary files), and returns this
    process's :class:`ChunkShare`: the group's unfinished chunks, claimed one at a time, or with
    ``dynamic=False`` the static share ``c % world == rank``.
    """
    attempt = exchange(uuid.uuid4().hex)[0]  # rank 0's: one id per launch
    claims = out / CLAIMS
    claims.mkdir(parents=True, exist_ok=True)
    (claims / f"present-{rank}").write_text(attempt, encoding="utf-8")
    exchange(None)  # every mark written
    sees = tuple(r for r in range(world) if _read(claims / f"present-{r}") == attempt)
    groups = sorted(set(map(tuple, exchange(sees))))
    leader = rank == sees[0]
    if leader:  # nobody of this launch has claimed or written anything yet
        for stale in [*claims.glob("chunk-*.claim"), *out.glob("*/.chunk-*.tmp*")]:
            stale.unlink(missing_ok=True)
    exchange(None)  # the stale claims are gone before anyone claims
    if not dynamic:
        return ChunkShare(out, my_chunks(out, total, rank, world), None, leader)
    group, count = groups.index(sees), len(groups)
    mine = [c for c in range(group, total, count) if not chunk_path(out, c).exists()]
    return ChunkShare(out, mine, claims, leader, f"{attempt} rank {rank} {socket.gethostname()} pid {os.getpid()}\n")


class Patience:
    """The launch's last wait, timed by the run's progress rather than in total: a static share (``engine=vllm``)
    keeps one process busy long after another finished its own, past the process group's timeout. Each
    process publishes, every ``every_s`` seconds from a thread, how many chunk and vLLM response files it
    sees in its output directory, through the launch's store (the nodes need not share a filesystem); the
    last wait ends when every process reached it, and fails when no count moved for ``timeout_s`` (a hung
    process still ends the launch, as the timeout did)."""

    def __init__(self, out: Path, rank: int, world: int, timeout_s: float, every_s: float = 5.0):
        self.out, self.rank, self.world, self.timeout_s, self.every_s = Path(out), rank, world, timeout_s, every_s
        self.store, self._stop = None, threading.Event()
        if world > 1:
            from torch.distributed import distributed_c10d

            self.store = distributed_c10d._get_default_store()
            self._thread = threading.Thread(target=self._publish, daemon=True)
            self._thread.start()

    def _seen(self) -> int:
        side = self.out / "vllm"
        return len(chunk_files(self.out)) + (sum(1 for _ in side.glob("chunk-*.json")) if side.is_dir() else 0)

    def _publish(self) -> None:
        while not self._stop.is_set():
            self.store.set(f"specheads/progress/{self.rank}", str(self._seen()))
            self._stop.wait(self.every_s)

    def wait(self) -> None:
        """Every process calls this at the end; raises RuntimeError naming the processes still working when
        nothing moved for ``timeout_s``."""
        if self.store is None:
            return
        self.store.add("specheads/finished", 1)
        last, idle = None, time.monotonic()
        while self.store.add("specheads/finished", 0) < self.world:
            keys = [f"specheads/progress/{r}" for r in range(self.world)]
            counts = [self.store.get(k) if self.store.check([k]) else None for k in keys]
            if counts != last:
                last, idle = counts, time.monotonic()
            elif time.monotonic() - idle > self.timeout_s:
                raise RuntimeError(
                    f"heads-datagen: no chunk or response landed for {self.timeout_s:.0f} s while waiting for the "
                    "launch's other processes (dist_timeout_s); one is hung or dead"
                )
            time.sleep(min(1.0, self.every_s))
        self._stop.set()


def _read(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None


def write_chunk(out_dir: Path, chunk: int, columns: dict[str, list], info: dict) -> Path:
    """Writes one chunk's examples as Parquet, atomically, with ``info`` in its footer."""
    import pyarrow.parquet as pq
    from datasets import Dataset
    from datasets.utils.logging import disable_progress_bar

    disable_progress_bar()  # one bar per run (the CLI's), not one per file
    path = chunk_path(out_dir, chunk)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    table = Dataset.from_dict(columns).data.table  # the datasets library's types and its schema record
    meta = dict(table.schema.metadata or {})
    meta[FOOTER_KEY] = json.dumps({"chunk": chunk, "schema_version": SCHEMA_VERSION, **info}).encode()
    pq.write_table(table.replace_schema_metadata(meta), str(tmp))
    return durable_replace(tmp, path)
