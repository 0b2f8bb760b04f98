"""The profiled cost table (cache, prediction), the engine's pass-size counts and the cost-aware stop rules.

Every verdict here rests on synthetic tables: measured times are only checked for shape."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import bigram

from specheads.errors import UserError
from specheads.evaluate.oracle import oracle_schedule, perfect_head_schedule
from specheads.heads import AcceptanceHead
from specheads.shim.costs import cost_table as costs_mod
from specheads.shim.costs.cost_rules import DraftGate, draft_more, predict_ms_per_token
from specheads.shim.costs.cost_table import CostTable, cost_table, load_table
from specheads.shim.loop.engine import Engine, GenerationStats
from specheads.shim.policies import ConfidenceStop, SpecDecPP, StandardSD

PROMPTS = [[5], [7, 9, 11, 4, 6], [3, 8, 12, 15, 20, 4, 9, 10, 11, 13, 5, 6, 7, 8, 22, 30, 31]]


def linear_table(t_d: float, t_t, sizes: int = 24) -> CostTable:
    """A synthetic table: ``t_t`` a number (flat) or a function of the pass size k."""
    return CostTable(t_draft_ms=t_d, t_target_ms=[float(t_t(k) if callable(t_t) else t_t) for k in range(1, sizes + 1)])


def ratio(table: CostTable, survivals: list[float], n: int) -> float:
    """E(n) / C(n) with E(n) = 1 + sum_{i<=n} S_i, C(n) = n t_d + t_t(n + 1): the hand formula."""
    return (1 + sum(survivals[:n])) / (n * table.t_draft_ms + table.t_target_ms[n])


# ---- the table ---------------------------------------------------------------------------------


def test_table_prices_extrapolation_and_round_cost():
    t = CostTable(t_draft_ms=2.0, t_target_ms=[10.0, 11.0, 13.0])
    assert [t.t_target(k) for k in (1, 2, 3, 4, 6)] == [10.0, 11.0, 13.0, 15.0, 19.0]  # line through the last two
    assert t.round_ms(2) == 2 * 2.0 + 13.0 and t.max_pass == 3
    with pytest.raises(ValueError):
        t.t_target(0)


def test_predict_ms_per_token_by_hand():
    t = CostTable(t_draft_ms=1.5, t_target_ms=[10.0, 12.0, 15.0, 20.0])
    # 30 draft forwards, passes: 4 of 4 tokens, 2 of 2 tokens, 1 of 1 token; 20 tokens
    want = (1.5 * 30 + 20.0 * 4 + 12.0 * 2 + 10.0 * 1) / 20
    assert predict_ms_per_token(t, 30, {4: 4, 2: 2, 1: 1}, 20) == pytest.approx(want)
    assert predict_ms_per_token(t, 30, [4, 2, 4, 1, 4, 2, 4], 20) == pytest.approx(want)  # each call's size
    assert predict_ms_per_token(t, 30, {"4": 4, "2": 2, "1": 1}, 20) == pytest.approx(want)  # JSON keys


def test_key_covers_the_settings_and_the_json_round_trip(tmp_path):
    a = CostTable(t_draft_ms=1.0, t_target_ms=[2.0], machine="cpu x", threads=2, target_fingerprint="f")
    b = CostTable(t_draft_ms=9.0, t_target_ms=[5.0, 6.0], machine="cpu x", threads=2, target_fingerprint="f")
    assert a.key == b.key  # the prices are not settings
    for change in (
        {"threads": 4},
        {"target_fingerprint": "g"},
        {"draft_vocab_hash": "h"},
        {"fused": False},
        {"target_dtype": "bfloat16"},
        {"draft_device": "cuda:0"},
    ):
        assert CostTable(**{**a.settings(), "t_draft_ms": 1.0, "t_target_ms": [2.0], **change}).key != a.key
    path = tmp_path / "t.json"
    path.write_text(json.dumps(b.to_dict()))
    back = load_table(path)
    assert back == b and back.source == str(path)


@pytest.mark.parametrize(
    "data, match",
    [
        ({"t_draft_ms": 1.0}, "t_target_ms"),
        ({"t_draft_ms": -1, "t_target_ms": [1.0]}, "t_draft_ms"),
        ({"t_draft_ms": 1.0, "t_target_ms": [1.0, 0]}, "t_target_ms"),
    ],
)
def test_bad_table_files(tmp_path, data, match):
    path = tmp_path / "t.json"
    path.write_text(json.dumps(data))
    with pytest.raises(UserError, match=match):
        load_table(path)
    with pytest.raises(UserError, match="missing"):
        load_table(tmp_path / "nope.json")


def test_cache_measures_once_then_reuses(tiny_pair, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECHEADS_CACHE", str(tmp_path / "cache"))
    calls = []

    def fake(target, draft, max_pass, *args, **kwargs):
        calls.append(max_pass)
        return 1.0, [float(k) for k in range(1, max_pass + 1)]

    monkeypatch.setattr(costs_mod, "measure", fake)
    target, draft = tiny_pair
    first = cost_table(target, draft, 5, "fp-t", "fp-d", fused=False)
    assert calls == [5] and first.source == "measured" and first.t_target_ms == [1.0, 2.0, 3.0, 4.0, 5.0]
    files = list((tmp_path / "cache" / "costs").glob("*.json"))
    assert [f.stem for f in files] == [first.key]
    saved = json.loads(files[0].read_text())
    assert saved["target_fingerprint"] == "fp-t" and saved["machine"] and saved["torch"] == torch.__version__
    assert saved["threads"] == torch.get_num_threads() and saved["target_device"] == "cpu"
    again = cost_table(target, draft, 4, "fp-t", "fp-d", fused=False)
    assert calls == [5] and again.source == str(files[0]) and again.t_target_ms == first.t_target_ms
    cost_table(target, draft, 5, "fp-t", "fp-d", fused=False, profile="refresh")
    cost_table(target, draft, 7, "fp-t", "fp-d", fused=False)  # the cached table is too short
    cost_table(target, draft, 3, "fp-t", "other", fused=False)  # another draft: another key
    assert calls == [5, 5, 7, 3]
    given = cost_table(target, draft, 40, profile=str(files[0]))  # a file is used as is
    assert calls == [5, 5, 7, 3] and given.max_pass == 7


def test_measure_runs_on_the_decoding_runners(tiny_pair):
    target, draft = tiny_pair
    t_d, t_t = costs_mod.measure(target, draft, 3, fused=False, prefix_tokens=8, reps=2, warmup=1)
    assert t_d > 0 and len(t_t) == 3 and all(t > 0 for t in t_t)


# ---- counting pass sizes -------------------------------------------------------------------------


def _cycle(v: int) -> list[list[float]]:
    return [[0.9 if j == (last + 1) % v else 0.1 / (v - 1) for j in range(v)] for last in range(v)]


@pytest.mark.parametrize("prompt", [[0], [3, 4, 5, 6, 7, 0]])
def test_engine_counts_each_pass_as_candidates_plus_one(prompt):
    """Draft = target: every candidate is accepted. 11 tokens with K = 3: rounds of 3 + bonus, 3 + bonus,
    then 2 (the room left) + bonus: passes of 4, 4 and 3 tokens; the prefill round counts as 4 too."""
    engine = Engine(bigram(_cycle(12)), bigram(_cycle(12)), eos_token_ids=[], fused=False)
    g = engine.generate(prompt, StandardSD(3), 11)
    assert g.stats.target_pass_sizes == {4: 2, 3: 1} and g.stats.target_calls == 3
    ar = engine.generate_ar(prompt, 11)
    assert ar.stats.target_pass_sizes == {1: 11}


def test_pass_sizes_sum_and_survive_json(tiny_pair):
    target, draft = tiny_pair
    engine = Engine(target, draft, eos_token_ids=[])
    stats = [engine.generate(p, StandardSD(4), 30).stats for p in PROMPTS]
    for s in stats:
        assert sum(s.target_pass_sizes.values()) == s.target_calls and max(s.target_pass_sizes) <= 5
        assert sum((k - 1) * c for k, c in s.target_pass_sizes.items()) == s.drafted
    tot = GenerationStats.total(stats)
    assert sum(tot.target_pass_sizes.values()) == tot.target_calls
    row = json.loads(json.dumps(tot.to_dict()))  # as rows.jsonl / outputs.jsonl hold it: str keys
    back = GenerationStats(**{k: v for k, v in row.items() if k in GenerationStats.__dataclass_fields__})
    assert back.target_pass_sizes == tot.target_pass_sizes  # int keys again


@pytest.mark.parametrize(
    "agree, k_max, sizes",
    [
        ([True] * 10, 3, {4: 2, 2: 1}),  # 3 drafts + 1, 3 + 1, then 1 draft + the final token
        ([False] * 4, 20, {1: 4}),
        ([True, False, True, True], 20, {2: 2}),  # one draft + the correction; one draft + the final token
    ],
)
def test_oracle_pass_sizes(agree, k_max, sizes):
    o = oracle_schedule(agree, k_max)
    assert o.target_pass_sizes == sizes and sum(sizes.values()) == o.target_calls


def test_perfect_head_pass_sizes():
    o = perfect_head_schedule([True, False, True, True, False], 1, 20, 1)  # see test_eval's hand cases
    assert o.target_pass_sizes == {3: 1, 4: 1}  # y_1, y_2 (doomed), y_3 seen; then 2 + 1 doomed drafts
    assert sum((k - 1) * c for k, c in o.target_pass_sizes.items()) == o.draft_forwards


# ---- the rule ----------------------------------------------------------------------------------


def test_draft_more_is_the_ratio_comparison():
    table = linear_table(1.0, lambda k: 4 + k)
    s = [0.9, 0.72]  # scored betas 0.9, 0.8
    # n = 2, both scored: E(2) = 1 + 0.9 + 0.72 = 2.62, C(2) = 2 + 7; next S_3 = 0.72 * 0.8
    e2, e3 = 2.62, 2.62 + 0.72 * 0.8
    assert draft_more(table, 2, 2, 0.72, sum(s), 0.8) == (e3 / 11 > e2 / 9)
    # n = 3, two scored, the newest gets beta = 0.8: E(3) = 2.62 + 0.576, E(4) = E(3) + 0.4608
    e3, e4 = 2.62 + 0.576, 2.62 + 0.576 + 0.4608
    assert draft_more(table, 3, 2, 0.72, sum(s), 0.8) == (e4 / 13 > e3 / 11)
    assert draft_more(table, 3, 2, 0.72, sum(s), 0.8) is False  # 0.2813 < 0.2905
    assert draft_more(linear_table(1.0, 10.0), 7, 7, 1.0, 7.0, 1.0)  # beta 1 and a flat t_t: t_t > t_d
    assert not draft_more(linear_table(10.0, 10.0), 7, 7, 1.0, 7.0, 1.0)  # t_t = t_d: nothing to gain


def _beta_head(betas: list[float]) -> torch.nn.Module:
    head = torch.nn.Linear(len(betas), 1)
    with torch.no_grad():
        head.weight.copy_(torch.logit(torch.tensor([betas], dtype=torch.float64)).float())
        head.bias.zero_()
    return head


def _first_round(policy, v: int = 24, new: int = 23) -> int:
    """Candidates of the first round on the cycling stub pair (draft = target: all accepted)."""
    seen = []

    class Probe(type(policy)):
        def verify(self, rnd, logits, hidden):
            seen.append(rnd.n)
            return super().verify(rnd, logits, hidden)

    policy.__class__ = Probe
    engine = Engine(bigram(_cycle(v)), bigram(_cycle(v)), eos_token_ids=[], fused=False)
    g = engine.generate([0], policy, new)
    assert g.tokens == [(i + 1) % v for i in range(new)]  # lossless: the target's own chain
    return seen[0]


@pytest.mark.parametrize("beta", [0.5, 0.8, 0.95])
@pytest.mark.parametrize("t_t", [lambda k: 4 + k, lambda k: 6 + 0.2 * k * k, lambda k: 20 + 0.5 * k])
def test_specdecpp_cost_stops_at_the_argmax_of_expected_tokens_per_cost(beta, t_t):
    """Every token scores ``beta``: S_i = beta^i, so the policy's estimates are exact and the round
    length must be the argmax over [k_min, k_max] of E(n) / C(n), computed by hand here."""
    table = linear_table(1.0, t_t)
    k_min, k_max = 2, 20
    survivals = [beta**i for i in range(1, k_max + 2)]
    want = max(range(k_min, k_max + 1), key=lambda n: ratio(table, survivals, n))
    policy = SpecDecPP(_beta_head([beta] * 24), k_min=k_min, k_max=k_max, stop="cost", costs=table)
    assert _first_round(policy) == want


def test_specdecpp_cost_hand_case():
    """Betas of tokens 1, 2, 3 ...: 0.9, 0.8, 0.7 ...; t_d = 1, t_t(k) = 4 + k, reference order.
    n = 2 (y_1 scored, y_2 gets 0.9): E = 2.71 / 9 = 0.301 < E(3) = 3.439 / 11 = 0.313: draft on.
    n = 3 (y_1, y_2 scored, y_3 gets 0.8): E = 3.196 / 11 = 0.2905 > E(4) = 3.657 / 13 = 0.2813: stop."""
    betas = [0.5] + [max(0.9 - 0.1 * i, 0.1) for i in range(23)]
    policy = SpecDecPP(_beta_head(betas), k_min=2, k_max=20, stop="cost", costs=linear_table(1.0, lambda k: 4 + k))
    assert _first_round(policy) == 3


def test_specdecpp_cost_flat_target_and_certain_head_drafts_to_k_max():
    head = torch.nn.Linear(24, 1)
    with torch.no_grad():
        head.weight.zero_()
        head.bias.fill_(30.0)  # beta = 1 - 1e-13
    policy = SpecDecPP(head, k_min=2, k_max=7, stop="cost", costs=linear_table(1.0, 10.0))
    assert _first_round(policy) == 7


def test_specdecpp_cost_expensive_draft_stops_at_k_min():
    policy = SpecDecPP(_beta_head([0.99] * 24), k_min=3, k_max=20, stop="cost", costs=linear_table(1000.0, 1.0))
    assert _first_round(policy) == 3


def test_confidence_cost_hand_case():
    """Draft chain 0 -> 1 (q 0.9) -> 2 (0.6) -> 3 (0.3) -> 1 (0.8); t_d = 1, t_t(k) = 4 + k.
    n = 1: E = 1.9 / 7 = 0.271 < E(2) = 2.71 / 9 = 0.301: draft on; n = 2: S = 0.9, 0.54, the next gets
    0.6: E = 2.44 / 9 = 0.271 > E(3) = 2.764 / 11 = 0.251: stop; the round emits 1, 2 and the bonus 3."""
    table = [[0.05, 0.9, 0.03, 0.02], [0.2, 0.1, 0.6, 0.1], [0.25, 0.2, 0.25, 0.3], [0.1, 0.8, 0.05, 0.05]]
    engine = Engine(bigram(table), bigram(table), [], fused=False)
    chunks = []
    policy = ConfidenceStop(k_max=10, stop="cost", costs=linear_table(1.0, lambda k: 4 + k))
    engine.generate([0], policy, 9, on_tokens=chunks.append)
    assert chunks[0] == [1, 2, 3]
    chunks.clear()  # with a far dearer target pass, drafting longer pays
    engine.generate(
        [0], ConfidenceStop(k_max=10, stop="cost", costs=linear_table(1.0, 100.0)), 9, on_tokens=chunks.append
    )
    assert len(chunks[0]) > 3


def test_confidence_cost_bounds():
    engine = Engine(bigram(_cycle(12)), bigram(_cycle(12)), eos_token_ids=[], fused=False)
    chunks = []
    engine.generate(
        [0], ConfidenceStop(k_max=6, stop="cost", costs=linear_table(0.001, 10.0)), 11, on_tokens=chunks.append
    )
    assert len(chunks[0]) == 7  # q = 0.9 everywhere, drafts nearly free: k_max + bonus
    chunks.clear()
    engine.generate(
        [0], ConfidenceStop(k_max=6, stop="cost", costs=linear_table(1000.0, 1.0), k_min=2), 11, on_tokens=chunks.append
    )
    assert len(chunks[0]) == 3  # k_min + bonus


def test_cost_stop_needs_a_table_and_a_known_mode():
    with pytest.raises(UserError, match="needs a cost table"):
        SpecDecPP(_beta_head([0.5] * 4), stop="cost")
    with pytest.raises(UserError, match="stop='fast'"):
        ConfidenceStop(stop="fast")
    with pytest.raises(UserError, match="k_min"):
        ConfidenceStop(k_min=5, k_max=3)


@pytest.mark.parametrize("position", ["own", "previous"])
def test_cost_aware_rules_are_lossless_on_a_tiny_pair(tiny_pair, position):
    target, draft = tiny_pair
    engine = Engine(target, draft, eos_token_ids=[])
    torch.manual_seed(0)
    head = AcceptanceHead(32, depth=1).eval()
    table = linear_table(0.3, lambda k: 2 + 0.1 * k)
    for prompt in PROMPTS:
        ref = engine.generate_ar(prompt, 30).tokens
        for policy in (
            SpecDecPP(head, k_min=1, k_max=8, position=position, stop="cost", costs=table),
            ConfidenceStop(k_max=8, stop="cost", costs=table),
        ):
            g = engine.generate(prompt, policy, 30)
            assert g.tokens == ref
            assert sum(g.stats.target_pass_sizes.values()) == g.stats.target_calls
            assert max(g.stats.target_pass_sizes) <= 9


# ---- the draft gate: rounds without a draft -----------------------------------------------------


def test_gate_closes_on_losing_rounds_probes_with_backoff_and_reopens():
    """t_d = 1, flat t_t = 10: a round with one rejected candidate has surplus 1 - 11/10 = -0.1, one with
    its candidate kept 2 - 1.1 = +0.9. Prior 0.5 over 2 rounds, memory 16."""
    gate = DraftGate(linear_table(1.0, 10.0), memory=16, probe_every=4, max_probe_every=16)
    decisions = []
    for _ in range(120):
        d = gate.open()
        decisions.append(d)
        if d:
            gate.observe(1, 0)
    first_closed = decisions.index(False)
    assert all(decisions[:first_closed]) and first_closed > 3  # the prior lets a prompt start drafting
    probes = [i for i in range(first_closed, len(decisions)) if decisions[i]]
    waits = [b - a - 1 for a, b in zip([first_closed - 1] + probes, probes)]
    assert waits[:4] == [4, 8, 16, 16]  # doubling up to max_probe_every
    for _ in range(3):  # probes that win: the estimate climbs back above zero, the gate opens on its own
        gate.observe(1, 1)
    assert gate.estimate() > 0 and gate.open() and gate.open()
    gate.reset()
    assert gate.estimate() == pytest.approx(0.5)
    gate.observe(0, 0)  # a round without candidates says nothing
    assert gate.estimate() == pytest.approx(0.5)
    with pytest.raises(UserError, match="probe_every"):
        DraftGate(linear_table(1.0, 10.0), probe_every=0)


def _disagreeing_pair(v: int = 12):
    """Target cycles i -> i + 1; the draft always proposes i -> i + 2: every candidate is rejected."""
    shifted = [[0.9 if j == (i + 2) % v else 0.1 / (v - 1) for j in range(v)] for i in range(v)]
    return bigram(_cycle(v)), bigram(shifted)


@pytest.mark.parametrize(
    "make",
    [
        lambda t: ConfidenceStop(k_max=4, stop="cost", costs=t, gate=True),
        lambda t: SpecDecPP(_beta_head([0.9] * 12), k_min=1, k_max=4, stop="cost", costs=t, gate=True),
    ],
)
def test_gated_rules_stop_drafting_where_it_loses_and_stay_lossless(make):
    target, draft = _disagreeing_pair()
    engine = Engine(target, draft, eos_token_ids=[], fused=False)
    table = linear_table(1.0, lambda k: 10 + k)
    ref = engine.generate_ar([0], 60).tokens
    gated = engine.generate([0], make(table), 60)
    assert gated.tokens == ref == [(i + 1) % 12 for i in range(60)]
    st = gated.stats
    assert st.accepted == 0 and st.undrafted_rounds > 30
    assert st.rounds == st.target_calls == 60  # one token per round, drafted or not
    # a round without candidates is a one-token pass; so is the last round, which has no room to draft
    assert st.target_pass_sizes[1] == st.undrafted_rounds + 1
    ungated = make(table)
    ungated.gate = None
    st = engine.generate([0], ungated, 60).stats
    assert st.undrafted_rounds == 0 and st.draft_forwards >= 59


def test_gate_stays_open_where_drafting_pays():
    engine = Engine(bigram(_cycle(12)), bigram(_cycle(12)), eos_token_ids=[], fused=False)
    g = engine.generate(
        [0], ConfidenceStop(k_max=4, stop="cost", costs=linear_table(1.0, lambda k: 10 + k), gate=True), 60
    )
    assert g.stats.undrafted_rounds == 0 and g.stats.accepted > 30


def test_gate_needs_the_cost_rule():
    with pytest.raises(UserError, match="gate=True needs stop=cost"):
        ConfidenceStop(gate=True)
    assert ConfidenceStop(stop="cost", costs=linear_table(1.0, 10.0), gate=False).gate is None
    assert ConfidenceStop(stop="cost", costs=linear_table(1.0, 10.0)).gate is None  # opt-in
    assert ConfidenceStop().gate is None


# ---- heads-decode ------------------------------------------------------------------------------


def test_heads_decode_stop_cost(tiny_pair_dirs, tmp_path, capsys, caplog):
    from specheads.decode.decode_cli import main

    t, d = tiny_pair_dirs
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ["the cat sat", "why is the sun red"]))
    table = tmp_path / "costs.json"
    table.write_text(json.dumps(linear_table(0.5, lambda k: 4 + 0.5 * k).to_dict()))

    def args(out, *extra):
        return [
            f"target.path={t}",
            "target.gguf_file=null",
            f"draft.path={d}",
            "target.device=cpu",
            "draft.device=cpu",
            f"prompts={prompts}",
            f"output_dir={tmp_path / out}",
            "max_new_tokens=12",
            "num_prompts=null",
            *extra,
        ]

    assert main(args("ar", "policy=ar")) == 0
    with caplog.at_level("INFO"):
        assert (
            main(
                args(
                    "cost",
                    "policy=confidence_stop",
                    "confidence_stop.stop=cost",
                    "confidence_stop.k_max=6",
                    f"profile={table}",
                )
            )
            == 0
        )
    assert "cost table t_d 0.5 ms" in caplog.text
    tokens = {
        n: [json.loads(x)["tokens"] for x in (tmp_path / n / "outputs.jsonl").read_text().splitlines()]
        for n in ("ar", "cost")
    }
    assert tokens["cost"] == tokens["ar"]  # lossless
    m = json.loads((tmp_path / "cost" / "metrics.json").read_text())
    assert m["stop"] == "cost" and m["tau"] is None and m["cost_table"]["t_draft_ms"] == 0.5
    want = predict_ms_per_token(
        linear_table(0.5, lambda k: 4 + 0.5 * k), m["draft_forwards"], m["target_pass_sizes"], m["new_tokens"]
    )
    assert m["predicted_ms_per_token"] == pytest.approx(want, abs=1e-4) and m["measured_ms_per_token"] > 0
    capsys.readouterr()
    assert main(args("bad", "policy=sd", "stop=cost")) == 2  # stop= is no key of heads-decode: a policy's setting
    err = capsys.readouterr().err
    assert "unknown key 'stop'" in err and ".stop'" in err
    assert main(args("bad1", "policy=confidence_stop", "confidence_stop.stop=cost", "profile=/nope.json")) == 2
    assert "'/nope.json'" in capsys.readouterr().err
    assert main(args("bad2", "policy=confidence_stop", "confidence_stop.stop=later")) == 2
    assert "stop='later'" in capsys.readouterr().err
