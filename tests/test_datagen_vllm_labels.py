"""``heads-datagen engine=vllm`` with no Transformers target pass: sampled acceptance labels from the target's
log-probabilities that vLLM returns while it generates (the top ``sampling.top_k``, or the whole vocabulary),
swap mining's continuations as requests to one vLLM process, and vLLM's parallelism settings passed through.
Without vLLM, fakes run the child's own file-writing code on the Transformers target's numbers; with vLLM
(``SPECHEADS_VLLM_PYTHON``), the real child's labels are checked against the Transformers target's pass over the
same responses (greedy: equal; sampled: within 1e-4), under tensor parallelism too."""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import DATAGEN_PROMPTS, chunk_rows, datagen_args, pair_args

from specheads.datagen import acceptance_labels, vllm_mining, vllm_responses
from specheads.datagen.cli import main
from specheads.datagen.judge_labels import JudgeLabeller
from specheads.datagen.vllm_logprobs import MISSING, dense
from specheads.errors import UserError
from specheads.vllm.child import child_environment, cpu_binding
from specheads.vllm.jobs import logprob_tensors, logprobs_name, side_name, write_atomic, write_tensors
from specheads.vllm_config import DatagenVllm

VLLM_PYTHON = os.environ.get("SPECHEADS_VLLM_PYTHON")
HERE = ["engine=vllm", f"vllm.python={os.sys.executable}"]
SCORE = acceptance_labels.response_logits  # the Transformers teacher-forced pass (the tests count the labeller's)


def fake_child(headers: list, fail_after: int | None = None):
    """A stand-in for the vLLM child: the Transformers target generates and scores its responses (vLLM's raw
    log-probabilities), and the child's own code writes the side files. ``headers`` gets each run's header and
    chunks; ``fail_after``: the run dies after that many chunks."""
    from transformers import AutoModelForCausalLM

    from specheads.errors import UserError
    from specheads.shim.batching import batch_generate as batched
    from specheads.shim.core.sampling import SamplingConfig

    def generate(cfg, header, lines, work, local_rank):
        headers.append((header, [line["chunk"] for line in lines]))
        model = AutoModelForCausalLM.from_pretrained(cfg.target.path).eval()
        vocab, eos = model.config.vocab_size, header["eos"]
        for n, line in enumerate(lines):
            if n == fail_after:
                raise UserError("vLLM died")
            responses, tensors = {}, {}
            for r in line["requests"]:
                s = SamplingConfig(**r["sampling"])
                g = torch.Generator().manual_seed(r["seed"] % 2**62) if s.do_sample else None
                (out,) = batched.generate(model, [r["prompt"]], r["max_new_tokens"], s, g, eos, eos[0])
                responses[r["key"]] = out = list(out)
                if r["logprobs"] is not None:
                    logits = SCORE(model, [r["prompt"]], [out], eos[0])[0]
                    lp = logits.float().log_softmax(-1)
                    k = vocab if r["logprobs"] < 0 else r["logprobs"]
                    top = lp.topk(k, dim=-1)
                    steps = [
                        {int(i): SimpleNamespace(logprob=float(v)) for i, v in zip(ids, vals)}
                        for ids, vals in zip(top.indices, top.values)
                    ]
                    tensors |= logprob_tensors(
                        r["key"], SimpleNamespace(token_ids=out, logprobs=steps), r["logprobs"], vocab
                    )
            side = {"chunk": line["chunk"], "digest": line["digest"], "responses": responses}
            side["finite"] = {k: True for k in responses}
            if tensors:
                write_tensors(str(work / logprobs_name(line["chunk"])), tensors, line["digest"], vocab)
                side["logprobs"] = logprobs_name(line["chunk"])
            write_atomic(str(work / side_name(line["chunk"])), side)
        write_atomic(str(work / "run.json"), {"startup_seconds": 0.0, "seconds": 0.0, "tokens": 0, "requests": 0})
        return {}

    return generate


def target_passes(monkeypatch, target_dir) -> list:
    """Counts the Transformers target's teacher-forced passes in acceptance labelling."""
    calls, real = [], SCORE

    def counted(model, *args, **kwargs):
        if Path(model.config._name_or_path).resolve() == Path(target_dir).resolve():
            calls.append(1)
        return real(model, *args, **kwargs)

    monkeypatch.setattr(acceptance_labels, "response_logits", counted)
    return calls


