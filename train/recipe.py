"""The head training run: setup, epochs, evaluation, early stopping, checkpoints, export.

One loop serves every head: the SpecDec++ acceptance head (soft labels, token mixing, weighted
soft BCE; selected on held-out binary KL; ``label=fsd``: the FSD decisions of ``fsd.py``, no
mixing), the Judge head (``judge.py``) and the SPRINTER verifier (``verifier.py``: hard
ratio-threshold labels, class-weighted BCE; selected on held-out AUROC, with ``metrics.json`` and
``roc.png``).

Data parallel under ``accelerate launch`` (DDP, DeepSpeed ZeRO 1-3): every process draws the
same seeded epoch permutation and takes every ``world``-th micro-batch of it, so the examples a
step sees do not depend on timing. Checkpoints (``checkpoint.py``) are written at epoch ends and,
with ``checkpoint_every``, every that many optimizer steps; a rerun of the same command (same
number of processes) continues at the saved data position with the saved optimizer, scheduler
and RNG state, and ends with the head an uninterrupted run ends with, bit for bit (under the same
numerics settings, which checkpoints record: a resume under others warns, see
``specheads.numerics``). Its ``metrics.jsonl`` is first cut back to the rows written up to that
checkpoint, so no step appears twice.
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import warnings
from contextlib import contextmanager
from pathlib import Path

import torch
from accelerate.utils import DistributedType
from tqdm import tqdm

from specheads.errors import UserError
from specheads.export import save_head
from specheads.export.shim.models import HiddenCapture, load_model
from specheads.config import to_yaml
from specheads.heads import AcceptanceHead, JudgeHead, VerifierHead
from specheads.numerics import check_resume, numerics_settings
from specheads.outputs import MetricsWriter, atomic_write_json, holds_other_run, prepare_output_dir

from . import checkpoint
from . import fsd as F
from . import judge as J
from . import verifier as V
from .config import TrainConfig
from .data import draft_features, load_examples, mix, mix_seed, split
from .features import FeatureCache, cache_key
from .loss import binary_kl, weighted_soft_bce

log = logging.getLogger(__name__)
EVAL_EPOCH = 0xFFF  # the fixed mixing draw of the held-out set


def _epoch_batches(n: int, batch: int, world: int, seed: int, epoch: int) -> list[list[int]]:
    """The epoch's micro-batches of example indices, padded so every process gets as many."""
    order = list(range(n))
    random.Random(seed * 1000 + epoch).shuffle(order)
    per_round = batch * world
    if len(order) % per_round:
        order += order[: per_round - len(order) % per_round]
    return [order[i: i + batch] for i in range(0, len(order), batch)]


def _features(ctx, examples, epoch: int):
    """(features, labels) of a batch: from the cache when there is one, else from the draft."""
    verifier = ctx["cfg"].head == "verifier"
    if ctx["cfg"].head == "judge":  # the datagen run's stored target features
        return ctx["cache"].batch(epoch, examples, ctx["device"])
    if (verifier or ctx["cfg"].label == "fsd") and epoch != EVAL_EPOCH:
        epoch = 0  # verifier and FSD features do not change between epochs (no mixing)
    if ctx.get("cache") is not None:
        x, y = ctx["cache"].batch(epoch, examples, ctx["device"])
    else:
        x, y, _ = _draft_features(ctx, examples, epoch)
    if verifier:  # y holds q(x)/p(x); the label is taken here so every lam shares the features
        y = (y <= ctx["cfg"].lam).float()
    return x, y


def _draft_features(ctx, examples, epoch: int):
    if ctx["cfg"].head == "verifier":
        return V.draft_features(ctx["draft"], ctx["capture"], examples, ctx["cfg"].feature, ctx["pad"], ctx["device"])
    seqs, starts, masks, labels = [], [], [], []
    expected = ctx["cfg"].label in ("expected", "fsd")  # labels that are functions of (p_i, q_i) alone
    for ex in examples:
        if expected:  # the state that produced q_i: the draft on the target's own prefix, every position
            z, m = ex.input_ids, [True] * len(ex.label)
        else:
            z, m = mix(ex, ctx["cfg"].mix_ratio, mix_seed(ctx["cfg"].seed, epoch, ex.index))
        seqs.append(z)
        starts.append(ex.start)
        masks.append(m)
        labels.append(ex.label)
    x, y = draft_features(ctx["draft"], ctx["capture"], seqs, starts, masks, labels, ctx["pad"], ctx["device"],
                          shift=1 if expected else 0)
    return x, y, [sum(m) for m in masks]


