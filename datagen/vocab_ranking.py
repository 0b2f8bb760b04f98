"""``heads-vocab``: rank tokens by frequency in the target's responses, for draft vocabulary pruning.

    heads-vocab recipe=quickstart                                   # reference responses of a corpus
    heads-vocab recipe=quickstart data_dir=runs/quickstart-datagen  # the target's own responses
    heads-decode recipe=quickstart draft.vocab_file=runs/vocab/vocab.json draft.vocab_top_n=8192

FR-Spec (Zhao et al. 2025) restricts the draft's output layer to the tokens the target actually
writes. The counts come from the target's responses in a ``heads-datagen`` output (labels
``acceptance`` or ``fsd``: every token after ``response_start``) or from the reference responses
of prompt files (``corpus``: GSM8K solutions, Alpaca outputs, ``reference`` fields; the whole
line of a ``.txt`` file), tokenised by the target's tokenizer. Writes ``vocab.json``: every
token seen, most frequent first (ties by id), its count, and the share of counted tokens the top
N cover for a few N; ``draft.vocab_file`` reads it.
"""

from __future__ import annotations

import collections
import logging
from dataclasses import dataclass, field
from pathlib import Path

from tqdm.auto import tqdm

from specheads.config import cli_main, to_yaml
from specheads.errors import UserError
from specheads.outputs import MetricsWriter, atomic_write_json, atomic_write_text, write_manifest
from specheads.shim import VOCAB_FORMAT as FORMAT
from specheads.shim import ModelSpec

log = logging.getLogger(__name__)
PROG = "heads-vocab"
COVERAGE_SIZES = (1024, 2048, 4096, 8192, 16384, 32768)


@dataclass
class VocabConfig:
    """Rank tokens by how often the target's responses use them; `draft.vocab_file` reads the ranking
    (FR-Spec pruning)."""

    target: ModelSpec = field(default_factory=ModelSpec)
    data_dir: str | None = field(
        default=None,
        metadata={
            "help": (
                "a heads-datagen output_dir (labels acceptance or fsd): count the target's own responses "
                "(used instead of corpus when set)"
            )
        },
    )
    corpus: str | None = field(
        default=None,
        metadata={"help": "prompt files whose reference responses are counted (comma-separated; .txt: every line)"},
    )
    num_rows: int | None = field(default=None, metadata={"help": "count only the first N rows of each corpus file"})
    output: str = field(default="runs/vocab/vocab.json", metadata={"help": "where the ranking is written"})
    top_n: int | None = field(
        default=None,
        metadata={
            "help": (
                "heads-pipeline: the draft's output layer keeps this many tokens in every later stage "
                "(draft.vocab_top_n); null: no pruning"
            )
        },
    )


def _corpus_texts(spec: str, limit: int | None):
    from specheads.prompts import iter_prompts

    for path in [p.strip() for p in spec.split(",") if p.strip()]:
        if not Path(path).is_file():
            raise UserError(f"corpus file {path!r} does not exist")
        if path.endswith(".txt"):
            with open(path, encoding="utf-8", errors="strict") as fh:
                for i, line in enumerate(fh):
                    if limit is not None and i >= limit:
                        break
                    if line.strip():
                        yield line.rstrip("\n")
            continue
        texts = 0
        for prompt in iter_prompts(path, limit=limit):
            if prompt.reference_text:
                texts += 1
                yield prompt.reference_text
        if not texts:
            raise UserError(
                f"corpus file {path!r} has no reference responses (GSM8K answer, Alpaca output, "
                f"reference); use data_dir=<heads-datagen output> or another file"
            )


def _datagen_responses(data_dir: str):
    import pyarrow.parquet as pq

    from specheads.dataset import read_manifest, shard_paths

    manifest = read_manifest(Path(data_dir))
    labels = manifest.get("labels", "acceptance")
    if labels not in ("acceptance", "fsd"):
        raise UserError(
            f"{data_dir} holds labels={labels} data; heads-vocab counts the target's responses of "
            f"acceptance or fsd data (or pass corpus=<prompt files>)"
        )
    for path in shard_paths(Path(data_dir)):
        table = pq.read_table(path, columns=["input_ids", "response_start"])
        for ids, start in zip(table.column("input_ids").to_pylist(), table.column("response_start").to_pylist()):
            yield ids[start:]


