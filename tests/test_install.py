"""The install extras: the base install decodes with an exported head; each stage stays within its extra;
a missing extra ends a stage's CLI in one line naming it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import module_imports, package_modules

from specheads import extras

ROOT = Path(__file__).resolve().parents[1]
# What pyproject.toml's base dependencies provide (import names): all that heads/ and export/ may import
# (numpy and huggingface_hub come with transformers, which requires them).
BASE = {"torch", "transformers", "safetensors", "yaml", "omegaconf", "tqdm", "numpy", "huggingface_hub"}
# The import names that only the extras add: a base install has none of them.
EXTRA_ONLY = sorted({m for mods in extras.EXTRAS.values() for m in mods} | {"gguf", "scipy", "deepspeed"})
# Each stage's folder and the import names its code (with every project module it imports) may use.
STAGES = {
    "heads": BASE,
    "shim": BASE,
    "export": BASE,
    "decode": BASE,
    # gguf: a GGUF target's tensors read by name (specheads/runtime/checkpoint_tensors.py: the EAGLE head's, and the
    # output layer of engine=vllm's target without weights), which says in one line to install the [gguf] extra when it
    # is missing, as loading a GGUF model anywhere does
    "datagen": BASE | set(extras.EXTRAS["train"]) | {"gguf"},
    "train": BASE | set(extras.EXTRAS["train"]) | {"deepspeed", "gguf"},
    "evaluate": BASE | set(extras.EXTRAS["eval"]),
}

# Runs in a fresh interpreter: the extras' packages are made to look uninstalled (importing one raises
# ModuleNotFoundError; transformers' availability checks see them absent), as on a base install, then
# the decode path runs: import specheads.export, load the pair, save and load an acceptance head,
# generate through the Python API and through heads-decode's main with policy=specdecpp.
_DECODE = """
import json, sys

for name in {blocked!r}:
    sys.modules[name] = None

import torch

import specheads.export
from specheads.export import load_head, save_head
from specheads.shim import ModelSpec, SamplingConfig, load_pair
from specheads.decode import generate
from specheads.decode.decode_cli import main
from specheads.heads import AcceptanceHead

target, draft, out = sys.argv[1:]
pair = load_pair(ModelSpec(path=target, device="cpu"), ModelSpec(path=draft, device="cpu"))
torch.manual_seed(0)
head = AcceptanceHead(pair.draft.hidden_size, depth=1)
path = save_head(out + "/head.safetensors", head, "acceptance", {{
    "head_config": head.config(), "hidden_size": pair.draft.hidden_size,
    "feature": {{"model": "draft", "state": "post", "layer": -1}},
    "draft": {{"name": pair.draft.name, "fingerprint": pair.draft.fingerprint}},
    "target": {{"name": pair.target.name, "fingerprint": pair.target.fingerprint}},
    "sampling": SamplingConfig().to_dict(), "default_threshold": 0.6}})
load_head(path, pair=pair)
api = generate(pair, "the cat sat", policy="sd", k=3, max_new_tokens=6)[0].tokens
with open(out + "/p.jsonl", "w") as fh:
    fh.write(json.dumps({{"prompt": "the cat sat"}}) + "\\n")
code = main([f"target.path={{target}}", "target.gguf_file=null", f"draft.path={{draft}}", "target.device=cpu",
             "draft.device=cpu", f"prompts={{out}}/p.jsonl", f"output_dir={{out}}/decode", "max_new_tokens=6",
             "num_prompts=null", "policy=specdecpp", f"specdecpp.head={{path}}"])
