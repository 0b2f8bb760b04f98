"""``heads-datagen``: run both models over prompts and write labelled examples.

    heads-datagen recipe=quickstart num_prompts=64 output_dir=runs/labels
    accelerate launch --multi_gpu --num_processes 2 -m specheads.datagen.cli recipe=quickstart   # no GPU: 2 CPU processes, gloo
    heads-datagen recipe=quickstart verify            # every prompt labelled once, every shard readable
    heads-datagen merge from=node0/labels,node1/labels output_dir=labels   # nodes without a shared disk

Output: ``data/chunk-*.parquet``, one row per prompt. ``labels=acceptance``: ``prompt_id``,
``prompt_index``, ``input_ids`` = prompt + response, ``response_start``, ``draft_token``,
``label``, ``expected_label``. ``labels=fsd`` (see ``fsd.py``): the same columns plus, per token,
``div_<name>`` (``Div(p_i, q_i)`` for each of ``fsd_divergences``) and ``fsd_<name>@<T>`` (the FSD
decision ``Div < T`` for each of ``fsd_thresholds``). ``labels=sprinter`` (see ``sprinter.py``):
``prompt_id``, ``prompt_index``, ``category``, ``input_ids`` (the context), ``positions`` (labelled prefix
lengths), ``draft_token``, ``q_token``, ``p_token``, ``ratio``, ``tv``. ``labels=judge`` (see
``judge.py``): one row per tuple side (``tuple_id``, ``prompt_index``, ``side``, ``input_ids`` =
question + answer, ``answer_start``, ``labels`` 1/0/-1), the target's features at the labelled
tokens in ``features/chunk-*.safetensors`` (fp16), ``tuples.jsonl`` and ``review.jsonl``. Also ``manifest.json`` (counts, label statistics, models, fingerprints,
sampling settings, seed, schema version, ``numerics``: threads per process, process count, dtypes,
devices, torch version, kernel path), ``metrics.jsonl`` (one line per chunk) and
``config.yaml``. Killed at any point and started again with the same command (any process
count), it finishes with every prompt labelled exactly once (see ``shards.py``); with the same
numerics settings (``threads=N`` sets the thread count), the files are the uninterrupted run's, byte
for byte, and a resume under other settings warns. A sample whose
logits hold NaN/Inf is skipped and counted (``skipped_nonfinite`` and ``skipped_samples`` in the
manifest), never written. Prompts are streamed: host memory does not grow with the prompt file.
"""

from __future__ import annotations

import itertools
import json
import logging
import shutil
import time
from pathlib import Path

import torch
from tqdm import tqdm
from transformers.utils import logging as hf_logging

from specheads.config import cli_main, to_yaml
from specheads.errors import UserError
from specheads.export import fit_context, format_prompt, load_pair
from specheads.export.shim.models import context_length
from specheads.export.shim.sampling import usable_logits
from specheads.numerics import check_resume, differences, numerics_settings, use_threads, without
from specheads.outputs import MetricsWriter, file_sha256, holds_other_run, prepare_output_dir, write_manifest
from specheads.prompts import iter_prompt_files

from . import shards
from . import fsd, judge, sprinter
from .acceptance import acceptance_labels, generate_responses, split_rows, teacher_forced_pair
from .config import DatagenConfig

log = logging.getLogger(__name__)
PROG = "heads-datagen"
LABELS = ("acceptance", "fsd", "sprinter", "judge")
JUDGE_COLUMNS = ("tuple_id", "prompt_index", "side", "input_ids", "answer_start", "labels")
JUDGE_COUNTS = ("items", "answers", "correct", "wrong", "ungraded", "localised", "review", "tuples", "too_long")
SPRINTER_COLUMNS = ("prompt_id", "prompt_index", "category", "input_ids", "positions", "draft_token", "q_token",
                    "p_token", "ratio", "tv")


