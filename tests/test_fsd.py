"""Training-free policies: divergences by hand, FSD's limits (T = 0, huge T, rule ``or`` = SD),
draft-confidence stopping, and both through heads-decode and heads-eval on the tiny models."""

from __future__ import annotations

import json
import math

import pytest
import torch
from conftest import bigram, decode_args

from specheads.errors import UserError
from specheads.shim.core.divergence import divergence
from specheads.shim.core.sampling import SamplingConfig
from specheads.shim.loop.engine import Engine
from specheads.shim.policies import FSD, ConfidenceStop, Round, StandardSD

PROMPTS = [[1, 5, 6, 7], [1, 9, 10], [1, 20, 21, 22, 23, 24]]
LN = math.log

# Two hand-written distributions over 3 tokens, and a pair with a zero in the draft (q[2] = 0 < p[2]).
P = [0.5, 0.3, 0.2]
Q = [0.25, 0.25, 0.5]
P0 = [0.5, 0.5, 0.0]
Q0 = [1.0, 0.0, 0.0]


def _t(values):
    return torch.tensor(values, dtype=torch.float32)


@pytest.mark.parametrize(
    "name, p, q, want",
    [
        ("kl", P, Q, 0.5 * LN(2) + 0.3 * LN(0.3 / 0.25) + 0.2 * LN(0.4)),  # 0.2180
        ("kl_rev", P, Q, 0.25 * LN(0.5) + 0.25 * LN(0.25 / 0.3) + 0.5 * LN(2.5)),  # 0.2393
        ("tv", P, Q, 0.5 * (0.25 + 0.05 + 0.3)),  # 0.3
        # m = [0.375, 0.275, 0.35]
        (
            "js",
            P,
            Q,
            0.5 * (0.5 * LN(0.5 / 0.375) + 0.3 * LN(0.3 / 0.275) + 0.2 * LN(0.2 / 0.35))
            + 0.5 * (0.25 * LN(0.25 / 0.375) + 0.25 * LN(0.25 / 0.275) + 0.5 * LN(0.5 / 0.35)),
        ),
        # zeros: p log p with p = 0 contributes 0; q = 0 < p makes KL(p || q) infinite
        ("kl", Q0, P0, LN(2)),  # KL(q0 || p0) written the other way round: 1 * ln(1 / 0.5)
        ("kl_rev", P0, Q0, LN(2)),
        ("tv", P0, Q0, 0.5),
        # m = [0.75, 0.25, 0]: 1/2 (0.5 ln(0.5/0.75) + 0.5 ln(0.5/0.25)) + 1/2 (1 ln(1/0.75))
        ("js", P0, Q0, 0.5 * (0.5 * LN(0.5 / 0.75) + 0.5 * LN(2)) + 0.5 * LN(1 / 0.75)),
    ],
)
def test_divergence_matches_hand_computation(name, p, q, want):
    got = divergence(name, _t(p), _t(q))
    torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float32), rtol=1e-5, atol=1e-6)


def test_kl_is_infinite_where_the_draft_has_no_mass():
    assert math.isinf(float(divergence("kl", _t(P0), _t(Q0))))  # p0[1] = 0.5 but q0[1] = 0


def test_top_k_variant_buckets_the_rest():
    p, q = _t([0.4, 0.3, 0.2, 0.1]), _t([0.1, 0.2, 0.1, 0.6])
    # the target's top 2 are tokens 0 and 1: p' = [0.4, 0.3, 0.3], q' = [0.1, 0.2, 0.7]
    want = {"tv": 0.5 * (0.3 + 0.1 + 0.4), "kl": 0.4 * LN(4) + 0.3 * LN(1.5) + 0.3 * LN(0.3 / 0.7)}
    for name, value in want.items():
        torch.testing.assert_close(divergence(name, p, q, top_k=2), torch.tensor(value), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(divergence("tv", p, q), torch.tensor(0.5), rtol=1e-5, atol=1e-6)  # full vocabulary
    # a zero in the draft inside the top k: KL(p || q) is infinite there, the reverse is finite
    z = _t([0.0, 0.5, 0.25, 0.25])
    assert math.isinf(float(divergence("kl", p, z, top_k=2)))
    # q' = [0, 0.5, 0.5]: KL(q' || p') = 0.5 ln(0.5 / 0.3) + 0.5 ln(0.5 / 0.3)
    torch.testing.assert_close(divergence("kl_rev", p, z, top_k=2), torch.tensor(LN(0.5 / 0.3)), rtol=1e-5, atol=1e-6)


def test_divergences_are_batched_and_js_is_at_most_ln2():
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(64, 50, generator=g) * 4, -1)
    q = torch.softmax(torch.randn(64, 50, generator=g) * 4, -1)
    js = divergence("js", p, q)
    assert js.shape == (64,) and bool((js >= 0).all()) and bool((js <= LN(2) + 1e-6).all())
    disjoint = divergence("js", _t([1.0, 0.0]), _t([0.0, 1.0]))  # the maximum, reached by disjoint supports
    torch.testing.assert_close(disjoint, torch.tensor(LN(2)), rtol=1e-6, atol=1e-6)
    assert float(divergence("tv", p[:1], p[:1])) == 0.0 and float(divergence("js", p[:1], p[:1])) == 0.0