def count_tokens(cfg: VocabConfig) -> tuple[collections.Counter, int, str]:
    """Token counts of the responses; returns (counts, vocabulary size, source description)."""
    from transformers import AutoTokenizer

    from specheads.shim import resolve_location

    path, gguf, _ = resolve_location(cfg.target, "target")
    kwargs = {"gguf_file": gguf} if gguf and not cfg.target.tokenizer else {}
    tok = AutoTokenizer.from_pretrained(cfg.target.tokenizer or path, **kwargs)
    counts: collections.Counter = collections.Counter()
    if cfg.data_dir:
        for ids in tqdm(_datagen_responses(cfg.data_dir), desc="responses", unit="row"):
            counts.update(ids)
        source = f"target responses in {cfg.data_dir}"
    else:
        batch: list[str] = []
        for text in tqdm(_corpus_texts(cfg.corpus, cfg.num_rows), desc="corpus", unit="text"):
            batch.append(text)
            if len(batch) == 256:
                for ids in tok(batch, add_special_tokens=False)["input_ids"]:
                    counts.update(ids)
                batch = []
        for ids in tok(batch, add_special_tokens=False)["input_ids"] if batch else []:
            counts.update(ids)
        source = f"reference responses in {cfg.corpus}"
    return counts, len(tok), source


def ranking(counts: collections.Counter, vocab_size: int, source: str) -> dict:
    """The ranking file's content: ids by count (descending, ties by id) and coverage at a few sizes."""
    order = sorted(counts, key=lambda i: (-counts[i], i))
    total = sum(counts.values())
    cum, coverage = 0, {}
    sizes = iter(COVERAGE_SIZES)
    size = next(sizes)
    for rank, i in enumerate(order, 1):
        cum += counts[i]
        while size is not None and rank == size:
            coverage[str(size)] = round(cum / total, 6)
            size = next(sizes, None)
    while size is not None:
        coverage[str(size)] = 1.0
        size = next(sizes, None)
    return {
        "format": FORMAT,
        "version": 1,
        "vocab_size": vocab_size,
        "source": source,
        "tokens_counted": total,
        "distinct": len(order),
        "coverage": coverage,
        "ranking": order,
        "counts": [counts[i] for i in order],
    }


def run(cfg: VocabConfig) -> int:
    if not cfg.data_dir and not cfg.corpus:
        raise UserError("nothing to count: set data_dir=<heads-datagen output> or corpus=<prompt files>")
    counts, vocab_size, source = count_tokens(cfg)
    if not counts:
        raise UserError(f"no tokens counted from {cfg.data_dir or cfg.corpus}; nothing to rank")
    out = ranking(counts, vocab_size, source)
    folder = Path(cfg.output).parent
    folder.mkdir(parents=True, exist_ok=True)
    atomic_write_text(folder / "config.yaml", to_yaml(cfg))
    atomic_write_json(cfg.output, out)
    summary = {k: out[k] for k in ("tokens_counted", "distinct", "coverage", "vocab_size", "source")}
    with MetricsWriter(folder) as metrics:
        metrics.write(**summary)
    write_manifest(folder, command=PROG, ranking=Path(cfg.output).name, **summary)
    cov = ", ".join(f"top {k}: {100 * v:.1f}%" for k, v in out["coverage"].items())
    log.info(
        "%d tokens counted, %d distinct; coverage %s -> %s", out["tokens_counted"], out["distinct"], cov, cfg.output
    )
    print(f"{out['tokens_counted']} tokens, {out['distinct']} distinct; coverage {cov}; wrote {cfg.output}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``heads-vocab``."""
    return cli_main(PROG, VocabConfig, "vocab", argv, run)


if __name__ == "__main__":
    raise SystemExit(main())
