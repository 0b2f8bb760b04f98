"""``heads-decode``: run a decoding policy over a prompt file.

    heads-decode recipe=quickstart sd.k=8 num_prompts=4 output_dir=runs/sd-k8
    heads-decode recipe=quickstart deploy=runs/export/head.safetensors   # the rule heads-eval chose, packaged

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
from specheads.decode import assemble, vllm_engine
from specheads.decode.decode_config import DecodeConfig, decode_schema, policy_settings
from specheads.engines import engine_of
from specheads.errors import UserError
from specheads.outputs import (
    MetricsWriter,
    atomic_write_json,
    pair_record,
    prepare_output_dir,
    read_finished_rows,
    write_manifest,
)
from specheads.prompts import load_prompt_files
from specheads.shim import COUNTS, POLICIES, GenerationStats, predict_ms_per_token

log = logging.getLogger(__name__)
PROG = "heads-decode"


def _deployed(cfg: DecodeConfig) -> None:
    """``deploy=``: the policy and settings the head's packaged choice names (``export/deploy.py``), set on ``cfg``
    where its policy section holds the default; its EAGLE head where ``eagle`` is unset."""
    from specheads.export.deploy import decode_choice, of_head

    try:
        record = of_head(cfg.deploy)
    except (OSError, UserError, ValueError) as err:
        raise UserError(f"deploy={cfg.deploy!r}: {str(err).splitlines()[0]}") from err
    if not record:
        raise UserError(
            f"deploy={cfg.deploy!r} carries no rule to deploy (heads-export deploy=<heads-eval output_dir> packs one)"
        )
    policy, settings = decode_choice(record, cfg.deploy)
    if cfg.policy not in ("sd", policy):  # sd: the default
        raise UserError(f"deploy={cfg.deploy!r} runs policy={policy} ({record['config']}); drop policy={cfg.policy}")
    cfg.policy = policy
    section = getattr(cfg, policy, None)
    if section is not None:
        defaults = type(section)()
        for key, value in settings.items():
            if hasattr(section, key) and getattr(section, key) == getattr(defaults, key):
                setattr(section, key, tuple(value) if isinstance(getattr(defaults, key), tuple) else value)
    regime = record.get("regime") or {}
    if regime.get("eagle") and not cfg.eagle:
        cfg.eagle = regime["eagle"]
    if regime.get("batch_size", cfg.batch_size) != cfg.batch_size or (
        regime.get("sampling", cfg.sampling.to_dict()) != cfg.sampling.to_dict()
    ):
        log.warning(
            "deploy=%s: %s was chosen at batch %s, sampling %s; this run is at batch %s, sampling %s",
            cfg.deploy,
            record["config"],
            regime.get("batch_size"),
            regime.get("sampling"),
            cfg.batch_size,
            cfg.sampling.to_dict(),
        )


def _check(cfg: DecodeConfig):
    """Every problem of the config in one UserError; returns the chosen policy's settings."""
    problems, settings = [], None
    if cfg.policy not in POLICIES:
        problems.append(f"policy={cfg.policy!r} is not one of {list(POLICIES)}")
    else:
        try:  # the policy checks its own settings
            settings = policy_settings(cfg)
        except UserError as exc:
            problems.append(str(exc))
    problems += assemble.problems(
        cfg.policy,
        settings,
        eagle=bool(cfg.eagle),
        sampling=cfg.sampling,
        fused_forward=cfg.fused_forward,
        batch_size=cfg.batch_size,
        max_new_tokens=cfg.max_new_tokens,
        profile=cfg.profile,
    )
    if not cfg.prompts:
        problems.append("prompts is not set; pass prompts=<file.jsonl>")
    if cfg.num_prompts is not None and cfg.num_prompts < 1:
        problems.append(f"num_prompts={cfg.num_prompts} must be >= 1 (or unset for all)")
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


def build(cfg: DecodeConfig, settings, sources=()):
    """The decoder of a ``heads-decode`` config (through :mod:`.assemble`) and its cost table (None without one)."""
    family = POLICIES[cfg.policy]
    # TLI and SLEM bridge two vocabularies; the draft alone needs none of the target's.
    models = assemble.load(
        cfg.target,
        cfg.draft if "draft" in family.models and not cfg.eagle else None,
        eagle=cfg.eagle,
        same_vocab=family.bridge is None and len(family.models) == 2,
        cost_pass=assemble.cost_pass(cfg.policy, settings),
        profile=cfg.profile,
        fused_forward=cfg.fused_forward,
        batch_size=cfg.batch_size,
    )
    policy = assemble.policy(cfg.policy, models, settings, sampling=cfg.sampling, strict=cfg.strict, sources=sources)
    run = dict(sampling=cfg.sampling, seed=cfg.seed, chat_template=cfg.chat_template, packed=cfg.packed)
    decoder = assemble.decoder(
        models,
        policy,
        max_new_tokens=cfg.max_new_tokens,
        fused_forward=cfg.fused_forward,
        batch_size=cfg.batch_size,
        **run,
    )
    return decoder, models.costs