def _gen(engine, policy, prompt, sampling, seed, n=24):
    g = torch.Generator().manual_seed(seed)
    return engine.generate(prompt, policy, n, sampling, g)


def test_fsd_paper_rule_with_zero_threshold_accepts_nothing(tiny_pair):
    target, draft = tiny_pair
    engine = Engine(target, draft, [2])
    for prompt in PROMPTS:
        out = _gen(engine, FSD(0.0, "js", k=3), prompt, SamplingConfig(), 0)
        ref = engine.generate_ar(prompt, 24, SamplingConfig(), None)
        assert out.stats.accepted == 0 and out.stats.drafted > 0
        assert out.tokens == ref.tokens  # every token is the target's: target-exact greedy output


@pytest.mark.parametrize("do_sample", [False, True])
@pytest.mark.parametrize("div", ["js", "kl", "tv"])
def test_fsd_or_rule_with_zero_threshold_is_sd_exactly(tiny_pair, do_sample, div):
    target, draft = tiny_pair
    engine = Engine(target, draft, [2])
    sampling = SamplingConfig(do_sample=do_sample, temperature=0.9)
    for i, prompt in enumerate(PROMPTS):
        policy = FSD(0.0, div, k=4, rule="or")
        fsd = _gen(engine, policy, prompt, sampling, i)
        sd = _gen(engine, StandardSD(4), prompt, sampling, i)
        assert fsd.tokens == sd.tokens and fsd.stats.accepted == sd.stats.accepted
        assert policy.fuzzy_only == 0


def _all_accepted_reference(target, draft, prompt, k, n, eos=2):
    """What a policy that keeps every candidate emits, from full (uncached) forwards: rounds of
    ``min(k, room)`` draft-greedy tokens and the target's greedy token; also the candidate positions."""
    seq, out, cand = list(prompt), [], []

    def argmax(model):
        return int(model(input_ids=torch.tensor([seq])).logits[0, -1].argmax())

    with torch.no_grad():
        while len(out) < n:
            for _ in range(min(k, n - len(out) - 1)):
                cand.append(len(out))
                out.append(argmax(draft))
                seq.append(out[-1])
            out.append(argmax(target))
            seq.append(out[-1])
    if eos in out:
        out = out[: out.index(eos) + 1]
    return out, [c for c in cand if c < len(out)]


@pytest.mark.parametrize("k", [1, 3, 5])
def test_fsd_with_huge_threshold_accepts_every_candidate(tiny_pair, k):
    target, draft = tiny_pair
    engine = Engine(target, draft, [2])
    for prompt in PROMPTS:
        policy = FSD(1e9, "kl", k=k)
        out = _gen(engine, policy, prompt, SamplingConfig(), 0)
        ref, cand = _all_accepted_reference(target, draft, prompt, k, 24)
        assert out.tokens == ref and out.stats.accepted == len(cand)
        # the lenient count: accepted candidates that are not the target's greedy token at their position
        with torch.no_grad():
            top = target(input_ids=torch.tensor([prompt + ref])).logits[0, len(prompt) - 1 : -1].argmax(-1)
        assert policy.fuzzy_only == sum(int(top[c]) != ref[c] for c in cand) > 0
    # one round covering the whole output: the candidates are the draft's own greedy output
    first = _gen(engine, FSD(1e9, "tv", k=5), PROMPTS[0], SamplingConfig(), 0, n=6)
    assert first.tokens[:5] == engine.generate_ar(PROMPTS[0], 5, SamplingConfig(), None, use_draft=True).tokens


