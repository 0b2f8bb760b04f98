"""The rule to deploy, packaged in an exported head (``heads-export deploy=``) and read back by ``heads-decode
deploy=`` and the vLLM stop plugin.

``heads-eval`` names, per regime it ran, the fastest lossless row that speculates (``deploy`` in ``sweep.json``:
:func:`specheads.evaluate.report.deploy`): a fixed K, a training-free stop rule with its constants, or the learned
head. :func:`from_sweep` checks that choice against the head being exported and returns the record kept in the head's
header under ``deploy``: ``config`` (the row's name), ``kind``, ``policy`` and ``settings`` (the row's own; a learned
choice's ``head`` is the file itself, so it is left out), ``regime`` (engine, batch, sampling, budget, EAGLE head),
the measured tokens/s with its interval and the paired ratios, and ``sweep`` (where it came from).
"""

from __future__ import annotations

import json
from pathlib import Path

from specheads.errors import UserError

KEYS = (
    "config",
    "kind",
    "policy",
    "settings",
    "regime",
    "tokens_per_s",
    "tokens_per_s_interval",
    "vs_best_fixed_k",
    "vs_best_training_free",
    "within_noise_of_fixed_k",
)


def from_sweep(path: str | Path, head_meta: dict) -> dict:
    """The ``deploy`` record of the ``heads-eval`` run at ``path`` (its output_dir or its ``sweep.json``), for the
    head whose metadata is ``head_meta``; UserError when the run names none or its learned choice read another head."""
    from specheads.export.package import read_metadata

    given = Path(path)
    sweep = given / "sweep.json" if given.is_dir() else given
    if not sweep.is_file():
        raise UserError(f"deploy={str(path)!r}: no sweep.json there (pass a heads-eval output_dir)")
    try:
        choice = json.loads(sweep.read_text()).get("deploy")
    except ValueError as err:
        raise UserError(f"deploy={str(path)!r}: {sweep} is not JSON ({err})") from err
    if not choice:
        raise UserError(f"deploy={str(path)!r}: that sweep names no rule to deploy (no lossless row speculated)")
    if "policy" not in choice:
        raise UserError(f"deploy={str(path)!r}: an older heads-eval wrote it (no policy in its choice); run it again")
    settings = dict(choice.get("settings") or {})
    if choice["kind"] == "learned":
        measured = settings.pop("head", None)
        theirs = read_metadata(measured).get("tensors_sha256") if measured and Path(measured).exists() else None
        if theirs != head_meta.get("tensors_sha256"):
            raise UserError(
                f"deploy={str(path)!r}: its choice {choice['config']} read the head {measured!r}, not this one "
                "(tensors differ); export the head that sweep measured, or sweep this one"
            )
    return {k: choice[k] for k in KEYS if k in choice} | {"settings": settings, "sweep": str(sweep.resolve())}


def of_head(path: str | Path) -> dict | None:
    """The ``deploy`` record an exported head carries (None: none was packaged)."""
    from specheads.export.package import read_metadata

    return read_metadata(path).get("deploy")


def decode_choice(record: dict, head: str | Path) -> tuple[str, dict]:
    """``(policy, settings)`` that run ``record`` in ``heads-decode``; a learned choice reads ``head`` (the file)."""
    settings = dict(record.get("settings") or {})
    if record.get("kind") == "learned":
        settings["head"] = str(head)
    return record["policy"], settings


def plugin_rule(record: dict) -> tuple[str, int | None]:
    """The stop plugin's ``(rule, fixed_k)`` for ``record``; ValueError naming the choice when the plugin has no such
    rule (it runs the cost rules and fixed K: :data:`specheads.vllm.stop_config.RULES`)."""
    policy, s = record.get("policy"), record.get("settings") or {}
    if policy == "sd" and "k" in s:
        return "fixed", int(s["k"])
    if s.get("stop") == "cost":
        if policy == "specdecpp":
            return "h-cost", None
        if policy == "confidence_stop" and s.get("estimate", "q") in ("q", "online"):
            return ("c-cost" if s.get("estimate", "q") == "q" else "c-online-cost"), None
    raise ValueError(
        f"the deployed rule {record.get('config')} ({policy} {json.dumps(s)}) does not run in the stop plugin, "
        "which runs fixed K and the cost rules: pass rule="
    )
