"""The paths a target split over GPUs takes, run on virtual GPUs (``specheads.runtime.virtual_devices``): each
path is one or more commands with ``target.device_map=auto`` on two virtual GPUs, where any operation that mixes
devices fails with the operation and both devices named. Used by tests/test_virtual_devices.py and by
bench/device_check.py (which also reverts each device fix and shows the path it breaks).

:func:`build` makes, on the plain CPU, what the paths need: a 4-layer tiny target (layers 0-1 on cuda:0, 2-3
on cuda:1 once split) with a noisy copy as its draft, an EAGLE head reading layers 1 and 3 (so its states come
from both GPUs), its SD rounds, and the stop, verifier, acceptance and judge heads trained on them.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from unittest import mock

import torch

PROMPTS = ["the cat sat", "a dog ran up", "one two three", "why is the sun red", "big moon", "yes no up down"]
SPLIT = ["target.device=auto", "target.device_map=auto", "draft.device=auto"]


def build(root: Path) -> dict:
    """The pair, heads and data the paths read (on the CPU, no sanitizer)."""
    from conftest import make_tokenizer, perturbed_copy, tiny_llama
    from ddp_runs import tiny_eagle_head

    from specheads.datagen.cli import main as datagen
    from specheads.train.cli import main as train

    root.mkdir(parents=True, exist_ok=True)
    tok = make_tokenizer()
    target = tiny_llama(len(tok), seed=0, layers=4)
    s: dict = {"root": root, "target": root / "target", "draft": root / "draft", "prompts": root / "p.jsonl"}
    for name, model in (("target", target), ("draft", perturbed_copy(target, scale=0.3))):
        model.save_pretrained(s[name])
        tok.save_pretrained(s[name])
    s["prompts"].write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    s["eagle"] = tiny_eagle_head(s["target"], root / "eagle.safetensors", layers=(1, 3))
    common = [*target_args(s, split=False), f"prompts={s['prompts']}", "num_prompts=null", "threads=1"]
    common += ["max_new_tokens=10", "chunk_size=3"]
    rounds = [*common, "draft.path=''", "labels=eagle_rounds", f"eagle_rounds.head={s['eagle']}", "eagle_rounds.k=3"]
    for name, extra in (("rounds", []), ("rounds0", ["eagle_rounds.position=previous"])):
        assert datagen([*rounds, f"output_dir={root / name}", "sampling.do_sample=false", *extra]) == 0
    fit = ["batch_size=2", "grad_accum=1", "epochs=2", "lr=1e-2", "eval_fraction=0.25", "patience=3", "threads=1"]
    for name, data, extra in (
        ("stop", "rounds", ["head=eagle_stop", "depth=1"]),
        ("verifier", "rounds0", ["head=eagle_verifier", "class_weights=balanced", "verifier.roc_lambdas=[1.0]"]),
    ):
        assert train([f"data_dir={root / data}", "draft.path=''", f"output_dir={root / name}", *fit, *extra]) == 0
        s[name] = root / name / "head.safetensors"
    assert datagen([*common, f"draft.path={s['draft']}", f"output_dir={root / 'acc'}", "sampling.do_sample=true"]) == 0
    draft = [f"draft.path={s['draft']}", "draft.gguf_file=null", "draft.device=cpu"]
    assert train([f"data_dir={root / 'acc'}", *draft, f"output_dir={root / 'acc_head'}", *fit, "depth=1"]) == 0
    s["acceptance"] = root / "acc_head" / "head.safetensors"
    words = "the cat dog sat on a mat and ran to big red blue sun moon one two three four five".split()
    rows = []
    for i in range(12):
        pick = [words[(7 * i + 3 * j) % len(words)] for j in range(16)]
        wrong = " ".join(pick[10:16])
        rows.append({"question": " ".join(pick[:4]), "correct": " ".join(pick[4:10]), "wrong": wrong})
        rows[-1]["error"] = [wrong.index(" ", 3) + 1, wrong.index(" ", 3) + 3]
    s["tuples"] = root / "tuples.jsonl"
    s["tuples"].write_text("".join(json.dumps(r) + "\n" for r in rows))
    judge = [*common, f"draft.path={s['draft']}", "labels=judge", f"judge.tuples={s['tuples']}", "prompts=''"]
    assert datagen([*judge, f"output_dir={root / 'judge_data'}", "chunk_size=4"]) == 0
    jfit = [*fit, "head=judge", "depth=0", "draft.path=unused"]
    assert train([f"data_dir={root / 'judge_data'}", f"output_dir={root / 'judge'}", *jfit]) == 0
    s["judge"] = root / "judge" / "head.safetensors"
    return s


def target_args(s: dict, split: bool = True) -> list[str]:
    return [f"target.path={s['target']}", "target.gguf_file=null", "target.device=cpu", *(SPLIT if split else [])]


def _run(main: Callable[[list[str]], int], args: list[str]) -> None:
    rc = main(args)
    if rc != 0:
        raise AssertionError(f"exit code {rc}: {' '.join(args)}")


def _decode(s, out, *extra, draft: bool = True):
    from specheads.decode.decode_cli import main

    drafts = [f"draft.path={s['draft']}", "draft.gguf_file=null"] if draft else ["draft.path=''"]
    _run(
        main,
        [
            *target_args(s),
            *drafts,
            f"prompts={s['prompts']}",
            "num_prompts=null",
            f"output_dir={out}",
            "max_new_tokens=10",
            *extra,
        ],
    )


def _eval(s, out, *extra):
    from specheads.evaluate.cli import main

    prompts = [f"prompts={s['prompts']}", "num_prompts=null", "offset=0", "head=null"]
    _run(main, [*target_args(s), "draft.path=''", *prompts, f"output_dir={out}", "max_new_tokens=8", *extra])


def _datagen(s, out, *extra, draft: bool = True):
    from specheads.datagen.cli import main

    drafts = [f"draft.path={s['draft']}", "draft.gguf_file=null"] if draft else ["draft.path=''"]
    _run(
        main,
        [
            *target_args(s),
            *drafts,
            f"prompts={s['prompts']}",
            "num_prompts=null",
            "offset=0",
            f"output_dir={out}",
            "max_new_tokens=8",
            "chunk_size=3",
            "batch_size=2",
            *extra,
        ],
    )


def _train_eagle_online(s, out):
    """An EAGLE head trained on states the split target makes while it trains (ids-only data, hybrid cache)."""
    from specheads.train.cli import main

    data = out / "data"
    _datagen(s, data, "labels=drafter", "drafter.layers=[1,3]", "drafter.store_states=false", draft=False)
    fit = ["head=eagle", f"data_dir={data}", f"output_dir={out / 'head'}", "batch_size=2", "grad_accum=1", "epochs=2"]
    fit += [
        "eval_fraction=0.25",
        "patience=3",
        "threads=1",
        "eagle.ttt_steps=2",
        "vocab_top_n=20",
        "eagle.states=hybrid",
    ]
    _run(main, [*target_args(s), *fit])


def first_word(prompt, text: str) -> str:
    """A prefix-stable checker for mining on the tiny pair: a response's answer is its first word, so a cut
    response's answer is trustworthy and every mismatch after the first word is tried."""
    return text.split(" ", 1)[0].strip()


