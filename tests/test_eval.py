"""``heads-eval``: oracle counts, the Pareto check, and a full sweep on tiny models."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import acceptance_head_file, perturbed_copy

from specheads.errors import UserError
from specheads.evaluate.cli import main
from specheads.evaluate.config import EvalConfig
from specheads.evaluate.oracle import (
    RoundRecorder,
    below_curve,
    draft_agreement,
    oracle_schedule,
    per_position_acceptance,
    perfect_head_schedule,
    rounds_oracle,
    rounds_perfect_head,
)
from specheads.evaluate.report import summarize
from specheads.evaluate.rows import expand, num
from specheads.evaluate.select import family
from specheads.shim import Engine, GenerationStats
from specheads.shim.costs.cost_table import CostTable


@pytest.mark.parametrize(
    "agree, k_max, calls, drafts",
    [
        ([True] * 10, 20, 1, 9),  # all agree: one round, the last token from the target
        ([True] * 10, 3, 3, 7),  # runs of 3 drafts + 1 target token: 4 + 4 + (1 draft + 1)
        ([False] * 4, 20, 4, 0),  # every token a disagreement
        ([True, False, True, True, False], 20, 2, 3),  # |S| = 2, the last token is a disagreement: |S| calls
        ([True, False, True, True], 20, 2, 2),  # |S| = 1, then the final round: |S| + 1
    ],
)
def test_oracle_schedule_hand_cases(agree, k_max, calls, drafts):
    o = oracle_schedule(agree, k_max)
    assert (o.new_tokens, o.target_calls, o.draft_forwards) == (len(agree), calls, drafts)


@pytest.mark.parametrize(
    "agree, k_min, k_max, lag, calls, drafts, discarded",
    [
        ([True, False, True, True, False], 1, 20, 0, 2, 4, 1),  # the disagreement is drawn, scored 0, dropped
        ([True, False, True, True, False], 1, 20, 1, 2, 5, 2),  # reference order: seen one forward later
        ([False] * 4, 1, 20, 0, 4, 3, 3),  # k_min = 1: every round drafts one doomed candidate (as K = 1)
        ([False] * 4, 2, 20, 0, 4, 5, 5),  # k_min = 2, capped by the room left before the final token
        ([True] * 10, 1, 3, 0, 3, 7, 0),  # k_max cuts: as the oracle
    ],
)
def test_perfect_head_schedule_hand_cases(agree, k_min, k_max, lag, calls, drafts, discarded):
    o = perfect_head_schedule(agree, k_min, k_max, lag)
    assert (o.new_tokens, o.target_calls, o.draft_forwards, o.discarded) == (len(agree), calls, drafts, discarded)
    assert o.target_calls >= oracle_schedule(agree, k_max).target_calls


@pytest.mark.parametrize(
    "rounds, k_min, lag, drafts, discarded",
    [
        ([(4, 2), (4, 4), (4, 0), (1, 1)], 1, 0, 3 + 4 + 1 + 1, 2),  # stop on the drawn rejection; full rounds run out
        ([(4, 2), (4, 4), (4, 0), (1, 1)], 1, 1, 4 + 4 + 2 + 1, 4),  # reference order: one more each
        ([(4, 0), (2, 0), (0, 0)], 3, 0, 3 + 2 + 0, 5),  # k_min, capped by the round's room; a round without room
    ],
)
def test_rounds_oracle_and_perfect_head_hand_cases(rounds, k_min, lag, drafts, discarded):
    n = sum(a + 1 for _, a in rounds)
    o = rounds_oracle(rounds, n)
    assert (o.target_calls, o.draft_forwards, o.discarded) == (len(rounds), sum(a for _, a in rounds), 0)
    assert o.target_pass_sizes == {a + 1: sum(x == a for _, x in rounds) for _, a in rounds}
    p = rounds_perfect_head(rounds, n, k_min, lag)
    assert (p.target_calls, p.draft_forwards, p.discarded, p.new_tokens) == (len(rounds), drafts, discarded, n)
    assert sum(p.target_pass_sizes.values()) == len(rounds)


def test_per_position_acceptance_counts_only_the_rounds_that_reached_the_step():
    rounds = [(4, 2), (4, 4), (4, 0), (1, 1), (2, 1)]
    # step 1: 5 rounds drafted it, 4 accepted; step 2: (4,2) (4,4) (2,1) reached it, 2 accepted;
    # step 3: (4,2) (4,4) reached it, 1 accepted; step 4: (4,4) alone; step 5: no round drafted it
    assert per_position_acceptance(rounds, 5) == [0.8, round(2 / 3, 4), 0.5, 1.0, None]
    assert per_position_acceptance([], 2) == [None, None]


@pytest.mark.parametrize("k_max, k_min, lag", [(3, 1, 0), (6, 2, 1)])
def test_recorded_rounds_give_the_agreement_schedules_for_a_draft_model(tiny_pair, k_max, k_min, lag):
    """For a draft model (its greedy token depends on the prefix alone) the rounds of SD at k_max give the same
    oracle and perfect head as the teacher-forced agreement: the recorded-rounds path the EAGLE drafter takes."""
    target, draft = tiny_pair
    engine = Engine(target, draft)
    for prompt in ([1, 5, 9, 4], [3, 7, 2], [8, 8, 1, 6, 2]):
        rec = RoundRecorder(k_max)
        out = engine.generate(prompt, rec, 20).tokens
        assert len(out) == 20  # no EOS: the recorded rounds' room is the schedules' room
        agree = draft_agreement(draft, prompt, out)
        for got, want in (
            (rounds_oracle(rec.rounds, len(out)), oracle_schedule(agree, k_max)),
            (rounds_perfect_head(rec.rounds, len(out), k_min, lag), perfect_head_schedule(agree, k_min, k_max, lag)),
        ):
            assert (got.new_tokens, got.target_calls, got.draft_forwards, got.discarded, got.target_pass_sizes) == (
                want.new_tokens,
                want.target_calls,
                want.draft_forwards,
                want.discarded,
                want.target_pass_sizes,
            )


def test_below_curve():
    curve = [(0.6, 0.2), (0.4, 0.8), (0.3, 2.0)]  # K grows: fewer calls, more discards
    assert below_curve(curve, 0.5, 0.4) is True  # curve at 0.5 is 0.5
    assert below_curve(curve, 0.5, 0.6) is False
    assert below_curve(curve, 0.35, 1.4) is True  # exactly on the segment
    assert below_curve(curve, 0.2, 0.0) is None  # outside the fixed-K range
    assert below_curve(curve, 0.6, 0.2) is True


def test_draft_agreement_is_greedy_agreement(tiny_pair):
    target = tiny_pair[0]
    draft = perturbed_copy(target, scale=0.1)
    prompt = [1, 5, 9, 4]
    out = Engine(target, None).generate_ar(prompt, 20).tokens
    agree = draft_agreement(draft, prompt, out)
    ref = []
    for i, tok in enumerate(out):
        logits = draft(torch.tensor([prompt + out[:i]])).logits[0, -1]
        ref.append(int(logits.argmax()) == tok)
    assert agree == ref and 0 < sum(agree) < len(agree)
    assert all(draft_agreement(target, prompt, out))  # the target agrees with its own greedy output


@pytest.fixture()
def head_file(tiny_pair_dirs, tmp_path):
    return acceptance_head_file(tiny_pair_dirs, tmp_path / "h.safetensors", extra={"train": {"eval_binary_kl": 0.123}})


def _args(pair_dirs, prompts, out, *extra):
    t, d = pair_dirs
    return [
        f"target.path={t}",
        "target.gguf_file=null",
        "offset=0",
        "num_prompts=null",
        "k_min=2",
        f"draft.path={d}",
        "target.device=cpu",
        "draft.device=cpu",
        f"prompts={prompts}",
        f"output_dir={out}",
        "max_new_tokens=16",
        "ks=[1,2,4]",
        "thresholds=[0.3,0.7]",
        *extra,
    ]


@pytest.fixture()
def prompts_file(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text(
        "".join(
            json.dumps({"prompt": p}) + "\n"
            for p in ["the cat sat", "why is the sun red", "one two three", "a dog ran up"]
        )
    )
    return path


@pytest.fixture()
def table_file(tmp_path):
    """A synthetic cost table (no timing decides a test): t_d = 0.5 ms, t_t(k) = 4 + 0.5 k ms."""
    path = tmp_path / "costs.json"
    path.write_text(json.dumps(CostTable(t_draft_ms=0.5, t_target_ms=[4 + 0.5 * k for k in range(1, 22)]).to_dict()))
    return path


def _predicted(rows: list[dict], t_d: float = 0.5) -> float:
    """The cost model by hand over a configuration's rows: (t_d N_draft + sum_k t_t(k) count_k) / N."""
    n = sum(r["new_tokens"] for r in rows)
    target = sum((4 + 0.5 * int(k)) * c for r in rows for k, c in r["target_pass_sizes"].items())
    return (t_d * sum(r["draft_forwards"] for r in rows) + target) / n


