"""Shared fixtures and helpers: tiny tokenizers and models built locally (nothing downloaded), stub LMs,
the tiny pair's datagen and train command lines, the losslessness chi-square, and a child process
that SIGKILLs itself at a fixed point of its own work. Test modules import helpers from here only."""

from __future__ import annotations

import ast
import itertools
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from scipy.stats import chisquare
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast

from specheads.shim import Engine, StandardSD
from specheads.shim.core.sampling import SamplingConfig, probs_from_logits
from specheads.shim.runners.fused import unfuse

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared"
# the prompts of the acceptance labels heads-train's tests fit on (``labelled``; tests/ddp_runs.py too)
LABEL_PROMPTS = [
    "the cat sat",
    "a dog ran up",
    "one two three",
    "why is the sun red",
    "big moon",
    "yes no up down",
    "left right",
    "the red sun",
    "two three four",
    "who was it",
]
# The tests call the CLIs without recipe= on tiny models and read their other settings from the default
# recipe: pin the draft-based SpecDec++ one (the old quickstart), not the main job's recipe=quickstart
# (an EAGLE head on the real target), here and in every child process the tests start.
os.environ["SPECHEADS_RECIPE"] = "specdecpp_draft_quickstart"

# The folders installed under the import root (pyproject's package-dir: specheads.<folder>).
PACKAGE_FOLDERS = ("specheads", "heads", "shim", "export", "decode", "datagen", "train", "evaluate", "recipes")
WORDS = (
    "the cat dog sat on a mat and ran to big red blue sun moon one two three four five six seven eight "
    "nine ten is was why how what when who yes no up down left right"
).split()


def make_tokenizer(words=WORDS, prefix: str = "") -> PreTrainedTokenizerFast:
    """A word-level tokenizer over ``words`` with <unk>=0, <s>=1, </s>=2 (no chat template)."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for w in words:
        vocab.setdefault(prefix + w, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def tiny_llama(vocab_size: int, seed: int = 0, layers: int = 2, max_positions: int = 256, init: float = 0.3):
    """A random Llama with peaked logits (large init) so greedy near-ties are rare; fp32, eval."""
    cfg = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_positions,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
        initializer_range=init,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()


def perturbed_copy(model, scale: float = 0.05, seed: int = 1):
    """A draft that mostly agrees with ``model``: its weights plus Gaussian noise."""
    draft = tiny_llama(
        model.config.vocab_size,
        layers=model.config.num_hidden_layers,
        max_positions=model.config.max_position_embeddings,
    )
    draft.load_state_dict(model.state_dict())
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale * p.std().clamp_min(1e-3))
    return draft


@pytest.fixture(scope="session")
def tokenizer():
    return make_tokenizer()


@pytest.fixture(scope="session")
def tiny_pair(tokenizer):
    """(target, draft) tiny Llamas over the word-level vocabulary; the draft is a noisy copy."""
    target = tiny_llama(len(tokenizer), seed=0)
    return target, perturbed_copy(target, scale=0.3)


@pytest.fixture(scope="session")
def tiny_pair_dirs(tmp_path_factory, tokenizer, tiny_pair):
    """The tiny pair saved as two Hugging Face directories (model + tokenizer)."""
    root = tmp_path_factory.mktemp("pair")
    out = []
    for name, model in zip(("target", "draft"), tiny_pair):
        unfuse(model)  # an earlier test may have run it on the fused forward (column-major views)
        model.save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
        out.append(root / name)
    return tuple(out)


class BigramLM(torch.nn.Module):
    """A stub causal LM whose next-token logits depend only on the last token: ``table[last]``.

    It speaks the Hugging Face interface the engine uses (``input_ids``, ``past_key_values``,
    ``use_cache``, ``logits_to_keep``) and fills the KV cache with dummies so that lengths
    and trimming behave as with a real model. Its final-norm state for token ``t`` is the
    one-hot vector ``e_t``. ``calls`` records each forward's input length.
    """

    def __init__(self, table: torch.Tensor):
        super().__init__()
        vocab = table.shape[0]
        self.config = LlamaConfig(
            vocab_size=vocab,
            hidden_size=vocab,
            num_hidden_layers=1,
            num_attention_heads=1,
            num_key_value_heads=1,
            max_position_embeddings=1024,
        )
        self.table = table.float()
        self.embed = torch.nn.Embedding(vocab, vocab)  # one-hot: the "hidden state" of token t is e_t
        with torch.no_grad():
            self.embed.weight.copy_(torch.eye(vocab))
        self.head = torch.nn.Linear(vocab, vocab, bias=False)
        self.norm = torch.nn.Identity()
        self.calls: list[int] = []

    def get_input_embeddings(self):
        return self.embed

    def get_output_embeddings(self):
        return self.head

    def forward(self, input_ids, past_key_values=None, use_cache=True, logits_to_keep=0, **kwargs):
        b, s = input_ids.shape
        self.calls.append(s)
        dummy = torch.zeros(b, 1, s, 1)
        past_key_values.update(dummy, dummy, 0)
        self.norm(self.embed(input_ids))
        logits = self.table[input_ids]
        if logits_to_keep:
            logits = logits[:, -logits_to_keep:]
        return SimpleNamespace(logits=logits)


def bigram(probs: list[list[float]]) -> BigramLM:
    """A BigramLM from next-token probabilities (rows may hold zeros: their logits are -inf)."""
    p = torch.tensor(probs, dtype=torch.float64)
    return BigramLM(torch.log(p).float())


@pytest.fixture(scope="session", autouse=True)
def _own_measurement_cache(tmp_path_factory):
    """Kernel choices and cost tables go to a fresh folder for the session (subprocesses inherit it),
    never to the user's ~/.cache/specheads."""
    import os

    old = os.environ.get("SPECHEADS_CACHE")
    os.environ["SPECHEADS_CACHE"] = str(tmp_path_factory.mktemp("specheads-cache"))
    yield
    if old is None:
        os.environ.pop("SPECHEADS_CACHE", None)
    else:
        os.environ["SPECHEADS_CACHE"] = old