first_word.prefix_stable = True  # type: ignore[attr-defined]

# name -> what it runs, given the built setup and an output directory; every one on the split target.
PATHS: dict[str, Callable[[dict, Path], None]] = {
    "decode_sd": lambda s, o: _decode(s, o, "policy=sd", "sd.k=3"),
    "decode_sd_sampled": lambda s, o: _decode(s, o, "policy=sd", "sd.k=3", "sampling.do_sample=true"),
    "decode_specdecpp_draft": lambda s, o: _decode(s, o, "policy=specdecpp", f"specdecpp.head={s['acceptance']}"),
    "decode_judge": lambda s, o: _decode(s, o, "policy=judge", "judge.k=3", f"judge.head={s['judge']}"),
    "decode_eagle_sd": lambda s, o: _decode(s, o, "policy=sd", "sd.k=3", f"eagle={s['eagle']}", draft=False),
    "decode_eagle_sampled": lambda s, o: _decode(
        s, o, "policy=sd", "sd.k=3", f"eagle={s['eagle']}", "sampling.do_sample=true", draft=False
    ),
    "decode_eagle_stop_head": lambda s, o: _decode(
        s, o, "policy=specdecpp", f"specdecpp.head={s['stop']}", f"eagle={s['eagle']}", draft=False
    ),
    "decode_eagle_verifier": lambda s, o: _decode(
        s, o, "policy=sprinter", f"sprinter.head={s['verifier']}", f"eagle={s['eagle']}", draft=False
    ),
    # sampled, so that the rows' outputs differ from the target's and fidelity scores them
    "eval_eagle_fidelity": lambda s, o: _eval(
        s, o, f"eagle={s['eagle']}", "ks=[2]", "trees=[]", "sampling.do_sample=true"
    ),
    "datagen_acceptance": lambda s, o: _datagen(s, o, "labels=acceptance", "sampling.do_sample=true"),
    "datagen_fsd": lambda s, o: _datagen(s, o, "labels=fsd"),
    "datagen_sprinter": lambda s, o: _datagen(s, o, "labels=sprinter", "sampling.do_sample=false", "chunk_size=4"),
    "datagen_judge": lambda s, o: _datagen(s, o, "labels=judge", f"judge.tuples={s['tuples']}", "prompts=''"),
    "datagen_judge_mining": lambda s, o: _datagen(
        s, o, "labels=judge", "judge.mining=swap", "judge.checker=exact", "chat_template=false"
    ),
    "datagen_judge_mining_eagle": lambda s, o: _datagen(
        s,
        o,
        "labels=judge",
        "judge.mining=swap",
        f"judge.checker={__name__}:first_word",
        "chat_template=false",
        f"judge.mine_eagle={s['eagle']}",
        draft=False,
    ),
    "datagen_drafter": lambda s, o: _datagen(s, o, "labels=drafter", "drafter.layers=[1,3]", draft=False),
    "train_eagle_online": _train_eagle_online,
    "datagen_eagle_rounds": lambda s, o: _datagen(
        s, o, "labels=eagle_rounds", f"eagle_rounds.head={s['eagle']}", "eagle_rounds.k=3", draft=False
    ),
}


