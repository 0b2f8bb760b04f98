"""``labels=passages``: prompts that hand the target a long passage to work on (extract, summarise, list,
rewrite, answer from it), so a drafter learns to read and copy from its context.

The training prompts of a drafter are short (user turns of 14-68 tokens in the median), while the requests it
is worst at give it a text to work on: extraction, summaries, questions over a document, code over given code.
This family composes such prompts without running a model. A passage is a run of texts from
``passages.sources``: the target's own responses in earlier ``labels=drafter`` runs (their output directories),
or a user's documents (``.json`` / ``.jsonl`` files, each row's ``passages.text_field``, the first
``passages.rows`` rows), each trimmed to its last full sentence, joined until it holds ``passages.min_tokens``
tokens and cut at a sentence end before ``passages.max_tokens``; an instruction of a task kind
(``passages.tasks``: ``extract``, ``summarise``, ``list``, ``rewrite``, ``question``, ``keywords``, ``title``,
``classify``) is put before or after it.
Item ``i`` has kind ``passages.tasks[i % len]``; its template, framing and responses are drawn by a generator
seeded with ``seed`` and ``i`` alone, so the prompt file does not depend on chunking or process count.

The Parquet chunk holds every composed prompt (``prompt_id``, ``prompt_index``, ``kind``, ``text``, ``tokens``:
the passage's length, ``reason``: empty when kept, ``too short`` when the sources ran out); the run ends by
writing ``output_dir/prompts.jsonl`` (deduplicated, as ``labels=prompts`` does), a prompt file a later
``labels=drafter`` run answers: ``heads-datagen labels=drafter prompts=<output_dir>/prompts.jsonl``.
"""

from __future__ import annotations

import random
import re
from pathlib import Path

from specheads.datagen.labelling import Job, Labelled, Labeller
from specheads.datagen.self_prompts import COLUMNS, FILE, write_prompts
from specheads.dataset import chunk_files
from specheads.errors import UserError
from specheads.prompts import read_rows

TASKS = {
    "extract": (
        "Extract every name, number and date mentioned in the text below, one per line, with what each refers to.",
        'From the passage below, pull out the key facts as a JSON object with the keys "topic", '
        '"main_points" and "examples".',
        "Read the text and list each specific item, step or example it mentions, in the order it appears.",
    ),
    "summarise": (
        "Summarize the following text in three sentences.",
        "Write a one-paragraph summary of the text below for a busy reader.",
        "Give a short summary of this text, then the single most important point in it.",
    ),
    "list": (
        "List the main points of the text below as bullet points.",
        "Turn the following text into a numbered list of its steps or ideas.",
        "Make a table with two columns, point and detail, from the text below.",
    ),
    "rewrite": (
        "Rewrite the following text in a more formal tone, keeping all of its content.",
        "Rewrite the text below so that a ten-year-old can understand it.",
        "Edit the following text to be shorter and clearer without losing any facts.",
    ),
    "question": (
        "Read the text below and answer: what is its main claim, and which examples support it? Quote the text.",
        "Based only on the passage below, what advice does it give? Answer using its own words.",
        "What questions does the text below answer? Write three, each with its answer from the text.",
    ),
    "keywords": (
        "Give five keywords for the text below and explain each in one line using the text's own words.",
        "Which terms in the following text would a reader need defined? Define each as the text uses it.",
    ),
    "title": (
        "Suggest a title for the text below and explain your choice with a quote from it.",
        "Write a headline and a one-sentence subtitle for the following text.",
    ),
    "classify": (
        "Classify the text below as advice, explanation, story or instructions, and quote the sentence that shows "
        "it best.",
        "Is the tone of the following text formal, neutral or casual? Support your answer with phrases from it.",
    ),
}
FRAMES = ("{instruction}\n\n{passage}", '{instruction}\n\nText:\n"""\n{passage}\n"""', "{passage}\n\n{instruction}")
_END = re.compile(r"(?<![0-9])[.!?](?=\s|$)")  # not a list number's point


