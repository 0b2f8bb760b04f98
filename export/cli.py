"""``heads-export``: package a trained head as one ``.safetensors`` file with its metadata.

    heads-export recipe=quickstart
    heads-export train_dir=runs/train checkpoint=latest threshold=0.5 output_dir=runs/export

    heads-export recipe=judge_quickstart format=hf   # a Hub-style directory: model.safetensors, config.json, README.md

Reads a ``heads-train`` output directory (its best head, its latest checkpoint, or a named
``checkpoint-<step>``), writes ``head.safetensors`` whose header carries the metadata the shim
checks on load (head type and config, hidden size, feature, model names and fingerprints,
sampling settings, default threshold, a summary of the training data), then reloads the file and
checks that it reproduces the head's outputs bit for bit. ``format=hf`` writes the same file as
``model.safetensors`` with ``config.json`` and a generated model card (``export/hub.py``), a directory
to upload as a Hub model repo; ``load_head`` takes the directory or the repo id. ``format=speculators``
(EAGLE heads only) writes the directory vLLM loads as an Eagle-3 draft (``config.json`` with
``speculators_config``, ``model.safetensors`` with ``d2t``/``t2d``; ``export/speculators.py``), read back with
``specheads.export.speculators.read``. ``deploy=<heads-eval output_dir>`` packages the rule that sweep names to
deploy (``export/deploy.py``), which ``heads-decode deploy=`` and the vLLM stop plugin then run by default. Also
``config.yaml``, ``manifest.json`` and ``metrics.jsonl``.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from safetensors.torch import load_file

from specheads.config import cli_main, to_yaml
from specheads.errors import UserError, article
from specheads.export import deploy, hub, speculators
from specheads.export.export_config import ExportConfig
from specheads.export.package import _digest, load_head, read_metadata, save_head
from specheads.outputs import MetricsWriter, prepare_output_dir, write_manifest
from specheads.shim import DTYPES

log = logging.getLogger(__name__)
PROG = "heads-export"


def _source(cfg: ExportConfig) -> tuple[Path, Path | None]:
    """(the training run's head file, which carries the metadata; the checkpoint to take weights from)."""
    if not cfg.train_dir:
        raise UserError("train_dir is not set; pass train_dir=<heads-train output_dir>")
    train_dir = Path(cfg.train_dir)
    best = train_dir / "head.safetensors"
    if not best.is_file():
        raise UserError(
            f"{best} not found; train_dir must be a heads-train output_dir with at least one finished epoch"
        )
    if cfg.checkpoint == "best":
        return best, None
    if cfg.checkpoint == "latest":
        pointer = train_dir / "latest"
        if not pointer.is_file():
            raise UserError(f"{train_dir} has no 'latest' checkpoint pointer")
        ckpt = train_dir / pointer.read_text().strip()
    else:
        ckpt = Path(cfg.checkpoint)
        if not ckpt.is_absolute() and not ckpt.exists():
            ckpt = train_dir / cfg.checkpoint
    if not (ckpt / "state.safetensors").is_file():
        known = sorted(p.name for p in train_dir.glob("checkpoint-*"))
        raise UserError(
            f"checkpoint {cfg.checkpoint!r} not found (looked for {ckpt / 'state.safetensors'}); "
            f"use best, latest or one of {known}"
        )
    return best, ckpt


DATA_KEYS = (
    "labels",
    "prompts_file",
    "offset",
    "prompts",
    "labelled_tokens",
    "positive_tokens",
    "negative_tokens",
    "label_mean",
    "max_new_tokens",
)


def training_data(train_dir: Path) -> dict:
    """What the head was trained on, from the training run's manifest and each data set's ``heads-datagen``
    manifest (empty fields where a manifest is missing)."""
    try:
        train = json.loads((train_dir / "manifest.json").read_text())
    except (OSError, ValueError):
        return {}
    dirs = [d for d in str(train.get("data_dir") or "").split(",") if d]
    sets = []
    for d in dirs:
        try:
            m = json.loads((Path(d) / "manifest.json").read_text())
        except (OSError, ValueError):
            sets.append({"data_dir": d})
            continue
        entry = {"data_dir": d, **{k: m[k] for k in DATA_KEYS if m.get(k) is not None}}
        mining = {
            k: v
            for k, v in (m.get("mining") or {}).items()
            if k in ("method", "checker", "prompts", "mismatches_tried", "important", "unimportant")
        }
        if mining:
            entry["mining"] = mining
        if m.get("tuple_counts"):
            entry["tuples"] = m["tuple_counts"].get("tuples")
        sets.append(entry)
    return {"data_sets": sets} if sets else {}


def export_head(cfg: ExportConfig, out: Path) -> dict:
    """Writes ``out/head.safetensors`` (``format=hf``: the Hub-style files); returns the manifest fields
    (including the round-trip check)."""
    if cfg.dtype not in DTYPES:
        raise UserError(f"dtype={cfg.dtype!r}; choose one of {sorted(DTYPES)}")
    if cfg.format not in ("safetensors", "hf", "speculators"):
        raise UserError(f"format={cfg.format!r}; choose safetensors, hf or speculators")
    if cfg.threshold is not None and not 0 < cfg.threshold < 1:
        raise UserError(f"threshold={cfg.threshold} must be in (0, 1)")
    best, ckpt = _source(cfg)
    loaded = load_head(best)
    if cfg.format == "speculators" and loaded.metadata["head_type"] != "eagle":
        raise UserError(
            f"format=speculators writes EAGLE heads (head_type=eagle) only; {best} holds a "
            f"{loaded.metadata['head_type']} head: use format=safetensors or format=hf"
        )
    meta = {k: v for k, v in loaded.metadata.items() if k not in ("format_version", "head_type", "tensors_sha256")}
    head = loaded.module
    if ckpt is not None:
        tensors = load_file(str(ckpt / "state.safetensors"))
        state = {k[len("model.") :]: v for k, v in tensors.items() if k.startswith("model.")}
        try:
            head.load_state_dict(state)
        except RuntimeError as err:
            kind = article(loaded.metadata["head_type"])
            raise UserError(f"{ckpt} does not hold {kind} head of this config: {str(err).splitlines()[0]}") from err
        meta.setdefault("extra", {})["checkpoint"] = ckpt.name
    if cfg.threshold is not None:
        meta["default_threshold"] = cfg.threshold
    if cfg.deploy:  # checked against the weights exported, before any change of precision
        digest = _digest({k: v.detach().contiguous().cpu() for k, v in head.state_dict().items()})
        meta["deploy"] = deploy.from_sweep(cfg.deploy, {"tensors_sha256": digest})
    head = head.to(DTYPES[cfg.dtype])
    meta.setdefault("extra", {})["dtype"] = cfg.dtype
    data = training_data(Path(cfg.train_dir))
    if data:
        meta["extra"]["training_data"] = data
    hf, spec = cfg.format == "hf", cfg.format == "speculators"
    if spec:
        embed = None
        if cfg.embed_tokens:
            from specheads.export.vllm_target import target_embedding

            embed = target_embedding(meta, cfg.verifier or None)
            if embed is None:
                raise UserError(
                    "format=speculators writes the target's token embedding (speculators' loader fills a missing one "
                    f"with zeros), and neither verifier={cfg.verifier!r} nor the target recorded at training "
                    f"({(meta.get('target') or {}).get('name')!r}) is a local model here: pass verifier=<the target's "
                    "directory or .gguf file>, or embed_tokens=false for vLLM alone"
                )
        path = speculators.write(
            out,
            head,
            meta,
            verifier=cfg.verifier or None,
            max_position_embeddings=cfg.max_position_embeddings,
            embed=embed,
        )
        back = speculators.read(out).module
    else:
        path = save_head(out / (hub.WEIGHTS if hf else "head.safetensors"), head, loaded.metadata["head_type"], meta)
        if hf:
            hub.write(out, read_metadata(path))
        back = load_head(out if hf else path).module
    # Round trip: the file (the directory, for format=hf/speculators) alone must rebuild the head: bit-identical
    # outputs on random inputs, or, for an EAGLE head (no single-input forward), bit-identical tensors.
    if loaded.metadata["head_type"] == "eagle":
        mine, theirs = head.state_dict(), back.state_dict()
        identical = mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
    else:
        g = torch.Generator().manual_seed(cfg.seed)
        # the module's own input width: a confidence head (SpecDec++ on an EAGLE head) reads d + 1 numbers
        width = getattr(head, "in_features", None) or meta.get("head_config", {}).get(
            "in_features", meta["hidden_size"]
        )
        x = torch.randn(64, width, generator=g).to(DTYPES[cfg.dtype])
        with torch.no_grad():
            identical = bool(torch.equal(head(x), back(x)))
    if not identical:
        raise RuntimeError(f"{path} does not reproduce the head's outputs after reloading")
    where = out if hf or spec else path
    return {
        "head": str(where),
        "format": cfg.format,
        "head_type": loaded.metadata["head_type"],
        "source": str(ckpt or best),
        "default_threshold": meta.get("default_threshold"),
        "dtype": cfg.dtype,
        "round_trip_identical": identical,
        "parameters": sum(p.numel() for p in head.parameters()),
        "deploy": meta["deploy"]["config"] if "deploy" in meta else None,
    }


def run(cfg: ExportConfig) -> int:
    out = prepare_output_dir(cfg.output_dir, to_yaml(cfg), overwrite=cfg.overwrite)
    info = export_head(cfg, Path(out))
    with MetricsWriter(out) as metrics:
        metrics.write(round_trip_identical=info["round_trip_identical"], parameters=info["parameters"])
    write_manifest(out, command=PROG, **info)
    log.info(
        "exported %s head (%s, h=%s) -> %s", info["head_type"], info["source"], info["default_threshold"], info["head"]
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``heads-export``."""
    return cli_main(PROG, ExportConfig, "export", argv, run)


if __name__ == "__main__":
    raise SystemExit(main())