def _check(cfg: DatagenConfig) -> None:
    problems = list(cfg.sampling.problems())
    if cfg.labels not in LABELS:
        problems.append(f"labels={cfg.labels!r} is not one of {list(LABELS)}")
    if not cfg.prompts and not (cfg.labels == "judge" and cfg.tuples):
        problems.append("prompts is not set; pass prompts=<file>" + (" or tuples=<file>" if cfg.labels == "judge" else ""))
    if cfg.labels == "judge":
        bad = [m for m in cfg.answer_models if m not in ("target", "draft")]
        if bad or not cfg.answer_models:
            problems.append(f"answer_models={list(cfg.answer_models)}: choose from target, draft")
        if cfg.answer_samples < 0 or cfg.answer_temperature <= 0:
            problems.append("answer_samples must be >= 0 and answer_temperature > 0")
    if cfg.labels == "fsd":
        problems += fsd.problems(list(cfg.fsd_divergences), list(cfg.fsd_thresholds), cfg.fsd_top_k, cfg.fsd_dist,
                                 cfg.sampling)
    for key in ("max_new_tokens", "batch_size", "chunk_size"):
        if getattr(cfg, key) < 1:
            problems.append(f"{key}={getattr(cfg, key)} must be >= 1")
    if cfg.threads is not None and cfg.threads < 1:
        problems.append(f"threads={cfg.threads} must be >= 1 (or null: torch's default)")
    if cfg.labels == "sprinter":
        if cfg.chunk_size % len(sprinter.CATEGORIES):
            problems.append(f"chunk_size={cfg.chunk_size}: labels=sprinter needs a multiple of "
                            f"{len(sprinter.CATEGORIES)} (every chunk holds the four prefix categories equally)")
        if any(lam <= 0 for lam in cfg.lambdas):
            problems.append(f"lambdas={list(cfg.lambdas)}: every lambda must be > 0")
        if not 0 <= cfg.mix_prob <= 1:
            problems.append(f"mix_prob={cfg.mix_prob} must be in [0, 1]")
    if problems:
        raise UserError("; ".join(problems))


def _prepare(cfg: DatagenConfig, is_main: bool) -> Path:
    config_yaml = to_yaml(cfg)
    out = Path(cfg.output_dir)
    if is_main:
        same = (out / "config.yaml").is_file() and not holds_other_run(out, config_yaml)
        prepare_output_dir(out, config_yaml, overwrite=cfg.overwrite)
        if not same:  # another run's files (and feature caches built on them) must not mix with this one's
            for sub in ("data", "features", "tuples", "review"):
                shutil.rmtree(out / sub, ignore_errors=True)
    return out


def _finite_rows(p_all: torch.Tensor, q_all: torch.Tensor, rows: list[int]) -> list[bool]:
    """Per response, whether every target logit at its positions is finite and the draft's are usable
    (:func:`~specheads.export.shim.sampling.usable_logits`)."""
    finite = (torch.isfinite(p_all).all(-1) & usable_logits(q_all)).cpu()  # a pruned draft's -inf is fine
    return [bool(f.all()) for f in finite.split(rows)]


def _skip(prompt, index: int, reason: str) -> dict:
    log.warning("prompt %d (%s) skipped: %s", index, prompt.id, reason)
    return {"prompt_index": index, "prompt_id": str(prompt.id), "reason": reason}


def _label_chunk(cfg, pair, items: list, chunk: int, pad: int, eos: list[int], limit) -> tuple[dict, int, list[dict]]:
    """Labels one chunk; returns its columns, its number of labelled tokens and the skipped samples."""
    lo = chunk * cfg.chunk_size
    seed = shards.chunk_seed(cfg.seed, chunk)
    gen = torch.Generator(device=pair.target.device).manual_seed(seed)
    if cfg.labels == "sprinter":
        return _label_sprinter_chunk(cfg, pair, items, lo, seed, gen, pad, eos, limit)
    if cfg.labels == "judge":
        return _label_judge_chunk(cfg, pair, items, lo, chunk, seed, pad, eos, limit)
    names = ["draft_token", "label", "expected_label"]
    if cfg.labels == "fsd":
        names += [fsd.divergence_column(d) for d in cfg.fsd_divergences]
        names += [fsd.label_column(d, t) for d in cfg.fsd_divergences for t in cfg.fsd_thresholds]
    cols: dict[str, list] = {k: [] for k in ("prompt_id", "prompt_index", "input_ids", "response_start", *names)}
    labelled, skipped = 0, []
    for b in range(0, len(items), cfg.batch_size):
        batch = items[b: b + cfg.batch_size]
        ids = [fit_context(format_prompt(pair.tokenizer, p, cfg.chat_template), cfg.max_new_tokens, limit)[0]
               for p in batch]
        responses, p_logits = generate_responses(pair.target.model, ids, cfg.max_new_tokens, cfg.sampling,
                                                 seed + b, pad, eos)
        p_all, q_all, rows = teacher_forced_pair(pair.target.model, pair.draft.model, ids, responses, pad, p_logits)
        ok = _finite_rows(p_all, q_all, rows)
        if not all(ok):  # a sample with NaN/Inf logits is counted, never written
            keep = torch.tensor(ok).repeat_interleave(torch.tensor(rows)).to(p_all.device)
            p_all, q_all = p_all[keep], q_all[keep]
            rows = [n for n, good in zip(rows, ok) if good]
        out = acceptance_labels(p_all, q_all, cfg.sampling, gen)  # the draws: the same as labels=acceptance
        if cfg.labels == "fsd":
            out |= fsd.fsd_labels(p_all, q_all, cfg.sampling, list(cfg.fsd_divergences), list(cfg.fsd_thresholds),
                                  cfg.fsd_top_k, cfg.fsd_dist)
        del p_all, q_all
        labels = iter(split_rows(out, rows) if rows else [])
        for i, (p, x, r, good) in enumerate(zip(batch, ids, responses, ok)):
            index = cfg.offset + lo + b + i
            if not good:
                skipped.append(_skip(p, index, "non-finite logits"))
                continue
            lab = next(labels)
            cols["prompt_id"].append(p.id)
            cols["prompt_index"].append(index)
            cols["input_ids"].append(x + r)
            cols["response_start"].append(len(x))
            for key in names:
                cols[key].append(lab[key].tolist() if key != "expected_label" or cfg.expected_label else None)
            labelled += len(r)
    return cols, labelled, skipped