def tasks(cfg) -> list[str]:
    """The configured task kinds, checked against :data:`TASKS`."""
    unknown = [t for t in cfg.passages.tasks if t not in TASKS]
    if unknown:
        raise UserError(f"passages.tasks: {unknown} not among {list(TASKS)}")
    return list(cfg.passages.tasks)


def sentence_trim(text: str) -> str:
    """``text`` up to its last sentence end (a response cut at ``max_new_tokens`` loses its broken tail); the
    whole text when it has none."""
    ends = list(_END.finditer(text))
    return text[: ends[-1].end()].strip() if ends else text.strip()


def read_documents(path: Path, text_field: str, rows: int | None) -> list[str]:
    """The ``text_field`` of a JSON (a list of rows) or JSONL file's first ``rows`` rows (all: ``None``), stripped;
    rows without the field, or with an empty one, are skipped."""
    table = read_rows(path)
    if not isinstance(table, list) or not all(isinstance(r, dict) for r in table):
        raise UserError(f"passages.sources: {path} is not a list of rows (JSON objects, one a line in JSONL)")
    table = table[:rows] if rows is not None else table
    texts = [r[text_field].strip() for r in table if isinstance(r.get(text_field), str) and r[text_field].strip()]
    if not texts:
        raise UserError(
            f"passages.sources: no row of {path} has text in {text_field!r} (set passages.text_field=; its rows' "
            f"fields: {sorted(table[0]) if table else 'none'})"
        )
    return texts


def read_responses(sources: list[str], tokenizer, eos: set[int], text_field: str = "text", rows=None) -> list[str]:
    """The passages' material, in source order: the responses of ``labels=drafter`` output directories, decoded
    and sentence-trimmed, in chunk order; the documents of a ``.json`` / ``.jsonl`` file source
    (:func:`read_documents`)."""
    import pyarrow.parquet as pq

    out = []
    for src in sources:
        if Path(src).is_file() and Path(src).suffix in (".json", ".jsonl"):
            out += [t for t in map(sentence_trim, read_documents(Path(src), text_field, rows)) if t]
            continue
        if not Path(src).is_dir():
            raise UserError(
                f"passages.sources: {src} is neither a labels=drafter output directory nor a .json / .jsonl file"
            )
        files = chunk_files(Path(src))
        if not files:
            raise UserError(f"passages.sources: {src} holds no datagen chunks (run heads-datagen labels=drafter first)")
        for path in files:
            names = pq.read_schema(str(path)).names
            if "input_ids" not in names or "response_start" not in names:
                raise UserError(
                    f"passages.sources: {path} has no responses (input_ids, response_start): not a "
                    "labels=drafter output"
                )
            for row in pq.read_table(str(path), columns=["input_ids", "response_start"]).to_pylist():
                ids = [t for t in row["input_ids"][row["response_start"] :] if t not in eos]
                text = sentence_trim(tokenizer.decode(ids, skip_special_tokens=True))
                if text:
                    out.append(text)
    return out


def compose(index: int, seed: int, kind: str, pool: list[str], count, lo: int, hi: int) -> tuple[str, int]:
    """Prompt ``index``: an instruction of ``kind`` and a passage of responses from ``pool`` (their token counts
    from ``count``) of at least ``lo`` tokens, cut at a sentence end at most ``hi`` tokens; returns the prompt and
    the passage's tokens (fewer than ``lo`` only when the pool ran out)."""
    rng = random.Random(f"passages-{seed}-{index}")
    instruction = rng.choice(TASKS[kind])
    frame = rng.choice(FRAMES)
    start = rng.randrange(len(pool))
    parts, tokens = [], 0
    for j in range(len(pool)):
        text = pool[(start + j * 7919) % len(pool)]  # a stride prime to most pool sizes: varied neighbours
        n = count(text)
        if tokens + n > hi:
            keep = []
            for sentence in re.split(r"(?<=[.!?])\s+", text):  # as many whole sentences as still fit
                m = count(sentence)
                if tokens + m > hi:
                    break
                keep.append(sentence)
                tokens += m
            if keep:
                parts.append(" ".join(keep))
            if tokens >= lo:
                break
            continue
        parts.append(text)
        tokens += n
        if tokens >= lo:
            break
    passage = "\n\n".join(parts)
    return frame.format(instruction=instruction, passage=passage), tokens