def _param_dtype(module) -> torch.dtype:
    """The dtype of a head's weights (bf16 inside a DeepSpeed bf16 engine, else fp32)."""
    return next(module.parameters()).dtype


@torch.no_grad()
def _predict(ctx, head, examples) -> tuple[torch.Tensor, torch.Tensor]:
    logits, labels = [], []
    for i in range(0, len(examples), ctx["cfg"].batch_size):
        batch = examples[i: i + ctx["cfg"].batch_size]
        if ctx["cfg"].head == "verifier":  # the raw ratios, for metrics at several lambda
            x, y = (ctx["cache"].batch(EVAL_EPOCH, batch, ctx["device"]) if ctx.get("cache") is not None
                    else _draft_features(ctx, batch, EVAL_EPOCH)[:2])
        else:
            x, y = _features(ctx, batch, EVAL_EPOCH)
        logits.append(head(x.to(_param_dtype(head))).float())
        labels.append(y)
    return torch.cat(logits), torch.cat(labels)


def _verifier_eval(ctx, head, examples) -> dict:
    cfg = ctx["cfg"]
    logits, ratio = _predict(ctx, head, examples)
    roc = V.roc_metrics(torch.sigmoid(logits), ratio, cfg.lam, cfg.threshold)
    y = (ratio <= cfg.lam).float()
    w_pos, w_neg = ctx["weights"]
    return {"eval_auroc": roc["auroc"], "eval_weighted_loss": float(weighted_soft_bce(logits, y, w_pos, w_neg)),
            "eval_tpr_at_eta": roc["tpr_at_eta"], "eval_fpr_at_eta": roc["fpr_at_eta"],
            "eval_accuracy_at_eta": roc["accuracy_at_eta"], "eval_alpha": roc["alpha"],
            "eval_tokens": roc["tokens"], "eval_label_mean": roc["label_mean"]}


def _judge_eval(ctx, head, examples) -> dict:
    cfg = ctx["cfg"]
    logits, labels = _predict(ctx, head, examples)
    m = J.judge_metrics(torch.sigmoid(logits), labels, cfg.threshold)
    w_pos, w_neg = ctx["weights"]
    return {"eval_auroc": m["auroc"], "eval_weighted_loss": float(weighted_soft_bce(logits, labels, w_pos, w_neg)),
            "eval_negative_precision": m["negative_precision"], "eval_negative_recall": m["negative_recall"],
            "eval_wrong_accepted_share": m["wrong_accepted_share"],
            "eval_correct_accepted_share": m["correct_accepted_share"], "eval_tokens": m["tokens"],
            "eval_negative_tokens": m["negative_tokens"]}


def _selection_score(metrics: dict, head: str) -> float:
    """Lower is better: held-out binary KL (acceptance) or minus AUROC (verifier, judge)."""
    if head in ("verifier", "judge"):
        return -(metrics["eval_auroc"] if metrics["eval_auroc"] is not None else 0.5)
    return metrics["eval_binary_kl"]


@torch.no_grad()
def evaluate(ctx, head, examples) -> dict:
    """Acceptance: unweighted binary KL, weighted loss and AUROC (against the binarised label) on
    held-out prompts. Verifier: AUROC, weighted loss, TPR/FPR/accuracy at eta, alpha."""
    from sklearn.metrics import roc_auc_score

    if ctx["cfg"].head == "verifier":
        return _verifier_eval(ctx, head, examples)
    if ctx["cfg"].head == "judge":
        return _judge_eval(ctx, head, examples)
    x, y = _predict(ctx, head, examples)
    hard = (y >= 0.5).cpu().numpy()
    auroc = float(roc_auc_score(hard, x.cpu().numpy())) if 0 < hard.sum() < len(hard) else None
    cfg = ctx["cfg"]
    return {"eval_binary_kl": float(binary_kl(y, x)), "eval_weighted_loss": float(weighted_soft_bce(x, y, cfg.w_acc,
            cfg.w_rej)), "eval_auroc": auroc, "eval_tokens": int(y.numel()), "eval_label_mean": float(y.mean())}


