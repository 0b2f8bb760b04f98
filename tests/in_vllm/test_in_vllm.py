"""The proposer inside vLLM itself (its CPU build, in its own virtualenv; skipped where vLLM is not installed).

Run as ``.ci/run`` does: ``python -m pytest tests/in_vllm --confcutdir=tests/in_vllm`` with vLLM's venv, which has
this package installed with ``--no-deps``. A tiny Llama target and a perturbed copy as the draft (saved with a
word-level tokenizer; vLLM gets token ids), greedy: vLLM with the proposer gives the target alone's outputs
token for token, with six requests through three batch rows (requests finish at different lengths and
waiting ones join), and vLLM's spec-decode counters show drafts verified and accepted.
"""

from __future__ import annotations

import gc
import os

import pytest

vllm = pytest.importorskip("vllm")

from pair import save_pair  # noqa: E402

from specheads.vllm.proposer import speculative_config  # noqa: E402

PROMPTS = [[1, 5, 9, 13], [1, 7], [1, 20, 21, 22, 3, 4, 5, 6, 7, 8], [1, 5, 9, 13], [1], [1, 14, 3]]
MAX_NEW = [24, 9, 30, 17, 12, 20]


def _run(target, spec=None):
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(
        model=str(target),
        skip_tokenizer_init=True,
        dtype="float32",
        max_model_len=256,
        max_num_seqs=3,
        enforce_eager=True,
        seed=0,
        disable_log_stats=False,
        speculative_config=spec,
    )
    params = [SamplingParams(temperature=0.0, max_tokens=n, detokenize=False) for n in MAX_NEW]
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in PROMPTS], params, use_tqdm=False)
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    counters = {m.name: getattr(m, "value", None) for m in llm.get_metrics() if m.name.startswith("vllm:spec_decode")}
    if spec is not None:  # the proposer's own counts, from the worker that holds it
        counters["proposer"] = llm.collective_rpc(_proposer_stats)[0]
    del llm
    gc.collect()
    return tokens, counters


def _proposer_stats(worker):
    return worker.model_runner.drafter.stats


def test_greedy_through_the_proposer_equals_vllms_target_alone(tmp_path):
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    target, draft = save_pair(tmp_path)
    alone, _ = _run(target)
    spec = speculative_config(str(draft), policy="confidence_stop", threshold=0.3, k_max=4)
    got, counters = _run(target, spec)
    assert got == alone
    assert sum(len(t) for t in alone) > 60
    drafted = counters.get("vllm:spec_decode_num_draft_tokens") or 0
    accepted = counters.get("vllm:spec_decode_num_accepted_tokens") or 0
    assert drafted > 0 and accepted > 0, counters
    mine = counters["proposer"]
    assert mine["candidates"] >= drafted and mine["draft_forwards"] > 0  # vLLM drops a finished request's
    assert mine["matched_tokens"] > sum(map(len, PROMPTS))  # the caches were kept from step to step
    assert mine["prefills"] <= len(PROMPTS)  # one per request at most: none lost to reordering


def test_the_settings_travel_in_vllms_own_speculative_config(tmp_path):
    """vLLM's SpeculativeConfig (validated, pickled to its workers) keeps the settings the proposer reads back."""
    import pickle

    from vllm.config import SpeculativeConfig

    from specheads.vllm.proposer import read_settings

    _, draft = save_pair(tmp_path)
    spec = speculative_config(str(draft), policy="confidence_stop", threshold=0.3, k_max=4, cache_mb=64.0)
    config = pickle.loads(pickle.dumps(SpeculativeConfig(**spec)))
    assert config.method == "custom_class" and config.num_speculative_tokens == 4
    got = read_settings(config)
    assert (got.draft, got.threshold, got.k_max, got.cache_mb) == (os.path.abspath(draft), 0.3, 4, 64.0)