def _label_sprinter_chunk(cfg, pair, items, lo: int, seed: int, gen, pad: int, eos: list[int], limit):
    cols: dict[str, list] = {k: [] for k in SPRINTER_COLUMNS}
    labelled, skipped = 0, []
    # Batches hold whole groups of four consecutive prompts (one per category) so that each
    # batch, and with it the chunk, is balanced over the categories.
    step = max(len(sprinter.CATEGORIES), cfg.batch_size - cfg.batch_size % len(sprinter.CATEGORIES))
    for b in range(0, len(items), step):
        batch = items[b: b + step]
        ids = [fit_context(format_prompt(pair.tokenizer, p, cfg.chat_template), cfg.max_new_tokens, limit)[0]
               for p in batch]
        indices = [cfg.offset + lo + b + i for i in range(len(batch))]
        rows = sprinter.label_chunk(pair.target.model, pair.draft.model, ids, indices, cfg.max_new_tokens,
                                    cfg.sampling, seed + b, pad, eos, cfg.mix_prob, gen)
        for p, index, row in zip(batch, indices, rows):
            if row.get("nonfinite"):
                skipped.append(_skip(p, index, "non-finite logits"))
                continue
            cols["prompt_id"].append(p.id)
            cols["prompt_index"].append(index)
            for key in SPRINTER_COLUMNS[2:]:
                cols[key].append(row[key])
            labelled += len(row["positions"])
    return cols, labelled, skipped


def _answers(cfg, pair, batch, ids, seed: int, pad: int, eos: list[int]) -> list[list[judge.Answer]]:
    """Every model's greedy answer and ``answer_samples`` sampled ones, per prompt of a batch."""
    from specheads.export.shim import batched
    from specheads.export.shim.sampling import SamplingConfig

    out = [[] for _ in batch]
    for mi, name in enumerate(cfg.answer_models):
        model = (pair.target if name == "target" else pair.draft).model
        device = model.get_input_embeddings().weight.device
        for si in range(1 + cfg.answer_samples):
            sampling = SamplingConfig() if si == 0 else SamplingConfig(do_sample=True, temperature=cfg.answer_temperature)
            g = torch.Generator(device=device).manual_seed(seed * 64 + mi * 16 + si) if si else None
            for i, o in enumerate(batched.generate(model, ids, cfg.max_new_tokens, sampling, g, eos, pad)):
                text = pair.tokenizer.decode(o, skip_special_tokens=True)
                out[i].append(judge.Answer(text, name, "greedy" if si == 0 else f"sample-{si}"))
    return out


