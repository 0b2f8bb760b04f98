"""Heads in a Hub-style directory (``heads-export format=hf``) and where a head named by path or repo id lives.

The directory holds what a model repository on the Hugging Face Hub holds:

* ``model.safetensors``: the exported head, the same single-file format as ``head.safetensors`` (weights,
  and the metadata in its header, checked on load);
* ``config.json``: that metadata as JSON (``library_name``, ``head_type`` and ``specheads``: the header's
  metadata), so the Hub and a reader without safetensors see what the head is; on load it must agree with the
  file's header, so an edit of one without the other is caught;
* ``README.md``: a model card generated from the metadata: the pair the head belongs to, the feature it
  reads, the training data, the training metrics and calibration, the default threshold and how it was
  chosen, and how to load it.

``head_file(x)`` resolves what :func:`specheads.export.load_head` is given: a ``.safetensors`` file, such a
directory, or a Hub repo id (``owner/name``, fetched with ``huggingface_hub`` into its cache, offline when
``HF_HUB_OFFLINE=1`` and the files are cached).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from specheads.errors import UserError
from specheads.export.header import read as read_header

FILES = ("config.json", "model.safetensors", "README.md")
WEIGHTS = "model.safetensors"
_REPO_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*")


def is_hub_dir(path: str | Path) -> bool:
    p = Path(path)
    return p.is_dir() and (p / WEIGHTS).is_file() and (p / "config.json").is_file()


def head_file(path_or_repo_id: str | Path) -> Path:
    """The head file ``path_or_repo_id`` names: the file itself, a Hub-style directory's ``model.safetensors``
    (its ``config.json`` checked against the header), or a Hub repo's (downloaded into the Hub cache).
    UserError, in one line, when none of these fits."""
    p = Path(path_or_repo_id)
    if p.is_file():
        return p
    if p.is_dir():
        missing = [f for f in ("config.json", WEIGHTS) if not (p / f).is_file()]
        if missing:
            inside = " (it holds head.safetensors: pass that file)" if (p / "head.safetensors").is_file() else ""
            raise UserError(
                f"{str(p)!r} is a directory without {' and '.join(missing)}{inside}; pass a head "
                ".safetensors or a directory written by heads-export format=hf"
            )
        check_config(p)
        return p / WEIGHTS
    name = str(path_or_repo_id)
    # owner/name is a repo id unless it reads as a local path: an existing first part, or a file name
    if _REPO_ID.fullmatch(name) and not name.endswith(".safetensors") and not p.parent.exists():
        return _from_hub(name)
    raise UserError(
        f"head {name!r} does not exist; pass the .safetensors written by heads-export, a directory "
        "written by heads-export format=hf, or a Hub repo id owner/name"
    )


def _from_hub(repo_id: str) -> Path:
    try:
        from huggingface_hub import snapshot_download
    except ImportError as exc:  # pragma: no cover - huggingface_hub comes with transformers
        raise UserError(f"head {repo_id!r} looks like a Hub repo id but huggingface_hub is missing ({exc})") from None
    try:
        local = snapshot_download(repo_id, allow_patterns=list(FILES))
    except Exception as exc:  # noqa: BLE001 - offline, unknown repo, HTTP or cache errors: all one line
        raise UserError(
            f"head {repo_id!r}: no such local path, and the Hub repo could not be fetched "
            f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"
        ) from None
    return head_file(Path(local))


def config_json(meta: dict) -> dict:
    return {"library_name": "specheads", "head_type": meta["head_type"], "specheads": meta}


def check_config(directory: Path) -> None:
    """UserError when ``config.json`` and ``model.safetensors``'s header disagree (one was edited or replaced)."""
    try:
        cfg = json.loads((directory / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise UserError(
            f"{directory / 'config.json'} is not JSON ({exc}); re-export with heads-export format=hf"
        ) from None
    meta = read_header(directory / WEIGHTS)
    # compared as canonical JSON text: 1 and 1.0, or true and 1, are equal in Python but not in the files
    if not isinstance(cfg, dict) or json.dumps(cfg.get("specheads"), sort_keys=True) != json.dumps(
        meta, sort_keys=True
    ):
        raise UserError(
            f"{directory}: config.json does not match model.safetensors' metadata (one was edited or "
            "replaced without the other); re-export with heads-export format=hf"
        )


def write(directory: str | Path, meta: dict) -> None:
    """(Re)writes ``config.json`` and ``README.md`` beside ``model.safetensors`` from its metadata ``meta``."""
    d = Path(directory)
    for name, text in (
        ("config.json", json.dumps(config_json(meta), indent=2, sort_keys=True) + "\n"),
        ("README.md", model_card(meta)),
    ):
        tmp = d / (name + ".tmp")
        tmp.write_text(text, encoding="utf-8")
        tmp.replace(d / name)


def _fmt(x, digits: int = 4) -> str:
    if isinstance(x, float):
        return f"{x:.{digits}g}"
    return "-" if x is None else str(x)


ROLE = {
    "acceptance": "SpecDec++ acceptance head: stops drafting when P(some candidate so far is rejected) > h",
    "verifier": "SPRINTER verifier: approves draft tokens without a target call while its score > eta",
    "judge": "Judge head: accepts a draft token the target would reject when its score > delta",
}
POLICY = {"acceptance": "specdecpp", "verifier": "sprinter", "judge": "judge"}


def model_card(meta: dict) -> str:
    """The README.md of a Hub-style head directory, from the head's metadata alone."""
    kind = meta["head_type"]
    extra = meta.get("extra") or {}
    train = extra.get("train") or {}
    data = extra.get("training_data") or {}
    feature = meta.get("feature") or {}
    lines = [
        "---",
        "library_name: specheads",
        "tags:",
        "- speculative-decoding",
        f"- specheads-{kind}",
        "---",
        "",
        f"# specheads {kind} head",
        "",
        ROLE.get(kind, kind) + ".",
        "",
        "## The pair it belongs to",
        "",
        "| role | model | fingerprint |",
        "|---|---|---|",
    ]
    for role in ("target", "draft"):
        m = meta.get(role) or {}
        lines.append(f"| {role} | `{m.get('name', '-')}` | `{m.get('fingerprint', '-')}` |")
    vocab = (meta.get("draft") or {}).get("vocab")
    lines += [
        "",
        f"Reads the {feature.get('model', '?')}'s {feature.get('state', '?')}-norm hidden state "
        f"(layer {feature.get('layer', -1)}, hidden size {meta.get('hidden_size')}); "
        f"head config `{json.dumps(meta.get('head_config', {}), sort_keys=True)}`; "
        f"weights in {extra.get('dtype', 'float32')}."
        + (f" Trained with the draft's output layer pruned to {vocab.get('size')} tokens." if vocab else ""),
        "",
        f"Sampling settings it was trained for: `{json.dumps(meta.get('sampling'), sort_keys=True)}`. "
        "Loading it against another model, hidden size or draft vocabulary is an error; other sampling "
        "settings warn.",
        "",
        "## Training data",
        "",
    ]
    for d in data.get("data_sets", []):
        line = f"- `{d['data_dir']}`"
        if "prompts" in d:
            line += (
                f": {d['prompts']} prompts from `{d.get('prompts_file')}` (offset {d.get('offset', 0)}, "
                f"labels={d.get('labels')}, max_new_tokens={d.get('max_new_tokens')}); "
                f"{d.get('labelled_tokens')} labelled tokens"
            )
            if d.get("positive_tokens") is not None:  # hard labels (judge, verifier)
                line += f", {d['positive_tokens']} positive, {d.get('negative_tokens')} negative"
            elif d.get("label_mean") is not None:  # soft labels (acceptance): the mean target
                line += f", mean label {_fmt(d['label_mean'])}"
        if d.get("tuples") is not None:
            line += f"; {d['tuples']} tuples"
        mining = d.get("mining") or {}
        if mining.get("method") == "swap":
            line += (
                f"; swap-mined with checker={mining.get('checker')}: {mining.get('mismatches_tried')} "
                f"mismatches tried, {mining.get('important')} important, {mining.get('unimportant')} unimportant"
            )
        lines.append(line)
    if not data.get("data_sets"):
        lines.append("- not recorded (exported without the heads-datagen manifest)")
    if "datagen_seed" in extra:
        lines.append(f"- datagen seed: {extra['datagen_seed']}")
    lines += ["", "## Metrics (held-out split of the training data)", ""]
    shown = {k: v for k, v in sorted(train.items()) if k.startswith("eval_") and not isinstance(v, (list, dict))}
    if shown:
        lines += ["| metric | value |", "|---|---|"] + [f"| {k[5:]} | {_fmt(v)} |" for k, v in shown.items()]
    else:
        lines.append("not recorded")
    cal = train.get("eval_calibration") or []
    if cal:
        lines += [
            "",
            "Calibration (held-out tokens by predicted probability):",
            "",
            "| bin | tokens | mean predicted | mean label |",
            "|---|---|---|---|",
        ]
        lines += [
            f"| {_fmt(b['low'], 2)}-{_fmt(b['high'], 2)} | {b['n']} | {_fmt(b['mean_p'])} | {_fmt(b['mean_label'])} |"
            for b in cal
            if b.get("n")
        ]
    chosen = meta.get("default_threshold_chosen_by")
    lines += [
        "",
        "## Default threshold",
        "",
        f"`{_fmt(meta.get('default_threshold'))}`"
        + (
            f", chosen by `{chosen.get('command', chosen)}`: {json.dumps(chosen, sort_keys=True)}"
            if isinstance(chosen, dict)
            else " (the training threshold; no quality-gated choice recorded)"
        )
        + ".",
        "",
        "## Use",
        "",
        "```python",
        "from specheads.export import load_head, load_pair, ModelSpec, generate",
        "",
        "pair = load_pair(ModelSpec(path=TARGET), ModelSpec(path=DRAFT))",
        'head = load_head("THIS_DIRECTORY_OR_REPO_ID", pair=pair)  # checked against the pair',
        "```",
        "",
        f"`heads-decode policy={POLICY.get(kind, kind)} {POLICY.get(kind, kind)}.head=THIS_DIRECTORY_OR_REPO_ID` "
        "decodes with it.",
        "",
    ]
    return "\n".join(lines)