def test_eval_sweep_end_to_end(tiny_pair_dirs, head_file, prompts_file, table_file, tmp_path, capsys):
    out = tmp_path / "ev"
    assert main(_args(tiny_pair_dirs, prompts_file, out, f"head={head_file}", f"profile={table_file}")) == 0
    printed = capsys.readouterr().out
    s = json.loads((out / "sweep.json").read_text())
    names = [r["config"] for r in s["table"]]
    assert names == ["ar", "draft", "k1", "k2", "k4", "h0.3", "h0.7", "h-cost"]
    by = {r["config"]: r for r in s["table"]}
    assert by["ar"]["verification_rate"] == 1.0 and by["ar"]["discard_rate"] == 0.0
    assert all(
        r["tokens_per_s_interval"][0] <= r["tokens_per_s"] <= r["tokens_per_s_interval"][1] + 1e-3 for r in s["table"]
    )
    assert by["k1"]["draft_forwards_per_token"] <= by["k4"]["draft_forwards_per_token"]
    # lossless greedy: every configuration emits the target's own tokens
    rows = [json.loads(x) for x in (out / "rows.jsonl").read_text().splitlines()]
    assert len(rows) == 4 * 8
    ar = {r["index"]: r["tokens"] for r in rows if r["config"] == "ar"}
    assert all(r["tokens"] == ar[r["index"]] for r in rows if r["config"] != "draft")
    # the oracle never calls the target more often than any policy does, and discards nothing
    assert s["oracle"]["tokens"] == by["ar"]["tokens"]
    assert all(
        s["oracle"]["verification_rate"] <= r["verification_rate"] + 1e-9 for r in s["table"] if r["config"] != "draft"
    )
    # the acceptance head's calibration while decoding: every SpecDec++ row, overall and by draft position
    for name in ("h0.3", "h0.7", "h-cost"):
        c = s["calibration"][name]
        assert c["overall"]["n"] == sum(v["n"] for v in c["by_position"].values()) > 0
        assert "1" in c["by_position"] and 0 <= c["overall"]["ece"] <= 1
    assert set(s["calibration"]) == {"h0.3", "h0.7", "h-cost"} and (out / "calibration.png").is_file()
    assert set(s["ratios"]) >= {
        "specdecpp_vs_best_fixed_k",
        "oracle_gain_fraction",
        "best_fixed_k_vs_ar",
        "cost_aware_vs_best_fixed_k",
        "share_of_perfect_head_gain",
    }
    assert isinstance(s["pareto_dominates"], bool) and set(s["below_fixed_k_curve"]) == {"h0.3", "h0.7", "h-cost"}
    assert s["head"]["eval_binary_kl"] == 0.123
    # the cost model: the given table at each row's own pass sizes, beside the measured ms/token
    assert s["cost_table"]["t_target_ms"][:2] == [4.5, 5.0] and s["cost_table"]["source"] == str(table_file)
    for name, r in by.items():
        mine = [x for x in rows if x["config"] == name]
        assert r["predicted_ms_per_token"] == pytest.approx(_predicted(mine), abs=1e-4)
        assert r["model_cost_ms_per_token"] == r["predicted_ms_per_token"]
        measured = 1000 * sum(x["wall_time"] for x in mine) / sum(x["new_tokens"] for x in mine)
        assert r["measured_ms_per_token"] == pytest.approx(measured, abs=1e-3)
        # rounded to 4 decimals: on a loaded machine the ratio is small and the rounding is most of the error
        assert r["predicted_over_measured"] == pytest.approx(r["predicted_ms_per_token"] / measured, rel=1e-3, abs=1e-4)
    assert by["ar"]["predicted_ms_per_token"] == pytest.approx(4.5)  # 1-token steps only
    assert by["draft"]["predicted_ms_per_token"] == pytest.approx(0.5)
    o = s["oracle"]
    assert sum(o["target_pass_sizes"].values()) == o["target_calls"]
    want = (0.5 * o["draft_forwards"] + sum((4 + 0.5 * int(k)) * c for k, c in o["target_pass_sizes"].items())) / o[
        "tokens"
    ]
    assert o["predicted_ms_per_token"] == pytest.approx(want, abs=1e-4)
    assert o["predicted_tokens_per_s"] == pytest.approx(1000 / o["predicted_ms_per_token"], rel=1e-3)
    assert s["ratios"]["cost_aware_vs_best_fixed_k"] == pytest.approx(
        by["h-cost"]["tokens_per_s"] / by[s["best_fixed_k"]]["tokens_per_s"], abs=1e-4
    )
    assert s["best_stop_rule"] in ("h0.3", "h0.7", "h-cost") and s["best_lossless"]["config"] in by
    # the rule to deploy: the fastest speculating lossless row, its interval and its paired ratio to the best fixed K
    d = s["deploy"]
    assert d["config"] == max((r for r in s["table"] if r["lossless"] and r["config"] != "ar"),
                              key=lambda r: r["tokens_per_s"])["config"]  # fmt: skip
    assert d["kind"] == ("learned" if d["config"].startswith("h") else "fixed_k")
    # ... with the policy and settings heads-export deploy= packs, and where it was measured
    want = {"k1": ("sd", {"k": 1}), "k2": ("sd", {"k": 2}), "k4": ("sd", {"k": 4})}.get(d["config"])
    if want is None:
        want = (
            "specdecpp",
            {"head": str(head_file), "k_min": 2, "k_max": 20}
            | ({"stop": "cost"} if d["config"] == "h-cost" else {"h": float(d["config"][1:])}),
        )
    assert (d["policy"], d["settings"]) == want
    assert (
        d["regime"]["batch_size"] == 1 and d["regime"]["max_new_tokens"] == 16 and d["regime"]["engine"] == "specheads"
    )
    lo, hi = d["tokens_per_s_interval"]
    assert lo <= d["tokens_per_s"] <= hi and f"to deploy ({d['kind']}): {d['config']}" in printed
    if d["kind"] != "fixed_k":
        vs = d["vs_best_fixed_k"]
        assert vs["against"] == s["best_fixed_k"] and vs["low"] <= vs["value"] <= vs["high"]
        assert vs["value"] == pytest.approx(d["tokens_per_s"] / by[s["best_fixed_k"]]["tokens_per_s"], rel=1e-3)
        assert d["within_noise_of_fixed_k"] == (vs["low"] <= 1.0)
    assert "cost table t_d 0.5 ms" in printed and "predicted_ms_per_token" in printed
    # the honest ceilings: a perfect rule scoring at lag 0 is at least as fast as one at lag 1; each head row
    # carries its own lag's (the head's lag 1)
    lag0, lag1 = (s["ceilings"][f"lag{n}"]["vs_best_fixed_k"] for n in (0, 1))
    assert (
        lag0 >= lag1 > 0
        and s["ceilings"]["lag1"]["vs_best_fixed_k"] == s["ratios"]["perfect_head_cost_gain_vs_best_fixed_k"]
    )
    assert all(by[n]["ceiling_vs_best_fixed_k"] == lag1 for n in ("h0.3", "h0.7", "h-cost"))
    assert "ceiling_vs_best_fixed_k" not in by["k2"] and "ceiling (a perfect stop rule" in printed
    assert (out / "pareto.png").read_bytes()[:4] == b"\x89PNG"
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 8
    assert {"config.yaml", "manifest.json", "metrics.json"} <= {p.name for p in out.iterdir()}