def _head_metadata(cfg: TrainConfig, manifest: dict, hidden: int, metrics: dict) -> dict:
    if cfg.head == "judge":
        return {"head_config": {"in_features": hidden, "depth": cfg.depth}, "hidden_size": hidden,
                "feature": {"model": "target", "state": "pre", "layer": -1, "position": "own"},
                "label": "judge", "draft": manifest.get("draft"), "target": manifest["target"],
                "sampling": manifest["sampling"], "default_threshold": cfg.threshold,
                "extra": {"train": metrics, "datagen_seed": manifest.get("seed")}}
    if cfg.head == "verifier":
        return {"head_config": {"in_features": V.feature_width(cfg.feature, hidden), "depth": cfg.depth},
                "hidden_size": hidden,
                "feature": {"model": "draft", "state": "post", "layer": -1, "position": cfg.feature},
                "label": "ratio", "lam": cfg.lam, "draft": manifest["draft"], "target": manifest["target"],
                "sampling": manifest["sampling"], "default_threshold": cfg.threshold,
                "extra": {"train": metrics, "datagen_seed": manifest.get("seed")}}
    meta = {"head_config": {"hidden_size": hidden, "depth": cfg.depth}, "hidden_size": hidden,
            "feature": {"model": "draft", "state": "post", "layer": -1,
                        "position": "previous" if cfg.label in ("expected", "fsd") else "own"},
            "label": cfg.label,
            "draft": manifest["draft"], "target": manifest["target"], "sampling": manifest["sampling"],
            "default_threshold": cfg.threshold, "extra": {"train": metrics, "datagen_seed": manifest.get("seed")}}
    if cfg.label == "fsd":
        meta["fsd"] = F.head_metadata(cfg.fsd_label, manifest)
    return meta


def overwrites_another_run(cfg: TrainConfig) -> bool:
    """``overwrite=true`` into an output_dir that holds a run with another config (call it before
    ``prepare_output_dir`` rewrites config.yaml): that run's checkpoints must not be resumed."""
    return cfg.overwrite and holds_other_run(cfg.output_dir, to_yaml(cfg))