def _label_judge_chunk(cfg, pair, items, lo: int, chunk: int, seed: int, pad: int, eos: list[int], limit):
    counts = {k: 0 for k in JUDGE_COUNTS}
    counts["items"] = len(items)
    tuples, review, index_of = [], [], {}
    if cfg.tuples:  # imported tuples: the items are the tuples themselves
        tuples = list(items)
        index_of = {t.id: cfg.offset + lo + i for i, t in enumerate(items)}
        counts["tuples"] = len(tuples)
    else:
        for b in range(0, len(items), cfg.batch_size):
            batch = items[b: b + cfg.batch_size]
            ids = [fit_context(format_prompt(pair.tokenizer, p, cfg.chat_template), cfg.max_new_tokens, limit)[0]
                   for p in batch]
            for i, (p, answers) in enumerate(zip(batch, _answers(cfg, pair, batch, ids, seed + b, pad, eos))):
                t, r = judge.build_tuples(p, answers, counts)
                tuples += t
                review += r
                index_of.update({x.id: cfg.offset + lo + b + i for x in t})

    def question_ids(question: str) -> list[int]:
        return format_prompt(pair.tokenizer, question, cfg.chat_template)

    rows = []
    for r in judge.tuple_rows(pair.tokenizer, tuples, question_ids):
        if limit and len(r["input_ids"]) > limit:
            counts["too_long"] += 1
            continue
        rows.append(r)
    feats, labels, per_row, bad = judge.target_features(pair.target.model, rows, pad, cfg.batch_size)
    skipped = []
    for i in bad:  # a tuple side whose target states hold NaN/Inf is counted, never written
        skipped.append({"prompt_index": index_of.get(rows[i]["tuple_id"], -1), "tuple_id": rows[i]["tuple_id"],
                        "side": rows[i]["side"], "reason": "non-finite target states"})
        log.warning("tuple %s side %s skipped: non-finite target states", rows[i]["tuple_id"], rows[i]["side"])
    dropped = set(bad)
    rows = [r for i, r in enumerate(rows) if i not in dropped]
    out = Path(cfg.output_dir)
    offsets = torch.zeros(len(rows) + 1, dtype=torch.int64)
    if rows:
        offsets[1:] = torch.tensor(per_row, dtype=torch.int64).cumsum(0)
    judge_files = shards.JudgeChunkFiles(out, chunk)
    judge_files.write(feats, labels, offsets, [t.to_json() for t in tuples], [json.dumps(x, ensure_ascii=False)
                                                                                for x in review], counts)
    cols = {k: [] for k in JUDGE_COLUMNS}
    for r in rows:
        cols["tuple_id"].append(r["tuple_id"])
        cols["prompt_index"].append(index_of.get(r["tuple_id"], -1))
        for key in ("side", "input_ids", "answer_start", "labels"):
            cols[key].append(r[key])
    return cols, int(labels.numel()), skipped


def _summarise_judge(out: Path) -> dict:
    """Tuple counts (summed over chunks), token label counts, and the merged tuple and review files
    (written chunk by chunk: memory does not grow with the run)."""
    import os
    import tempfile

    counts = {k: 0 for k in JUDGE_COUNTS}
    pos = neg = 0
    handles = {}
    for name in ("tuples.jsonl", "review.jsonl"):
        fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=out)
        handles[name] = (os.fdopen(fd, "w", encoding="utf-8"), tmp)
    try:
        for path in shards.chunk_files(out):
            files = shards.JudgeChunkFiles(out, int(path.stem.split("-")[1]))
            for k, v in files.counts().items():
                counts[k] = counts.get(k, 0) + v
            labels = files.labels()
            pos += int((labels == 1).sum())
            neg += int((labels == 0).sum())
            handles["tuples.jsonl"][0].writelines(x + "\n" for x in files.tuples())
            handles["review.jsonl"][0].writelines(x + "\n" for x in files.review())
        for name, (fh, tmp) in handles.items():
            fh.flush()
            os.fsync(fh.fileno())
            fh.close()
            os.replace(tmp, out / name)
    finally:
        for fh, tmp in handles.values():
            fh.close()
            Path(tmp).unlink(missing_ok=True)
    tokens = pos + neg
    return {"prompts": counts["items"], "tuple_counts": counts, "labelled_tokens": tokens,
            "positive_tokens": pos, "negative_tokens": neg, "label_mean": pos / tokens if tokens else None,
            "tuples_file": "tuples.jsonl", "review_file": "review.jsonl"}