def test_eval_resumes_after_a_kill(tiny_pair_dirs, prompts_file, tmp_path, monkeypatch):
    from specheads.decode.api import Decoder

    out = tmp_path / "ev"
    args = _args(tiny_pair_dirs, prompts_file, out, "ks=[2]", "head=null")
    real, calls = Decoder.decode, {"n": 0}

    def dying(self, *a, **k):
        calls["n"] += 1
        if calls["n"] > 3 + 5:  # 3 warm-up calls, then 5 timed runs
            raise KeyboardInterrupt
        return real(self, *a, **k)

    monkeypatch.setattr(Decoder, "decode", dying)
    assert main(args) == 130
    assert len((out / "rows.jsonl").read_text().splitlines()) == 5
    monkeypatch.setattr(Decoder, "decode", real)
    assert main(args) == 0
    rows = [json.loads(x) for x in (out / "rows.jsonl").read_text().splitlines()]
    assert sorted((r["index"], r["config"]) for r in rows) == sorted(
        (i, c) for i in range(4) for c in ("ar", "draft", "k2")
    )


def test_overwrite_never_resumes_from_the_other_runs_rows(tiny_pair_dirs, prompts_file, table_file, tmp_path):
    """The same config names under other settings (here max_new_tokens) are another run's rows: overwrite=true
    decodes afresh instead of reporting them."""
    out = tmp_path / "ev"
    common = [f"profile={table_file}", "ks=[2]", "thresholds=[]", "head=null", "oracle=false", "quality=false"]
    assert main(_args(tiny_pair_dirs, prompts_file, out, *common, "max_new_tokens=3")) == 0
    assert main(_args(tiny_pair_dirs, prompts_file, out, *common, "max_new_tokens=6", "overwrite=true")) == 0
    rows = [json.loads(x) for x in (out / "rows.jsonl").read_text().splitlines()]
    assert len(rows) == 4 * 3 and any(len(r["tokens"]) > 3 for r in rows)