def reference_gap(rows, pair_dirs, sampling) -> float:
    """The largest difference between the rows' sampled labels and those of the Transformers target's
    teacher-forced pass over the same responses, at the same draft tokens."""
    from transformers import AutoModelForCausalLM

    from specheads.shim.core.sampling import SamplingConfig, probs_from_logits

    s = SamplingConfig(**sampling)
    target, draft = (AutoModelForCausalLM.from_pretrained(d).eval() for d in pair_dirs)
    gap = 0.0
    for r in rows:
        x, y = r["input_ids"][: r["response_start"]], r["input_ids"][r["response_start"] :]
        p, q = (probs_from_logits(SCORE(m, [x], [y], 2)[0], s) for m in (target, draft))
        t = torch.tensor(r["draft_token"])[:, None]
        py, qy = p.gather(-1, t).squeeze(-1), q.gather(-1, t).squeeze(-1)
        label = torch.where(qy > 0, (py / qy.clamp_min(1e-30)).clamp(max=1.0), torch.ones_like(py))
        gap = max(gap, float((label - torch.tensor(r["label"])).abs().max()))
        gap = max(gap, float((torch.minimum(p, q).sum(-1) - torch.tensor(r["expected_label"])).abs().max()))
    return gap


@pytest.mark.parametrize("top_k, asked", [(4, 4), (0, -1)])
def test_sampled_acceptance_takes_p_from_vllm_with_no_target_pass(
    tiny_pair_dirs, prompts_file, tmp_path, monkeypatch, top_k, asked
):
    headers: list = []
    monkeypatch.setattr(vllm_responses, "run_vllm", fake_child(headers))
    passes = target_passes(monkeypatch, tiny_pair_dirs[0])
    out = tmp_path / "dg"
    args = [*HERE, f"sampling.top_k={top_k}", "sampling.temperature=0.7"]
    assert main(datagen_args(tiny_pair_dirs, prompts_file, out, *args)) == 0
    assert passes == []  # p came from the side files alone
    header = headers[0][0]
    assert header["pipeline_parallel"] == 1 and header["max_logprobs"] == (-1 if asked < 0 else 20)
    assert not (out / "vllm").exists()
    rows = chunk_rows(out)
    assert len(rows) == len(DATAGEN_PROMPTS)
    sampling = json.loads((out / "manifest.json").read_text())["sampling"]
    assert reference_gap(rows, tiny_pair_dirs, sampling) < 1e-4
    # vllm.logprobs=false: the same responses (same seeds), p from the Transformers target's pass instead
    again = tmp_path / "hf-p"
    passes.clear()
    assert main(datagen_args(tiny_pair_dirs, prompts_file, again, *args, "vllm.logprobs=false")) == 0
    assert len(passes) == 3  # one per chunk
    other = chunk_rows(again)
    assert [r["draft_token"] for r in rows] == [r["draft_token"] for r in other]
    for a, b in zip(rows, other):
        for key in ("label", "expected_label"):
            torch.testing.assert_close(torch.tensor(a[key]), torch.tensor(b[key]), atol=1e-5, rtol=0)


def test_a_chunk_whose_logprobs_file_is_lost_is_generated_again(tiny_pair_dirs, prompts_file, tmp_path, monkeypatch):
    headers: list = []
    monkeypatch.setattr(vllm_responses, "run_vllm", fake_child(headers, fail_after=2))
    out, args = tmp_path / "dg", [*HERE, "sampling.top_k=4"]
    assert main(datagen_args(tiny_pair_dirs, prompts_file, out, *args)) == 2  # died after two chunks
    (out / "vllm" / logprobs_name(0)).unlink()
    monkeypatch.setattr(vllm_responses, "run_vllm", fake_child(headers))
    assert main(datagen_args(tiny_pair_dirs, prompts_file, out, *args)) == 0
    assert [chunks for _, chunks in headers] == [[0, 1, 2], [0, 2]]
    once = tmp_path / "once"
    assert main(datagen_args(tiny_pair_dirs, prompts_file, once, *args)) == 0
    assert chunk_rows(once) == chunk_rows(out)


def test_dense_fills_what_vllm_did_not_give():
    ids = torch.tensor([[3, 0, -1], [1, 2, 0]], dtype=torch.int32)  # -1: padding (the chosen token was in the top k)
    logp = torch.tensor([[-0.1, -2.5, float("-inf")], [-0.3, -1.5, -4.0]])
    out = dense(ids, logp, 5)
    assert out.shape == (2, 5)
    m = float(torch.tensor(MISSING))  # in fp32
    assert out[0].tolist() == pytest.approx([-2.5, m, m, -0.1, m])  # the padding went nowhere, token 0 kept
    assert out[1].tolist() == pytest.approx([-4.0, -0.3, -1.5, m, m])
    full = torch.randn(2, 5).log_softmax(-1)
    assert torch.equal(dense(None, full, 5), full)


