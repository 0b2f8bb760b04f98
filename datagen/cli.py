"""``heads-datagen``: run both models over prompts and write labelled examples.

    heads-datagen recipe=quickstart num_prompts=64 output_dir=runs/labels
    accelerate launch --multi_gpu --num_processes 2 -m specheads.datagen.cli recipe=quickstart   # no GPU: 2 CPU
    processes, gloo
    heads-datagen recipe=quickstart verify            # every prompt labelled once, every shard readable
    heads-datagen merge from=node0/labels,node1/labels output_dir=labels   # nodes without a shared disk
    heads-datagen recipe=judge_mined_quickstart show index=3   # one swap-mined prompt, its mismatches coloured

Output: ``data/chunk-*.parquet``, one row per prompt. ``labels=acceptance``: ``prompt_id``,
``prompt_index``, ``input_ids`` = prompt + response, ``response_start``, ``draft_token``,
``label``, ``expected_label``. ``labels=fsd`` (see ``fsd.py``): the same columns plus, per token,
``div_<name>`` (``Div(p_i, q_i)`` for each of ``fsd.divergences``) and ``fsd_<name>@<T>`` (the FSD
decision ``Div < T`` for each of ``fsd.thresholds``). ``labels=sprinter`` (see ``sprinter.py``):
``prompt_id``, ``prompt_index``, ``category``, ``input_ids`` (the context), ``positions`` (labelled prefix
lengths), ``draft_token``, ``q_token``, ``p_token``, ``ratio``, ``tv``. ``labels=judge`` (see
``judge.py``): one row per tuple side (``tuple_id``, ``prompt_index``, ``side``, ``input_ids`` =
question + answer, ``answer_start``, ``labels`` 1/0/-1), the target's features at the labelled
tokens in ``features/chunk-*.safetensors`` (fp16), ``tuples.jsonl`` and ``review.jsonl``; with
``judge.mining=swap`` (``mining.py``) the rows come from swapping the draft's mismatches in, and ``mined.jsonl``
holds each searched prompt with its marked mismatches. ``labels=eagle_rounds`` (``eagle_rounds.py``): one row per
prompt decoded by SD with the EAGLE head ``eagle_rounds.head=`` at ``eagle_rounds.k`` candidates per round, per
labelled candidate its round, step, token, ``q_token``, ``p_token``, ``label`` and ``outcome``, the head's states in
``states/chunk-*.safetensors``. Also ``manifest.json`` (counts, label statistics, models, fingerprints,
sampling settings, seed, schema version, ``numerics``: threads per process, process count, dtypes,
devices, torch version, kernel path), ``metrics.jsonl`` (one line per chunk) and
``config.yaml``. Killed at any point and started again with the same command (any process
count), it finishes with every prompt labelled exactly once (see ``shards.py``); with the same
numerics settings (``threads=N`` sets the thread count), the files are the uninterrupted run's, byte
for byte, and a resume under other settings warns. A sample whose
logits hold NaN/Inf is skipped and counted (``skipped_nonfinite`` and ``skipped_samples`` in the
manifest), never written. Prompts are streamed: host memory does not grow with the prompt file.

This module is the dispatcher: arguments, run setup, this process's share of the chunks, resumption
and progress. Each ``labels=`` family is a labeller (``registry.py``: ``acceptance.py``, ``fsd.py``,
``sprinter.py``, ``judge.py``); ``manifest.py`` finishes the run; the layout every reader relies on
is :mod:`specheads.dataset`. ``engine=vllm`` (``vllm_responses.py``): before the models load, one vLLM run
generates the target's responses for every chunk still to write, and the labellers take them from there.
"""

from __future__ import annotations

import itertools
import logging
import shutil
import time
from datetime import timedelta
from pathlib import Path

import torch
from tqdm import tqdm
from transformers.utils import logging as hf_logging

from specheads.config import cli_main, to_yaml
from specheads.datagen import shards, vllm_responses
from specheads.datagen.config import PROG, DatagenConfig
from specheads.datagen.engines import Runtime, runtime_of
from specheads.datagen.labelling import Job, Labeller
from specheads.datagen.manifest import chunk_metrics, finish
from specheads.datagen.mined_view import show
from specheads.datagen.registry import LABELLERS, labeller
from specheads.datagen.verify import merge, verify_main
from specheads.dataset import RUN_DIRS, chunk_files, chunk_info
from specheads.errors import UserError
from specheads.outputs import MetricsWriter, holds_other_run, prepare_output_dir
from specheads.plan import run_plan
from specheads.runtime.numerics import check_resume, numerics_settings, use_threads, without
from specheads.runtime.target_shell import load_target
from specheads.shim import context_length, load_pair