def test_eval_bad_input(tiny_pair_dirs, prompts_file, tmp_path, capsys):
    assert main(_args(tiny_pair_dirs, prompts_file, tmp_path / "a", "ks=[0,2]", "head=null")) == 2
    assert "every K must be >= 1" in capsys.readouterr().err
    assert main(_args(tiny_pair_dirs, prompts_file, tmp_path / "b", "head=/nope.safetensors")) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(_args(tiny_pair_dirs, prompts_file, tmp_path / "c", "thresholds=[1.2]", "ks=[]", "head=x")) == 2
    assert "every h must be in (0, 1)" in capsys.readouterr().err
    # a repeated setting would name two rows alike: one line, never a silently dropped row
    assert main(_args(tiny_pair_dirs, prompts_file, tmp_path / "d", "ks=[]", "head=null", "fsd.kl=[0.3,0.3]")) == 2
    assert "both named 'fsd-kl-0.3'" in capsys.readouterr().err


def test_row_names_keep_every_digit_of_a_setting():
    # ``:g`` wrote 0.9999999 as "1": a judge row named as if delta were 1 (SD), and a clash with delta = 1
    assert [num(x) for x in (0.99, 1.0, 0.999999, 0.9999999, 0.3)] == ["0.99", "1", "0.999999", "0.9999999", "0.3"]
    rows = {"policy": "specdecpp", "sweep": {"h": [0.9999999, 1.0]}, "name": "h"}
    assert [name for name, _, _ in expand(rows)] == ["h0.9999999", "h1"]


