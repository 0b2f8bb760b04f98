"""``heads-eval``: any set of decoding policies side by side on held-out prompts.

    heads-eval recipe=quickstart
    heads-eval recipe=quickstart head=runs/quickstart-export/head.safetensors thresholds=[0.3,0.5,0.7]
    heads-eval recipe=sprinter_quickstart
    heads-eval recipe=fsd_quickstart fsd.js=[0.05,0.1] confidence.taus=[0.5]

One run decodes every prompt with: the target alone (``ar``), the draft alone (``draft``),
standard SD at each fixed ``K`` and SpecDec++ at each threshold ``h``, interleaved prompt by
prompt. It reports for each configuration tokens/s, tokens and accepted drafts per target call,
verification rate, discard rate and draft forwards per token; the per-forward times ``t_t``
and ``t_d`` measured by the two baselines (wall time per forward, loop overhead included); the
cost model ``T/N`` of docs/algorithms/cost-model.md at the profiled cost table
(:mod:`specheads.shim.costs.cost_table`: ``t_d`` and ``t_t(k)`` per target pass size ``k``, cached per
machine; ``profile=``) over the pass sizes each row actually used (``predicted_ms_per_token``),
beside the measured ms/token (wall time / new tokens, prefill included) and their ratio; with
``cost_stop`` the cost-aware stop rules (rows ``h-cost``, ``c-cost``: no threshold, stop where the
expected tokens per ms of the cost table peak); and, for greedy decoding, the oracle stopping rule
(SpecDec++ Theorem 4.1) computed from the target's own output, and the same stopping rule as a
perfect SpecDec++ head would apply it (it can only judge a candidate after drafting it, never before
``k_min``): the most any head can gain on these prompts with these models, both priced with the
cost table. With ``sprinter.head=`` it also decodes with SPRINTER at each
``eta`` and reports, for every configuration, FLOPs per token, verifier calls per token and ROUGE
against the target-only outputs and the references, and for SPRINTER the measured ``alpha`` and the
TV bound (``quality.py``) and its ratios to the best SD configuration. Training-free rows: top-K
verification (``topk.ks=``, rows ``t<K>``), FSD per divergence (``fsd.js=`` ..., rows ``fsd-<div>-<T>``)
and draft-confidence stopping (``confidence.taus=``, rows ``c<tau>``), summarised against SD in the
``training_free`` section (``training_free.py``). Ratios of the stop rules: ``cost_aware_vs_best_fixed_k``
(tokens/s of ``h-cost`` over the fastest fixed K; ``confidence_cost_vs_best_fixed_k`` for ``c-cost``) and
``share_of_perfect_head_gain`` (the fastest SpecDec++ row's measured gain over the fastest fixed K,
``tokens/s / best K's - 1``, divided by the perfect head's predicted gain, ``predicted tokens/s / best K's
predicted - 1``). Writes ``sweep.json`` (cost table, table, oracle, perfect head, best lossless row,
ratios, Pareto check, ``accuracy``, ``sprinter``, ``judge``, ``training_free``), ``pareto.png``,
``quality.png`` (quality against tokens/s and accepted drafts per call, every row),
``rows.jsonl`` (every prompt x configuration; a killed sweep resumes),
``metrics.jsonl`` (one line per configuration), ``metrics.json``, ``config.yaml`` and
``manifest.json``. This module reads the arguments and runs the sweep; ``report.py`` builds the
summary, the sections and the files from the decoded rows.

With ``eagle=<an exported EAGLE head>`` the same-vocabulary rows (``k``, ``h``, ``h-cost``, ``c``, ``c-cost``,
``t``, the judges, FSD) draft with that head from the target's own states (``head=``: a stop head trained on
them), priced by the head's cost table; no draft model is needed (without ``draft.path`` there is no ``draft``
row), and the greedy oracle and perfect head come from the rounds of SD at ``k_max`` on the head
(:func:`~.oracle.rounds_oracle`). The rows that read a draft model's states (``sprinter.head=``, an FSD row with
a head) or vocabulary (``hetero.methods=``) are refused with it.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from transformers.utils import logging as hf_logging

from specheads.config import cli_main, to_yaml
from specheads.decode import assemble
from specheads.decode.api import fit_context, format_prompt
from specheads.engines import engine_of
from specheads.errors import UserError
from specheads.evaluate import report, report_files
from specheads.evaluate.checks import _check, _max_pass
from specheads.evaluate.config import EvalConfig
from specheads.evaluate.oracle import (
    RoundRecorder,
    draft_agreement,
    oracle_schedule,
    perfect_head_schedule,
    rounds_oracle,
    rounds_perfect_head,
)
from specheads.evaluate.printout import print_summary
from specheads.evaluate.rows import expand
from specheads.evaluate.select import family as gated_family
from specheads.evaluate.sweep import build_decoders, decoder, run_sweep, same_vocab_rows
from specheads.export.package import read_metadata, set_default_threshold
from specheads.outputs import holds_other_run, pair_record, prepare_output_dir, write_manifest
from specheads.prompts import load_prompt_files
from specheads.shim import ConfidenceStop, GenerationStats, SpecDecPP, same_vocabulary

log = logging.getLogger(__name__)
PROG = "heads-eval"


def _rounds_oracle(cfg: EvalConfig, models: assemble.Models, prompts, ar_rows: list[dict], lags: list[int]):
    """The oracle and the perfect heads (one per lag in ``lags``) from recorded rounds: every prompt decoded with
    SD at ``k_max`` (:class:`~.oracle.RoundRecorder`; on the EAGLE head, else the draft), its rounds turned into
    the oracle's and the perfect heads'. Sampled, a round's outcome is its draws': a rule that stops right after
    the first rejected candidate keeps the same tokens under the same draws, so the ceilings are those draws'."""
    dec = decoder(cfg, models, RoundRecorder(cfg.k_max))
    oracle = GenerationStats(prompts=0)
    perfect = {lag: GenerationStats(prompts=0) for lag in lags}
    differ = 0
    for i, (prompt, row) in enumerate(zip(prompts, ar_rows)):
        res = dec.decode(prompt, i, name=f"prompt {prompt.id}")
        differ += res.tokens != row["tokens"]
        rounds = dec.policy.rounds
        oracle = GenerationStats.total([oracle, rounds_oracle(rounds, res.stats.new_tokens)])
        for lag in lags:
            one = rounds_perfect_head(rounds, res.stats.new_tokens, cfg.k_min, lag)
            perfect[lag] = GenerationStats.total([perfect[lag], one])
    if differ and not cfg.sampling.do_sample:  # greedy SD is lossless: only numerics (an argmax tie) can part them
        log.warning("the oracle's SD decode differs from the target alone on %d of %d prompts", differ, len(prompts))
    return oracle, perfect