def test_fsd_decision_on_a_stub_pair():
    """Bigram stubs with known distributions: the draft's greedy chain from 3 is 1, 2; the target
    agrees after 3 (JS 0) and not after 1 (JS 0.253), so at T = 0.1 the paper rule keeps y_1 = 1,
    rejects y_2 = 2 and emits the target's argmax there (3); just above 0.253 it keeps both."""
    draft = bigram([[0.1, 0.1, 0.1, 0.7], [0.1, 0.1, 0.7, 0.1], [0.7, 0.1, 0.1, 0.1], [0.1, 0.7, 0.1, 0.1]])
    target = bigram([[0.1, 0.1, 0.1, 0.7], [0.1, 0.1, 0.1, 0.7], [0.7, 0.1, 0.1, 0.1], [0.1, 0.7, 0.1, 0.1]])
    engine = Engine(target, draft, [], fused=False)
    js = float(divergence("js", torch.tensor([0.1, 0.1, 0.1, 0.7]), torch.tensor([0.1, 0.1, 0.7, 0.1])))
    # m = [0.1, 0.1, 0.4, 0.4]: both halves are 0.1 ln(0.1 / 0.4) + 0.7 ln(0.7 / 0.4)
    assert abs(js - (0.1 * LN(0.25) + 0.7 * LN(1.75))) < 1e-6
    policy = FSD(0.1, "js", k=2)
    out = engine.generate([3], policy, 3, SamplingConfig(), None)  # round 1: two candidates; round 2: none
    assert out.tokens == [1, 3, 1] and out.stats.accepted == 1 and out.stats.discarded == 1
    assert policy.fuzzy_only == 0
    lenient = FSD(js + 1e-3, "js", k=2)
    out = engine.generate([3], lenient, 3, SamplingConfig(), None)
    assert out.tokens == [1, 2, 0] and out.stats.accepted == 2 and lenient.fuzzy_only == 1
    assert out.stats.counters == {"fuzzy_only": 1}  # the policy's counts, folded into the stats
    # the comparison is strict: at T = 0 even the identical distributions after 3 (JS exactly 0) reject
    out = engine.generate([3], FSD(0.0, "js", k=2), 3, SamplingConfig(), None)
    assert out.tokens == [1, 3, 1] and out.stats.accepted == 0


@pytest.mark.parametrize("threshold, accepted, row", [(0.0, 0, 0), (1e9, 1, 1)])
def test_fsd_sampling_paper_rule_draws_from_p(threshold, accepted, row):
    """One candidate under sampling: rejected (T = 0), the emitted token follows ``p_1`` (not the
    residual, not the draft); accepted (huge T), the bonus follows ``p_2``."""
    p = torch.tensor([[0.4, 0.1, 0.1, 0.4], [0.1, 0.1, 0.1, 0.7]])  # p_1, p_2 (the bonus row)
    q = torch.tensor([0.1, 0.7, 0.1, 0.1])  # the draft's q_1; the candidate is its likeliest token
    policy, g, n = FSD(threshold, "tv", k=1), torch.Generator().manual_seed(0), 4000
    counts = torch.zeros(4)
    for _ in range(n):
        rnd = Round(
            SamplingConfig(do_sample=True),
            g,
            limit=1,
            position=0,
            tokens=[torch.tensor(1)],
            q=[q],
            draft_logits=[q.log()],
        )
        verdict = policy.verify(rnd, p.log(), None)
        assert verdict.accepted == accepted
        counts[verdict.token] += 1
    torch.testing.assert_close(counts / n, p[row], atol=0.03, rtol=0)
    assert policy.fuzzy_only == pytest.approx(n * accepted * (1 - 0.1 / 0.7))  # expected SD rejections of y_1


def test_fsd_sampling_paper_rule_runs_and_is_seeded(tiny_pair):
    target, draft = tiny_pair
    engine = Engine(target, draft, [])  # no EOS: every run has all 24 tokens
    sampling = SamplingConfig(do_sample=True, top_p=0.9)
    for dist in ("raw", "warped"):
        a = _gen(engine, FSD(0.2, "tv", k=3, fsd_dist=dist), PROMPTS[1], sampling, 7)
        b = _gen(engine, FSD(0.2, "tv", k=3, fsd_dist=dist), PROMPTS[1], sampling, 7)
        assert a.tokens == b.tokens and len(a.tokens) == 24


def test_confidence_stop_with_zero_tau_is_sd_at_k_max(tiny_pair):
    target, draft = tiny_pair
    engine = Engine(target, draft, [2])
    for do_sample in (False, True):
        sampling = SamplingConfig(do_sample=do_sample)
        for i, prompt in enumerate(PROMPTS):
            c = _gen(engine, ConfidenceStop(0.0, k_max=5), prompt, sampling, i)
            sd = _gen(engine, StandardSD(5), prompt, sampling, i)
            assert c.tokens == sd.tokens and c.stats.draft_forwards == sd.stats.draft_forwards