def test_rows_of_built_in_policies_get_the_names_the_reports_know():
    """A row given as rows= (no name) is named as the shorthand fields name it, so gating and the report's
    sections find it; a policy of one's own gets <policy>-<setting>."""
    cases = [
        ({"policy": "judge", "settings": {"head": "J", "k": 10}, "sweep": {"delta": [0.5, 0.99]}}, ["j0.5", "j0.99"]),
        ({"policy": "sprinter", "settings": {"head": "S"}, "sweep": {"eta": [0.5]}}, ["s0.5"]),
        ({"policy": "fsd", "settings": {"divergence": "kl"}, "sweep": {"T": [0.3]}}, ["fsd-kl-0.3"]),
        ({"policy": "topk_verify", "sweep": {"verify_top_k": [2]}}, ["t2"]),
        ({"policy": "specdecpp", "settings": {"head": "H", "stop": "cost"}}, ["h-cost"]),
        ({"policy": "confidence_stop", "sweep": {"tau": [0.4]}}, ["c0.4"]),
        ({"policy": "tree", "settings": {"k": 4, "tree_width": 3, "tree_nodes": 8}}, ["tree-4x3x8"]),
        ({"policy": "slem", "settings": {"k": 2}}, ["v-slem-k2"]),
        ({"policy": "sd", "sweep": {"k": [1, 4]}}, ["k1", "k4"]),
        ({"policy": "judge", "sweep": {"delta": [0.9]}, "name": "j-mined-"}, ["j-mined-0.9"]),
    ]
    for row, names in cases:
        assert [name for name, _, _ in expand(row)] == names, row
    assert [family(n) for n in ("j0.5", "s0.5", "fsd-kl-0.3", "t2", "j-mined-0.9")] == [
        "judge",
        "sprinter",
        "fsd_kl",
        "topk_verify",
        "judge_mined",
    ]
    with pytest.raises(UserError, match="sweep one setting per row"):
        expand({"policy": "judge", "sweep": {"delta": [0.5], "k": [4]}})
    with pytest.raises(UserError, match="unknown policy"):
        expand({"policy": "nope"})