def _summarise_sprinter(out: Path, lambdas: list[float]) -> dict:
    """Prefix counts and shares per category, and the label mean at each lambda."""
    import pyarrow.parquet as pq

    prompts = tokens = 0
    per_cat = {c: 0 for c in sprinter.CATEGORIES}
    prompts_per_cat = {c: 0 for c in sprinter.CATEGORIES}
    accept = {lam: 0 for lam in lambdas}
    for path in shards.chunk_files(out):
        table = pq.read_table(path, columns=["category", "q_token", "p_token"])
        for cat, qs, ps in zip(*(table.column(c).to_pylist() for c in ("category", "q_token", "p_token"))):
            prompts += 1
            prompts_per_cat[cat] += 1
            per_cat[cat] += len(qs)
            tokens += len(qs)
            for lam in lambdas:
                accept[lam] += sum(q <= lam * p for q, p in zip(qs, ps))
    return {"prompts": prompts, "labelled_tokens": tokens, "prefixes_per_category": per_cat,
            "category_shares": {c: (n / tokens if tokens else None) for c, n in per_cat.items()},
            "prompts_per_category": prompts_per_cat,
            "label_mean_by_lambda": {f"{lam:g}": (accept[lam] / tokens if tokens else None) for lam in lambdas},
            "label_mean": accept[lambdas[0]] / tokens if tokens and lambdas else None}


def _summarise(out: Path) -> dict:
    """Counts and label statistics, streamed chunk by chunk from the files."""
    import pyarrow.parquet as pq

    prompts = tokens = 0
    label_sum = expected_sum = 0.0
    hist = [0] * 10
    for path in shards.chunk_files(out):
        table = pq.read_table(path, columns=["label", "expected_label"])
        for labels, expected in zip(table.column("label").to_pylist(), table.column("expected_label").to_pylist()):
            prompts += 1
            tokens += len(labels)
            label_sum += sum(labels)
            expected_sum += sum(expected or [])
            for v in labels:
                hist[min(int(v * 10), 9)] += 1
    return {"prompts": prompts, "labelled_tokens": tokens,
            "label_mean": label_sum / tokens if tokens else None,
            "expected_label_mean": expected_sum / tokens if tokens else None,
            "label_histogram_deciles": hist}


def _items(cfg: DatagenConfig):
    """The run's prompts (or imported tuples), one at a time: JSONL is streamed, never held whole."""
    if cfg.labels == "judge" and cfg.tuples:
        from .tuples import load_tuples

        everything = load_tuples(cfg.tuples)[cfg.offset:]
        return iter(everything[: cfg.num_prompts] if cfg.num_prompts is not None else everything)
    return iter_prompt_files(cfg.prompts, limit=cfg.num_prompts, offset=cfg.offset)


def count_items(cfg: DatagenConfig) -> int:
    """Reads (and so validates) every prompt once, keeping none: bad rows fail before any labelling."""
    return sum(1 for _ in _items(cfg))


def _chunks_of(items, size: int):
    """``(chunk, items)`` for consecutive groups of ``size`` items."""
    it = iter(items)
    chunk = 0
    while batch := list(itertools.islice(it, size)):
        yield chunk, batch
        chunk += 1


def _clean_temporaries(out: Path, rank: int, world: int) -> None:
    """Removes the half-written files a killed run of this process's chunks left behind."""
    for tmp in out.glob("*/.chunk-*.tmp*"):
        try:
            chunk = int(tmp.name.split("-")[1].split(".")[0])
        except (IndexError, ValueError):
            continue
        if shards.owner(chunk, world) == rank:
            tmp.unlink(missing_ok=True)


def _models(pair) -> dict:
    return {"target": {"name": pair.target.name, "fingerprint": pair.target.fingerprint},
            "draft": ({"name": pair.draft.name, "fingerprint": pair.draft.fingerprint, "vocab": pair.draft.vocab}
                      if pair.draft else None),
            "hidden_size": pair.target.hidden_size}


def _numerics(pair, processes: int) -> dict:
    """The run's numerics settings (see :mod:`specheads.numerics`)."""
    loaded = {"target": pair.target, "draft": pair.draft}
    loaded = {role: m for role, m in loaded.items() if m is not None}
    return numerics_settings(processes, {role: m.model.dtype for role, m in loaded.items()},
                             {role: m.device for role, m in loaded.items()})


def run(cfg: DatagenConfig) -> int:
    """Labels this process's unfinished chunks, then (main process) writes the manifest."""
    _check(cfg)
    with use_threads(cfg.threads):  # before any model work: the thread count changes the last bits
        return _run(cfg)