def _row_lags(decoders) -> dict[str, int]:
    """Each stop row's lag: how many drafts after a candidate its rule scores it (a SpecDec++ head's ``lag``;
    the training-free confidence rules score a candidate as it is drawn: 0)."""
    out = {}
    for name, d in decoders.items():
        if isinstance(d.policy, SpecDecPP):
            out[name] = d.policy.lag
        elif isinstance(d.policy, ConfidenceStop):
            out[name] = 0
    return out


def run(cfg: EvalConfig) -> int:
    if engine_of(cfg).own_python:  # vLLM runs the whole evaluation in its own processes
        return _run_vllm(cfg)
    _check(cfg)
    if not cfg.eagle and not cfg.draft.path:
        raise UserError("draft.path is not set; pass draft.path=<the draft model> (or eagle=<an EAGLE head>)")
    hf_logging.disable_progress_bar()
    head_meta = read_metadata(cfg.head) if cfg.head else None
    prompts = load_prompt_files(cfg.prompts, limit=cfg.num_prompts, offset=cfg.offset)
    fresh = cfg.overwrite and holds_other_run(cfg.output_dir, to_yaml(cfg))
    out = prepare_output_dir(cfg.output_dir, to_yaml(cfg), overwrite=cfg.overwrite)
    if fresh:  # another run's rows share config names with this one's, not its settings: never resume from them
        (out / "rows.jsonl").unlink(missing_ok=True)
    started = time.time()
    # With an EAGLE head the draft model only drafts the draft row (none without draft.path).
    models = assemble.load(
        cfg.target,
        cfg.draft,
        eagle=cfg.eagle,
        same_vocab=not cfg.hetero.methods,
        cost_pass=_max_pass(cfg),
        profile=cfg.profile,
        fused_forward=cfg.fused_forward,
        batch_size=cfg.batch_size,
    )
    pair, eagle, costs = models.pair, models.eagle, models.costs
    shared = eagle is not None or same_vocabulary(pair.target.tokenizer, pair.draft.tokenizer)
    if not shared and same_vocab_rows(cfg):
        raise UserError(
            f"the draft's tokenizer differs from the target's: {', '.join(same_vocab_rows(cfg))} need "
            "one vocabulary; on this pair sweep only hetero.methods=[tli,slem,slrs] (and pass ks=[])"
        )
    decoders = build_decoders(cfg, models)
    grouped = run_sweep(decoders, prompts, out / "rows.jsonl", batch_size=cfg.batch_size)
    oracle, perfects = None, {}
    lag = next((d.policy.lag for d in decoders.values() if isinstance(d.policy, SpecDecPP)), None)
    row_lags = _row_lags(decoders)
    lags = sorted(set(row_lags.values()) | ({0, 1} if row_lags else set()))  # both ceilings beside any stop row
    if cfg.oracle and not shared:
        log.info("the oracle needs one vocabulary; skipped for this heterogeneous pair")
    elif cfg.oracle and (eagle is not None or cfg.sampling.do_sample):
        oracle, perfects = _rounds_oracle(cfg, models, prompts, grouped["ar"], lags)
    elif cfg.oracle and not cfg.sampling.do_sample:
        oracle = GenerationStats(prompts=0)
        perfects = {each: GenerationStats(prompts=0) for each in lags}
        ar = decoders["ar"]
        for prompt, row in zip(prompts, grouped["ar"]):
            ids, _ = fit_context(
                format_prompt(pair.tokenizer, prompt, cfg.chat_template), cfg.max_new_tokens, ar.context
            )
            agree = draft_agreement(pair.draft.model, ids, row["tokens"], cfg.fused_forward, ar.engine.vocab_size)
            oracle = GenerationStats.total([oracle, oracle_schedule(agree, cfg.k_max)])
            for each in lags:
                one = perfect_head_schedule(agree, cfg.k_min, cfg.k_max, each)
                perfects[each] = GenerationStats.total([perfects[each], one])
    eagle_info = report.eagle_section(cfg.eagle, eagle.metadata) if eagle is not None else None
    perfect = perfects.get(lag) if lag is not None else None
    ceilings = (perfects, row_lags) if perfects else None
    args = (cfg, pair, prompts, grouped, decoders, oracle, perfect, head_meta, costs, out)
    summary = report.build(*args, eagle=eagle_info, ceilings=ceilings)
    if cfg.write_default:
        _write_defaults(cfg, summary, out)
    report_files.write(out, summary)
    write_manifest(
        out,
        command=PROG,
        prompts_file=cfg.prompts,
        num_prompts=len(prompts),
        **pair_record(pair),
        eagle=eagle_info,
        head=cfg.head,
        sampling=cfg.sampling.to_dict(),
        seed=cfg.seed,
        wall_time_s=round(time.time() - started, 3),
    )
    print_summary(summary)
    return 0