# --- heads-datagen and heads-train on the tiny pair ---------------------------------------------

DATAGEN_PROMPTS = ["the cat sat", "a dog ran up", "one two three four", "why is the sun red", "big blue moon", "yes no"]
SPRINTER_PROMPTS = [
    "the cat sat on a mat",
    "a dog ran up",
    "one two three four five",
    "why is the sun red",
    "big blue moon",
    "yes no up down",
    "how was the cat",
    "left right left",
]


@pytest.fixture()
def prompts_file(tmp_path):
    """``DATAGEN_PROMPTS`` as a prompt file."""
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps({"prompt": w}) + "\n" for w in DATAGEN_PROMPTS))
    return path


def acceptance_head_file(pair_dirs, path, seed: int = 0, extra: dict | None = None):
    """An untrained acceptance head (32 wide, depth 1, seeded) on the tiny pair's draft states, exported to ``path``
    with the metadata the shim checks (default threshold 0.6; ``extra``: the header's free-form part)."""
    from specheads.export import save_head
    from specheads.heads import AcceptanceHead
    from specheads.shim import ModelSpec, load_pair

    t, d = pair_dirs
    pair = load_pair(ModelSpec(path=str(t), device="cpu"), ModelSpec(path=str(d), device="cpu"))
    torch.manual_seed(seed)
    head = AcceptanceHead(32, depth=1)
    meta = {
        "head_config": head.config(),
        "hidden_size": 32,
        "feature": {"model": "draft", "state": "post", "layer": -1},
        "draft": {"name": pair.draft.name, "fingerprint": pair.draft.fingerprint},
        "target": {"name": pair.target.name, "fingerprint": pair.target.fingerprint},
        "sampling": SamplingConfig().to_dict(),
        "default_threshold": 0.6,
    }
    return save_head(path, head, "acceptance", meta | ({"extra": extra} if extra else {}))