def _run(cfg: DatagenConfig) -> int:
    from accelerate import PartialState

    hf_logging.disable_progress_bar()
    state = PartialState(cpu=not torch.cuda.is_available())
    out = _prepare(cfg, state.is_local_main_process)  # one per node: nodes need not share a filesystem
    n_items = count_items(cfg)
    state.wait_for_everyone()
    needs_draft = not (cfg.labels == "judge" and (cfg.tuples or "draft" not in cfg.answer_models))
    pair = load_pair(cfg.target, cfg.draft if needs_draft or cfg.draft.path else None, same_vocab=True)
    if pair.draft is None and needs_draft:
        raise UserError("heads-datagen needs a draft model; set draft.path")
    eos = pair.eos_token_ids
    pad = pair.tokenizer.pad_token_id if pair.tokenizer.pad_token_id is not None else eos[0]
    limit = min(x for x in (context_length(pair.target.model),
                            context_length(pair.draft.model) if pair.draft is not None else None, 1 << 30) if x)
    total = shards.num_chunks(n_items, cfg.chunk_size)
    rank, world = state.process_index, state.num_processes
    _clean_temporaries(out, rank, world)
    mine = set(shards.my_chunks(out, total, rank, world))
    numerics = _numerics(pair, world)
    if state.is_main_process:
        done = total - len(shards.pending_chunks(out, n_items, cfg.chunk_size))
        if done:
            log.info("resuming: %d of %d chunks already labelled in %s", done, total, out)
            first = shards.chunk_files(out)[0]
            check_resume(shards.chunk_info(first).get("numerics"), numerics, str(first), ignore=("processes",))
    models = {**_models(pair), "numerics": without(numerics, ("processes",))}  # the count changes no chunk
    started, labelled = time.perf_counter(), 0
    with tqdm(total=len(mine), unit="chunk", desc=f"{PROG} rank {rank}", disable=not state.is_main_process) as bar, \
            MetricsWriter(out, f"metrics.rank{rank}.jsonl") as metrics:
        for chunk, items in _chunks_of(_items(cfg), cfg.chunk_size):
            if chunk not in mine:
                continue
            t0 = time.perf_counter()
            cols, n, skipped = _label_chunk(cfg, pair, items, chunk, pad, eos, limit)
            rows = len(next(iter(cols.values())))
            info = {"first_prompt": cfg.offset + chunk * cfg.chunk_size, "prompts": len(items), "rows": rows,
                    "labelled_tokens": n, "skipped": skipped, **models}
            shards.write_chunk(out, chunk, cols, info)
            labelled += n
            metrics.write(chunk=chunk, rank=rank, prompts=len(items), rows=rows, labelled_tokens=n,
                          skipped=len(skipped), seconds=round(time.perf_counter() - t0, 3))
            bar.update()
            bar.set_postfix(labelled_tok_s=f"{labelled / (time.perf_counter() - started):.1f}")
    state.wait_for_everyone()
    if state.is_main_process:
        finish(cfg, out, total, processes=world)
    return 0


def _metrics_rows(path: Path) -> list[dict]:
    """The complete lines of a per-rank metrics file (a line torn by a kill is dropped)."""
    rows = []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:
            continue
    return rows