def train(cfg: TrainConfig, out: Path, fresh: bool = False) -> dict:
    """Runs the whole training; returns the final metrics and the run's ``numerics``. Resumes from the
    newest checkpoint in ``out``, if any, unless ``fresh`` (``out`` held another run, overwritten: its
    state is removed)."""
    from accelerate import Accelerator

    cuda = torch.cuda.is_available()
    deepspeed = os.environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() == "true"  # set by accelerate launch
    # Under DeepSpeed the engine owns accumulation (and scales the loss); elsewhere this loop does.
    acc = Accelerator(cpu=not cuda and not deepspeed, gradient_accumulation_steps=cfg.grad_accum if deepspeed else 1,
                      mixed_precision="bf16" if cfg.bf16 and cuda and torch.cuda.is_bf16_supported() else "no")
    manifest_path = Path(cfg.data_dir) / "manifest.json"
    if not manifest_path.is_file():
        raise UserError(f"{manifest_path} not found; data_dir must be a finished heads-datagen output_dir")
    manifest = json.loads(manifest_path.read_text())
    verifier = cfg.head == "verifier"
    want = {"verifier": "sprinter", "judge": "judge"}.get(cfg.head, "acceptance")
    held = manifest.get("labels", "acceptance")
    if held != want and not (want == "acceptance" and held == "fsd"):  # fsd data holds the acceptance columns too
        raise UserError(f"{cfg.data_dir} holds labels={held!r} data; head={cfg.head} needs "
                        f"heads-datagen labels={want}")
    if _any_rank(acc, fresh):
        if acc.is_main_process:
            checkpoint.clear(out)
            for name in ("head.safetensors", "best_metrics.json"):
                (out / name).unlink(missing_ok=True)
        acc.wait_for_everyone()
    if cfg.head == "judge":  # the datagen run stored the target's features: no model is loaded
        return _train_loop(cfg, out, acc, manifest, *_judge_setup(cfg, acc, manifest))
    if verifier:
        examples = V.load_examples(cfg.data_dir)
    elif cfg.label == "fsd":
        examples = load_examples(cfg.data_dir, F.label_column(cfg.fsd_label, manifest, cfg.data_dir))
    else:
        examples = load_examples(cfg.data_dir, "expected_label" if cfg.label == "expected" else "label")
    train_ex, eval_ex = split(examples, cfg.eval_fraction, cfg.seed)
    cfg.draft.device = str(acc.device) if cfg.draft.device == "auto" else cfg.draft.device
    with _unpartitioned_models(acc):
        draft = load_model(cfg.draft, "draft")
    if draft.fingerprint != manifest["draft"]["fingerprint"]:
        raise UserError(f"draft {draft.name!r} (fingerprint {draft.fingerprint}) is not the draft the data was "
                        f"labelled with ({manifest['draft']['name']!r}, {manifest['draft']['fingerprint']}); "
                        "set draft.path to that model")
    tok = draft.tokenizer
    ctx = {"cfg": cfg, "draft": draft.model, "capture": HiddenCapture(draft.model), "device": draft.device,
           "pad": tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)}
    ctx["weights"] = V.class_weights(train_ex, cfg.lam) if verifier and cfg.class_weights == "balanced" \
        else (cfg.w_acc, cfg.w_rej)
    if cfg.features == "cached":
        if verifier:
            key = cache_key(draft.fingerprint, 0.0, cfg.seed, f"verifier:{cfg.feature}", cfg.eval_fraction)
        elif cfg.label == "fsd":  # no mixing; the labels differ per divergence and threshold
            name, threshold = F.parse_label(cfg.fsd_label)
            key = cache_key(draft.fingerprint, 0.0, cfg.seed, f"fsd:{name}@{threshold!r}", cfg.eval_fraction)
        else:
            key = cache_key(draft.fingerprint, cfg.mix_ratio, cfg.seed, cfg.label, cfg.eval_fraction)
        root = Path(cfg.cache_dir or Path(cfg.data_dir) / "features") / key
        cache = FeatureCache(root, lambda exs, epoch: _draft_features(ctx, exs, epoch), cfg.batch_size)
        if acc.is_main_process:  # built once, before training; other processes wait for the files
            for epoch in range(1 if verifier or cfg.label == "fsd" else cfg.epochs):
                cache.build(epoch, train_ex)
            cache.build(EVAL_EPOCH, eval_ex)
        acc.wait_for_everyone()
        ctx["cache"] = cache
        log.info("cached features: %s (%.1f MB)", root, cache.nbytes() / 1e6)
    torch.manual_seed(cfg.seed)
    if verifier:
        head = VerifierHead(V.feature_width(cfg.feature, draft.hidden_size), cfg.depth)
    else:
        head = AcceptanceHead(draft.hidden_size, cfg.depth)
    ctx["hidden"], ctx["model_name"] = draft.hidden_size, draft.name
    return _train_loop(cfg, out, acc, manifest, ctx, head, train_ex, eval_ex)


def _judge_setup(cfg: TrainConfig, acc, manifest: dict):
    store = J.JudgeStore(cfg.data_dir)
    train_ex, eval_ex = split(store.examples, cfg.eval_fraction, cfg.seed)
    hidden = int(manifest["hidden_size"])
    weights = (cfg.w_acc, cfg.w_rej)
    if cfg.class_weights == "balanced":  # negatives are rare (the first mistake of each wrong answer)
        labels = torch.cat([store.labels[e.start:e.end] for e in train_ex])
        share = float((labels >= 0.5).float().mean())
        if share in (0.0, 1.0):
            raise UserError(f"every training token of {cfg.data_dir} has label {int(share)}: nothing to learn; "
                            "generate or import more tuples")
        weights = (0.5 / share, 0.5 / (1 - share))
    ctx = {"cfg": cfg, "device": acc.device, "cache": store, "weights": weights, "hidden": hidden,
           "model_name": manifest["target"]["name"]}
    torch.manual_seed(cfg.seed)
    return ctx, JudgeHead(hidden, cfg.depth), train_ex, eval_ex


