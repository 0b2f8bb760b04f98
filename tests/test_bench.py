"""Every bench script answers ``--help`` without loading a model, ``bench/README.md`` lists every script, and
benchmarks and studies keep their results apart.

Each ``--help`` runs in a process of its own, as ``python bench/[studies/]NAME.py --help`` would (``__main__``,
its folder first on ``sys.path``), forked two at a time from one helper process that imported torch,
Transformers and the package once: paying for those imports in every process made the test take minutes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
# scripts without a --help of their own: name -> why (the test fails once one of them gains one)
NO_HELP = {"gpu_smoke_helper.py": "bench/gpu_smoke.sh's helper, run as 'split ...' or 'check WORK LOGS'"}

HELPER = r"""
import json, os, runpy, sys, traceback
import torch, transformers  # what nearly every script imports: paid once, before the forks
from transformers import LlamaForCausalLM
import specheads.shim

def child(script, out):
    for fd, name in ((1, ".out"), (2, ".err")):
        os.dup2(os.open(out + name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
    sys.argv, sys.path[0], code = [script, "--help"], os.path.dirname(script), 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush(), sys.stderr.flush()
    os._exit(code)

scripts, out = json.loads(sys.argv[1]), sys.argv[2]
queue, running, codes = list(enumerate(scripts)), {}, {}
while queue or running:
    while queue and len(running) < 2:
        i, script = queue.pop(0)
        pid = os.fork()
        if pid == 0:
            child(script, os.path.join(out, str(i)))
        running[pid] = i
    pid, status = os.wait()
    codes[running.pop(pid)] = os.waitstatus_to_exitcode(status)
print(json.dumps([codes[i] for i in range(len(scripts))]))
"""


def _scripts() -> list[Path]:
    """Every runnable Python file under bench/ and bench/studies/."""
    files = sorted([*BENCH.glob("*.py"), *(BENCH / "studies").glob("*.py")])
    return [f for f in files if f.name != "_common.py" and 'if __name__ == "__main__":' in f.read_text()]


@pytest.mark.skipif(not hasattr(os, "fork"), reason="forks one process per script")
def test_every_bench_script_answers_help(tmp_path):
    scripts = _scripts()
    assert len(scripts) > 30, [s.name for s in scripts]
    cwd, out = tmp_path / "cwd", tmp_path / "out"
    cwd.mkdir(), out.mkdir()
    env = {
        **os.environ,
        "SPECHEADS_SHARED": str(tmp_path / "no-shared"),  # a model loaded before the arguments are parsed fails
        "HF_HUB_OFFLINE": "1",
        "OMP_NUM_THREADS": "1",
    }
    proc = subprocess.run(
        [sys.executable, "-c", HELPER, json.dumps([str(s) for s in scripts]), str(out)],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    codes = json.loads(proc.stdout.splitlines()[-1])
    failed, gained = [], []
    for i, (script, code) in enumerate(zip(scripts, codes)):
        usage = (out / f"{i}.out").read_text()
        ok = code == 0 and usage.startswith("usage:")
        if script.name in NO_HELP:
            gained += [script.name] if ok else []
        elif not ok:
            failed.append(f"{script.relative_to(ROOT)}: exit {code}\n{(out / f'{i}.err').read_text()[-1500:]}")
    assert failed == [], "\n\n".join(failed)
    assert gained == [], f"{gained} now answer --help: take them out of NO_HELP"
    assert sorted(p.name for p in cwd.iterdir()) == [], "a --help wrote files"


def test_bench_readme_lists_every_script():
    text = (BENCH / "README.md").read_text()
    files = sorted([*BENCH.glob("*.py"), *BENCH.glob("*.sh"), *(BENCH / "studies").glob("*.py")])
    named = [str(f.relative_to(ROOT)) for f in files if f.name != "_common.py"]
    missing = [name for name in named if name not in text]
    assert missing == [], f"document these in bench/README.md (a benchmark or a study): {missing}"


def test_benchmark_and_study_results_name_their_own_kind_of_script():
    wrong = []
    for folder, kind in ((BENCH / "results", "bench/"), (BENCH / "studies/results", "bench/studies/")):
        for path in sorted(folder.glob("*.json")):
            command = json.loads(path.read_text()).get("command") or ""
            script = next((w for w in command.split() if w.endswith(".py")), None)
            own = script and script.startswith(kind) and "/" not in script[len(kind) :] and (ROOT / script).is_file()
            if script and not own:
                wrong.append(f"{path.relative_to(ROOT)}: {script}")
    assert wrong == [], wrong