def _stats_row(new: int, wall: float, drafts: int, sizes: dict[int, int]) -> dict:
    calls = sum(sizes.values())
    return {
        "new_tokens": new,
        "wall_time": wall,
        "draft_forwards": drafts,
        "target_calls": calls,
        "prompts": 1,
        "drafted": drafts,
        "accepted": new - calls,
        "discarded": drafts - (new - calls),
        "target_pass_sizes": {str(k): c for k, c in sizes.items()},
    }


def test_summary_costs_and_stop_rule_ratios_by_hand():
    """Hand-made rows: every cost figure and ratio of the summary from the formulas."""
    table = CostTable(t_draft_ms=1.0, t_target_ms=[10.0, 11.0, 12.0, 13.0, 14.0])
    grouped = {
        "ar": [_stats_row(100, 1.2, 0, {1: 100})],
        "draft": [_stats_row(100, 0.2, 100, {})],
        "k2": [_stats_row(100, 0.8, 80, {3: 40})],  # predicted (80 + 12 * 40) / 100 = 5.6 ms
        "k4": [_stats_row(100, 0.9, 100, {5: 25})],  # (100 + 14 * 25) / 100 = 4.5 ms
        "h0.5": [_stats_row(100, 0.7, 90, {4: 30})],  # (90 + 13 * 30) / 100 = 4.8 ms
        "h-cost": [_stats_row(100, 0.6, 90, {4: 20, 5: 5})],
    }  # (90 + 260 + 70) / 100 = 4.2 ms
    perfect = GenerationStats(
        prompts=0, new_tokens=100, target_calls=20, draft_forwards=80, target_pass_sizes={5: 20}
    )  # (80 + 14 * 20) / 100 = 3.6 ms
    lag0 = GenerationStats(
        prompts=0, new_tokens=100, target_calls=20, draft_forwards=70, target_pass_sizes={4: 10, 5: 10}
    )  # (70 + 13 * 10 + 14 * 10) / 100 = 3.4 ms
    lags = {"h0.5": 1, "h-cost": 1, "c-cost": 0}
    exact = {n: n != "draft" for n in grouped}  # Policy.lossless of each row's policy
    s = summarize(EvalConfig(), grouped, None, None, perfect, table, ({0: lag0, 1: perfect}, lags), exact)
    by = {r["config"]: r for r in s["table"]}
    assert [by[n]["predicted_ms_per_token"] for n in ("ar", "draft", "k2", "k4", "h0.5", "h-cost")] == [
        10.0,
        1.0,
        5.6,
        4.5,
        4.8,
        4.2,
    ]
    assert by["k4"]["measured_ms_per_token"] == 9.0 and by["k4"]["predicted_over_measured"] == 0.5
    assert s["best_fixed_k"] == "k2" and s["best_threshold"] == "h0.5" and s["best_stop_rule"] == "h-cost"
    r = s["ratios"]
    tps = {n: 100 / rows[0]["wall_time"] for n, rows in grouped.items()}
    assert r["cost_aware_vs_best_fixed_k"] == pytest.approx(tps["h-cost"] / tps["k2"], abs=1e-4)  # 0.8 / 0.6
    # predicted against predicted, from the best fixed K's predicted 4.5 ms (k4): best stop rule h-cost
    # 4.5 / 4.2 - 1; perfect head 4.5 / 3.6 - 1
    assert r["share_of_perfect_head_gain"] == pytest.approx((4.5 / 4.2 - 1) / (4.5 / 3.6 - 1), abs=1e-4)
    assert s["ceilings"] == {"lag0": {"vs_best_fixed_k": round(4.5 / 3.4, 4)}, "lag1": {"vs_best_fixed_k": 1.25}}
    assert by["h-cost"]["ceiling_vs_best_fixed_k"] == 1.25  # its own lag's
    assert by["h-cost"]["share_of_ceiling"] == pytest.approx((4.5 / 4.2 - 1) / 0.25, abs=1e-4)
    assert by["h0.5"]["share_of_ceiling"] == pytest.approx((4.5 / 4.8 - 1) / 0.25, abs=1e-4)  # a loss: negative
    assert "ceiling_vs_best_fixed_k" not in by["k2"] and "ceiling_vs_best_fixed_k" not in by["ar"]
    assert r["perfect_head_cost_gain_vs_best_fixed_k"] == pytest.approx(4.5 / 3.6, abs=1e-4)  # the predicted best K
    assert s["perfect_head"]["predicted_tokens_per_s"] == pytest.approx(1000 / 3.6, abs=1e-2)
    assert s["best_lossless"] == {
        "config": "h-cost",
        "tokens_per_s": pytest.approx(tps["h-cost"], abs=1e-3),
        "predicted_tokens_per_s": pytest.approx(1000 / 4.2, abs=1e-2),
    }
    assert "h-cost" in s["below_fixed_k_curve"]
    assert by["k2"]["lossless"] and not by["draft"]["lossless"]
    alone = summarize(EvalConfig(), grouped, None, None, perfect, table)  # no policies known: only ar is lossless
    assert alone["best_lossless"]["config"] == "ar"


