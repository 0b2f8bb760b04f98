"""What every benchmark result records about how it was produced."""

from __future__ import annotations

import os
import platform
import sys
from pathlib import Path

import torch


def run_info(script: str, argv: list[str] | None, setting: str) -> dict:
    """``command`` (to rerun it) and ``machine`` (where it ran) for a result file."""
    args = argv if argv is not None else sys.argv[1:]
    return {"command": f"python bench/{Path(script).name} " + " ".join(args),
            "machine": f"{platform.machine()} {os.cpu_count()} cpus, torch {torch.__version__}, "
                       f"{torch.get_num_threads()} threads, {setting}"}
