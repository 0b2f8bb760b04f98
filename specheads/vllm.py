"""A trained stop head inside vLLM: a proposer for vLLM's ``custom_class`` speculative method.

    from vllm import LLM, SamplingParams
    from specheads.vllm import speculative_config

    spec = speculative_config(draft="path/to/draft", policy="specdecpp", head="runs/x-export/head.safetensors",
                              k_max=6)
    llm = LLM(model="path/to/target", speculative_config=spec, max_num_seqs=16)

vLLM builds ``Proposer(vllm_config)`` in its model runner, and each step calls
``propose(sampled_token_ids, num_tokens_no_spec, token_ids_cpu)`` with every running request's token ids
under its batch row; it verifies the returned candidates with the target (lossless: greedy output equals
the target alone's, sampled output follows it). The proposer drafts with the draft model and stops each
request's drafting by its policy: ``specdecpp`` (an exported SpecDec++ acceptance head on the draft's
states; ``stop="threshold"`` at ``threshold``, or ``stop="cost"`` with a cost table), ``confidence_stop``
(training-free: the draft's probability of its own candidate below ``threshold``, or the cost rule) or
``sd`` (always ``k_max``). The work is :class:`~specheads.export.shim.batching.row_proposer.RowProposer`: one batched
draft forward per step over the rows still drafting, and draft KV caches kept by content, since vLLM
gives the proposer neither request ids nor notice of joins, finishes or preemption.

**How the settings reach it.** vLLM instantiates the class itself, from a dotted path, with its own config
only. :func:`speculative_config` checks the settings, puts them (JSON) in the environment variable
``SPECHEADS_VLLM``, which vLLM's worker inherits, and returns the ``speculative_config`` dict for ``LLM``
(``num_speculative_tokens = k_max``). A mistake (no head for ``specdecpp``, a head trained on another
draft, a draft with another vocabulary, a bad threshold) is a one-line ``UserError`` when ``LLM(...)``
starts (vLLM wraps it into its own one-line ``RuntimeError``).

The draft runs in vLLM's worker process on the fused Llama forward (Llama-family drafts, as
``heads-decode``), on the device vLLM runs on, with one cache row per request vLLM may batch
(``max_num_seqs``: set it to the batch you serve; each draft step computes the leading rows in use). A
pruned draft output layer (``vocab_file``/``vocab_top_n``, as ``draft.vocab_file`` elsewhere) works.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass

from specheads.errors import UserError

ENV = "SPECHEADS_VLLM"
POLICIES = ("specdecpp", "confidence_stop", "sd")
CLASS_PATH = "specheads.vllm.Proposer"


@dataclass
class ProposerSettings:
    """What the proposer drafts with and how it stops (see :func:`speculative_config`)."""

    draft: str
    policy: str = "confidence_stop"
    head: str | None = None
    k_max: int = 6
    k_min: int = 1
    threshold: float | None = None
    stop: str = "threshold"
    costs: str | None = None
    vocab_file: str | None = None
    vocab_top_n: int | None = None
    gate: bool | None = None

    def problems(self) -> list[str]:
        out = []
        if self.policy not in POLICIES:
            out.append(f"policy={self.policy!r}; choose one of {list(POLICIES)}")
        if not self.draft or not os.path.isdir(self.draft):
            out.append(f"draft={self.draft!r} is not a local Hugging Face model directory")
        if self.policy == "specdecpp" and not self.head:
            out.append("policy=specdecpp needs head=<an exported SpecDec++ acceptance head>")
        if self.head and not os.path.exists(self.head):
            out.append(f"head={self.head!r} does not exist")
        if self.head and self.policy != "specdecpp":
            out.append(f"policy={self.policy} takes no head; drop head= or use policy='specdecpp'")
        if self.k_max < 1 or not 1 <= self.k_min <= self.k_max:
            out.append(f"k_min={self.k_min}, k_max={self.k_max}: need 1 <= k_min <= k_max")
        if self.stop not in ("threshold", "cost"):
            out.append(f"stop={self.stop!r}; choose threshold or cost")
        if self.stop == "cost" and not self.costs:
            out.append("stop='cost' needs costs=<a cost-table JSON> (the engine's pass times by size)")
        if self.stop == "cost" and self.policy == "sd":
            out.append("policy=sd drafts k_max every round; stop='cost' is for specdecpp and confidence_stop")
        if self.gate and self.stop != "cost":
            out.append("gate=True skips drafting by the cost table: it needs stop='cost'")
        if self.threshold is not None and not 0 <= self.threshold <= 1:
            out.append(f"threshold={self.threshold} must be in [0, 1]")
        return out


def speculative_config(
    draft: str,
    policy: str = "confidence_stop",
    head: str | None = None,
    k_max: int = 6,
    k_min: int = 1,
    threshold: float | None = None,
    stop: str = "threshold",
    costs: str | None = None,
    vocab_file: str | None = None,
    vocab_top_n: int | None = None,
    gate: bool | None = None,
) -> dict:
    """Checks the proposer's settings, hands them to vLLM's worker (``SPECHEADS_VLLM``) and returns the
    ``speculative_config`` for ``vllm.LLM``.

    Args:
        draft: the draft model's local Hugging Face directory (same tokenizer as the target).
        policy: ``specdecpp``, ``confidence_stop`` or ``sd``.
        head: the exported SpecDec++ acceptance head (``specdecpp``), trained on this draft.
        k_max, k_min: most and fewest candidates per round (``k_max`` is vLLM's ``num_speculative_tokens``).
        threshold: SpecDec++'s ``h`` (default: the head's own) or ``confidence_stop``'s ``tau``.
        stop: ``threshold`` or ``cost`` (the cost-aware rule; needs ``costs``).
        costs: a cost-table JSON (``CostTable.to_dict``: the draft step and the target pass by size and batch),
            measured in vLLM: :func:`specheads.export.vllm_costs.vllm_cost_table` (``heads-decode engine=vllm
            stop=cost`` makes and caches it).
        vocab_file, vocab_top_n: prune the draft's output layer to a ``heads-vocab`` ranking.
        gate: with ``stop="cost"`` (its default there), a round may draft nothing: the draft gate
            (:class:`~specheads.export.shim.costs.cost_rules.DraftGate`) prices the request's recent rounds at the
            batch about to run, so drafting stops where verification no longer pays (a large batch).
    """
    settings = ProposerSettings(
        os.path.abspath(draft) if draft else "",
        policy,
        head,
        int(k_max),
        int(k_min),
        threshold,
        stop,
        costs,
        vocab_file,
        vocab_top_n,
        gate,
    )
    bad = settings.problems()
    if bad:
        raise UserError("; ".join(bad))
    os.environ[ENV] = json.dumps(asdict(settings))
    return {"method": "custom_class", "model": CLASS_PATH, "num_speculative_tokens": settings.k_max}


def _read_settings() -> ProposerSettings:
    raw = os.environ.get(ENV)
    if not raw:
        raise UserError(
            f"{CLASS_PATH} reads its settings from ${ENV}: build speculative_config with "
            "specheads.vllm.speculative_config(draft=..., ...)"
        )
    try:
        settings = ProposerSettings(**json.loads(raw))
    except (TypeError, ValueError) as err:
        raise UserError(f"${ENV} is not a proposer's settings: {err}") from err
    bad = settings.problems()
    if bad:
        raise UserError("; ".join(bad))
    return settings


class Proposer:
    """vLLM's ``custom_class`` proposer (built by vLLM: ``Proposer(vllm_config)``)."""

    def __init__(self, vllm_config):
        from specheads.export.policy_factory import make_policy
        from specheads.export.shim import ModelSpec, Pair, RowProposer, eos_ids, load_model, load_table

        settings = _read_settings()
        k = int(vllm_config.speculative_config.num_speculative_tokens)
        if k != settings.k_max:
            raise UserError(
                f"num_speculative_tokens={k} but the proposer's k_max={settings.k_max}: build "
                "speculative_config with specheads.vllm.speculative_config"
            )
        device = str(getattr(vllm_config.device_config, "device", "cpu") or "cpu")
        draft = load_model(
            ModelSpec(
                path=settings.draft, device=device, vocab_file=settings.vocab_file, vocab_top_n=settings.vocab_top_n
            ),
            "draft",
        )
        target_vocab = int(vllm_config.model_config.get_vocab_size())
        rows = draft.model.config.vocab_size
        if rows != target_vocab:
            raise UserError(
                f"the draft's vocabulary has {rows} tokens and the target's {target_vocab}: the "
                "proposer drafts on the target's vocabulary (same tokenizer)"
            )
        pair = Pair(target=draft, draft=draft)  # the head reads the draft's states: checked against the draft
        costs = load_table(settings.costs) if settings.stop == "cost" else None
        if settings.policy == "sd":
            own = {"k": k}
        else:
            own = {
                "k_min": settings.k_min,
                "k_max": k,
                "stop": settings.stop,
                "threshold": settings.threshold,
                "gate": settings.stop == "cost" if settings.gate is None else settings.gate,
            }
            if settings.policy == "specdecpp":
                own["head"] = settings.head
        policy = make_policy(settings.policy, pair, costs=costs, **own)
        self.settings, self.max_len = settings, int(vllm_config.model_config.max_model_len)
        self.core = RowProposer(
            draft.model, policy, int(vllm_config.scheduler_config.max_num_seqs), eos_ids(draft.model, draft.tokenizer)
        )

    def load_model(self, *args, **kwargs) -> None:
        """The draft was loaded when the proposer was built (nothing of the target's is needed)."""

    def propose(self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings=None, **_) -> list[list[int]]:
        """Candidates per batch row; rows without new tokens (a prefill in progress) or at the length limit
        get none."""
        seqs, limits = {}, {}
        for i, sampled in enumerate(sampled_token_ids):
            n = int(num_tokens_no_spec[i])
            if sampled and n < self.max_len:
                seqs[i], limits[i] = token_ids_cpu[i, :n], self.max_len - n - 1
        out = self.core.propose(seqs, limits)
        return [out.get(i, []) for i in range(len(sampled_token_ids))]

    @property
    def stats(self) -> dict:
        """Calls, rows, candidates, draft forwards, prefills, matched cache tokens and seconds in ``propose``."""
        return dict(self.core.stats)