log = logging.getLogger(__name__)


def _check(cfg: DatagenConfig) -> None:
    """Raises one UserError listing every invalid setting."""
    problems = list(cfg.sampling.problems())
    if cfg.labels in LABELLERS:
        problems += labeller(cfg.labels).problems(cfg)
    else:
        problems.append(f"labels={cfg.labels!r} is not one of {list(LABELLERS)}")
    for key in ("max_new_tokens", "batch_size", "chunk_size"):
        if getattr(cfg, key) < 1:
            problems.append(f"{key}={getattr(cfg, key)} must be >= 1")
    if cfg.num_prompts is not None and cfg.num_prompts < 1:
        problems.append(f"num_prompts={cfg.num_prompts} must be >= 1 (or null: every prompt after offset)")
    if cfg.offset < 0:
        problems.append(f"offset={cfg.offset} must be >= 0")
    if cfg.threads is not None and cfg.threads < 1:
        problems.append(f"threads={cfg.threads} must be >= 1 (or null: torch's default)")
    if cfg.dist_timeout_s <= 0:
        problems.append(f"dist_timeout_s={cfg.dist_timeout_s} must be > 0")
    try:
        problems += runtime_of(cfg).problems(cfg)
    except UserError as e:  # an unknown engine
        problems.append(str(e))
    if problems:
        raise UserError("; ".join(problems))


def _prepare(cfg: DatagenConfig, is_main: bool) -> Path:
    config_yaml = to_yaml(cfg)
    out = Path(cfg.output_dir)
    if is_main:
        same = (out / "config.yaml").is_file() and not holds_other_run(out, config_yaml)
        prepare_output_dir(out, config_yaml, overwrite=cfg.overwrite)
        if not same:  # another run's files (and feature caches built on them) must not mix with this one's
            for sub in (*RUN_DIRS, vllm_responses.SIDE):
                shutil.rmtree(out / sub, ignore_errors=True)
    return out


def _chunks_of(items, size: int):
    """``(chunk, items)`` for consecutive groups of ``size`` items."""
    it = iter(items)
    chunk = 0
    while batch := list(itertools.islice(it, size)):
        yield chunk, batch
        chunk += 1


def _models(pair) -> dict:
    return {
        "target": {"name": pair.target.name, "fingerprint": pair.target.fingerprint},
        "draft": (
            {"name": pair.draft.name, "fingerprint": pair.draft.fingerprint, "vocab": pair.draft.vocab}
            if pair.draft
            else None
        ),
        "hidden_size": pair.target.hidden_size,
    }


def _numerics(pair, processes: int) -> dict:
    """The run's numerics settings (see :mod:`specheads.runtime.numerics`)."""
    loaded = {"target": pair.target, "draft": pair.draft}
    loaded = {role: m for role, m in loaded.items() if m is not None}
    return numerics_settings(
        processes, {role: m.model.dtype for role, m in loaded.items()}, {role: m.device for role, m in loaded.items()}
    )


def _load(cfg: DatagenConfig, family: Labeller, runtime: Runtime) -> Job:
    """The models, with the padding token, EOS ids and the shortest context length. With ``engine=vllm`` the
    Transformers target holds only what the family still needs of it (often its config alone)."""
    needs_draft = family.needs_draft(cfg)
    target = load_target(cfg.target, runtime.target_use(cfg, family))
    pair = load_pair(cfg.target, cfg.draft if needs_draft or cfg.draft.path else None, True, target)
    if pair.draft is None and needs_draft:
        raise UserError("heads-datagen needs a draft model; set draft.path")
    eos = pair.eos_token_ids
    pad = pair.tokenizer.pad_token_id if pair.tokenizer.pad_token_id is not None else eos[0]
    limit = min(
        x
        for x in (
            context_length(pair.target.model),
            context_length(pair.draft.model) if pair.draft is not None else None,
            1 << 30,
        )
        if x
    )
    return Job(cfg, pair, pad, eos, limit)


def run(cfg: DatagenConfig) -> int:
    """Labels this process's unfinished chunks, then (main process) writes the manifest."""
    if cfg.plan:  # before any check against files or any model: the plan reads shapes only
        return run_plan("datagen", cfg)
    _check(cfg)
    with use_threads(cfg.threads):  # before any model work: the thread count changes the last bits
        return _run(cfg)