def _write_defaults(cfg: EvalConfig, summary: dict, out: Path) -> None:
    """Each chosen judge / sprinter threshold into its head file (``write_default=true``), when the chosen row is
    within the gate on the test half too (else the head keeps its threshold and ``not_written`` says why)."""
    heads = [
        ("judge", cfg.judge.head),
        ("sprinter", cfg.sprinter.head),
        *((f"judge_{n}", p) for n, p in cfg.judge.heads.items()),
    ]
    for row in cfg.rows:  # rows= of a head-reading policy: the family its rows are gated in
        names = [name for name, _, settings in expand(row) if settings.get("head")]
        fixed = expand(row)[0][2] if names else {}
        if names and gated_family(names[0]) and fixed.get("max_gap") is None:  # a threshold alone is not a floor
            heads.append((gated_family(names[0]), fixed["head"]))
    for family, path in heads:
        entry = summary.get("gated", {}).get("rows", {}).get(family)
        if not path or not entry or entry["row"] is None:
            continue
        if not entry.get("within_gate_on_test"):  # chosen on one half, it must hold on the other to be written
            entry["not_written"] = "outside the gate on the test half"
            log.warning(
                "%s: %s passed %s on the calibration half but not on the test half; %s keeps its threshold",
                family,
                entry["row"],
                summary["gated"]["select"],
                path,
            )
            continue
        set_default_threshold(
            path,
            entry["threshold"],
            {
                "command": f"{PROG} select={cfg.select}",
                "gate": summary["gated"]["select"],  # which bounds chose it
                "competent_sources": summary["gated"]["competent_sources"],
                "sweep": str(out / "sweep.json"),
                "prompts": cfg.prompts,
                "acc_drop": entry["acc_drop"],
                "acc_drop_upper": entry["acc_drop_upper"],
                "disagree_upper": entry.get("disagree_upper"),
                "gap_lower": entry.get("gap_lower"),
                "sources": sorted(entry.get("disagree_by_source", {})),
                "tokens_per_s_vs_target": entry["tokens_per_s_vs_target"],
            },
        )
        entry["written_to"] = path
        log.info("%s: default_threshold %g written to %s", family, entry["threshold"], path)


def _run_vllm(cfg: EvalConfig) -> int:
    """``engine=vllm``: the rows vLLM can decode, side by side (:mod:`.vllm_sweep`)."""
    from specheads.evaluate import vllm_sweep

    bad = vllm_sweep.problems(cfg)
    if bad:
        raise UserError("; ".join(bad))
    prompts = load_prompt_files(cfg.prompts, limit=cfg.num_prompts, offset=cfg.offset)
    if not prompts:
        raise UserError("no prompts to decode (check prompts=, offset=, num_prompts=)")
    out = prepare_output_dir(cfg.output_dir, to_yaml(cfg), overwrite=cfg.overwrite)
    return vllm_sweep.run(cfg, prompts, out, PROG)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``heads-eval``."""
    return cli_main(PROG, EvalConfig, "eval", argv, run)


if __name__ == "__main__":
    raise SystemExit(main())
