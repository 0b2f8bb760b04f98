"""The vLLM child that computes a target's hidden states for this package's processes, and what every vLLM child
is told of its devices: :class:`StatesServer` (``heads-datagen engine=vllm``'s drafter, judge and SPRINTER states;
``heads-train head=eagle eagle.states=online eagle.source=vllm``'s states while the head trains), each process's GPUs
or cores and vLLM's parallelism settings.

The child is :mod:`specheads.vllm.states_child` in ``vllm.python``: vLLM's ``extract_hidden_states`` method keeps the
residual stream at the chosen layers and :class:`specheads.vllm.states.StatesConnector` writes each sequence's states
to a file in the engine step that computes it; this side reads the files back and removes them. Each sequence runs as
a prompt (a teacher-forced prefill). ``cfg`` is the caller's config: its ``target``, ``vllm`` section, ``seed`` and
``output_dir`` (where the exchange folder goes).
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


def device_slice(local_rank: int, tp: int, visible: list[str]) -> list[str]:
    """The GPUs of local process ``local_rank`` (one data-parallel vLLM on ``tp`` of them)."""
    lo = local_rank * tp
    if lo + tp > len(visible):
        raise UserError(
            f"engine=vllm: local process {local_rank} needs GPUs {lo}..{lo + tp - 1} "
            f"(vllm.tensor_parallel={tp}) but {len(visible)} are visible; start fewer processes"
        )
    return visible[lo : lo + tp]


def parallel_header(cfg) -> dict:
    """The vLLM child's parallelism: ``tensor_parallel``, ``pipeline_parallel`` and ``executor_backend`` (None:
    vLLM's choice, ``mp`` on one node; ``ray`` spans nodes)."""
    return {
        "tensor_parallel": cfg.vllm.tensor_parallel,
        "pipeline_parallel": cfg.vllm.pipeline_parallel,
        "executor_backend": cfg.vllm.executor_backend,
    }


def cpu_binding(workers: int, cores: int) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` for ``workers`` CPU workers (tensor x pipeline parallel) on ``cores`` cores:
    consecutive equal slices, or one core each, shared round robin, when there are fewer cores than workers
    (vLLM's own default binds one NUMA node per worker and refuses more workers than nodes)."""
    if cores < workers:
        return "|".join(str(i % cores) for i in range(workers))
    per = cores // workers
    return "|".join(f"{i * per}-{i * per + per - 1}" if per > 1 else str(i) for i in range(workers))


def target_header(cfg) -> dict:
    """The target as vLLM reads it (``target``: a GGUF file converted once into a Hugging Face directory) and
    its ``dtype`` (``target.dtype``; ``auto``: bf16 on a GPU that has it, fp32 on a CPU)."""
    from specheads.decode.vllm_engine import target_dir
    from specheads.shim import resolve_device, resolve_dtype

    target = target_dir(cfg.target) if cfg.target.gguf_file or os.path.exists(cfg.target.path) else cfg.target.path
    dtype = str(resolve_dtype(cfg.target.dtype, resolve_device(cfg.target.device))).split(".")[-1]
    return {"target": str(target), "dtype": dtype}


def child_environment(cfg, python: str, local_rank: int) -> dict:
    """vLLM's environment (:func:`~specheads.decode.vllm_engine.environment`) with this process's GPUs
    (``tensor x pipeline`` of them; with ``executor_backend=ray``, which spans nodes, every GPU of this node,
    for one process) or, on a CPU with several workers, their cores (``VLLM_CPU_OMP_THREADS_BIND``, unless
    set)."""
    import torch

    from specheads.decode.vllm_engine import environment

    gpu = torch.cuda.is_available()
    env = environment(python, cfg.vllm.threads, gpu)
    workers = cfg.vllm.tensor_parallel * cfg.vllm.pipeline_parallel
    if gpu and cfg.vllm.executor_backend == "ray":  # one vLLM over the Ray cluster: Ray places its workers
        if local_rank > 0:
            raise UserError(
                "engine=vllm with vllm.executor_backend=ray: one vLLM spans the nodes' GPUs; run heads-datagen "
                "as one process (without accelerate launch)"
            )
    elif gpu:
        seen = env.get("CUDA_VISIBLE_DEVICES")
        visible = seen.split(",") if seen else [str(i) for i in range(torch.cuda.device_count())]
        env["CUDA_VISIBLE_DEVICES"] = ",".join(device_slice(local_rank, workers, visible))
    elif workers > 1 and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
        env["VLLM_CPU_OMP_THREADS_BIND"] = cpu_binding(workers, cfg.vllm.threads or os.cpu_count() or 1)
    return env


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