def _unmoved_commit(self, seq, new, kept):
    """Item 1 reverted: the drafter keeps the target's states on the GPU they came out on."""
    v = self.verifier
    if v.forwards == self.passes or v.aux_states is None:
        return
    self.passes = v.forwards
    usable = len(seq) - 1 - v.aux_start
    if usable > 0:
        self.pending.append((v.aux_start, v.aux_states[:usable]))


def reverts():
    """Each device fix reverted: fix -> (a patch that puts the bug back, the path that must then fail, the
    sanitizer's message it fails with, a regex)."""
    from specheads.decode import policy_factory
    from specheads.evaluate import fidelity
    from specheads.shim.loop.eagle_drafter import EagleDrafter
    from specheads.shim.runners.hidden import AuxCapture

    real = policy_factory.load_head

    def on_last_gpu(path, **kw):  # item 2 reverted: the stop head on the output GPU (the last of the paths' two)
        kw["device"] = torch.device("cuda:1")
        return real(path, **kw)

    return {
        "1_eagle_states_to_head_gpu": (
            mock.patch.object(EagleDrafter, "commit", _unmoved_commit),
            "decode_eagle_sd",
            r"linear mixes devices cuda:1 .*, cuda:0",
        ),
        "2_stop_head_on_eagle_gpu": (
            mock.patch.object(policy_factory, "load_head", on_last_gpu),
            "decode_eagle_stop_head",
            r"mixes devices cuda:1 .*, cuda:0",
        ),
        "3_mining_layers_joined_on_one_gpu": (  # the layers' states joined where each came out
            mock.patch.object(AuxCapture, "states", property(lambda c: torch.cat([c._seen[i] for i in c.layers], -1))),
            "datagen_judge_mining_eagle",
            r"torch\.cat mixes devices cuda:0 .*, cuda:1",
        ),
        "4_fidelity_index_on_logits_gpu": (  # the index built on the embeddings' GPU
            mock.patch.object(fidelity, "output_device", lambda model: next(model.parameters()).device),
            "eval_eagle_fidelity",
            r"gather mixes devices cuda:1 .*, cuda:0",
        ),
    }


def run_path(name: str, s: dict, out: Path, gpus: int = 2) -> int:
    """Runs path ``name`` on ``gpus`` virtual GPUs; returns the number of operations checked (raises
    :class:`~specheads.runtime.virtual_devices.DeviceMismatch` on the first that mixes devices)."""
    from specheads.runtime.virtual_devices import VirtualGPUs

    torch.manual_seed(0)
    with VirtualGPUs(gpus) as vg:
        PATHS[name](s, out)
    return sum(vg.ops.values())
