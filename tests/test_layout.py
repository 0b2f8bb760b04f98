"""The module layout's rules (ARCHITECTURE.md): which stage may import which, no import circle, the
pipeline meets the stages only at their CLIs' entry points, and no module of a stage runs long."""

from __future__ import annotations

import ast

from conftest import module_imports, package_modules

STAGES = ("datagen", "train", "export", "evaluate")  # what heads-pipeline chains
# The package's parts by layer (ARCHITECTURE.md): a module imports, from the other parts, only those of a lower
# rank; parts of one rank never import each other. specheads/ itself holds the bottom layer ("root": errors, config,
# outputs, prompts, dataset ...), its folders the layers above it: heads/ the models, plan/ the memory and time of
# a run, shim/ the decoding runtime, export/ the head's file format, runtime/ the target's states and checkpoint
# tensors over the runtime, decode/ the decode front (settings to a Decoder), vllm/ and hf/ the serving engines'
# integrations, the stages, and pipeline/ (every stage chained, at the top).
RANKS = {
    "root": 0,
    "heads": 1,
    "plan": 1,
    "recipes": 1,
    "shim": 2,
    "export": 3,
    "runtime": 3,
    "decode": 4,
    "vllm": 5,
    "hf": 5,
    "datagen": 6,
    "train": 6,
    "evaluate": 6,
    "pipeline": 7,
}
MAX_LINES = 400  # a module is split by role, never to forward names; one cohesive module may run to this


def _part(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in RANKS else "root"  # facts/: the root's built-in fact table


def _graph() -> dict[str, set[str]]:
    modules = package_modules()
    return {n: module_imports(n, p, modules)[1] - {n, "specheads"} for n, p in modules.items()}


def test_every_part_imports_only_lower_layers():
    """Each module imports, from the package's other parts, only those of a lower rank (root < heads, plan <
    shim < export, runtime < decode < vllm, hf < datagen, train, evaluate < pipeline): the stages never import each
    other, the runtime nothing of the head format or the decode front, and only pipeline/ imports the stages."""
    packages = {n.split(".")[1] for n, p in package_modules().items() if n.count(".") == 1 and p.name == "__init__.py"}
    assert packages - set(RANKS) == {"facts"}, "a new folder must be given its layer"
    wrong = sorted(
        (n, o)
        for n, deps in _graph().items()
        for o in deps
        if _part(o) != _part(n) and RANKS[_part(o)] >= RANKS[_part(n)]
    )
    assert wrong == []


def test_no_import_circle():
    """No chain of imports (at module level or inside functions) leads from a module back to itself."""
    graph, state, cycles = _graph(), {}, []

    def visit(node: str, path: list[str]) -> None:
        state[node] = "open"
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == "open":
                cycles.append(path[path.index(dep) :] + [dep])
            elif dep not in state:
                visit(dep, path + [dep])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert cycles == []


SHIM = "specheads.shim"
# The runtime's folders by layer (ARCHITECTURE.md): a folder imports only folders of a lower rank.
SHIM_RANK = {"core": 0, "runners": 1, "costs": 2, "policies": 3, "loop": 4, "batching": 5, "vocab": 5}


def _shim_folder(module: str) -> str | None:
    parts = module.split(".")
    return parts[2] if len(parts) > 3 and module.startswith(SHIM + ".") else None  # a module inside a folder


def test_the_shims_folders_import_downward():
    """Every module of a runtime folder imports, from the other folders, only those of a lower layer (core <
    runners < costs < policies < loop < batching, vocab); a new folder must be given its layer."""
    graph = _graph()
    folders = {_shim_folder(n) for n in graph} - {None}
    assert folders <= set(SHIM_RANK), f"folders without a layer: {sorted(folders - set(SHIM_RANK))}"
    upward = sorted(
        (n, o)
        for n, deps in graph.items()
        if _shim_folder(n)
        for o in deps
        if _shim_folder(o)
        and _shim_folder(o) != _shim_folder(n)
        and SHIM_RANK[_shim_folder(o)] >= SHIM_RANK[_shim_folder(n)]
    )
    assert upward == []


def test_no_module_forwards_names():
    """Outside ``__init__.py`` no module imports a name only to hand it on (``noqa: F401``): its users import it
    from the module that defines it; a module meant to be imported by users says what it offers in ``__all__``."""
    forwarding = sorted(
        f"{n}:{i}"
        for n, p in package_modules().items()
        if p.name != "__init__.py"
        for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), start=1)
        if "noqa: F401" in line
    )
    assert forwarding == []


