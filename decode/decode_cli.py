"""``heads-decode``: run a decoding policy over a prompt file.

    heads-decode recipe=quickstart sd.k=8 num_prompts=4 output_dir=runs/sd-k8

Writes ``outputs.jsonl`` (one completion per prompt, with its stats), ``metrics.jsonl``
(the same stats, one line per prompt), ``metrics.json`` (aggregate; with ``stop=cost`` also the
cost table and the predicted and measured ms/token), ``config.yaml`` and ``manifest.json`` into
``output_dir``. Re-running the same command after an interruption
resumes: finished prompts are kept, the rest are decoded (each prompt's draws are seeded
from ``(seed, prompt index)``, so the result equals an uninterrupted run).
"""

from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path

from tqdm import tqdm
from transformers.utils import logging as hf_logging

from specheads.config import cli_main, to_yaml
from specheads.decode import vllm_engine
from specheads.decode.api import Decoder, load_eagle, make_policy, pair_costs, policy_problems
from specheads.decode.decode_config import DecodeConfig, decode_schema, policy_settings
from specheads.engines import engine_of
from specheads.errors import UserError
from specheads.export.package import outside_gate, read_metadata
from specheads.outputs import (
    MetricsWriter,
    atomic_write_json,
    pair_record,
    prepare_output_dir,
    read_finished_rows,
    write_manifest,
)
from specheads.prompts import load_prompt_files
from specheads.shim import COUNTS, POLICIES, PROFILES, GenerationStats, load_pair, predict_ms_per_token

log = logging.getLogger(__name__)
PROG = "heads-decode"


def _check(cfg: DecodeConfig):
    """Every problem of the config in one UserError; returns the chosen policy's settings."""
    problems = list(cfg.sampling.problems())
    cls = POLICIES.get(cfg.policy)
    settings = None
    if cls is None:
        problems.append(f"policy={cfg.policy!r} is not one of {list(POLICIES)}")
    else:
        try:  # the policy checks its own settings
            settings = policy_settings(cfg)
        except UserError as exc:
            problems.append(str(exc))
    stop = getattr(settings, "stop", None)
    if cls is not None:  # the decode's own rules, as the Decoder will check them once the models are loaded
        problems += policy_problems(cls, bool(cfg.eagle), cfg.sampling, cfg.fused_forward, batch_size=cfg.batch_size)
    if stop == "cost" and cfg.profile not in PROFILES and not Path(cfg.profile).is_file():
        problems.append(f"profile={cfg.profile!r} is not auto, refresh or an existing cost-table JSON file")
    if cfg.max_new_tokens < 1:
        problems.append(f"max_new_tokens={cfg.max_new_tokens} must be >= 1")
    if not cfg.prompts:
        problems.append("prompts is not set; pass prompts=<file.jsonl>")
    if cfg.num_prompts is not None and cfg.num_prompts < 1:
        problems.append(f"num_prompts={cfg.num_prompts} must be >= 1 (or unset for all)")
    if cfg.batch_size < 1:
        problems.append(f"batch_size={cfg.batch_size} must be >= 1")
    try:
        if engine_of(cfg).own_python:
            problems += vllm_engine.problems(cfg, settings)
    except UserError as e:  # an unknown engine, named with the other problems
        problems.append(str(e))
    if cfg.batch_size > 1 and cfg.stream:
        problems.append("stream=true prints one completion at a time: use batch_size=1")
    if problems:
        raise UserError("; ".join(problems))
    return settings


class _Streamer:
    """Prints a completion's text as its tokens are committed (decoding the whole suffix keeps
    multi-byte characters intact)."""

    def __init__(self, tokenizer):
        self.tokenizer, self.ids, self.printed = tokenizer, [], 0

    def __call__(self, ids: list[int]) -> None:
        self.ids.extend(ids)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if text.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for more tokens
            return
        sys.stdout.write(text[self.printed :])
        sys.stdout.flush()
        self.printed = len(text)