def _train_loop(cfg: TrainConfig, out: Path, acc, manifest: dict, ctx: dict, head, train_ex, eval_ex) -> dict:
    """Epochs, evaluation, early stopping, checkpoints and the best head's export, for every head type."""
    from transformers import get_cosine_schedule_with_warmup

    verifier = cfg.head == "verifier"
    w_pos, w_neg = ctx["weights"]
    opt = torch.optim.AdamW(head.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    world = acc.num_processes
    micro = len(_epoch_batches(len(train_ex), cfg.batch_size, world, cfg.seed, 0)) // world
    steps_per_epoch = math.ceil(micro / cfg.grad_accum)
    total = min(steps_per_epoch * cfg.epochs, cfg.max_steps or 1 << 62)
    sched = get_cosine_schedule_with_warmup(opt, math.ceil(cfg.warmup_ratio * total), total)
    ds = acc.distributed_type == DistributedType.DEEPSPEED
    zero3 = ds and _zero_stage(acc) == 3
    if ds:  # the recipe's batch geometry, not the launcher's, drives DeepSpeed's accumulation
        ds_cfg = acc.state.deepspeed_plugin.deepspeed_config
        ds_cfg["train_micro_batch_size_per_gpu"] = cfg.batch_size
        ds_cfg["gradient_accumulation_steps"] = cfg.grad_accum
        ds_cfg.pop("train_batch_size", None)  # derived by accelerate from the two above
        if zero3:  # accelerate fills these "auto" values from model.config, which a head lacks: the same
            h = ctx["hidden"]  # rule from the head's width (its h x h weights are partitioned, biases kept whole)
            zero_cfg = ds_cfg.setdefault("zero_optimization", {})
            for key, value in (("reduce_bucket_size", h * h), ("stage3_prefetch_bucket_size", int(0.9 * h * h)),
                               ("stage3_param_persistence_threshold", 10 * h)):
                if zero_cfg.get(key, "auto") == "auto":
                    zero_cfg[key] = value
            warnings.filterwarnings("ignore", category=FutureWarning,  # DeepSpeed's collectives, once per call
                                    message=r".*torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)")
    # position: the next micro-batch of this process's share of the epoch (at an optimizer step)
    progress = {"epoch": 0, "step": 0, "position": 0, "best": None, "bad_epochs": 0, "done": False, "world": world}
    ckpt = checkpoint.find(out, world, acc.process_index, zero=ds, any_rank=lambda bad: _any_rank(acc, bad))
    if ckpt is not None:  # under DeepSpeed the optimizer state is per-rank partitions, loaded after prepare
        progress.update(checkpoint.restore(ckpt, head, None if ds else opt, sched))
        log.info("resumed from %s (epoch %d, step %d, micro-batch %d)", ckpt.path, progress["epoch"],
                 progress["step"], progress["position"])
        if acc.is_main_process:
            _cut_metrics(out, progress.get("metrics_bytes"))
    head, opt = acc.prepare(head, opt)
    raw = acc.unwrap_model(head)
    dtype = _param_dtype(raw)
    if ds and ckpt is not None:
        checkpoint.load_zero_partition(ckpt, opt, acc.process_index, world)
    numerics = _numerics(ctx, acc, dtype)
    if ckpt is not None and acc.is_main_process:
        check_resume(ckpt.progress.get("numerics"), numerics, str(ckpt.path))
    progress["numerics"] = numerics  # what the next checkpoints record
    ckpt = None
    final = {}
    with MetricsWriter(out) if acc.is_main_process else _Null() as metrics, \
            tqdm(total=total, initial=progress["step"], unit="step", desc="heads-train",
                 disable=not acc.is_main_process) as bar:

        def save_checkpoint():
            parts = []
            if ds:  # every rank writes its optimizer partition; the main process files them in
                checkpoint.save_zero_partition(out, progress["step"], opt, acc.process_index, world)
                parts = [checkpoint.zero_partition_path(out, progress["step"], r) for r in range(world)]
                acc.wait_for_everyone()
            with _full_weights(raw, zero3):
                if acc.is_main_process:
                    progress["metrics_bytes"] = metrics.path.stat().st_size  # what a resumed run keeps
                    checkpoint.save(out, progress["step"], raw, None if ds else opt, sched, dict(progress),
                                    extra_files=parts)
            acc.wait_for_everyone()

        while not progress["done"] and progress["epoch"] < cfg.epochs:
            epoch = progress["epoch"]
            batches = _epoch_batches(len(train_ex), cfg.batch_size, world, cfg.seed, epoch)[acc.process_index::world]
            head.train()
            for i in range(progress["position"], len(batches)):
                x, y = _features(ctx, [train_ex[j] for j in batches[i]], epoch)
                with acc.autocast():  # a DeepSpeed bf16 engine holds bf16 weights: feed it its dtype
                    loss = weighted_soft_bce(head(x.to(dtype)).float(), y, w_pos, w_neg)
                if not ds:  # DeepSpeed divides by its gradient_accumulation_steps itself
                    loss = loss / cfg.grad_accum
                last = (i + 1) % cfg.grad_accum == 0 or i + 1 == len(batches)
                if ds:  # where DeepSpeed's accumulation boundary is
                    acc.gradient_state._set_sync_gradients(last)
                if last:
                    acc.backward(loss)
                    opt.step()
                    sched.step()
                    opt.zero_grad()
                    progress["step"] += 1
                    progress["position"] = i + 1
                    bar.update()
                    metrics.write(step=progress["step"], epoch=epoch, loss=float(loss.detach()) * (1 if ds else cfg.grad_accum),
                                  lr=sched.get_last_lr()[0])
                    if progress["step"] >= total:
                        break
                    if cfg.checkpoint_every and progress["step"] % cfg.checkpoint_every == 0 and i + 1 < len(batches):
                        save_checkpoint()  # mid-epoch (the epoch's last step is checkpointed after its eval)
                else:
                    with acc.no_sync(head):
                        acc.backward(loss)
            head.eval()
            final = {"epoch": epoch, "step": progress["step"], **evaluate(ctx, raw, eval_ex)}
            metrics.write(final)
            score = _selection_score(final, cfg.head)
            improved = progress["best"] is None or score < progress["best"]
            if improved:
                progress["best"], progress["bad_epochs"] = score, 0
            else:
                progress["bad_epochs"] += 1
            with _full_weights(raw, zero3):
                if improved and acc.is_main_process:
                    save_head(out / "head.safetensors", raw, cfg.head,
                              _head_metadata(cfg, manifest, ctx["hidden"], final))
                    atomic_write_json(out / "best_metrics.json", final)
            progress["epoch"] += 1
            progress["position"] = 0
            progress["done"] = progress["bad_epochs"] >= cfg.patience or progress["step"] >= total
            save_checkpoint()
    best = json.loads((out / "best_metrics.json").read_text()) if (out / "best_metrics.json").exists() else final
    if verifier:
        best.update(_verifier_report(cfg, out, ctx, eval_ex, acc, ctx["model_name"]))
    best["numerics"] = numerics
    if cfg.head == "judge" and acc.is_main_process:
        atomic_write_json(out / "metrics.json", {k[len("eval_"):]: v for k, v in best.items() if k.startswith("eval_")}
                          | {"delta": cfg.threshold, "epoch": best.get("epoch")})
    return best


def _numerics(ctx, acc, dtype: torch.dtype) -> dict:
    """The run's numerics settings (see :mod:`specheads.numerics`): the head's and the draft's."""
    dtypes, devices = {"head": dtype, "autocast": acc.mixed_precision}, {"head": acc.device}
    if ctx.get("draft") is not None:  # the judge head trains on stored features: no draft
        dtypes["draft"], devices["draft"] = ctx["draft"].dtype, ctx["device"]
    return numerics_settings(acc.num_processes, dtypes, devices)


def _verifier_report(cfg: TrainConfig, out: Path, ctx, eval_ex, acc, draft_name: str) -> dict:
    """``metrics.json`` (ROC, AUROC, TPR/FPR at eta, alpha) of the best head; with ``roc_lambdas``,
    one more head per lambda trained on the same data, and ``roc.png`` with every curve."""
    from dataclasses import replace

    from specheads.export.package import load_head

    curves = []
    if acc.is_main_process:
        best = load_head(out / "head.safetensors").module.to(ctx["device"]).float()
        logits, ratio = _predict(ctx, best, eval_ex)
        curves.append(V.roc_metrics(torch.sigmoid(logits), ratio, cfg.lam, cfg.threshold))
    for lam in cfg.roc_lambdas:
        if lam == cfg.lam:
            continue
        sub = replace(cfg, lam=lam, roc_lambdas=[], output_dir=str(out / f"lambda-{lam:g}"))
        fresh = overwrites_another_run(sub)
        if acc.is_main_process:
            prepare_output_dir(sub.output_dir, to_yaml(sub), overwrite=cfg.overwrite)
        acc.wait_for_everyone()
        log.info("roc_lambdas: training the lambda=%g verifier in %s", lam, sub.output_dir)
        train(sub, Path(sub.output_dir), fresh=fresh)
        if acc.is_main_process:
            head = load_head(Path(sub.output_dir) / "head.safetensors").module.to(ctx["device"]).float()
            logits, ratio = _predict(ctx, head, eval_ex)
            curves.append(V.roc_metrics(torch.sigmoid(logits), ratio, lam, cfg.threshold))
    if not acc.is_main_process:
        return {}
    curves.sort(key=lambda c: c["lam"])
    png = V.roc_plot(out / "roc.png", curves, f"SPRINTER verifier ({cfg.feature}) on {Path(draft_name).name}\n"
                                               f"{curves[0]['tokens']} held-out tokens, eta={cfg.threshold:g}")
    main = next(c for c in curves if c["lam"] == cfg.lam)
    report = {"auroc": main["auroc"], "lam": cfg.lam, "eta": cfg.threshold, "feature": cfg.feature,
              "tpr_at_eta": main["tpr_at_eta"], "fpr_at_eta": main["fpr_at_eta"],
              "accuracy_at_eta": main["accuracy_at_eta"], "alpha": main["alpha"], "roc_png": str(png),
              "by_lambda": {f"{c['lam']:g}": c for c in curves}}
    atomic_write_json(out / "metrics.json", report)
    return {k: report[k] for k in ("auroc", "tpr_at_eta", "fpr_at_eta", "alpha", "roc_png")}


def _zero_stage(acc) -> int:
    return int(acc.state.deepspeed_plugin.deepspeed_config.get("zero_optimization", {}).get("stage", 0))


@contextmanager
def _full_weights(module, zero3: bool):
    """The head's full parameters inside the block (ZeRO-3 partitions them; collective: every rank enters)."""
    if not zero3:
        yield
        return
    import deepspeed

    with deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None):
        yield