class PassagesLabeller(Labeller):
    """``labels=passages``: instructions over passages made of the target's earlier responses (no model runs)."""

    def __init__(self):
        self._pool: tuple[tuple, list[str]] | None = None

    def problems(self, cfg) -> list[str]:
        out = []
        if not cfg.num_prompts:
            out.append("labels=passages: set num_prompts= (how many prompts to compose)")
        if not cfg.passages.sources:
            out.append(
                "labels=passages: set passages.sources=[DIR_OR_FILE,...] (labels=drafter outputs whose "
                "responses make the passages, or JSON / JSONL files of documents)"
            )
        if not cfg.passages.tasks:
            out.append(f"passages.tasks is empty; choose from {list(TASKS)}")
        else:
            try:
                tasks(cfg)
            except UserError as err:
                out.append(str(err))
        if not 1 <= cfg.passages.min_tokens <= cfg.passages.max_tokens:
            out.append(
                f"passages.min_tokens={cfg.passages.min_tokens} and max_tokens={cfg.passages.max_tokens}: need "
                "1 <= min_tokens <= max_tokens"
            )
        if cfg.passages.rows is not None and cfg.passages.rows < 1:
            out.append(f"passages.rows={cfg.passages.rows}: need a positive count or null (every row)")
        return out

    def needs_draft(self, cfg) -> bool:
        return False

    def target_under_vllm(self, cfg) -> str:
        return "config"

    def check_models(self, job: Job) -> None:
        self.pool(job)  # every source is read (and checked) before any chunk

    def pool(self, job: Job) -> list[str]:
        opts = job.cfg.passages
        key = (*opts.sources, opts.text_field, opts.rows)
        if self._pool is None or self._pool[0] != key:
            texts = read_responses(list(opts.sources), job.pair.tokenizer, set(job.eos), opts.text_field, opts.rows)
            if not texts:
                raise UserError(f"passages.sources {list(opts.sources)}: no responses with text")
            self._pool = (key, texts)
        return self._pool[1]

    def items(self, cfg):
        table = tasks(cfg)
        for i in range(cfg.offset, cfg.offset + (cfg.num_prompts or 0)):
            yield (i, table[i % len(table)])

    def count(self, cfg) -> int:
        return cfg.num_prompts or 0

    def label_chunk(self, job: Job, items: list, chunk: int) -> Labelled:
        cfg, tok = job.cfg, job.pair.tokenizer
        pool = self.pool(job)

        def count(text: str) -> int:
            return len(tok(text, add_special_tokens=False)["input_ids"])

        cols: dict[str, list] = {k: [] for k in COLUMNS}
        total = 0
        for index, kind in items:
            text, n = compose(index, cfg.seed, kind, pool, count, cfg.passages.min_tokens, cfg.passages.max_tokens)
            cols["prompt_id"].append(f"passage-{kind}-{index}")
            cols["prompt_index"].append(index)
            cols["kind"].append(kind)
            cols["text"].append(text)
            cols["tokens"].append(n)
            cols["reason"].append("" if n >= cfg.passages.min_tokens else "too short")
            total += n
        return Labelled(cols, total, [])

    def summarise(self, cfg, out: Path, models: dict) -> tuple[dict, dict]:
        settings = {"tasks": tasks(cfg), "sources": list(cfg.passages.sources), "file": FILE}
        settings |= {"text_field": cfg.passages.text_field, "rows": cfg.passages.rows}
        settings |= {"min_tokens": cfg.passages.min_tokens, "max_tokens": cfg.passages.max_tokens}
        return write_prompts(out), {"passages": settings}