class FakeServer:
    """:class:`vllm_mining.TargetServer` on the Transformers target: greedy continuations, the same stats."""

    made: list = []

    def __init__(self, python, header, env):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(header["target"]).eval()
        self.header, self.closed = header, False
        self.stats = {"calls": 0, "prompt_tokens": 0, "cached_tokens": 0, "generated_tokens": 0, "seconds": 0.0}
        FakeServer.made.append(self)

    def generate(self, contexts, max_new, vocab=None):
        from specheads.shim.batching import batch_generate as batched
        from specheads.shim.core.sampling import SamplingConfig

        eos = self.header["eos"]
        self.stats["calls"] += 1
        self.stats["prompt_tokens"] += sum(map(len, contexts))
        return [list(o) for o in batched.generate(self.model, contexts, max_new, SamplingConfig(), None, eos, eos[0])]

    def close(self):
        self.closed = True


def mining_args(pair_dirs, prompts, out, *extra):
    return [
        *pair_args(pair_dirs),
        "labels=judge",
        "judge.mining=swap",
        f"prompts={prompts}",
        f"output_dir={out}",
        "max_new_tokens=12",
        "batch_size=2",
        "chunk_size=2",
        "chat_template=false",
        "judge.checker=exact",
        *extra,
    ]


def test_swap_mining_continues_the_target_in_one_vllm_process(tiny_pair_dirs, prompts_file, tmp_path, monkeypatch):
    ours, theirs = tmp_path / "ours", tmp_path / "vllm"
    assert main(mining_args(tiny_pair_dirs, prompts_file, ours)) == 0
    monkeypatch.setattr(vllm_mining, "TargetServer", FakeServer)
    try:  # the judge features on the Transformers target here (their vLLM path is tested on its own)
        from specheads.datagen import vllm_states

        monkeypatch.setattr(vllm_states, "server", lambda *args, **kwargs: None)
        monkeypatch.setattr(JudgeLabeller, "target_under_vllm", lambda self, cfg: "model")  # so a pass is allowed
    except ImportError:
        pass
    FakeServer.made = []
    extra = [*HERE, "vllm.tensor_parallel=3", "vllm.executor_backend=mp"]
    assert main(mining_args(tiny_pair_dirs, prompts_file, theirs, *extra)) == 0
    (server,) = FakeServer.made  # one process for the whole run, closed at its end
    assert server.closed and not vllm_mining._SERVERS
    assert (server.header["tensor_parallel"], server.header["executor_backend"]) == (3, "mp")
    assert (ours / "mined.jsonl").read_text() == (theirs / "mined.jsonl").read_text()
    assert chunk_rows(ours) == chunk_rows(theirs)
    mined = json.loads((theirs / "manifest.json").read_text())["mining"]
    assert mined["vllm_prompt_tokens"] == server.stats["prompt_tokens"] > 0 and "vllm_cached_tokens" in mined
    assert "vllm_prompt_tokens" not in json.loads((ours / "manifest.json").read_text())["mining"]


@pytest.mark.parametrize(
    "extra, message",
    [
        (["vllm.pipeline_parallel=0"], "vllm.pipeline_parallel=0 must be >= 1"),
        (["vllm.executor_backend=slurm"], "vllm.executor_backend='slurm'"),
    ],
)
def test_parallel_settings_are_one_line_errors(tiny_pair_dirs, prompts_file, tmp_path, capsys, extra, message):
    assert main(datagen_args(tiny_pair_dirs, prompts_file, tmp_path / "x", *HERE, *extra)) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


def test_cpu_workers_get_cores_vllm_can_bind(monkeypatch):
    assert cpu_binding(3, 2) == "0|1|0"  # the shared target at TP=3 on two cores
    assert cpu_binding(2, 8) == "0-3|4-7" and cpu_binding(4, 4) == "0|1|2|3"
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cfg = SimpleNamespace(vllm=DatagenVllm(threads=2, tensor_parallel=3))
    assert child_environment(cfg, os.sys.executable, 0)["VLLM_CPU_OMP_THREADS_BIND"] == "0|1|0"
    cfg.vllm.tensor_parallel = 1
    assert "VLLM_CPU_OMP_THREADS_BIND" not in child_environment(cfg, os.sys.executable, 0)
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0-1|0-1")  # the user's own binding stays
    cfg.vllm.pipeline_parallel = 2
    assert child_environment(cfg, os.sys.executable, 0)["VLLM_CPU_OMP_THREADS_BIND"] == "0-1|0-1"