# ---- the child process of ``heads-decode engine=vllm`` (export/vllm_engine.py): ``python -m specheads.vllm JOB`` --


def _proposer_stats(worker) -> dict:
    return dict(worker.model_runner.drafter.stats)


def run_job(path: str) -> int:
    """Decodes a job file's prompts (token ids) with vLLM and writes the result file it names."""
    import time

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    job = json.loads(open(path, encoding="utf-8").read())
    spec = job["speculative"]
    proposer = bool(spec and "specheads" in spec)
    if proposer:
        spec = speculative_config(**spec["specheads"])
    longest = max(len(p) for p in job["prompts"]) + job["max_new_tokens"]
    t = time.perf_counter()
    llm = LLM(
        model=job["target"],
        dtype="float32",
        max_model_len=max(longest, 256),
        max_num_seqs=job["batch_size"],
        seed=job["seed"],
        enforce_eager=True,
        disable_log_stats=False,
        speculative_config=spec or None,
    )
    startup = time.perf_counter() - t
    sampling = job["sampling"]
    params = [
        SamplingParams(max_tokens=job["max_new_tokens"], seed=job["seed"] + i, **sampling)
        for i in range(len(job["prompts"]))
    ]

    def counters() -> dict:
        return {
            m.name: m.value
            for m in llm.get_metrics()
            if m.name.startswith("vllm:spec_decode") and isinstance(getattr(m, "value", None), (int, float))
        }

    before = counters()
    t = time.perf_counter()
    res = llm.generate([TokensPrompt(prompt_token_ids=p) for p in job["prompts"]], params, use_tqdm=False)
    seconds = time.perf_counter() - t
    out = {
        "outputs": [list(r.outputs[0].token_ids) for r in res],
        "seconds": seconds,
        "startup_seconds": startup,
        "counters": {k: v - before.get(k, 0) for k, v in counters().items()},
    }
    if proposer:
        out["proposer"] = llm.collective_rpc(_proposer_stats)[0]
    with open(job["out"], "w", encoding="utf-8") as fh:
        json.dump(out, fh)
    return 0


if __name__ == "__main__":
    import sys

    raise SystemExit(run_job(sys.argv[1]))