def test_the_engine_is_chosen_in_one_place():
    """No module asks a config which engine it names (``cfg.engine == "vllm"``) but ``specheads/engines.py``, which
    looks the engine up, and ``datagen/engines.py``, which picks its runtime: the rest ask the engine object."""
    import re

    asks = re.compile(r"\.engine\s*(==|!=|in\b|not in\b)|==\s*[\"']vllm[\"']")
    where = sorted(
        f"{n}:{i}"
        for n, p in package_modules().items()
        if n not in ("specheads.engines", "specheads.datagen.engines")
        for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), start=1)
        if asks.search(line)
    )
    assert where == []


def _defines(path, name: str) -> bool:
    return any(isinstance(n, ast.FunctionDef) and n.name == name for n in ast.parse(path.read_text()).body)


def test_pipeline_calls_only_each_stages_entry_point():
    """heads-pipeline imports from a stage only ``run`` (a resolved config in, an exit code out) of a
    module that is that stage's CLI (it defines ``main``)."""
    modules = package_modules()
    tree = ast.parse(modules["specheads.pipeline"].read_text(encoding="utf-8"))
    from_stages = {
        (node.module, a.name)
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module and _part(node.module) in STAGES
        for a in node.names
    }
    assert {_part(m) for m, _ in from_stages} == {"datagen", "train", "export", "evaluate"}
    assert {name for _, name in from_stages} == {"run"}, from_stages
    assert all(_defines(modules[m], "main") and _defines(modules[m], "run") for m, _ in from_stages)


def test_no_module_runs_long():
    """No module of the package (the stages, the runtime and the root modules under specheads/) is longer than
    MAX_LINES: past it a module holds more than one role (a cohesive 350-line module beats two that forward
    names to each other; ``test_no_module_forwards_names`` keeps the split honest)."""
    long = {
        n: lines
        for n, p in package_modules().items()
        if (lines := len(p.read_text(encoding="utf-8").splitlines())) > MAX_LINES
    }
    assert long == {}


def test_only_the_shim_reaches_into_the_shim():
    """Outside ``shim/``, modules of the package use the decoding runtime through its public
    interface (``specheads.shim``'s ``__init__``), never through a module inside it."""
    inside = {
        n: sorted(o for o in deps if o.startswith(SHIM + "."))
        for n, deps in _graph().items()
        if not (n == SHIM or n.startswith(SHIM + "."))
    }
    assert {n: o for n, o in inside.items() if o} == {}


def test_the_shims_interface_exports_what_it_imports():
    import specheads.shim as shim

    assert sorted(shim.__all__) == sorted(set(shim.__all__))
    assert all(hasattr(shim, name) for name in shim.__all__)


def test_decoders_and_policies_are_built_by_the_assembler():
    """Outside the decode front's builders (``decode/assemble.py``, and ``decode/api.py``/``policy_factory.py``
    that it builds on) no module of the package builds a ``Decoder`` or calls ``make_policy``: heads-decode,
    heads-eval, the ``generate`` integration and the vLLM proposer all go through ``specheads.decode.assemble``."""
    import re

    builds = re.compile(r"\b(Decoder|make_policy)\(")
    own = {"specheads.decode.assemble", "specheads.decode.api", "specheads.decode.policy_factory", "specheads"}
    where = sorted(
        f"{n}:{i}"
        for n, p in package_modules().items()
        if n not in own
        for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), start=1)
        if builds.search(line.split("#")[0]) and not line.lstrip().startswith(("def ", "class "))
    )
    assert where == []
    users = {n for n, deps in _graph().items() if "specheads.decode.assemble" in deps}
    assert {
        "specheads.decode.decode_cli",
        "specheads.evaluate.sweep",
        "specheads.hf",
        "specheads.vllm.proposer",
    } <= users