def test_a_batched_sweep_decodes_what_batch_one_decodes(tiny_pair_dirs, head_file, prompts_file, table_file, tmp_path):
    """batch_size=2: every row's tokens and counts are batch 1's; wall_time is the row's share of its
    configuration's time on the block (they add up to the block's time), latency_s its own."""
    one, two = tmp_path / "b1", tmp_path / "b2"
    common = [f"head={head_file}", f"profile={table_file}", "ks=[2]", "thresholds=[0.5]", "oracle=false"]
    assert main(_args(tiny_pair_dirs, prompts_file, one, *common)) == 0
    assert main(_args(tiny_pair_dirs, prompts_file, two, *common, "batch_size=2")) == 0

    def rows(out):
        return {(r["index"], r["config"]): r for r in map(json.loads, (out / "rows.jsonl").read_text().splitlines())}

    a, b = rows(one), rows(two)
    assert a.keys() == b.keys()
    for key in a:
        for field in ("tokens", "target_calls", "draft_forwards", "accepted", "target_pass_sizes"):
            assert b[key][field] == a[key][field], (key, field)
        assert "latency_s" in b[key] and "latency_s" not in a[key]
    s = json.loads((two / "sweep.json").read_text())  # the cost table prices batch-1 forwards only
    assert s["batch_size"] == 2 and "batch 1 only" in s["cost_model"]
    assert all(r["predicted_ms_per_token"] is None for r in s["table"])
    assert (
        main(_args(tiny_pair_dirs, prompts_file, tmp_path / "bad", *common, "batch_size=2", "fused_forward=false")) == 2
    )