def pair_args(pair_dirs) -> list[str]:
    """The tiny pair as any command's arguments: its two directories (no GGUF file), on the CPU."""
    t, d = pair_dirs
    return [f"target.path={t}", "target.gguf_file=null", f"draft.path={d}", "target.device=cpu", "draft.device=cpu"]


def decode_args(pair_dirs, prompts, out, *extra):
    """``heads-decode`` arguments on the tiny pair: every prompt of ``prompts``, 12 new tokens, into ``out``."""
    return [
        *pair_args(pair_dirs),
        f"prompts={prompts}",
        f"output_dir={out}",
        "max_new_tokens=12",
        "num_prompts=null",
        *extra,
    ]


def datagen_args(pair_dirs, prompts, out, *extra):
    """``heads-datagen`` acceptance labels on the tiny pair: chunks of 2 prompts, up to 6 new tokens, sampled."""
    return [
        *pair_args(pair_dirs),
        f"prompts={prompts}",
        f"output_dir={out}",
        "num_prompts=null",
        "max_new_tokens=6",
        "batch_size=2",
        "chunk_size=2",
        "sampling.do_sample=true",
        *extra,
    ]


def sprinter_args(pair_dirs, prompts, out, *extra):
    """``heads-datagen labels=sprinter`` on the tiny pair: chunks of 4 prompts (one per prefix category), greedy."""
    return datagen_args(
        pair_dirs, prompts, out, "batch_size=4", "chunk_size=4", "labels=sprinter", "sampling.do_sample=false", *extra
    )


def chunk_rows(out):
    """Every row of a datagen output's chunk files, in chunk order."""
    import pyarrow.parquet as pq

    rows = []
    for path in sorted((out / "data").glob("chunk-*.parquet")):
        rows += pq.read_table(path).to_pylist()
    return rows


class HFStates:
    """A stand-in for ``heads-datagen engine=vllm``'s states child (``specheads.vllm.child.StatesServer``) on the
    Transformers target: the same states (``[T, len(layers), d]``, layer ``n`` the output before the final norm)
    and top-k, from one forward per sequence of its own copy of the target. ``calls`` counts the sequences asked,
    ``target_passes`` the forwards of the run's own Transformers target (``watch``)."""

    def __init__(self, model, watch=None):
        self.model, self.calls, self.target_passes = model, 0, 0
        if watch is not None:  # its first decoder layer runs in every forward of the run's target
            watch.model.layers[0].register_forward_pre_hook(
                lambda *a: setattr(self, "target_passes", self.target_passes + 1)
            )

    @torch.inference_mode()
    def states(self, seqs, layers, top_k=0):
        from specheads.shim import HiddenCapture

        out = []
        for seq in seqs:
            self.calls += 1
            with HiddenCapture(self.model) as cap:
                o = self.model(torch.tensor([seq]), output_hidden_states=True)
            n = self.model.config.num_hidden_layers
            st = torch.stack([cap.pre[0] if i == n else o.hidden_states[i][0] for i in layers], 1).float()
            top = None
            if top_k:
                best = torch.log_softmax(o.logits[0, :-1].float(), -1).topk(top_k, -1)
                top = (best.indices.to(torch.int32), best.values)
            out.append((st, top))
        return out

    def close(self):
        pass


def fake_states(monkeypatch) -> list:
    """Routes ``engine=vllm``'s states to :class:`HFStates`; returns the list of servers made (one per run)."""
    from specheads.datagen import vllm_states

    made = []

    def server(cfg, job, local_rank=0):
        if cfg.engine != "vllm" or cfg.labels not in vllm_states.FAMILIES:
            return None
        made.append(HFStates(AutoModelForCausalLM.from_pretrained(cfg.target.path).eval(), job.pair.target.model))
        return made[-1]

    monkeypatch.setattr(vllm_states, "server", server)
    return made


