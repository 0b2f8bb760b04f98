"""``labels=prompts``: prompts the target writes itself (Magpie-style), so a drafter's data is not limited by the files.

Each item is an open user turn: the chat template rendered up to where the user's words begin, after a system
message that names a kind of request (``self_prompts.kinds``: writing, reasoning, code, extraction, facts, chat, or
``name:system text`` of your own). The target, sampled (``sampling.do_sample=true``, temperature 1 by default),
continues it with what a user would send until its end-of-turn token. A response is kept when it ended by
itself (not at ``max_new_tokens``), holds no template token and has at least ``self_prompts.min_tokens`` tokens; at
the end of the run the kept texts are deduplicated over the whole run (case and spacing folded) and written to
``output_dir/prompts.jsonl`` (``{"id", "prompt", "kind"}`` rows), a prompt file every other run reads:
``heads-datagen labels=drafter prompts=<output_dir>/prompts.jsonl``. Item ``i`` has kind
``self_prompts.kinds[i % len]``, so the mix is even and does not depend on chunking.

The Parquet chunk holds every generated text (``prompt_id``, ``prompt_index``, ``kind``, ``text``, ``tokens``,
``reason``: empty when kept), so the filter's verdicts can be read back; ``engine=vllm`` generates them in one
vLLM run.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path

from specheads.datagen import shards
from specheads.datagen.acceptance_labels import generate_responses
from specheads.datagen.labelling import Job, Labelled, Labeller
from specheads.dataset import chunk_files
from specheads.errors import UserError
from specheads.outputs import atomic_write_text
from specheads.prompts import Prompt

KINDS = {
    "writing": "The user asks you to write or rewrite a text: an email, a story, a poem, a summary, a letter.",
    "reasoning": "The user asks a question that needs step-by-step reasoning: a math word problem, a logic puzzle, "
    "a plan, a comparison.",
    "code": "The user asks for help with programming: to write, explain or fix a function or a script.",
    "extraction": "The user gives you a short passage and asks you to extract, classify, list or reformat "
    "information from it.",
    "facts": "The user asks a factual question about science, history, geography, health or how something works.",
    "chat": "The user asks for advice, an opinion or ideas about everyday life, work or study.",
    # further kinds a recipe may ask for (self_prompts.kinds): the rest of the requests chat benchmarks ask
    "roleplay": "The user asks you to play a character or a role and answer in that role: a historical figure, "
    "a job interviewer, a fictional character, a travel guide.",
    "math": "The user asks a math question: to solve an equation, compute a probability, or prove or explain a result.",
    "stem": "The user asks you to explain a concept of science, engineering or medicine to a student.",
    "humanities": "The user asks you to discuss or explain a question of history, philosophy, economics, law or "
    "the arts.",
}
SYSTEM = "You are a helpful AI assistant. {}"
FILE = "prompts.jsonl"
COLUMNS = ("prompt_id", "prompt_index", "kind", "text", "tokens", "reason")  # reason "": kept


def kinds(cfg) -> list[tuple[str, str]]:
    """``(name, system message)`` per configured kind (``name`` from :data:`KINDS`, or ``name:text``)."""
    out = []
    for item in cfg.self_prompts.kinds:
        name, colon, text = str(item).partition(":")
        if colon:
            out.append((name.strip(), text.strip()))
        elif name in KINDS:
            out.append((name, SYSTEM.format(KINDS[name])))
        else:
            raise UserError(
                f"self_prompts.kinds: {name!r} is not one of {list(KINDS)}; or write name:<system message> for "
                "your own kind"
            )
    return out


def fold(text: str) -> str:
    """The text deduplication compares: lower case, runs of white space as one space, trimmed."""
    return re.sub(r"\s+", " ", text).strip().lower()


def verdict(response: list[int], eos: set[int], special: set[int], max_new_tokens: int, min_tokens: int) -> str:
    """Why a generated user turn is dropped (``""``: kept)."""
    ended = bool(response) and response[-1] in eos
    body = response[:-1] if ended else response
    if not ended:
        return "truncated" if len(response) >= max_new_tokens else "no end of turn"
    if any(t in special for t in body):
        return "template token"
    if len(body) < min_tokens:
        return "too short"
    return ""


class PromptsLabeller(Labeller):
    """``labels=prompts``: user turns the target writes after a kind's system message (Magpie)."""

    def problems(self, cfg) -> list[str]:
        out = []  # ``prompts`` is not read (a recipe's prompt file is left alone)
        if not cfg.num_prompts:
            out.append("labels=prompts: set num_prompts= (how many user turns to generate)")
        if not cfg.sampling.do_sample:
            out.append("labels=prompts samples its user turns: set sampling.do_sample=true (temperature 1: Magpie's)")
        if not cfg.chat_template:
            out.append("labels=prompts renders the chat template up to the user turn: set chat_template=true")
        if not cfg.self_prompts.kinds:
            out.append(f"self_prompts.kinds is empty; choose from {list(KINDS)} or write name:<system message>")
        else:
            try:
                kinds(cfg)
            except UserError as err:
                out.append(str(err))
        if cfg.self_prompts.min_tokens < 1:
            out.append(f"self_prompts.min_tokens={cfg.self_prompts.min_tokens} must be >= 1")
        return out

    def needs_draft(self, cfg) -> bool:
        return False

    def target_under_vllm(self, cfg) -> str:
        return "config"  # vLLM writes every user turn

    def check_models(self, job: Job) -> None:
        if not getattr(job.pair.tokenizer, "chat_template", None):
            raise UserError("labels=prompts needs a target tokenizer with a chat template (its user turn is written)")

    def items(self, cfg):
        table = kinds(cfg)
        for i in range(cfg.offset, cfg.offset + (cfg.num_prompts or 0)):
            name, system = table[i % len(table)]
            # an open user turn: format_prompt renders the template up to where its words begin
            yield Prompt(
                id=f"self-{name}-{i}",
                messages=[{"role": "system", "content": system}, {"role": "user", "content": None}],
                source=name,
            )

    def count(self, cfg) -> int:
        return cfg.num_prompts or 0

    def label_chunk(self, job: Job, items: list, chunk: int) -> Labelled:
        cfg, tok = job.cfg, job.pair.tokenizer
        eos, special = set(job.eos), set(getattr(tok, "all_special_ids", []) or [])
        cols: dict[str, list] = {k: [] for k in COLUMNS}
        seed, tokens = shards.chunk_seed(cfg.seed, chunk), 0
        for b in range(0, len(items), cfg.batch_size):
            batch = items[b : b + cfg.batch_size]
            if job.pregenerated is None:
                responses, _ = generate_responses(
                    job.pair.target.model,
                    job.prompt_ids(batch),
                    cfg.max_new_tokens,
                    cfg.sampling,
                    seed + b,
                    job.pad,
                    job.eos,
                    logits=False,
                )
            else:
                first = job.first_index(chunk) + b
                responses = [job.response(str(first + i))[0] for i in range(len(batch))]
            for i, (p, r) in enumerate(zip(batch, responses)):
                body = r[:-1] if r and r[-1] in eos else r
                text = tok.decode(body, skip_special_tokens=True).strip()
                why = verdict(r, eos, special, cfg.max_new_tokens, cfg.self_prompts.min_tokens) or (
                    "" if text else "empty"
                )
                cols["prompt_id"].append(p.id)
                cols["prompt_index"].append(job.first_index(chunk) + b + i)
                cols["kind"].append(p.source)
                cols["text"].append(text)
                cols["tokens"].append(len(r))
                cols["reason"].append(why)
                tokens += len(r)
        return Labelled(cols, tokens, [])

    def summarise(self, cfg, out: Path, models: dict) -> tuple[dict, dict]:
        return write_prompts(out), {"self_prompts": {"kinds": [k for k, _ in kinds(cfg)], "file": FILE}}


def write_prompts(out: Path) -> dict:
    """Writes ``out/prompts.jsonl`` (kept, deduplicated over the run, in item order) and returns its statistics."""
    import pyarrow.parquet as pq

    seen: set[str] = set()
    rows, reasons, per_kind, generated, tokens = [], Counter(), Counter(), 0, 0
    for path in chunk_files(out):
        table = pq.read_table(str(path), columns=list(COLUMNS)).to_pylist()
        for row in table:
            generated += 1
            tokens += row["tokens"]
            why = row["reason"] or ("duplicate" if fold(row["text"]) in seen else "")
            if why:
                reasons[why] += 1
                continue
            seen.add(fold(row["text"]))
            per_kind[row["kind"]] += 1
            rows.append({"id": row["prompt_id"], "prompt": row["text"], "kind": row["kind"]})
    atomic_write_text(out / FILE, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    return {
        "prompts": generated,
        "labelled_tokens": tokens,
        "label_mean": len(rows) / generated if generated else None,  # the share kept
        "kept": len(rows),
        "kept_by_kind": dict(sorted(per_kind.items())),
        "dropped": dict(sorted(reasons.items())),
    }
