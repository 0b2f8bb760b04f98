"""``heads-datagen engine=vllm``: the target's hidden states from vLLM, so drafter, judge and SPRINTER labels run
no Transformers target pass.

One vLLM child per run (:mod:`specheads.vllm.states_child`, in ``vllm.python``), started when a labeller first
asks for states and kept until the run ends (:class:`StatesServer`): vLLM's ``extract_hidden_states`` method
keeps the residual stream at the chosen layers and :class:`specheads.vllm.states.StatesConnector` writes each
sequence's states to a file in the engine step that computes it; this side reads the files back and removes
them. Each sequence runs as a prompt (a teacher-forced prefill), the pass the Transformers engine runs.

What each family takes:

* ``drafter``: the stream entering ``drafter.layers`` at every position of prompt + response, and the
  target's ``drafter.top_k`` most likely tokens at every response token (vLLM's ``prompt_logprobs``);
* ``judge``: the last layer's output before the final norm at the labelled answer tokens;
* ``sprinter``: the same state at the kept prefixes; the target's final norm and output layer turn it into
  the distribution ``p`` (SPRINTER's TV needs all of it, which ``prompt_logprobs`` does not give).

States come back in vLLM's dtype (fp32 on a CPU by default; ``target.dtype`` as the Transformers engine
resolves it) and equal the Transformers engine's to float rounding.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path

import torch

from specheads.errors import UserError

FAMILIES = ("drafter", "judge", "sprinter")


class StatesServer:
    """The vLLM child of one run (started at the first :meth:`states` call; :meth:`close` ends it).

    Args:
        cfg: the run's ``DatagenConfig`` (target, dtype, ``vllm_*`` settings).
        limit: the longest sequence it will be asked (vLLM's ``max_model_len``).
        local_rank: this process's index on its node (its GPUs: ``vllm.tensor_parallel`` of them).
    """

    def __init__(self, cfg, limit: int, local_rank: int = 0):
        self.cfg, self.limit, self.local_rank = cfg, limit, local_rank
        self.layers: list[int] | None = None
        self.top_k = 0
        self.startup_seconds = 0.0
        self.seconds = 0.0
        self.tokens = 0
        self._proc = None
        self._reply = None
        self._work: Path | None = None

    def states(self, seqs: list[list[int]], layers: list[int], top_k: int = 0):
        """Per sequence, ``(states, top)``: ``states`` ``[len(seq), len(layers), d]`` on the CPU, the layers
        in the order given; ``top`` (``top_k > 0``) ``(ids [len(seq) - 1, k] int32, logp fp32)``, else None."""
        if not seqs:
            return []
        if self._proc is None:
            self._start(sorted(set(layers)), top_k)
        elif not set(layers) <= set(self.layers) or top_k > self.top_k:
            raise UserError(
                f"vLLM states: the child runs layers {self.layers} and top_k {self.top_k}; asked {layers}, {top_k}"
            )
        folder = tempfile.mkdtemp(dir=self._work)
        self._send({"dir": folder, "seqs": [list(map(int, s)) for s in seqs], "top_k": top_k})
        got = self._receive()
        self.seconds += got["seconds"]
        self.tokens += got["tokens"]
        order = [self.layers.index(i) for i in layers]
        return [self._load(folder, i, order, top_k) for i in range(len(seqs))]

    def close(self) -> None:
        """Ends the child (an empty line), then removes the exchange folder."""
        if self._proc is not None:
            try:
                self._proc.stdin.write("\n")
                self._proc.stdin.close()
            except OSError:
                pass
            self._proc.wait()
            self._reply.close()
            self._proc = None
        if self._work is not None:
            shutil.rmtree(self._work, ignore_errors=True)
            self._work = None

    def _start(self, layers: list[int], top_k: int) -> None:
        from specheads.datagen.vllm_job import child_environment, parallel_header, target_header
        from specheads.decode.vllm_engine import vllm_python

        cfg = self.cfg
        python = vllm_python(cfg.vllm.python)
        # beside the output (a batch's states can be gigabytes), one folder per node and process: a killed
        # run's is cleared by the next
        self._work = Path(cfg.output_dir) / f".vllm-states-{socket.gethostname()}-{self.local_rank}"
        shutil.rmtree(self._work, ignore_errors=True)
        self._work.mkdir(parents=True)
        header = {
            **target_header(cfg),
            **parallel_header(cfg),
            "max_model_len": max(int(self.limit), 16),
            "batch_size": cfg.vllm.max_num_seqs,
            "seed": cfg.seed,
            "layers": layers,
            "max_logprobs": max(top_k, 1),
        }
        env = child_environment(cfg, python, self.local_rank)
        if torch.cuda.is_available():  # this process keeps its models on those GPUs: vLLM takes most of what is free
            seen = os.environ.get("CUDA_VISIBLE_DEVICES")
            visible = seen.split(",") if seen else [str(i) for i in range(torch.cuda.device_count())]
            mine = [visible.index(g) for g in env["CUDA_VISIBLE_DEVICES"].split(",")]
            share = min(free / total for free, total in map(torch.cuda.mem_get_info, mine))
            header["gpu_memory_utilization"] = round(0.9 * share, 3)
        path = self._work / "header.json"
        path.write_text(json.dumps(header))
        read, write = os.pipe()
        self._proc = subprocess.Popen(
            [python, "-m", "specheads.vllm.states_child", str(path), str(write)],
            stdin=subprocess.PIPE,
            env=env,
            text=True,
            pass_fds=(write,),
        )
        os.close(write)
        self._reply = os.fdopen(read, encoding="utf-8")
        self.layers, self.top_k = layers, top_k
        self.startup_seconds = self._receive()["startup_seconds"]

    def _send(self, request: dict) -> None:
        try:
            self._proc.stdin.write(json.dumps(request) + "\n")
            self._proc.stdin.flush()
        except OSError:
            self._fail()

    def _receive(self) -> dict:
        line = self._reply.readline()
        if not line:
            self._fail()
        return json.loads(line)

    def _fail(self):
        code = self._proc.wait()
        self._proc = None
        raise UserError(
            f"vLLM (states of the target, {self.cfg.vllm.python or 'this python'}) failed with exit code {code}; "
            "its log is above (finished chunks are kept: the same command resumes)"
        )

    def _load(self, folder: str, i: int, order: list[int], top_k: int):
        from safetensors.torch import load_file

        base = Path(folder) / f"{i}.safetensors"
        states = load_file(str(base))["states"][:, order]
        base.unlink()
        top = None
        if top_k:
            path = Path(folder) / f"{i}.top.safetensors"
            t = load_file(str(path))
            top = (t["ids"][:, :top_k], t["logp"][:, :top_k])
            path.unlink()
        return states, top


def server(cfg, job, local_rank: int = 0) -> StatesServer | None:
    """The ``engine=vllm`` run's states server when the family needs the target's states, else None."""
    if cfg.labels not in FAMILIES:
        return None
    return StatesServer(cfg, job.limit, local_rank)


def drafter_states(job, seqs: list[list[int]], layers: list[int], responses: list[int], top_k: int):
    """Per sequence (prompt + response, the response ``responses[i]`` tokens long): the stream entering
    ``layers`` at every position, ``[T, len(layers) * d]`` fp16, the target's top ``top_k`` at each response
    token (``(ids [n, k] int32, logp [n, k] fp32)``) and whether both are finite."""
    out = []
    for seq, n, (st, (ids, logp)) in zip(seqs, responses, job.states.states(seqs, layers, top_k)):
        ids, logp = ids[len(seq) - n - 1 :], logp[len(seq) - n - 1 :]  # row p: the token at position p + 1
        ok = bool(torch.isfinite(st).all()) and bool(torch.isfinite(logp).all())
        out.append((st.reshape(st.shape[0], -1).to(torch.float16), (ids, logp), ok))
    return out


def final_states(job, seqs: list[list[int]]) -> list[torch.Tensor]:
    """Per sequence, the target's last-layer output before its final norm at every position, ``[T, d]``."""
    n = job.pair.target.model.config.num_hidden_layers
    return [st[:, 0] for st, _ in job.states.states(seqs, [n])]


def target_logits(job, seqs: list[list[int]], positions: list[list[int]]) -> list[torch.Tensor]:
    """Per row, the target's logits ``[len(positions[b]), V]`` after each prefix ``seqs[b][:t]`` (as
    :func:`specheads.runtime.states.logits_at`): vLLM's final states through the target's final norm and output
    layer."""
    from specheads.shim import final_norm, output_device

    model = job.pair.target.model
    norm, head, device = final_norm(model), model.get_output_embeddings(), output_device(model)
    out = []
    with torch.inference_mode():
        for st, pos in zip(final_states(job, seqs), positions):
            rows = st[torch.tensor(pos, dtype=torch.long) - 1].to(device=device, dtype=head.weight.dtype)
            out.append(head(norm(rows)))
    return out


def judge_features(job, rows: list[dict]):
    """:func:`specheads.datagen.judge_labels.target_features` from vLLM's states: features ``[M, d]`` fp16 at
    the labelled answer tokens, their labels, tokens per kept row, the rows left out (non-finite states) and the
    target's verdict on each token (signals ``[M, 4]``, through the target's final norm and output layer)."""
    from specheads.datagen.judge_features import gather_features, verdicts_from
    from specheads.shim import final_norm

    model = job.pair.target.model
    norm = final_norm(model)
    states = final_states(job, [r["input_ids"] for r in rows])

    def post(i: int) -> torch.Tensor:
        return norm(states[i].to(dtype=model.get_output_embeddings().weight.dtype))

    got = gather_features(
        rows, lambda i: states[i] if bool(torch.isfinite(states[i]).all()) else None, verdicts_from(model, post)
    )
    if not got[0].numel():
        return (torch.empty(0, job.pair.target.hidden_size, dtype=torch.float16), *got[1:])
    return got