@pytest.mark.parametrize("tau", [0.3, 0.9, 1.0])
def test_confidence_stop_is_lossless(tiny_pair, tau):
    target, draft = tiny_pair
    engine = Engine(target, draft, [2])
    for prompt in PROMPTS:
        out = _gen(engine, ConfidenceStop(tau, k_max=6), prompt, SamplingConfig(), 0)
        assert out.tokens == engine.generate_ar(prompt, 24, SamplingConfig(), None).tokens


def test_confidence_stop_stops_after_the_first_unsure_candidate():
    # draft greedy chain: 0 -> 1 (q = 0.9) -> 2 (0.6) -> 3 (0.3) -> 1 (0.8); the target is the same table
    table = [[0.05, 0.9, 0.03, 0.02], [0.2, 0.1, 0.6, 0.1], [0.25, 0.2, 0.25, 0.3], [0.1, 0.8, 0.05, 0.05]]
    engine = Engine(bigram(table), bigram(table), [], fused=False)

    def rounds(tau, k_max, n=10):
        chunks = []
        engine.generate([0], ConfidenceStop(tau, k_max), n, SamplingConfig(), None, on_tokens=chunks.append)
        return chunks

    # stop after y = 3 (0.3 < 0.5): three accepted candidates and the bonus, then from 1: 2, 3 and the bonus
    assert rounds(0.5, 10) == [[1, 2, 3, 1], [2, 3, 1], [2, 3, 1]]
    assert rounds(0.5, 2)[0] == [1, 2, 3]  # k_max caps before confidence does
    assert rounds(0.95, 10)[0] == [1, 2]  # 0.9 < 0.95: one candidate
    assert rounds(0.0, 3)[0] == [1, 2, 3, 1]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"threshold": 0.1, "divergence": "hellinger"}, "unknown divergence 'hellinger'"),
        ({"threshold": -0.1}, r"T=-0.1 must be >= 0"),
        ({"threshold": float("nan")}, "must be >= 0"),
        ({"threshold": 0.1, "rule": "and"}, "rule 'and'"),
        ({"threshold": 0.1, "fsd_dist": "logits"}, "fsd_dist='logits'"),
        ({"threshold": 0.1, "fsd_top_k": -1}, "fsd_top_k=-1"),
    ],
)
def test_bad_fsd_settings(kwargs, match):
    with pytest.raises(UserError, match=match) as err:
        FSD(**kwargs)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("tau", [-0.1, 1.5])
def test_bad_tau(tau):
    with pytest.raises(UserError, match=r"tau=.* must be in \[0, 1\]"):
        ConfidenceStop(tau)


_decode_args = decode_args  # conftest