def finish(cfg: DatagenConfig, out: Path, total: int, processes: int | None = None) -> dict:
    """Checks every chunk is there and writes ``metrics.jsonl`` and ``manifest.json`` from the chunk files.

    The manifest's ``numerics`` are chunk 0's settings with ``processes`` (the count of the run that
    finishes; ``None`` from ``merge``); chunks labelled otherwise are warned about and listed.
    """
    missing = [c for c in range(total) if not shards.chunk_path(out, c).exists()]
    if missing:
        raise UserError(f"{len(missing)} of {total} chunks (first: {missing[:5]}) are not in {out}: run the same "
                        "command again to label them; if the nodes do not share a filesystem, run "
                        "`heads-datagen merge from=<dir>,<dir>... output_dir=<dir>` over every node's output_dir")
    with MetricsWriter(out) as metrics:  # merge the per-rank logs in chunk order, one line per chunk
        rows = {}
        for path in sorted(out.glob("metrics.rank*.jsonl")):
            for row in _metrics_rows(path):
                rows[row["chunk"]] = row
            path.unlink()
        for chunk in sorted(rows):
            metrics.write(rows[chunk])
    shard_list, skipped, models, numerics, otherwise = [], [], None, None, {}
    for c in range(total):
        path = shards.chunk_path(out, c)
        info = shards.chunk_info(path)
        if c == 0:
            numerics = info.get("numerics")
        elif info.get("numerics") != numerics:
            otherwise[c] = info.get("numerics") or {}
        here = {k: info.get(k) for k in ("target", "draft", "hidden_size")}
        if models is None:
            models = here
        elif here != models:
            raise UserError(f"{path} was labelled with other models ({here['target']}, {here['draft']}) than chunk 0 "
                            f"({models['target']}, {models['draft']}); relabel it (delete it and rerun)")
        entry = {"file": f"data/{path.name}", "chunk": c, "first_prompt": info.get("first_prompt"),
                 "prompts": info.get("prompts"), "rows": info.get("rows"), "labelled_tokens": info.get("labelled_tokens"),
                 "skipped": len(info.get("skipped", [])), "bytes": path.stat().st_size, "sha256": file_sha256(path)}
        if cfg.labels == "judge":
            feats = shards.JudgeChunkFiles(out, c).features_path
            entry["features"] = {"file": f"features/{feats.name}", "bytes": feats.stat().st_size,
                                 "sha256": file_sha256(feats)}
        shard_list.append(entry)
        skipped += info.get("skipped", [])
    if cfg.labels == "sprinter":
        stats = _summarise_sprinter(out, list(cfg.lambdas))
        extra = {"lambdas": list(cfg.lambdas), "mix_prob": cfg.mix_prob}
    elif cfg.labels == "judge":
        stats = _summarise_judge(out)
        extra = {"answer_models": list(cfg.answer_models), "answer_samples": cfg.answer_samples,
                 "answer_temperature": cfg.answer_temperature, "tuples_imported_from": cfg.tuples,
                 "hidden_size": models["hidden_size"], "feature": {"model": "target", "state": "pre", "layer": -1}}
    else:
        stats = _summarise(out)
        extra = {}
        if cfg.labels == "fsd":
            extra["fsd"] = fsd.manifest_block(out, list(cfg.fsd_divergences), list(cfg.fsd_thresholds), cfg.fsd_top_k,
                                              cfg.fsd_dist)
    prompts_read = sum(s["prompts"] or 0 for s in shard_list)
    if otherwise:  # a resume under other settings (it warned too), or a merge of such nodes
        first = next(iter(otherwise))
        log.warning("%d chunks (first: %d) were labelled with other numerics settings (%s) than chunk 0: %s is not "
                    "byte-identical to a run with one setting", len(otherwise), first,
                    ", ".join(differences(numerics or {}, otherwise[first])), out)
        extra["numerics_otherwise"] = list(otherwise)[:1000]
    write_manifest(out, command=PROG, labels=cfg.labels, schema_version=shards.SCHEMA_VERSION, **extra,
                   prompts_file=cfg.prompts, offset=cfg.offset, chunk_size=cfg.chunk_size, chunks=total,
                   target=models["target"], draft=models["draft"],
                   sampling=cfg.sampling.to_dict(), seed=cfg.seed, max_new_tokens=cfg.max_new_tokens,
                   numerics={**(numerics or {}), "processes": processes},
                   prompts_read=prompts_read, skipped_nonfinite=len(skipped),
                   skipped_samples=skipped[:1000], **stats, shards=shard_list)
    log.info("%d prompts, %d labelled tokens, mean label %.3f, %d skipped (non-finite) -> %s", stats["prompts"],
             stats["labelled_tokens"], stats["label_mean"] or 0.0, len(skipped), out)
    return stats


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``heads-datagen`` (and its ``verify`` and ``merge`` steps, see ``verify.py``)."""
    import sys

    from .verify import merge, verify_main

    args = list(sys.argv[1:] if argv is None else argv)
    if "verify" in args:
        args.remove("verify")
        return cli_main(f"{PROG} verify", DatagenConfig, "datagen", args, verify_main)
    if "merge" in args:
        args.remove("merge")
        sources = [a for a in args if a.startswith("from=")]
        args = [a for a in args if not a.startswith("from=")]
        dirs = [d.strip() for a in sources for d in a[len("from="):].split(",") if d.strip()]
        return cli_main(f"{PROG} merge", DatagenConfig, "datagen", args,
                        lambda cfg: (merge(dirs, cfg.output_dir), 0)[1])
    return cli_main(PROG, DatagenConfig, "datagen", args, run)


if __name__ == "__main__":
    raise SystemExit(main())