def _rows(cfg, decoder, prompts, done, outputs):
    """Every prompt's output row, in order of finishing: the finished ones of an earlier attempt first, each new
    one written to ``outputs`` as it finishes."""
    yield from (done[i] for i in sorted(done))
    todo = [(i, p) for i, p in enumerate(prompts, start=cfg.offset) if i not in done]
    if cfg.stream:
        tokenizer = decoder.pair.tokenizer
        results = ((i, _streamed(decoder, i, p, tokenizer)) for i, p in todo)
    else:
        results = decoder.decode_many(todo, cfg.batch_size, names=[f"prompt {p.id}" for _, p in todo])
    for index, res in results:
        prompt = prompts[index - cfg.offset]
        row = {
            "index": index,
            "id": prompt.id,
            "completion": res.text,
            "tokens": res.tokens,
            "reference": prompt.reference,
            "truncated_prompt_tokens": res.truncated_prompt_tokens,
            "stats": res.stats.to_dict(),
            **{k: round(v, 4) for k, v in res.stats.counters.items()},
        }
        outputs.write(json.dumps(row, ensure_ascii=False) + "\n")
        outputs.flush()
        yield row


def _streamed(decoder, index, prompt, tokenizer):
    print(f"\n### {prompt.id}", flush=True)
    res = decoder.decode(prompt, index, on_tokens=_Streamer(tokenizer), name=f"prompt {prompt.id}")
    print(flush=True)
    return res


def _summary(cfg, decoder, costs, total, counted, truncated, elapsed, all_new: bool) -> dict:
    """metrics.json: the policy and its settings, the sampling, the totals; a run that decoded every prompt its
    throughput, a cost-aware one its cost table and predicted against measured ms/token."""
    out = {
        "policy": cfg.policy,
        **decoder.policy.describe(),
        "sampling": cfg.sampling.to_dict(),
        "truncated_prompts": truncated,
        **total.to_dict(),
    }
    if all_new:  # every prompt decoded in this run: its throughput over the wall clock
        rate = round(total.new_tokens / elapsed, 4) if elapsed > 0 else None
        out.update(batch_size=cfg.batch_size, elapsed_s=round(elapsed, 3), aggregate_tokens_per_s=rate)
    out.update({k: round(v, 4) for k, v in counted.items()})
    if costs is not None and total.new_tokens:
        predicted = predict_ms_per_token(costs, total.draft_forwards, total.target_pass_sizes, total.new_tokens)
        measured = 1000 * total.wall_time / total.new_tokens
        out.update(
            cost_table=costs.to_dict(),
            predicted_ms_per_token=round(predicted, 4),
            measured_ms_per_token=round(measured, 4),
            predicted_over_measured=round(predicted / measured, 4) if measured else None,
        )
    return out


def run(cfg: DecodeConfig) -> int:
    """Loads the pair, decodes every prompt, writes outputs and metrics."""
    if cfg.deploy:
        _deployed(cfg)
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
    started = time.time()
    decoder, costs = build(cfg, settings, sources={p.source for p in prompts})
    own = [k for k in decoder.policy.counters() if k not in COUNTS]  # the policy's counts (fsd: fuzzy_only)
    log.info("decoding %d prompts with policy=%s %s", len(prompts), cfg.policy, decoder.policy.describe())
    (out_dir / "metrics.jsonl").unlink(missing_ok=True)  # mirrors outputs.jsonl: rebuilt from the finished rows
    total, truncated, counted = GenerationStats(prompts=0), 0, dict.fromkeys(own, 0.0)
    bar = tqdm(total=len(prompts), desc=f"{PROG} {cfg.policy}", unit="prompt", disable=cfg.stream)
    with open(out_dir / "outputs.jsonl", "a", encoding="utf-8") as outputs, MetricsWriter(out_dir) as metrics, bar:
        decode_started = time.perf_counter()
        for row in _rows(cfg, decoder, prompts, done, outputs):
            metrics.write({"index": row["index"], "id": row["id"], **row["stats"]})
            total = GenerationStats.total([total, _stats(row)])
            counted = {k: counted[k] + row.get(k, 0.0) for k in counted}
            truncated += bool(row["truncated_prompt_tokens"])
            bar.update()
            bar.set_postfix(tok_s=f"{total.tokens_per_s:.1f}", per_call=f"{total.tokens_per_call:.2f}")
        elapsed = time.perf_counter() - decode_started
    summary = _summary(cfg, decoder, costs, total, counted, truncated, elapsed, not done and bool(prompts))
    atomic_write_json(out_dir / "metrics.json", summary)
    _finish(cfg, decoder.pair, out_dir, len(prompts), total, time.time() - started)
    return 0


def _finish(cfg, pair, out_dir: Path, n: int, total: GenerationStats, wall: float) -> None:
    """The manifest, and the run's totals in the log."""
    extra = dict(sampling=cfg.sampling.to_dict(), seed=cfg.seed, wall_time_s=round(wall, 3))
    write_manifest(out_dir, command=PROG, prompts_file=cfg.prompts, num_prompts=n, **pair_record(pair), **extra)
    log.info(
        "%d tokens, %.2f tokens/s, %.3f tokens per target call, verification rate %.3f, discard rate %.3f -> %s",
        total.new_tokens,
        total.tokens_per_s,
        total.tokens_per_call,
        total.verification_rate,
        total.discard_rate,
        out_dir,
    )


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``heads-decode``."""
    return cli_main(PROG, decode_schema(), "decode", argv, run)


if __name__ == "__main__":
    raise SystemExit(main())