def test_on_gpus_the_child_keeps_the_callers_environment_and_ray_spans_nodes(monkeypatch):
    """On a GPU node the vLLM child gets neither the CPU build's threads (all cores in every tensor-parallel
    worker) nor its allocator preloads (issue 59 item 10); with ``executor_backend=ray`` (pipeline stages on
    other nodes) one process keeps every GPU of its node for Ray instead of being refused for want of
    tp x pp local GPUs (item 8), and a second local process is a one-line error."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    for name in ("OMP_NUM_THREADS", "LD_PRELOAD", "CUDA_VISIBLE_DEVICES", "VLLM_CPU_KVCACHE_SPACE"):
        monkeypatch.delenv(name, raising=False)
    cfg = SimpleNamespace(vllm=DatagenVllm(tensor_parallel=8, pipeline_parallel=2, executor_backend="ray"))
    env = child_environment(cfg, os.sys.executable, 0)
    assert not {"OMP_NUM_THREADS", "LD_PRELOAD", "VLLM_CPU_KVCACHE_SPACE", "CUDA_VISIBLE_DEVICES"} & env.keys()
    with pytest.raises(UserError, match="executor_backend=ray: one vLLM spans the nodes"):
        child_environment(cfg, os.sys.executable, 1)
    cfg.vllm.executor_backend, cfg.vllm.pipeline_parallel, cfg.vllm.tensor_parallel = None, 1, 4
    assert child_environment(cfg, os.sys.executable, 1)["CUDA_VISIBLE_DEVICES"] == "4,5,6,7"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cpu = child_environment(cfg, os.sys.executable, 0)
    assert cpu["OMP_NUM_THREADS"] == str(os.cpu_count()) and "VLLM_CPU_KVCACHE_SPACE" in cpu


def vllm_pair(tmp_path):
    from in_vllm.pair import save_pair

    target, draft = save_pair(tmp_path)
    prompts = tmp_path / "p.jsonl"
    words = ["the cat sat on", "one two three", "why is the sun", "a big red dog ran", "the moon"]
    prompts.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in words))
    common = [
        *pair_args((target, draft)),
        f"prompts={prompts}",
        "num_prompts=null",
        "max_new_tokens=16",
        "batch_size=2",
        "chunk_size=2",
        "chat_template=false",
    ]
    return (target, draft), prompts, common


@pytest.mark.skipif(not VLLM_PYTHON, reason="SPECHEADS_VLLM_PYTHON (vLLM's python) is not set")
def test_vllm_sampled_labels_match_the_target_pass(tmp_path):
    pair, _, common = vllm_pair(tmp_path)
    for top_k in (5, 0):  # the top 5 log-probabilities; the whole vocabulary
        out = tmp_path / f"top{top_k}"
        args = [*common, "sampling.do_sample=true", f"sampling.top_k={top_k}", f"output_dir={out}"]
        assert main([*args, "engine=vllm", f"vllm.python={VLLM_PYTHON}"]) == 0
        sampling = json.loads((out / "manifest.json").read_text())["sampling"]
        assert reference_gap(chunk_rows(out), pair, sampling) < 1e-4


@pytest.mark.skipif(not VLLM_PYTHON, reason="SPECHEADS_VLLM_PYTHON (vLLM's python) is not set")
def test_vllm_tensor_parallel_gives_the_greedy_labels(tmp_path):
    _, _, common = vllm_pair(tmp_path)
    args = [*common, "sampling.do_sample=false"]
    assert main([*args, f"output_dir={tmp_path / 'ours'}"]) == 0
    tp = ["engine=vllm", f"vllm.python={VLLM_PYTHON}", "vllm.tensor_parallel=2", f"output_dir={tmp_path / 'tp'}"]
    assert main([*args, *tp]) == 0
    assert chunk_rows(tmp_path / "ours") == chunk_rows(tmp_path / "tp")


@pytest.mark.skipif(not VLLM_PYTHON, reason="SPECHEADS_VLLM_PYTHON (vLLM's python) is not set")
def test_vllm_swap_mining_finds_the_transformers_engines_mismatches(tmp_path):
    pair, prompts, _ = vllm_pair(tmp_path)
    assert main(mining_args(pair, prompts, tmp_path / "ours")) == 0
    assert main(mining_args(pair, prompts, tmp_path / "vllm", "engine=vllm", f"vllm.python={VLLM_PYTHON}")) == 0
    assert (tmp_path / "ours" / "mined.jsonl").read_text() == (tmp_path / "vllm" / "mined.jsonl").read_text()
    assert chunk_rows(tmp_path / "ours") == chunk_rows(tmp_path / "vllm")
    mined = json.loads((tmp_path / "vllm" / "manifest.json").read_text())["mining"]
    assert mined["vllm_prompt_tokens"] > 0


def test_the_logprobs_file_name_is_the_childs(tmp_path):
    """The run removes the log-probabilities file the vLLM child wrote beside a chunk's side file."""
    from specheads.datagen.vllm_responses import side_path

    assert side_path(tmp_path, 3).with_suffix(".logprobs.safetensors").name == logprobs_name(3)