@contextmanager
def _unpartitioned_models(acc):
    """Under ZeRO-3, transformers would build models partitioned (``zero.Init``): the draft, which
    only computes features, is loaded whole."""
    plugin = acc.state.deepspeed_plugin if acc.distributed_type == DistributedType.DEEPSPEED else None
    if plugin is None or _zero_stage(acc) != 3:
        yield
        return
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    unset_hf_deepspeed_config()
    try:
        yield
    finally:
        plugin.set_deepspeed_weakref()


def _any_rank(acc, bad: bool) -> bool:
    """Whether any process says ``bad`` (every process must call it)."""
    if acc.num_processes == 1:
        return bad
    flag = torch.tensor([1.0 if bad else 0.0], device=acc.device)
    return bool(acc.reduce(flag, reduction="sum").item() > 0)


def _cut_metrics(out: Path, size: int | None) -> None:
    """Drops the rows a killed run wrote after the checkpoint it resumes from (the rerun writes them again)."""
    path = out / "metrics.jsonl"
    if size is not None and path.is_file() and path.stat().st_size > size:
        with open(path, "r+b") as f:
            f.truncate(size)
        log.info("metrics.jsonl cut back to the checkpoint's rows (%d bytes)", size)


class _Null:
    path = None

    def write(self, *a, **k):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass
