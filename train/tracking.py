"""Experiment tracking (``report_to``): every row ``metrics.jsonl`` gets also goes to accelerate's trackers.

``report_to=[tensorboard]`` writes TensorBoard event files under ``<output_dir>/<run_name>``; ``wandb``, ``mlflow``
and the other trackers accelerate knows log where their own settings say (``WANDB_MODE=offline``, ...). The
resolved config is logged as the run's hyperparameters (its scalar settings, dotted). Off by default; a tracker
whose package is missing is a one-line error before training starts.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path


def problems(cfg) -> list[str]:
    """One line per tracker that is unknown or not installed."""
    if not cfg.report_to:
        return []
    import accelerate.utils as au
    from accelerate.utils import LoggerType

    known = [t.value for t in LoggerType if t.value != "all"]
    out = []
    for name in cfg.report_to:
        if name not in known:
            out.append(f"report_to: {name!r} is not a tracker accelerate knows; choose from {known}")
        elif not getattr(au, f"is_{name}_available")():
            extra = " (pip install 'specheads[track]')" if name == "tensorboard" else ""
            out.append(f"report_to: {name} is not installed here: pip install {name}{extra}")
    return out


def hyperparameters(cfg) -> dict:
    """The config's scalar settings, dotted (what trackers accept as hyperparameters)."""

    def flat(d: dict, prefix: str = "") -> dict:
        out = {}
        for k, v in d.items():
            if isinstance(v, dict):
                out |= flat(v, f"{prefix}{k}.")
            elif isinstance(v, (int, float, str, bool)):
                out[f"{prefix}{k}"] = v
        return out

    return flat(asdict(cfg))


class Tracked:
    """A :class:`~specheads.outputs.MetricsWriter` whose every row also goes to the run's trackers (main process)."""

    def __init__(self, metrics, acc, cfg, out: Path):
        self.metrics, self.acc, self.on = metrics, acc, bool(cfg.report_to)
        if self.on:
            acc.init_trackers(cfg.run_name or Path(out).name, config=hyperparameters(cfg))

    @property
    def path(self):
        return self.metrics.path

    def write(self, record: dict | None = None, **fields) -> None:
        self.metrics.write(record, **fields)
        if self.on:
            row = {**(record or {}), **fields}
            values = {k: v for k, v in row.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
            self.acc.log(values, step=int(row.get("step", 0)))

    def close(self) -> None:
        if self.on:
            self.acc.end_training()
