"""The quality figures of a sweep's report: ROUGE against the target alone and the references, FLOPs per token,
SPRINTER's alpha and its section."""

from __future__ import annotations

from specheads.evaluate import quality
from specheads.evaluate.accuracy import output_text, prompt_ids
from specheads.evaluate.sweep import total
from specheads.export.package import read_metadata


def add_quality(cfg, pair, prompts, grouped: dict[str, list[dict]], decoders, summary: dict) -> None:
    """Adds FLOPs, verifier calls and ROUGE to the table rows; SPRINTER's alpha, TV bound and ratios."""
    tok = pair.tokenizer
    texts = {n: [output_text(pair, n, r["tokens"]) for r in rows] for n, rows in grouped.items()}
    refs = [p.reference_text for p in prompts]
    v_params = {
        n: sum(p.numel() for p in d.policy.head.parameters())
        for n, d in decoders.items()
        if n.startswith("s") and hasattr(d.policy, "head")
    }
    for row in summary["table"]:
        n = row["config"]
        tot = total(grouped[n])
        own = getattr(decoders[n], "eagle", None)  # the row's drafter: the EAGLE head, else the draft model
        drafter = own.module if own is not None else pair.draft.model if pair.draft is not None else None
        f = quality.flops_per_token(tot, pair.target.model, drafter, v_params.get(n, 0))
        row["gflops_per_token"] = round(f / 1e9, 5) if f is not None else None
        row["verifier_calls_per_token"] = round(tot.verifier_calls / tot.new_tokens, 4) if tot.new_tokens else None
        row["rouge_vs_target"] = quality.rouge(texts[n], texts["ar"]) if n != "ar" else None
        row["rouge_vs_reference"] = quality.rouge(texts[n], refs)
    sprinter = [r for r in summary["table"] if r["config"].startswith("s")]
    if not sprinter:
        return
    pad = tok.pad_token_id if tok.pad_token_id is not None else pair.eos_token_ids[0]
    ids = prompt_ids(cfg, pair, prompts, decoders)
    section: dict = {"verifier": cfg.sprinter.head, "max_run": cfg.sprinter.max_run, "by_eta": {}}
    for row in sprinter:
        rows = grouped[row["config"]]
        decisions = [[tuple(d) for d in r.get("decisions", [])] for r in rows]
        if getattr(decoders[row["config"]], "eagle", None) is not None:
            # an EAGLE head drafts a round's later candidates from its own states: no teacher-forced pass gives
            # the q they were drawn from, so alpha is not measured (heads-train's held-out eval_alpha is)
            errs = {"decisions": sum(map(len, decisions)), "alpha": None, "drafter": "eagle"}
        else:
            errs = quality.verifier_errors(
                pair.target.model, pair.draft.model, ids, [r["tokens"] for r in rows], decisions, cfg.sampling, pad
            )
        section["by_eta"][row["config"]] = {
            **errs,
            "tokens_per_s": row["tokens_per_s"],
            "target_calls_per_token": row["verification_rate"],
            "tokens_between_target_calls": row["tokens_per_call"],
            "gflops_per_token": row["gflops_per_token"],
            "rouge_vs_target": row["rouge_vs_target"],
            "rouge_vs_reference": row["rouge_vs_reference"],
        }
    sds = [r for r in summary["table"] if r["config"][0] in "kh"]
    main = sprinter[0]
    section["main"] = main["config"]
    section["alpha"] = section["by_eta"][main["config"]]["alpha"]
    if sds:
        sd = max(sds, key=lambda r: r["tokens_per_s"])
        section["best_sd"] = sd["config"]
        section["ratios"] = {
            "target_calls_sd_over_sprinter": round(sd["verification_rate"] / main["verification_rate"], 4)
            if main["verification_rate"]
            else None,
            "sprinter_vs_sd_tokens_per_s": round(main["tokens_per_s"] / sd["tokens_per_s"], 4),
            "flops_sd_over_sprinter": round(sd["gflops_per_token"] / main["gflops_per_token"], 4)
            if main["gflops_per_token"]
            else None,
        }
    head = read_metadata(cfg.sprinter.head)
    section["head"] = {
        "feature": head.get("feature", {}).get("position"),
        "lam": head.get("lam"),
        "auroc": head.get("extra", {}).get("train", {}).get("eval_auroc"),
        "default_eta": head.get("default_threshold"),
    }
    summary["sprinter"] = section
