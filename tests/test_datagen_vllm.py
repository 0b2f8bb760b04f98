"""``heads-datagen engine=vllm``: settings checked in one line; the responses generated up front into side files
(here by a fake generator on the Transformers engine, in the vLLM child's file format) give every family the labels
of ``engine=specheads`` on greedy prompts; a run killed while generating resumes without generating the finished
chunks again, and the side files go once their chunks land. With vLLM (``SPECHEADS_VLLM_PYTHON``: the python of
vLLM's virtualenv), the real child gives the Transformers engine's greedy responses and labels."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
import torch
from conftest import DATAGEN_PROMPTS, SPRINTER_PROMPTS, chunk_rows, datagen_args, fake_states

from specheads.datagen import vllm_responses
from specheads.datagen.cli import main
from specheads.errors import UserError
from specheads.vllm.jobs import side_name, write_atomic

VLLM_PYTHON = os.environ.get("SPECHEADS_VLLM_PYTHON")
GSM = [
    {"question": "what is two plus two", "answer": "2 + 2 = 4\n#### 4"},
    {"question": "what is three plus one", "answer": "3 + 1 = 4\n#### 4"},
]


def fake_vllm(calls: list, fail_after: int | None = None):
    """A stand-in for the vLLM child: the Transformers engine's batched generation, one batch per chunk and
    sampling setting (the labellers' batches at batch_size = chunk_size), side files in the child's format."""
    from transformers import AutoModelForCausalLM

    from specheads.shim.batching import batch_generate as batched
    from specheads.shim.core.sampling import SamplingConfig

    def generate(cfg, header, lines, work, local_rank):
        calls.append([line["chunk"] for line in lines])
        model = AutoModelForCausalLM.from_pretrained(cfg.target.path).eval()
        for n, line in enumerate(lines):
            if fail_after is not None and n == fail_after:
                raise UserError("vLLM died")
            groups: dict[str, list] = {}
            for r in line["requests"]:
                groups.setdefault(json.dumps(r["sampling"], sort_keys=True), []).append(r)
            responses = {}
            for key, reqs in groups.items():
                s = SamplingConfig(**json.loads(key))
                g = torch.Generator().manual_seed(reqs[0]["seed"] % 2**62) if s.do_sample else None
                outs = batched.generate(
                    model, [r["prompt"] for r in reqs], reqs[0]["max_new_tokens"], s, g, header["eos"], header["eos"][0]
                )
                responses.update({r["key"]: o for r, o in zip(reqs, outs)})
            write_atomic(
                str(work / side_name(line["chunk"])),
                {
                    "chunk": line["chunk"],
                    "digest": line["digest"],
                    "responses": responses,
                    "finite": {k: True for k in responses},
                },
            )
        write_atomic(str(work / "run.json"), {"startup_seconds": 0.0, "seconds": 0.0, "tokens": 0, "requests": 0})
        return {}

    return generate


def close(a, b) -> bool:
    """Rows equal, floats to 1e-4 (a teacher-forced pass vs the logits recorded while generating)."""
    if isinstance(a, float) and isinstance(b, float):
        return math.isclose(a, b, rel_tol=1e-4, abs_tol=1e-4) or (math.isinf(a) and a == b)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(close(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(close(a[k], b[k]) for k in a)
    return a == b


@pytest.fixture()
def gsm_file(tmp_path):
    path = tmp_path / "gsm.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in GSM))
    return path


def family_args(labels: str, prompts: Path, gsm: Path) -> tuple[Path | None, list[str]]:
    if labels == "sprinter":
        return None, ["batch_size=4", "chunk_size=4", "labels=sprinter"]
    if labels == "judge":
        return gsm, ["labels=judge", "chat_template=false", "max_new_tokens=8", "judge.answer_samples=1"]
    if labels == "drafter":
        return None, ["labels=drafter", "drafter.top_k=5", "max_new_tokens=8"]
    return None, [f"labels={labels}"]


@pytest.mark.parametrize("labels", ["acceptance", "fsd", "sprinter", "drafter", "judge"])
def test_engine_vllm_gives_the_specheads_labels_on_greedy_prompts(
    tiny_pair_dirs, tmp_path, gsm_file, monkeypatch, labels
):
    prompts = tmp_path / "p.jsonl"
    words = SPRINTER_PROMPTS if labels == "sprinter" else DATAGEN_PROMPTS
    prompts.write_text("".join(json.dumps({"prompt": w}) + "\n" for w in words))
    other, extra = family_args(labels, prompts, gsm_file)
    common = ["sampling.do_sample=false", *extra, *([f"prompts={other}"] if other else [])]
    ours, theirs = tmp_path / "ours", tmp_path / "vllm"
    assert main(datagen_args(tiny_pair_dirs, prompts, ours, *common)) == 0
    calls: list = []
    monkeypatch.setattr(vllm_responses, "run_vllm", fake_vllm(calls))
    states = fake_states(monkeypatch)  # drafter, judge, sprinter: the target's states from "vLLM" too
    assert (
        main(datagen_args(tiny_pair_dirs, prompts, theirs, *common, "engine=vllm", f"vllm.python={os.sys.executable}"))
        == 0
    )
    assert len(calls) == 1  # one generation run for every chunk
    assert len(states) == (labels in ("drafter", "judge", "sprinter"))  # one states server per run
    if states:  # the states from "vLLM", and not one forward of the Transformers target
        assert (labels == "judge" or states[0].calls > 0) and states[0].target_passes == 0
    a, b = chunk_rows(ours), chunk_rows(theirs)
    assert (a or labels == "judge") and len(a) == len(b)  # the tiny pair's answers give no judge tuples:
    for x, y in zip(a, b):
        assert close(x, y), (x, y)
    if labels == "judge":  # its greedy answers are compared through the review file (sampled ones differ)
        greedy = [
            [x for x in (d / "review.jsonl").read_text().splitlines() if json.loads(x)["setting"] == "greedy"]
            for d in (ours, theirs)
        ]
        assert greedy[0] and greedy[0] == greedy[1]
        m = [json.loads((d / "manifest.json").read_text())["tuple_counts"]["answers"] for d in (ours, theirs)]
        assert m == [2 * 2 * 2] * 2
    assert not (theirs / "vllm").exists()  # side files removed as their chunks landed
    assert json.loads((theirs / "manifest.json").read_text())["engine"] == "vllm"
    if labels == "drafter":
        from specheads.dataset import DrafterChunkFiles

        for c in range(3):
            s, t = DrafterChunkFiles(ours, c).load(), DrafterChunkFiles(theirs, c).load()
            assert torch.equal(s["top_ids"], t["top_ids"]) and torch.equal(s["offsets"], t["offsets"])
            assert torch.allclose(s["top_logp"], t["top_logp"], atol=1e-4)
            assert torch.allclose(s["states"].float(), t["states"].float(), atol=1e-2)


def test_sampled_acceptance_labels_vllms_responses_with_a_target_pass(
    tiny_pair_dirs, prompts_file, tmp_path, monkeypatch
):
    from transformers import AutoModelForCausalLM

    from specheads.datagen.acceptance_labels import response_logits
    from specheads.shim.core.sampling import SamplingConfig, probs_from_logits

    calls: list = []
    monkeypatch.setattr(vllm_responses, "run_vllm", fake_vllm(calls))
    out = tmp_path / "dg"
    args = ["engine=vllm", "vllm.logprobs=false", f"vllm.python={os.sys.executable}"]
    assert main(datagen_args(tiny_pair_dirs, prompts_file, out, *args)) == 0
    rows = chunk_rows(out)
    assert len(rows) == len(DATAGEN_PROMPTS) and calls == [[0, 1, 2]]
    target, draft = (AutoModelForCausalLM.from_pretrained(d).eval() for d in tiny_pair_dirs)
    sampling = SamplingConfig(**json.loads((out / "manifest.json").read_text())["sampling"])
    for r in rows:  # the expected label 1 - TV(p, q) needs p: a teacher-forced pass of the target along vLLM's response
        x, y = r["input_ids"][: r["response_start"]], r["input_ids"][r["response_start"] :]
        p, q = (probs_from_logits(response_logits(m, [x], [y], 2)[0], sampling) for m in (target, draft))
        assert torch.allclose(torch.minimum(p, q).sum(-1), torch.tensor(r["expected_label"]), atol=1e-4)


def test_a_run_killed_while_generating_resumes_with_the_rest(tiny_pair_dirs, prompts_file, tmp_path, monkeypatch):
    args = ["sampling.do_sample=false", "engine=vllm", f"vllm.python={os.sys.executable}"]
    calls: list = []
    monkeypatch.setattr(vllm_responses, "run_vllm", fake_vllm(calls, fail_after=2))
    out = tmp_path / "dg"
    assert main(datagen_args(tiny_pair_dirs, prompts_file, out, *args)) == 2  # died after two chunks' files
    assert sorted(p.name for p in (out / "vllm").glob("chunk-*")) == [side_name(0), side_name(1)]
    assert not (out / "data").exists() or not list((out / "data").glob("chunk-*"))
    (out / "vllm" / "job.99999.jsonl").write_text("{}\n")  # the request file a killed process leaves behind
    monkeypatch.setattr(vllm_responses, "run_vllm", fake_vllm(calls))
    assert main(datagen_args(tiny_pair_dirs, prompts_file, out, *args)) == 0
    assert calls == [[0, 1, 2], [2]]  # the finished side files were not generated again
    (out / "data" / "chunk-000001.parquet").unlink()  # killed before this chunk landed
    assert main(datagen_args(tiny_pair_dirs, prompts_file, out, *args)) == 0
    assert calls[-1] == [1]
    once = tmp_path / "once"
    assert main(datagen_args(tiny_pair_dirs, prompts_file, once, *args)) == 0
    assert chunk_rows(once) == chunk_rows(out) and not (out / "vllm").exists()


def test_a_side_file_for_other_requests_is_generated_again(tiny_pair_dirs, prompts_file, tmp_path, monkeypatch):
    calls: list = []
    monkeypatch.setattr(vllm_responses, "run_vllm", fake_vllm(calls, fail_after=1))
    out = tmp_path / "dg"
    args = ["sampling.do_sample=false", "engine=vllm", f"vllm.python={os.sys.executable}"]
    assert main(datagen_args(tiny_pair_dirs, prompts_file, out, *args)) == 2
    side = out / "vllm" / side_name(0)
    data = json.loads(side.read_text())
    side.write_text(json.dumps({**data, "digest": "other"}))
    monkeypatch.setattr(vllm_responses, "run_vllm", fake_vllm(calls))
    assert main(datagen_args(tiny_pair_dirs, prompts_file, out, *args)) == 0
    assert calls[-1] == [0, 1, 2]


@pytest.mark.parametrize(
    "extra, message",
    [
        (["engine=fast"], "engine='fast'"),
        (["labels=eagle_rounds", "eagle_rounds.head=h.safetensors"], "run it on engine=specheads"),
        (["labels=judge", "judge.tuples=t.jsonl"], "generates none"),
        (["vllm.tensor_parallel=0"], "vllm.tensor_parallel=0"),
        (["vllm.python=/nowhere/python"], "does not exist"),
    ],
)
def test_engine_vllm_settings_are_one_line_errors(tiny_pair_dirs, prompts_file, tmp_path, capsys, extra, message):
    engine = [] if extra[0].startswith("engine=") else ["engine=vllm", f"vllm.python={os.sys.executable}"]
    assert main(datagen_args(tiny_pair_dirs, prompts_file, tmp_path / "x", *engine, *extra)) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


def test_engine_vllm_without_vllm_is_a_one_line_error(tiny_pair_dirs, prompts_file, tmp_path, capsys):
    if __import__("importlib").util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed here")
    assert main(datagen_args(tiny_pair_dirs, prompts_file, tmp_path / "x", "engine=vllm")) == 2
    assert "vllm.python=" in capsys.readouterr().err


def test_each_process_gets_its_own_gpus():
    from specheads.vllm.child import device_slice

    gpus = [str(i) for i in range(8)]
    assert device_slice(0, 2, gpus) == ["0", "1"]
    assert device_slice(3, 2, gpus) == ["6", "7"]
    with pytest.raises(UserError, match="start fewer processes"):
        device_slice(2, 4, gpus)


def test_sampled_seeds_depend_on_the_prompt_not_the_chunking():
    a = vllm_responses.prompt_seed(0, 5, "response")
    assert a == vllm_responses.prompt_seed(0, 5, "response") != vllm_responses.prompt_seed(0, 6, "response")
    assert a != vllm_responses.prompt_seed(1, 5, "response") and 0 <= a < 2**62


def test_seeded_sampling_on_a_cpu_keeps_every_prefill_whole():
    """vLLM rewinds a seeded request's generator after a partial prefill by its offset, which a CPU generator lacks:
    sampled jobs on a CPU run without chunked prefill (a step's budget holds the longest prompt); others keep it."""
    from specheads.vllm.jobs import whole_prefills

    sampled = [{"requests": [{"sampling": {"do_sample": False}}, {"sampling": {"do_sample": True}}]}]
    greedy = [{"requests": [{"sampling": {"do_sample": False}}]}, {"requests": []}]
    assert whole_prefills(sampled, False, 4096) == {"enable_chunked_prefill": False, "max_num_batched_tokens": 4096}
    assert whole_prefills(sampled, False, 396)["max_num_batched_tokens"] == 2048
    assert whole_prefills(sampled, True, 4096) == {} and whole_prefills(greedy, False, 4096) == {}


@pytest.mark.skipif(not VLLM_PYTHON, reason="SPECHEADS_VLLM_PYTHON (vLLM's python) is not set")
def test_vllm_gives_the_transformers_engines_greedy_responses_and_labels(tmp_path):
    from in_vllm.pair import save_pair

    target, draft = save_pair(tmp_path)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(
        "".join(
            json.dumps({"prompt": t}) + "\n"
            for t in ["the cat sat on", "one two three", "why is the sun", "a big red dog ran", "the moon"]
        )
    )
    common = [
        f"target.path={target}",
        "target.gguf_file=null",
        f"draft.path={draft}",
        "target.device=cpu",
        "draft.device=cpu",
        f"prompts={prompts}",
        "num_prompts=null",
        "max_new_tokens=16",
        "batch_size=2",
        "chunk_size=2",
        "chat_template=false",
        "sampling.do_sample=false",
    ]
    assert main([*common, f"output_dir={tmp_path / 'ours'}"]) == 0
    assert main([*common, f"output_dir={tmp_path / 'vllm'}", "engine=vllm", f"vllm.python={VLLM_PYTHON}"]) == 0
    a, b = chunk_rows(tmp_path / "ours"), chunk_rows(tmp_path / "vllm")
    assert [r["input_ids"] for r in a] == [r["input_ids"] for r in b]  # the same responses, EOS kept
    assert a == b  # and the same labels
    assert not (tmp_path / "vllm" / "vllm").exists()