@pytest.fixture()
def prompts_file(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text(
        "".join(json.dumps({"prompt": p}) + "\n" for p in ["the cat sat", "why is the sun red", "one two three"])
    )
    return path


def test_heads_decode_fsd_and_confidence(tiny_pair_dirs, prompts_file, tmp_path, capsys):
    from specheads.decode.decode_cli import main

    runs = {
        "ar": ["policy=ar"],
        "fsd0": ["policy=fsd", "fsd.T=0", "fsd.k=3"],
        "fsd": ["policy=fsd", "fsd.T=0.3", "fsd.divergence=tv", "fsd.fsd_top_k=5", "fsd.fsd_rule=or", "fsd.k=3"],
        "conf": ["policy=confidence_stop", "confidence_stop.tau=0.5", "confidence_stop.k_max=6"],
    }
    rows = {}
    for name, extra in runs.items():
        assert main(_decode_args(tiny_pair_dirs, prompts_file, tmp_path / name, *extra)) == 0
        rows[name] = [json.loads(x) for x in (tmp_path / name / "outputs.jsonl").read_text().splitlines()]
    tokens = {n: [r["tokens"] for r in rs] for n, rs in rows.items()}
    assert tokens["fsd0"] == tokens["ar"] and tokens["conf"] == tokens["ar"]  # both exact under greedy
    m = json.loads((tmp_path / "fsd" / "metrics.json").read_text())
    settings = (m["divergence"], m["fsd_top_k"], m["fsd_rule"], m["fsd_dist"], m["threshold"])
    assert settings == ("tv", 5, "or", "raw", 0.3)
    assert m["fuzzy_only"] == sum(r["fuzzy_only"] for r in rows["fsd"])
    assert json.loads((tmp_path / "conf" / "metrics.json").read_text())["tau"] == 0.5
    assert json.loads((tmp_path / "fsd0" / "metrics.json").read_text())["accepted"] == 0
    capsys.readouterr()
    bad = _decode_args(
        tiny_pair_dirs, prompts_file, tmp_path / "bad", "policy=fsd", "fsd.T=-1", "fsd.divergence=hellinger"
    )
    assert main(bad) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "T=-1.0 must be >= 0" in err[0] and "unknown divergence 'hellinger'" in err[0]
    assert main(_decode_args(tiny_pair_dirs, prompts_file, tmp_path / "bad2", "policy=fsd")) == 2
    assert "set fsd.T=<value>" in capsys.readouterr().err
    assert (
        main(
            _decode_args(
                tiny_pair_dirs, prompts_file, tmp_path / "bad3", "policy=confidence_stop", "confidence_stop.tau=1.5"
            )
        )
        == 2
    )
    assert "must be in [0, 1]" in capsys.readouterr().err


def test_heads_decode_help_lists_fsd_settings(capsys):
    from specheads.decode.decode_cli import main

    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for needle in ("fsd", "confidence_stop", "divergence:", "fsd_top_k:", "fsd_rule:", "fsd_dist:", "verify_top_k:"):
        assert needle in out


def test_heads_eval_training_free_rows(tiny_pair_dirs, prompts_file, tmp_path, capsys):
    from specheads.evaluate.cli import main

    t, d = tiny_pair_dirs
    out = tmp_path / "ev"
    args = [
        f"target.path={t}",
        "target.gguf_file=null",
        f"draft.path={d}",
        "target.device=cpu",
        "draft.device=cpu",
        f"prompts={prompts_file}",
        f"output_dir={out}",
        "offset=0",
        "num_prompts=null",
        "max_new_tokens=12",
        "head=null",
        "ks=[3]",
        "topk.ks=[2]",
        "topk.k=3",
        "fsd.k=3",
        "oracle=false",
    ]
    extra = ["fsd.js=[0,0.2]", "fsd.tv=[1.5]", "confidence.taus=[0,0.5]", "confidence.k_max=3"]
    assert main(args + extra) == 0
    s = json.loads((out / "sweep.json").read_text())
    names = [r["config"] for r in s["table"]]
    free = ["c0", "c0.5", "c-cost", "c-online-cost", "c-entropy-cost"]
    assert names == ["ar", "draft", "k3", "t2", "fsd-js-0", "fsd-js-0.2", "fsd-tv-1.5", *free]
    tf = s["training_free"]
    assert tf["sd_reference"] == "k3" and tf["quality_metric"] == "ROUGE-L vs target-only outputs"
    assert tf["settings"]["fsd"] == {
        "thresholds": {"js": [0.0, 0.2], "tv": [1.5]},
        "k": 3,
        "rule": "paper",
        "fsd_top_k": 0,
        "fsd_dist": "raw",
        "greedy": True,
    }
    assert tf["settings"]["confidence"] == {"taus": [0.0, 0.5], "k_max": 3, "estimates": ["q", "online", "entropy"]}
    rows = tf["rows"]
    assert set(rows) == {"t2", "fsd-js-0", "fsd-js-0.2", "fsd-tv-1.5", *free}
    assert rows["fsd-js-0"]["accepted_per_call"] == 0 and rows["fsd-js-0"]["quality"] == 1.0  # target-exact
    assert all(rows[c]["quality"] == 1.0 for c in free)  # lossless
    by = {r["config"]: r for r in s["table"]}
    assert rows["fsd-tv-1.5"]["accepted_per_call"] > by["k3"]["accepted_per_call"]
    assert rows["fsd-tv-1.5"]["fuzzy_only"] > 0  # TV <= 1 < T: every candidate, also those SD rejects
    assert rows["fsd-tv-1.5"]["vs_sd_accepted_per_call"] > 1
    assert (out / "quality.png").read_bytes()[:4] == b"\x89PNG" and s["quality_png"].endswith("quality.png")
    run_rows = [json.loads(x) for x in (out / "rows.jsonl").read_text().splitlines()]
    assert all("fuzzy_only" in r for r in run_rows if r["config"].startswith("fsd-"))
    assert json.loads((out / "metrics.json").read_text())["training_free"]["sd_reference"] == "k3"
    capsys.readouterr()
    bad = ["fsd.kl=[-1]", "confidence.taus=[2]", "fsd.rule=xor", f"output_dir={tmp_path / 'bad'}"]
    assert main(args + bad) == 2
    err = capsys.readouterr().err
    assert "every FSD threshold T must be >= 0" in err and "every tau must be in [0, 1]" in err and "'xor'" in err