def _stats(row: dict) -> GenerationStats:
    """The stats of one output row (its derived rates dropped)."""
    fields = GenerationStats.__dataclass_fields__
    return GenerationStats(**{k: v for k, v in row["stats"].items() if k in fields})


def run(cfg: DecodeConfig) -> int:
    """Loads the pair, decodes every prompt, writes outputs and metrics."""
    settings = _check(cfg)
    hf_logging.disable_progress_bar()  # our own bar is the one to watch; errors stay one line
    prompts = load_prompt_files(cfg.prompts, limit=cfg.num_prompts, offset=cfg.offset)
    config_yaml = to_yaml(cfg)
    previous = Path(cfg.output_dir) / "config.yaml"
    same_run = previous.is_file() and previous.read_text(encoding="utf-8") == config_yaml
    out_dir = prepare_output_dir(cfg.output_dir, config_yaml, overwrite=cfg.overwrite)
    if not same_run:
        (out_dir / "outputs.jsonl").unlink(missing_ok=True)
    done = {row["index"]: row for row in read_finished_rows(out_dir / "outputs.jsonl")}
    if engine_of(cfg).own_python:  # vLLM decodes every prompt in a child process of its own Python
        return vllm_engine.run(cfg, settings, prompts, out_dir, PROG)
    if done:
        log.info("resuming: %d of %d prompts already done in %s", len(done), len(prompts), out_dir)
    family = POLICIES[cfg.policy]
    lossy_head = getattr(settings, "head", None) if cfg.policy in ("judge", "sprinter") else None
    if lossy_head:
        why = outside_gate(read_metadata(lossy_head), {p.source for p in prompts})
        if why:
            log.warning("%s head %s: %s", cfg.policy, lossy_head, why)
    # TLI and SLEM bridge two vocabularies; the draft alone needs none of the target's.
    pair = load_pair(
        cfg.target,
        cfg.draft if "draft" in family.models and not cfg.eagle else None,
        same_vocab=family.bridge is None and len(family.models) == 2,
    )
    eagle = load_eagle(cfg.eagle, pair) if cfg.eagle else None
    costs = None
    if getattr(settings, "stop", None) == "cost":
        own = family.Settings.THRESHOLD
        if own and getattr(settings, own) is not None:
            log.warning("%s.%s=%s is not used with stop=cost", cfg.policy, own, getattr(settings, own))
        most = max(getattr(settings, "k_max", 20), getattr(settings, "tree_nodes", 0))
        costs = pair_costs(pair, most + 1, cfg.profile, cfg.fused_forward, eagle=eagle, batch_size=cfg.batch_size)
        log.info("%s", costs.describe())
    policy = make_policy(
        cfg.policy, pair, settings=settings, sampling=cfg.sampling, strict=cfg.strict, costs=costs, eagle=eagle
    )
    decoder = Decoder(
        pair,
        policy,
        cfg.max_new_tokens,
        sampling=cfg.sampling,
        seed=cfg.seed,
        chat_template=cfg.chat_template,
        fused_forward=cfg.fused_forward,
        eagle=eagle,
        packed=cfg.packed,
    )
    problem = decoder.batch_problem() if cfg.batch_size > 1 else None
    if problem:
        raise UserError(f"batch_size={cfg.batch_size}: {problem}")
    settings = policy.describe()
    own = [k for k in policy.counters() if k not in COUNTS]  # the policy's counts beside the stats (fsd: fuzzy_only)
    log.info("decoding %d prompts with policy=%s %s", len(prompts), cfg.policy, settings)
    # metrics.jsonl mirrors outputs.jsonl: rebuilt from the finished rows, then appended to.
    (out_dir / "metrics.jsonl").unlink(missing_ok=True)
    started = time.time()
    with (
        open(out_dir / "outputs.jsonl", "a", encoding="utf-8") as outputs,
        MetricsWriter(out_dir) as metrics,
        tqdm(total=len(prompts), desc=f"{PROG} {cfg.policy}", unit="prompt", disable=cfg.stream) as bar,
    ):
        total, truncated, counted = GenerationStats(prompts=0), 0, dict.fromkeys(own, 0.0)
        todo = [(i, p) for i, p in enumerate(prompts, start=cfg.offset) if i not in done]
        ids = {i: p.id for i, p in enumerate(prompts, start=cfg.offset)}

        def results():
            yield from ((i, done[i]) for i in sorted(done))
            if cfg.stream:
                for index, prompt in todo:
                    print(f"\n### {prompt.id}", flush=True)
                    res = decoder.decode(prompt, index, on_tokens=_Streamer(pair.tokenizer), name=f"prompt {prompt.id}")
                    print(flush=True)
                    yield index, res
            else:
                yield from decoder.decode_many(todo, cfg.batch_size, names=[f"prompt {p.id}" for _, p in todo])

        decode_started = time.perf_counter()
        for index, res in results():
            row = res
            if not isinstance(res, dict):  # decoded now (a dict: a finished row of an earlier attempt)
                row = {
                    "index": index,
                    "id": ids[index],
                    "completion": res.text,
                    "tokens": res.tokens,
                    "reference": prompts[index - cfg.offset].reference,
                    "truncated_prompt_tokens": res.truncated_prompt_tokens,
                    "stats": res.stats.to_dict(),
                    **{k: round(v, 4) for k, v in res.stats.counters.items()},
                }
                outputs.write(json.dumps(row, ensure_ascii=False) + "\n")
                outputs.flush()
            metrics.write({"index": index, "id": ids[index], **row["stats"]})
            total = GenerationStats.total([total, _stats(row)])
            for k in counted:
                counted[k] += row.get(k, 0.0)
            truncated += bool(row["truncated_prompt_tokens"])
            bar.update()
            bar.set_postfix(tok_s=f"{total.tokens_per_s:.1f}", per_call=f"{total.tokens_per_call:.2f}")
        elapsed = time.perf_counter() - decode_started
    summary = {
        "policy": cfg.policy,
        **settings,
        "sampling": cfg.sampling.to_dict(),
        "truncated_prompts": truncated,
        **total.to_dict(),
    }
    if todo and not done:  # every prompt decoded in this run: its throughput over the wall clock
        summary.update(
            batch_size=cfg.batch_size,
            elapsed_s=round(elapsed, 3),
            aggregate_tokens_per_s=round(total.new_tokens / elapsed, 4) if elapsed > 0 else None,
        )
    summary.update({k: round(v, 4) for k, v in counted.items()})
    if costs is not None and total.new_tokens:
        predicted = predict_ms_per_token(costs, total.draft_forwards, total.target_pass_sizes, total.new_tokens)
        measured = 1000 * total.wall_time / total.new_tokens
        summary.update(
            cost_table=costs.to_dict(),
            predicted_ms_per_token=round(predicted, 4),
            measured_ms_per_token=round(measured, 4),
            predicted_over_measured=round(predicted / measured, 4) if measured else None,
        )
    atomic_write_json(out_dir / "metrics.json", summary)
    write_manifest(
        out_dir,
        command=PROG,
        prompts_file=cfg.prompts,
        num_prompts=len(prompts),
        **pair_record(pair),
        sampling=cfg.sampling.to_dict(),
        seed=cfg.seed,
        wall_time_s=round(time.time() - started, 3),
    )
    log.info(
        "%d tokens, %.2f tokens/s, %.3f tokens per target call, verification rate %.3f, discard rate %.3f -> %s",
        total.new_tokens,
        total.tokens_per_s,
        total.tokens_per_call,
        total.verification_rate,
        total.discard_rate,
        out_dir,
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``heads-decode``."""
    return cli_main(PROG, decode_schema(), "decode", argv, run)


if __name__ == "__main__":
    raise SystemExit(main())
