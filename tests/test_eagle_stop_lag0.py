"""The lag-0 stop head on the EAGLE drafter: labels=eagle_rounds eagle_rounds.position=previous stores every
candidate with the state that drew it and the signals of its distribution; heads-train head=eagle_stop
eagle_stop.signals=[...] fits a head on them; policy=specdecpp scores each candidate as it is drawn, from exactly the
stored features."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import chunk_rows
from safetensors.torch import load_file
from test_eagle_stop import (  # noqa: F401  (PROMPTS: the setup's)
    PROMPTS,
    K,
    Recorder,
    rounds_args,
    setup,  # noqa: F401  (the module fixture)
    stop_args,
)

from specheads.datagen.cli import main as datagen_main
from specheads.decode.api import load_eagle
from specheads.decode.decode_cli import main as decode_main
from specheads.export import read_metadata
from specheads.heads.acceptance_head import AcceptanceHead, signal_values
from specheads.shim.core.sampling import SamplingConfig
from specheads.shim.loop.engine import Engine
from specheads.shim.policies import SpecDecPP
from specheads.train.cli import main as train_main

SIGNALS = ("entropy", "margin", "step")


class SignalRecorder(Recorder):
    signals = SIGNALS

    def __init__(self):
        super().__init__(confidence=True)


@pytest.fixture(scope="module", params=["greedy", "sampled"])
def lag0_rounds(request, setup):  # noqa: F811
    out = setup["root"] / f"lag0-{request.param}"
    sampling = ["sampling.do_sample=false"] if request.param == "greedy" else ["sampling.do_sample=true", "seed=5"]
    assert datagen_main(rounds_args(setup, out, "eagle_rounds.position=previous", *sampling)) == 0
    return out, request.param == "greedy"


def _stored(out):
    side = [load_file(str(p)) for p in sorted((out / "states").glob("chunk-*.safetensors"))]
    states, offsets, base = [], [], 0
    for s in side:
        states.append(s["states"])
        offsets += [base + int(x) for x in s["offsets"][:-1]]
        base += int(s["offsets"][-1])
    return torch.cat(states), offsets


def test_every_candidate_is_stored_with_the_state_that_drew_it(lag0_rounds, setup):  # noqa: F811
    """Per round of n candidates, steps 1..n are stored (lag 1 stores 1..n-1), and policy=specdecpp at lag 0
    scores each as soon as it is drawn (but the round's last, where no decision is left), from the stored
    state, log q(y) and signals."""
    out, greedy = lag0_rounds
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["eagle_rounds"]["feature"]["position"] == "previous"
    pair = setup["pair"]
    eagle = load_eagle(str(setup["eagle"]), pair)
    engine = Engine(pair.target.model, None, pair.eos_token_ids, eagle=eagle.module)
    states, offsets = _stored(out)
    sampling = SamplingConfig() if greedy else SamplingConfig(do_sample=True)
    seen_last = False
    for r, row in enumerate(chunk_rows(out)):
        assert min(row["step"]) == 1 and max(row["step"]) <= K
        head = SignalRecorder()
        gen = None
        if not greedy:  # the datagen run's draws for this prompt
            from specheads.datagen.eagle_rounds import stream

            gen = torch.Generator().manual_seed(stream(5, row["prompt_index"]))
        policy = SpecDecPP(head, 0.5, K, K, position="previous")
        got = engine.generate(row["input_ids"][: row["response_start"]], policy, 14, sampling, gen)
        assert got.tokens == row["input_ids"][row["response_start"] :]
        drafted: dict[int, int] = {}  # round -> its candidates (all stored)
        for start in row["round_start"]:
            drafted[start] = drafted.get(start, 0) + 1
        keep = [i for i, (start, step) in enumerate(zip(row["round_start"], row["step"])) if step < drafted[start]]
        assert len(head.seen) == len(keep) > 0  # every candidate with a decision after it, scored as drawn
        seen = torch.stack(head.seen)
        at = torch.tensor(keep)
        torch.testing.assert_close(seen[:, :32], states[offsets[r] + at].float(), atol=2e-3, rtol=2e-3)
        logq = torch.tensor(row["q_token"])[at].log()
        col = lambda name: torch.tensor(row[name])[at]  # noqa: E731
        want = signal_values(SIGNALS, col("q_entropy"), col("q_margin"), col("step"))
        torch.testing.assert_close(seen[:, 32], logq, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(seen[:, 33:], want, atol=1e-4, rtol=1e-4)
        seen_last |= any(s == K for s in row["step"])
    assert seen_last  # a round's last candidate is stored too


def test_a_lag0_head_with_signals_trains_exports_and_decodes_losslessly(lag0_rounds, setup, tmp_path):  # noqa: F811
    out, greedy = lag0_rounds
    if not greedy:
        pytest.skip("one training run suffices")
    trained = tmp_path / "stop"
    assert train_main(stop_args(out, trained, "depth=1", "eagle_stop.signals=[step,entropy,margin]")) == 0
    meta = read_metadata(trained / "head.safetensors")
    assert meta["head_config"] == {"hidden_size": 32, "depth": 1, "confidence": True, "signals": list(SIGNALS)}
    assert meta["feature"]["position"] == "previous"
    metrics = json.loads((trained / "best_metrics.json").read_text())
    assert metrics["eval_decision_rows"] > 0 and "eval_auroc_decisions" in metrics
    ar, ours = tmp_path / "ar", tmp_path / "ours"
    common = [
        f"target.path={setup['target']}",
        "target.gguf_file=null",
        "target.device=cpu",
        f"prompts={setup['prompts']}",
        "max_new_tokens=12",
        "num_prompts=4",
    ]
    assert decode_main([*common, f"output_dir={ar}", "policy=ar"]) == 0
    head = f"specdecpp.head={trained / 'head.safetensors'}"
    assert (
        decode_main(
            [
                *common,
                f"output_dir={ours}",
                "policy=specdecpp",
                "specdecpp.stop=cost",
                "specdecpp.k_max=6",
                head,
                f"eagle={setup['eagle']}",
            ]
        )
        == 0
    )
    read = lambda d: [json.loads(x)["tokens"] for x in (d / "outputs.jsonl").read_text().splitlines()]  # noqa: E731
    assert read(ours) == read(ar)


@pytest.mark.parametrize(
    "extra,message",
    [
        (["eagle_stop.signals=[vibes]"], "eagle_stop.signals=['vibes']"),
        (
            ["eagle_stop.signals=[step]", "eagle_stop.confidence=false"],
            "eagle_stop.signals needs eagle_stop.confidence=true",
        ),
    ],
)
def test_bad_signals_are_one_line_errors(lag0_rounds, tmp_path, capsys, extra, message):
    out, _ = lag0_rounds
    assert train_main(stop_args(out, tmp_path / "x", *extra)) == 2
    assert message in capsys.readouterr().err


def test_the_head_refuses_signals_without_confidence():
    with pytest.raises(ValueError, match="signals"):
        AcceptanceHead(8, 1, confidence=False, signals=("step",))


def test_q_calibrated_on_log_q_and_step_is_a_stateless_linear_head(lag0_rounds, setup, tmp_path):  # noqa: F811
    """depth=0 eagle_stop.state=false eagle_stop.signals=[step]: Platt scaling of q(y) on [log q, step], fitted on
    the same data; it decodes losslessly and reads no state."""
    out, greedy = lag0_rounds
    if not greedy:
        pytest.skip("one training run suffices")
    trained = tmp_path / "platt"
    args = stop_args(out, trained, "depth=0", "eagle_stop.state=false", "eagle_stop.signals=[step]", "w_rej=1")
    assert train_main(args) == 0
    meta = read_metadata(trained / "head.safetensors")
    assert meta["head_config"] == {"hidden_size": 0, "depth": 0, "confidence": True, "signals": ["step"]}
    from specheads.export import load_head

    head = load_head(trained / "head.safetensors").module
    assert sum(p.numel() for p in head.parameters()) == 3  # w_logq, w_step, bias
    _decodes_as_the_target_alone(head, setup)


def _decodes_as_the_target_alone(head, setup) -> None:  # noqa: F811
    """SD on the EAGLE head, stopped by ``head`` at lag 0, gives the target alone's tokens and drafts."""
    from specheads.shim.policies import TargetOnly

    pair = setup["pair"]
    eagle = load_eagle(str(setup["eagle"]), pair)
    engine = Engine(pair.target.model, None, pair.eos_token_ids, eagle=eagle.module)
    alone = Engine(pair.target.model, None, pair.eos_token_ids)
    for ids in ([5, 9, 11], [7, 3, 40]):
        got = engine.generate(ids, SpecDecPP(head, 0.5, 1, 6, position="previous"), 12)
        assert got.tokens == alone.generate(ids, TargetOnly(), 12).tokens and got.stats.drafted > 0


def test_stop_state_false_needs_the_confidence_feature(lag0_rounds, tmp_path, capsys):
    out, _ = lag0_rounds
    assert train_main(stop_args(out, tmp_path / "x", "eagle_stop.state=false", "eagle_stop.confidence=false")) == 2
    assert "eagle_stop.state=false needs eagle_stop.confidence=true" in capsys.readouterr().err


def test_the_signals_of_a_warped_distribution_with_zeros_are_finite_and_exact():
    """Top-k/top-p leave zeros in q (log q = -inf): the entropy counts them as 0 log 0 = 0, the margin stays finite."""
    from specheads.heads.acceptance_head import distribution_signals

    q = torch.softmax(torch.randn(5, 100, generator=torch.Generator().manual_seed(0)), -1)
    q[:, :50] = 0
    q /= q.sum(-1, keepdim=True)
    ent, margin = distribution_signals(q.log())
    torch.testing.assert_close(ent, -torch.special.xlogy(q, q).sum(-1), atol=1e-6, rtol=1e-6)
    top = q.topk(2).values.log()
    torch.testing.assert_close(margin, top[:, 0] - top[:, 1])
    point = torch.full((10,), float("-inf"))
    point[3] = 0.0
    ent, margin = distribution_signals(point)
    assert float(ent) == 0.0 and float(margin) == 30.0  # a point mass: capped margin


def test_a_skip_head_starts_as_the_drafters_confidence():
    """skip=True: the logit is linear in [log q(y), signals] plus the residual body, which starts at zero, so an
    untrained head ranks candidates exactly as q(y) does, whatever the state."""
    head = AcceptanceHead(8, 2, confidence=True, signals=("step",), skip=True)
    state, logq = torch.randn(5, 8), torch.rand(5).log()
    x = AcceptanceHead.features(state, logq, torch.rand(5, 1))
    assert torch.equal(head(x), logq) and head.config()["skip"] is True
    with torch.no_grad():
        head.out.weight.fill_(0.1)  # once trained, the state moves it
    assert not torch.allclose(head(x), logq)
    assert "skip" not in AcceptanceHead(8, 2, confidence=True).config()
    with pytest.raises(ValueError, match="needs confidence=True"):
        AcceptanceHead(8, 1, skip=True)


def test_a_skip_head_trains_exports_and_decodes_losslessly(lag0_rounds, setup, tmp_path, capsys):  # noqa: F811
    out, greedy = lag0_rounds
    if not greedy:
        pytest.skip("one training run suffices")
    assert train_main(stop_args(out, tmp_path / "x", "eagle_stop.skip=true", "eagle_stop.confidence=false")) == 2
    assert (
        "eagle_stop.skip=true starts the head at log q(y): it needs eagle_stop.confidence=true"
        in capsys.readouterr().err
    )
    trained = tmp_path / "skip"
    assert train_main(stop_args(out, trained, "depth=1", "eagle_stop.skip=true", "eagle_stop.signals=[step]")) == 0
    meta = read_metadata(trained / "head.safetensors")
    # the learned head, or (chosen on the held-out rounds) the calibrated q alone: no state, no body
    width, depth = (32, 1) if meta["extra"]["train"]["chosen"] == "learned" else (0, 0)
    want = {"hidden_size": width, "depth": depth, "confidence": True, "signals": ["step"], "skip": True}
    assert meta["head_config"] == want
    from specheads.export import load_head

    head = load_head(trained / "head.safetensors").module
    assert head.skip is not None and head.skip.weight.shape == (1, 2)
    _decodes_as_the_target_alone(head, setup)


def test_a_skip_head_is_at_worst_the_calibrated_q_on_held_out_rounds(lag0_rounds, tmp_path):
    """skip=True fits the linear part alone first (q calibrated on [log q, signals]); after training, the calibrated q
    is set against the best epoch on the held-out rounds and the better one is the run's head."""
    out, greedy = lag0_rounds
    if not greedy:
        pytest.skip("one training run suffices")
    trained = tmp_path / "floor"
    assert train_main(stop_args(out, trained, "depth=1", "eagle_stop.skip=true", "eagle_stop.signals=[step]")) == 0
    best = json.loads((trained / "best_metrics.json").read_text())
    assert best["chosen"] in ("learned", "calibrated_q")
    assert best["eval_binary_kl"] <= best["calibrated_q_eval_binary_kl"] + 1e-9  # never worse than the floor
    meta = read_metadata(trained / "head.safetensors")
    assert meta["extra"]["train"]["chosen"] == best["chosen"]
    from specheads.export import load_head

    head = load_head(trained / "head.safetensors").module
    if best["chosen"] == "calibrated_q":  # the fitted line alone: no state read, no body
        assert meta["head_config"]["hidden_size"] == 0 and meta["head_config"]["depth"] == 0
        assert not head.out.weight.any() and not head.out.bias.any()
    # the linear part was fitted: not the identity on log q it starts from
    assert not torch.equal(head.skip.weight, torch.tensor([[1.0, 0.0]])) or head.skip.bias.item() != 0.0