def _run(cfg: DatagenConfig) -> int:
    from accelerate import PartialState

    hf_logging.disable_progress_bar()
    family, runtime = labeller(cfg.labels), runtime_of(cfg)
    state = PartialState(cpu=not torch.cuda.is_available(), timeout=timedelta(seconds=cfg.dist_timeout_s))
    out = _prepare(cfg, state.is_local_main_process)  # one per node: nodes need not share a filesystem
    n_items = family.count(cfg)
    if not n_items:  # e.g. an offset past the end of a tuple file
        raise UserError(f"nothing to label: offset={cfg.offset} skips every item; lower offset")
    state.wait_for_everyone()
    total = shards.num_chunks(n_items, cfg.chunk_size)
    rank, world = state.process_index, state.num_processes
    # an engine that generates up front fixes a process's chunks then; otherwise they are claimed one by one
    up_front = runtime.engine.own_python
    share = shards.share_chunks(out, total, rank, world, shards.launch_exchange(world), not up_front)
    patience = shards.Patience(out, rank, world, cfg.dist_timeout_s)  # publishes its progress from now on
    if up_front:  # before the models load: vLLM gets the GPUs first, once for every chunk left
        chunks = ((c, items) for c, items in _chunks_of(family.items(cfg), cfg.chunk_size) if c in share.chunks)
        runtime.generate_up_front(cfg, out, chunks, state.local_process_index)
    job = _load(cfg, family, runtime)
    family.check_models(job)
    job.states = runtime.states(cfg, job, state.local_process_index)  # engine=vllm: the target's states too
    numerics = _numerics(job.pair, world)
    if state.is_main_process:
        done = total - len(shards.pending_chunks(out, n_items, cfg.chunk_size))
        if done:
            log.info("resuming: %d of %d chunks already labelled in %s", done, total, out)
            first = chunk_files(out)[0]
            check_resume(chunk_info(first).get("numerics"), numerics, str(first), ignore=("processes",))
    models = {**_models(job.pair), "numerics": without(numerics, ("processes",))}  # the count changes no chunk
    started, labelled = time.perf_counter(), 0
    with (
        tqdm(
            total=len(share.chunks), unit="chunk", desc=f"{PROG} rank {rank}", disable=not state.is_main_process
        ) as bar,
        MetricsWriter(out, f"metrics.rank{rank}.jsonl") as metrics,
    ):
        for chunk, items in _chunks_of(family.items(cfg), cfg.chunk_size):
            if not share.take(chunk):
                continue
            t0 = time.perf_counter()
            job.pregenerated = runtime.responses(job, items, chunk)
            result = family.label_chunk(job, items, chunk)
            rows = len(next(iter(result.columns.values())))
            info = {
                "first_prompt": job.first_index(chunk),
                "prompts": len(items),
                "rows": rows,
                "labelled_tokens": result.tokens,
                "skipped": result.skipped,
                **models,
            }
            shards.write_chunk(out, chunk, result.columns, info)  # killed after this: finish() rebuilds the line
            runtime.landed(out, chunk)  # its pregenerated responses are in the chunk now
            labelled += result.tokens
            metrics.write(chunk_metrics(chunk, info), rank=rank, seconds=round(time.perf_counter() - t0, 3))
            if state.is_main_process:  # what this process's group has finished (one directory listing)
                bar.update(share.finished() - bar.n)
            bar.set_postfix(labelled_tok_s=f"{labelled / (time.perf_counter() - started):.1f}")
    if job.states is not None:  # the run's states server
        job.states.close()
    patience.wait()  # not a barrier: a process with a larger static share may finish long after this one
    state.wait_for_everyone()
    share.close()
    if state.is_local_main_process:
        runtime.landed(out)
    if state.is_main_process:
        finish(cfg, out, total, processes=world)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``heads-datagen`` (its ``verify`` and ``merge`` steps: ``verify.py``;
    ``show``: ``mined_view.py``)."""
    import sys

    args = list(sys.argv[1:] if argv is None else argv)
    if "verify" in args:
        args.remove("verify")
        return cli_main(f"{PROG} verify", DatagenConfig, "datagen", args, verify_main)
    if "show" in args:
        args.remove("show")
        picked = [a for a in args if a.startswith("index=")]
        args = [a for a in args if not a.startswith("index=")]
        index = picked[-1][len("index=") :] if picked else "0"
        return cli_main(f"{PROG} show", DatagenConfig, "datagen", args, lambda cfg: show(cfg.output_dir, index))
    if "merge" in args:
        args.remove("merge")
        sources = [a for a in args if a.startswith("from=")]
        args = [a for a in args if not a.startswith("from=")]
        dirs = [d.strip() for a in sources for d in a[len("from=") :].split(",") if d.strip()]
        return cli_main(
            f"{PROG} merge", DatagenConfig, "datagen", args, lambda cfg: (merge(dirs, cfg.output_dir), 0)[1]
        )
    return cli_main(PROG, DatagenConfig, "datagen", args, run)


if __name__ == "__main__":
    raise SystemExit(main())
