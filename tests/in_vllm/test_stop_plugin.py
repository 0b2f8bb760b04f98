"""The stop plugin (``specheads.vllm.stop_plugin``) inside vLLM's CPU build, on a tiny Llama target and an untrained
EAGLE-3 head written as ``heads-export format=speculators`` writes it.

Greedy: with each rule (``c-cost`` with the draft gate, ``c-online-cost`` and ``h-cost`` on an untrained lag-0 stop
head, without it) vLLM gives the target alone's tokens, every request's draft lengths spread over several values, and
every round's length equals what the toolkit's own rule decides on the EAGLE head's drafts recomputed from the
Transformers target (``specheads.vllm.stop_check``), fed vLLM's verdicts and batch sizes. Bad settings stop
``LLM(...)`` with one line; without the plugin's settings vLLM's ``eagle3`` drafts ``K`` every round.
"""

from __future__ import annotations

import gc
import json
import os

import pytest

vllm = pytest.importorskip("vllm")

import torch  # noqa: E402
from pair import save_pair  # noqa: E402

from specheads.vllm import stop_plugin as sp  # noqa: E402
from specheads.vllm import stop_tools  # noqa: E402
from specheads.vllm.stop_config import SECTION, speculative_config  # noqa: E402

PROMPTS = [[1, 5, 9, 13], [1, 7], [1, 20, 21, 22, 3, 4, 5, 6, 7, 8], [1, 5, 9, 13, 4], [1], [1, 14, 3]]
MAX_NEW = [24, 9, 30, 17, 12, 20]
K = 4


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """The tiny target (3 layers), an untrained EAGLE-3 head on it, a lag-0 stop head on that head, a cost table."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from transformers import AutoConfig

    from specheads.export import read_metadata, save_head, speculators
    from specheads.export.package import load_head
    from specheads.heads import AcceptanceHead, EagleConfig, EagleHead

    root = tmp_path_factory.mktemp("stop")
    target, _ = save_pair(root, layers=3)
    c = AutoConfig.from_pretrained(target)
    torch.manual_seed(0)
    eagle = EagleHead(EagleConfig.for_target(c, [0, 1, 2], c.vocab_size, num_layers=1))
    meta = {
        "head_config": eagle.config(),
        "hidden_size": c.hidden_size,
        "feature": {"model": "target", "state": "aux", "layers": eagle.layer_ids},
        "target": {"name": "tiny", "fingerprint": ""},
        "sampling": {"temperature": 0.0},
    }
    save_head(root / "eagle.safetensors", eagle, "eagle", meta)
    loaded = load_head(root / "eagle.safetensors")
    eagle_dir = speculators.write(root / "eagle3", loaded.module, loaded.metadata, verifier=str(target))
    stop = AcceptanceHead(c.hidden_size, depth=1, confidence=True, signals=("entropy", "margin", "step"), skip=True)
    with torch.no_grad():
        for p in stop.parameters():
            p.normal_(0, 0.2)
    sha = read_metadata(root / "eagle.safetensors")["tensors_sha256"]
    save_head(
        root / "stop.safetensors",
        stop,
        "acceptance",
        {
            "head_config": {"hidden_size": c.hidden_size, "depth": 1, "confidence": True, "skip": True}
            | {"signals": ["entropy", "margin", "step"]},
            "hidden_size": c.hidden_size,
            "feature": {"model": "eagle", "eagle": {"file": "eagle.safetensors", "tensors_sha256": sha}}
            | {"state": "post", "layer": -1, "position": "previous"},
            "target": {"name": "tiny", "fingerprint": ""},
            "sampling": {"do_sample": False},
            "label": "soft",
        },
    )
    costs = root / "costs.json"  # drafting cheap, verification growing: lengths follow the estimates
    costs.write_text(json.dumps({"t_draft_ms": 0.5, "t_target_ms": [10.0, 10.2, 10.4, 10.6, 10.8, 11.0]}))
    return {"target": target, "eagle": eagle_dir, "stop": root / "stop.safetensors", "costs": costs}


def _llm(target, spec, **kw):
    from vllm import LLM

    return LLM(
        model=str(target),
        skip_tokenizer_init=True,
        dtype="float32",
        max_model_len=256,
        max_num_seqs=3,
        enforce_eager=True,
        seed=0,
        disable_log_stats=False,
        speculative_config=spec,
        **kw,
    )


def _generate(llm):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = [SamplingParams(temperature=0.0, max_tokens=n, detokenize=False) for n in MAX_NEW]
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in PROMPTS], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs], [o.request_id for o in outs]


def _drop(llm):
    del llm
    gc.collect()


@pytest.fixture(scope="module")
def alone(setup):
    llm = _llm(setup["target"], None)
    got, _ = _generate(llm)
    _drop(llm)
    return got


RULES = {  # the rules at every batch (rule_max_batch=None); "scheduled": the default, the table's K above batch 1
    "c-cost": {"rule": "c-cost", "gate": True, "rule_max_batch": None},
    "c-online-cost": {"rule": "c-online-cost", "gate": False, "rule_max_batch": None},
    "h-cost": {"rule": "h-cost", "gate": False, "rule_max_batch": None},
    "scheduled": {"rule": "c-online-cost", "gate": False},
}


@pytest.fixture(scope="module")
def runs(setup):
    """Every rule in one vLLM engine (settings changed between runs over collective_rpc), with its trace."""
    base = {"costs": str(setup["costs"]), "trace": True}
    spec = speculative_config(str(setup["eagle"]), K, **RULES["c-cost"], **base)
    llm = _llm(setup["target"], spec)
    out = {}
    for name, rule in RULES.items():
        settings = {**base, **rule, "head": str(setup["stop"]) if name == "h-cost" else None}
        assert llm.collective_rpc(sp.configure, args=(settings,)) == [True]
        llm.collective_rpc(sp.take_trace)
        tokens, ids = _generate(llm)
        trace = llm.collective_rpc(sp.take_trace)[0]["trace"]
        out[name] = {"tokens": tokens, "ids": ids, "trace": trace}
    _drop(llm)
    return out


@pytest.mark.parametrize("rule", list(RULES))
def test_greedy_output_equals_the_target_alone_with_every_rule(runs, alone, rule):
    assert runs[rule]["tokens"] == alone
    lengths = [len(e["draft"]) for e in runs[rule]["trace"] if "draft" in e]
    assert max(lengths) <= K
    if RULES[rule]["rule"] != "c-online-cost":  # (the online estimate learns the untrained head is rarely right)
        assert len(set(lengths)) >= 2, sorted(set(lengths))  # the rule cut at several lengths
    scheduled = [e for e in runs[rule]["trace"] if e.get("scheduled")]
    assert bool(scheduled) == (rule == "scheduled")  # batches above rule_max_batch draft the table's K
    if scheduled:  # one length per step, the same for every request of it
        assert all(
            len({len(e["draft"]) for e in scheduled if e["step"] == s}) == 1 for s in {e["step"] for e in scheduled}
        )


@pytest.mark.parametrize("rule", list(RULES))
def test_every_draft_length_is_the_toolkit_rules_on_the_same_states(setup, runs, rule):
    from transformers import AutoModelForCausalLM

    from specheads.export import speculators
    from specheads.vllm.stop_check import reference_rounds, replay, rounds_of
    from specheads.vllm.stop_config import StopSettings, rule_policy

    eagle = speculators.read(setup["eagle"]).module.float().eval()
    meta = json.loads((setup["eagle"] / "config.json").read_text())["specheads"]
    target = AutoModelForCausalLM.from_pretrained(setup["target"], dtype=torch.float32).eval()
    run = runs[rule]
    by_req = rounds_of(run["trace"])
    gate = RULES[rule]["gate"]
    head = str(setup["stop"]) if rule == "h-cost" else None
    rule = RULES[rule]["rule"]
    checked = verdicts = 0
    for prompt, out, rid in zip(PROMPTS, run["tokens"], run["ids"]):
        rounds = next(v for key, v in by_req.items() if key == rid or key.startswith(f"{rid}-"))
        verdicts += sum(r.get("verified", 0) > 0 for r in rounds)
        ref = reference_rounds(eagle, target, prompt + out, K)
        policy = rule_policy(StopSettings(rule=rule, head=head, costs=str(setup["costs"]), gate=gate), K, meta)
        got = replay(policy, ref, len(prompt), rounds, K)
        assert got["match"], (rid, got)
        assert got["drafts_differ"] == 0  # and vLLM drew the reference's candidates
        checked += len(got["lengths"])
    assert checked > 40 and verdicts > 20  # vLLM's verdicts reached the rule


def test_bad_settings_stop_the_engine_at_start_with_one_line(setup):
    from specheads.errors import UserError

    with pytest.raises(UserError, match="rule=h-cost needs head="):
        speculative_config(str(setup["eagle"]), K, rule="h-cost", costs=str(setup["costs"]))
    with pytest.raises(UserError, match="no setting treshold"):
        speculative_config(str(setup["eagle"]), K, treshold=0.5)
    spec = speculative_config(str(setup["eagle"]), K, costs=str(setup["costs"]))
    spec["draft_load_config"]["model_loader_extra_config"][SECTION]["costs"] = str(setup["costs"]) + ".gone"
    with pytest.raises(ValueError) as err:  # vLLM's config is built, before any model loads
        _llm(setup["target"], spec)
    assert "is not a file" in str(err.value) and "\n" not in str(err.value)
    spec = speculative_config(str(setup["eagle"]), K, costs=str(setup["costs"]))
    with pytest.raises(ValueError, match="async scheduling off.*gpu_model_runner.py:1857") as err:
        _llm(setup["target"], spec, async_scheduling=True)
    assert "\n" not in str(err.value)
    spec["method"] = "ngram"
    with pytest.raises(ValueError, match="runs on method eagle3 or draft_model; got method='ngram'"):
        _llm(setup["target"], spec)


def test_without_its_settings_vllms_eagle3_is_unchanged(setup):
    spec = {"method": "eagle3", "model": str(setup["eagle"]), "num_speculative_tokens": K}
    llm = _llm(setup["target"], spec)
    _generate(llm)
    counters = {m.name: getattr(m, "value", None) for m in llm.get_metrics() if m.name.startswith("vllm:spec_decode")}
    assert llm.collective_rpc(sp.take_trace) == [None]  # no controller was built
    _drop(llm)
    drafts, tokens = counters["vllm:spec_decode_num_drafts"], counters["vllm:spec_decode_num_draft_tokens"]
    assert drafts > 0 and tokens == K * drafts


def test_the_profile_prices_vllms_steps(setup, tmp_path):
    table = stop_tools.profile(
        str(setup["target"]), str(setup["eagle"]), 2, [2], str(tmp_path / "t.json"), steps=24, prefix=8,
        dtype="float32", enforce_eager=True,
    )  # fmt: skip
    from specheads.shim.costs.cost_table import load_table

    t = load_table(tmp_path / "t.json")
    assert t.max_pass == 3 and t.batches == [2] and t.t_draft_ms > 0 and min(t.t_target_ms) > 0
    assert table["samples"]["t_first 1"] and table["samples"]["t_d 2"]


def test_vllms_draft_model_proposer_stops_by_a_specdecpp_head_on_the_draft(tmp_path):
    """method="draft_model": vLLM's own draft-model proposer (the draft sharded as vLLM shards it) with each
    request's draft stopped by the cost rule on q(y) and by an untrained SpecDec++ head on the draft's states; greedy
    output equals the target alone's and every round's length is the toolkit rule's on the Transformers draft."""
    from transformers import AutoModelForCausalLM

    from specheads.export import save_head
    from specheads.heads import AcceptanceHead
    from specheads.vllm.stop_check import draft_reference, replay, rounds_of
    from specheads.vllm.stop_config import StopSettings, rule_policy

    target, draft = save_pair(tmp_path)
    torch.manual_seed(1)
    head = AcceptanceHead(128, depth=1)
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0, 0.3)
    save_head(
        tmp_path / "stop.safetensors",
        head,
        "acceptance",
        {
            "head_config": head.config(),
            "hidden_size": 128,
            "feature": {"model": "draft", "state": "post", "layer": -1, "position": "own"},
            "target": {"name": "tiny", "fingerprint": ""},
            "sampling": {"do_sample": False},
            "label": "soft",
        },
    )
    costs = tmp_path / "costs.json"
    costs.write_text(json.dumps({"t_draft_ms": 0.5, "t_target_ms": [10.0, 10.2, 10.4, 10.6, 10.8, 11.0]}))
    llm = _llm(target, None)
    alone, _ = _generate(llm)
    _drop(llm)
    rules = {"c-cost": None, "h-cost": str(tmp_path / "stop.safetensors")}
    spec = speculative_config(str(draft), K, method="draft_model", costs=str(costs), trace=True)
    llm = _llm(target, spec)
    runs = {}
    for rule, path in rules.items():
        settings = {"rule": rule, "head": path, "costs": str(costs), "trace": True}
        llm.collective_rpc(sp.configure, args=(settings,))
        llm.collective_rpc(sp.take_trace)
        runs[rule] = (*_generate(llm), llm.collective_rpc(sp.take_trace)[0]["trace"])
    _drop(llm)
    model = AutoModelForCausalLM.from_pretrained(draft, dtype=torch.float32).eval()
    for rule, (tokens, ids, trace) in runs.items():
        assert tokens == alone, rule
        by_req = rounds_of(trace)
        lengths = set()
        for prompt, out, rid in zip(PROMPTS, tokens, ids):
            rounds = next(v for key, v in by_req.items() if key == rid or key.startswith(f"{rid}-"))
            policy = rule_policy(StopSettings(rule=rule, head=rules[rule], costs=str(costs)), K, None, 128)
            got = replay(policy, draft_reference(model, prompt + out, K), len(prompt), rounds, K)
            assert got["match"] and got["drafts_differ"] == 0, (rule, rid, got)
            lengths |= set(got["lengths"])
        assert len(lengths) >= 2, (rule, lengths)