@pytest.fixture(scope="module")
def labelled(tmp_path_factory, tiny_pair_dirs):
    """Acceptance labels of 10 prompts (up to 10 new tokens each) on the tiny pair, for heads-train."""
    from specheads.datagen.cli import main as datagen_main

    root = tmp_path_factory.mktemp("labelled")
    prompts = root / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": w}) + "\n" for w in LABEL_PROMPTS))
    out = root / "dg"
    assert datagen_main(datagen_args(tiny_pair_dirs, prompts, out, "max_new_tokens=10")) == 0
    return out


def train_args(tiny_pair_dirs, data, out, *extra):
    """``heads-train`` of a depth-1 acceptance head on ``data``: 3 epochs, batch 2, 2 accumulation steps."""
    return [
        f"data_dir={data}",
        f"draft.path={tiny_pair_dirs[1]}",
        "draft.gguf_file=null",
        "draft.device=cpu",
        f"output_dir={out}",
        "batch_size=2",
        "grad_accum=2",
        "epochs=3",
        "lr=1e-2",
        "eval_fraction=0.2",
        "depth=1",
        "patience=3",
        *extra,
    ]


def same_heads(a, b, atol=0.0):
    """The exported heads of two training output folders are equal (bit for bit by default)."""
    from specheads.export import load_head

    a = load_head(a / "head.safetensors").module.state_dict()
    b = load_head(b / "head.safetensors").module.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=atol)


# --- the losslessness chi-square on a bigram pair -----------------------------------------------

P_ROWS = [[0.50, 0.20, 0.20, 0.10], [0.10, 0.60, 0.20, 0.10], [0.25, 0.25, 0.25, 0.25], [0.05, 0.15, 0.30, 0.50]]
Q_ROWS = [[0.10, 0.10, 0.40, 0.40], [0.50, 0.20, 0.20, 0.10], [0.70, 0.10, 0.10, 0.10], [0.25, 0.25, 0.25, 0.25]]


def exact_sequences(sampling: SamplingConfig, horizon: int, rows=P_ROWS) -> dict[tuple, float]:
    """The probability of every token sequence of length ``horizon`` from token 0 under the bigram ``rows``."""
    p = probs_from_logits(torch.log(torch.tensor(rows)), sampling)
    out = {}
    for seq in itertools.product(range(4), repeat=horizon):
        prob, last = 1.0, 0
        for t in seq:
            prob, last = prob * float(p[last, t]), t
        out[seq] = prob
    return out


def sd_pvalue(
    sampling: SamplingConfig, n: int = 3000, horizon: int = 3, k: int = 2, policy=None, rows=P_ROWS, draft=None
) -> float:
    """Chi-square p-value of ``n`` sampled outputs of ``policy`` (default SD with ``k``) on the
    bigram pair (or the target with ``draft``) against the exact sequence distribution of the
    bigram ``rows`` (default: the target)."""
    engine = Engine(bigram(P_ROWS), draft if draft is not None else bigram(Q_ROWS), eos_token_ids=[])
    gen = torch.Generator().manual_seed(1234)
    exact = exact_sequences(sampling, horizon, rows)
    counts = dict.fromkeys(exact, 0)
    policy = policy or StandardSD(k)
    for _ in range(n):
        counts[tuple(engine.generate([0], policy, horizon, sampling, gen).tokens)] += 1
    assert sum(counts[s] for s in exact if exact[s] == 0) == 0  # never emits an impossible sequence
    total = sum(exact.values())
    obs, exp, pool_obs, pool_exp = [], [], 0, 0.0
    for s, prob in exact.items():  # pool cells expected < 5 times so the chi-square approximation holds
        e = prob / total * n
        if e >= 5:
            obs.append(counts[s])
            exp.append(e)
        elif prob > 0:
            pool_obs, pool_exp = pool_obs + counts[s], pool_exp + e
    if pool_exp > 0:
        obs.append(pool_obs)
        exp.append(pool_exp)
    exp = [e * n / sum(exp) for e in exp]
    return chisquare(obs, exp).pvalue