def test_a_smaller_budget_per_prompt_source(tiny_pair_dirs, prompts_file, table_file, tmp_path, capsys):
    out = tmp_path / "ev"
    common = [f"profile={table_file}", "ks=[2]", "thresholds=[]", "head=null", "oracle=false"]
    assert (
        main(_args(tiny_pair_dirs, prompts_file, out, *common, "max_new_tokens_by_source={prompt: 3}", "batch_size=2"))
        == 0
    )
    rows = [json.loads(x) for x in (out / "rows.jsonl").read_text().splitlines()]
    assert rows and all(len(r["tokens"]) <= 3 for r in rows) and any(len(r["tokens"]) == 3 for r in rows)
    assert (
        main(_args(tiny_pair_dirs, prompts_file, tmp_path / "bad", *common, "max_new_tokens_by_source={arcs: 16}")) == 2
    )
    assert "max_new_tokens_by_source.arcs" in capsys.readouterr().err


def test_sampled_sweeps_get_their_ceilings_from_the_recorded_rounds(tiny_pair_dirs, prompts_file, table_file, tmp_path):
    """Sampled, the oracle and the perfect rules come from SD's recorded rounds under the same draws."""
    out = tmp_path / "ev"
    extra = [f"profile={table_file}", "head=null", "thresholds=[]", "confidence.taus=[0.5]", "confidence.k_max=20"]
    assert main(_args(tiny_pair_dirs, prompts_file, out, *extra, "sampling.do_sample=true", "quality=false")) == 0
    s = json.loads((out / "sweep.json").read_text())
    by = {r["config"]: r for r in s["table"]}
    assert s["oracle"]["tokens"] > 0 and s["oracle"]["discard_rate"] == 0.0
    assert s["ceilings"]["lag0"]["vs_best_fixed_k"] >= s["ceilings"]["lag1"]["vs_best_fixed_k"]
    assert by["c-online-cost"]["ceiling_vs_best_fixed_k"] == s["ceilings"]["lag0"]["vs_best_fixed_k"]


def test_a_bad_row_is_named_once_in_its_error():
    """``rows=`` errors say ``rows:`` once, whether the row's shape or a policy's own rule refuses it."""
    from specheads.evaluate.rows import problems

    got = problems([{"policy": "nope"}, {"policy": "sd", "settings": {"k": 0}}])
    assert len(got) == 2 and all(p.startswith("rows: ") and "rows: rows:" not in p for p in got)


def test_the_deploy_choice_without_paired_rows_has_no_ratio_interval():
    """A batched sweep's rows are not paired prompt by prompt: the choice still names itself, without an interval."""
    from specheads.evaluate.report import deploy

    table = [
        {"config": "k2", "lossless": True, "tokens_per_s": 10.0},
        {"config": "h-cost", "lossless": True, "tokens_per_s": 12.0},
    ]
    row = {"new_tokens": 10, "wall_time": 1.0}
    grouped = {"k2": [dict(row, index=i) for i in range(2)], "h-cost": [dict(row, index=i) for i in range(3)]}
    d = deploy({"table": table}, grouped)
    assert d["config"] == "h-cost" and d["vs_best_fixed_k"] == {
        "value": None,
        "low": None,
        "high": None,
        "against": "k2",
    }
    assert d["within_noise_of_fixed_k"] is False