cli = json.loads(open(out + "/decode/outputs.jsonl").readline())["tokens"]
loaded = sorted(m for m, mod in sys.modules.items() if m.split(".")[0] in {blocked!r} and mod is not None)
print(json.dumps({{"exit": code, "api": api, "cli": cli, "loaded": loaded}}))
"""


@pytest.mark.slow  # a long run: CI's slow step
def test_decode_path_runs_without_the_extras(tiny_pair_dirs, tmp_path):
    """On an install without accelerate, datasets, scikit-learn, scipy, matplotlib, rouge-score, pyarrow,
    gguf or deepspeed, ``specheads.export`` imports and decodes with an exported head, and nothing on the
    way imports one of them. (They are blocked rather than looked for in ``sys.modules`` only:
    transformers imports accelerate and scipy by itself whenever they are installed.)"""
    t, d = tiny_pair_dirs
    proc = subprocess.run(
        [sys.executable, "-c", _DECODE.format(blocked=EXTRA_ONLY), str(t), str(d), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["exit"] == 0 and result["loaded"] == []
    assert result["cli"] == result["api"] and 1 <= len(result["api"]) <= 6  # greedy: SpecDec++ decodes as SD


def _closure(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Each module's third-party imports, with those of every project module it imports (and their packages)."""
    direct = {n: module_imports(n, p, modules) for n, p in modules.items()}
    out: dict[str, set[str]] = {}
    for name in modules:
        seen, todo, third = set(), [name], set()
        while todo:
            m = todo.pop()
            if m in seen or m not in direct:
                continue
            seen.add(m)
            third |= direct[m][0]
            todo += list(direct[m][1])
            todo += [m.rsplit(".", i)[0] for i in range(1, m.count("."))]  # parent packages run first
        out[name] = third
    return out


def test_each_stage_imports_only_its_extra():
    """heads/, shim/, export/ and decode/ (the decode path) need the base install only; datagen/ and train/ the [train]
    extra (train/ also [deepspeed]); evaluate/ the [eval] extra: counting every import in every function
    of each module and of each project module it imports."""
    modules = package_modules()
    closure = _closure(modules)
    wrong = {}
    for name, third in closure.items():
        stage = name.split(".")[1] if name.count(".") else None
        if stage in STAGES and third - STAGES[stage]:
            wrong[name] = sorted(third - STAGES[stage])
    assert wrong == {}
    assert any("accelerate" in third for name, third in closure.items() if name.startswith("specheads.train."))


def test_extras_match_pyproject():
    """Every import name ``specheads.extras`` checks for is provided by a distribution its pyproject extra lists."""
    tomllib = pytest.importorskip("tomllib")
    from importlib.metadata import packages_distributions

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    listed = {
        extra: {r.split(">")[0].split("=")[0].split("[")[0].strip().lower().replace("_", "-") for r in reqs}
        for extra, reqs in project["optional-dependencies"].items()
    }
    dists = packages_distributions()
    for extra, names in extras.EXTRAS.items():
        for name in names:
            provided = {d.lower().replace("_", "-") for d in dists.get(name, [])}
            assert provided & listed[extra], f"{name} (from {provided}) is not in pyproject's [{extra}]"
    base = {r.split(">")[0].strip().lower() for r in project["dependencies"]}
    assert not base & set().union(*listed.values())


@pytest.mark.parametrize(
    "script, extra, module",
    [
        (extras.heads_datagen, "train", "accelerate"),
        (extras.heads_vocab, "train", "pyarrow"),
        (extras.heads_train, "train", "sklearn"),
        (extras.heads_eval, "eval", "rouge_score"),
    ],
)
def test_a_missing_extra_ends_the_cli_in_one_line(monkeypatch, capsys, script, extra, module):
    monkeypatch.setitem(sys.modules, module, None)  # not installed, as importlib sees it
    assert script(["--help"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].endswith(
        f"needs the [{extra}] extra (not installed: {module}): pip install 'specheads[{extra}]'"
    ), err


def test_an_installed_extra_runs_the_cli(capsys):
    assert extras.heads_eval(["--help"]) == 0
    assert "heads-eval" in capsys.readouterr().out


def test_a_gguf_model_without_the_gguf_extra_is_one_line(monkeypatch, tmp_path):
    from specheads.errors import UserError
    from specheads.shim import ModelSpec, load_model

    (tmp_path / "m.gguf").write_bytes(b"")
    monkeypatch.setitem(sys.modules, "accelerate", None)  # transformers reads GGUF files with gguf and accelerate
    with pytest.raises(
        UserError,
        match=r"needs the \[gguf\] extra \(not installed: accelerate\): "
        r"pip install 'specheads\[gguf\]'",
    ):
        load_model(ModelSpec(path=str(tmp_path / "m.gguf"), device="cpu"), "target")