#: Sampling settings every losslessness chi-square runs under (plain and warped).
SAMPLINGS = pytest.mark.parametrize(
    "sampling",
    [SamplingConfig(do_sample=True), SamplingConfig(do_sample=True, temperature=0.7, top_k=3, top_p=0.9)],
    ids=["plain", "warped"],
)


# --- a process killed at a fixed point of its own work ------------------------------------------

# Runs ``python -m <module> <args>`` with os.replace wrapped: at the n-th rename onto a file whose name
# matches the pattern, the process SIGKILLs itself, before the rename (the temporary file written, not
# yet in place) or right after it. The project writes every finished file by such a rename.
_KILL_DRIVER = """
import fnmatch, os, runpy, signal, sys

pattern, nth, when = os.environ["SPECHEADS_TEST_KILL"].split(":")
nth, seen, replace = int(nth), [0], os.replace


def replace_or_die(src, dst, *args, **kwargs):
    hit = fnmatch.fnmatch(os.path.basename(os.fspath(dst)), pattern)
    seen[0] += hit
    if hit and seen[0] == nth and when == "before":
        os.kill(os.getpid(), signal.SIGKILL)
    replace(src, dst, *args, **kwargs)
    if hit and seen[0] == nth and when == "after":
        os.kill(os.getpid(), signal.SIGKILL)


os.replace = replace_or_die
module, sys.argv = sys.argv[1], sys.argv[1:]
runpy.run_module(module, run_name="__main__", alter_sys=True)
"""


def run_killed(module: str, args: list[str], pattern: str, nth: int, when: str, timeout: float = 300):
    """Runs ``python -m module *args`` in a child process that SIGKILLs itself at the ``nth`` rename
    (``os.replace``) onto a file named like ``pattern`` (fnmatch), ``when`` = ``"before"`` or ``"after"``
    it; asserts that it died there (not earlier by an error, not later by finishing)."""
    assert when in ("before", "after")
    env = {**os.environ, "SPECHEADS_TEST_KILL": f"{pattern}:{nth}:{when}"}
    proc = subprocess.run(
        [sys.executable, "-c", _KILL_DRIVER, module, *args], capture_output=True, text=True, timeout=timeout, env=env
    )
    assert proc.returncode == -signal.SIGKILL, (
        f"{module} was to die {when} rename {nth} onto {pattern}; exit {proc.returncode}: {proc.stderr[-2000:]}"
    )
    return proc


def package_modules() -> dict[str, Path]:
    """Every module of the package, by dotted name (pyproject's package-dir: ``specheads.<folder>``)."""
    out = {}
    for path in sorted(ROOT.glob("*/**/*.py")):
        rel = path.relative_to(ROOT)
        if rel.parts[0] not in PACKAGE_FOLDERS:
            continue
        parts = list(rel.with_suffix("").parts)
        if parts[0] != "specheads":
            parts.insert(0, "specheads")
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def module_imports(name: str, path: Path, modules: dict[str, Path]) -> tuple[set[str], set[str]]:
    """``(third-party top-level names, project modules)`` that a module imports anywhere in its body."""
    package = (name if path.name == "__init__.py" else name.rpartition(".")[0]).split(".")
    third, ours = set(), set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package, up level - 1 packages
                base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
            targets = [base] + [f"{base}.{a.name}" for a in node.names]  # a name may be a submodule
        else:
            continue
        for target in targets:
            top = target.split(".")[0]
            if top == "specheads":
                ours |= {target} & modules.keys()
            elif top not in sys.stdlib_module_names and top != "__future__":
                third.add(top)
    return third, ours
