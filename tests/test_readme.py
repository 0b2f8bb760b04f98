"""The README's Python runs as written, after what it says to run first: a short main job on the real pair
writes the stop head the snippet loads (slow: it trains one)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import SHARED

ROOT = Path(__file__).resolve().parents[1]

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not (SHARED / "models").is_dir(), reason="../shared/models not present"),
]


def _blocks(path: Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", path.read_text(encoding="utf-8"), re.S)


def test_the_readme_python_runs_after_the_main_job(tmp_path):
    """In a fresh folder laid out as the repository is (recipes/, ../shared), the main job's first stages
    (heads-pipeline recipe=quickstart, fewer prompts) write runs/quickstart-export/head.safetensors; then every
    README Python block that does not need vLLM runs as written and exits 0."""
    work = tmp_path / "repo"
    work.mkdir()
    (work / "recipes").symlink_to(ROOT / "recipes")
    (tmp_path / "shared").symlink_to(SHARED.resolve())
    env = {**os.environ, "SPECHEADS_SHARED": str(tmp_path / "shared")}
    job = [
        sys.executable,
        "-m",
        "specheads.pipeline",
        "recipe=quickstart",
        "pipeline.regimes=[]",
        "pipeline.stages=[datagen,train,export]",
        "datagen.num_prompts=4",
        "datagen.max_new_tokens=32",
        "train.epochs=1",
    ]
    done = subprocess.run(job, cwd=work, env=env, capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stderr[-2000:]
    assert (work / "runs/quickstart-export/head.safetensors").is_file()
    blocks = [b for b in _blocks(ROOT / "README.md") if "vllm" not in b]
    assert blocks, "the README has Python to run"
    for code in blocks:
        ran = subprocess.run(
            [sys.executable, "-c", code], cwd=work, env=env, capture_output=True, text=True, timeout=900
        )
        assert ran.returncode == 0, f"{code}\n{ran.stderr[-2000:]}"
