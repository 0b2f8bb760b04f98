"""Stop heads on the EAGLE drafter: labels=eagle_rounds (on-policy SD rounds with the head), heads-train
head=eagle_stop on the stored states, and policy=specdecpp / stop=cost drafting with it (lossless, checked
against the EAGLE head it was trained on)."""

from __future__ import annotations

import json
from unittest import mock

import pytest
import torch
from conftest import LABEL_PROMPTS, chunk_rows
from safetensors.torch import load_file

from specheads.datagen.cli import main as datagen_main
from specheads.decode import Decoder
from specheads.decode.api import format_prompt, load_eagle, make_policy
from specheads.decode.decode_cli import main as decode_main
from specheads.errors import UserError
from specheads.evaluate.cli import main as eval_main
from specheads.export import read_metadata, save_head
from specheads.heads import AcceptanceHead, EagleHead
from specheads.shim import ModelSpec, load_pair
from specheads.shim.costs.cost_table import CostTable
from specheads.shim.loop.engine import Engine
from specheads.shim.policies import SpecDecPP
from specheads.train.cli import main as train_main
from specheads.train.eagle_data import init_from_target

PROMPTS = LABEL_PROMPTS[:8]
K = 4


def eagle_file(pair, path, seed: int, fingerprint: str | None = None):
    """An EAGLE head for the tiny target (layer 1 of 2), started from the target as heads-train does."""
    model = pair.target.model
    vocab = model.config.vocab_size
    head = EagleHead(
        hidden_size=32,
        layers=[1],
        draft_vocab_size=vocab,
        vocab_size=vocab,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        intermediate_size=64,
        rms_norm_eps=model.config.rms_norm_eps,
        rope_theta=10000.0,
    )
    init_from_target(head, model, list(range(vocab)), seed)
    save_head(
        path,
        head,
        "eagle",
        {
            "head_config": head.config(),
            "hidden_size": 32,
            "target": {"name": pair.target.name, "fingerprint": fingerprint or pair.target.fingerprint},
            "feature": {"model": "target", "state": "aux", "layers": [1]},
        },
    )
    return path


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tiny_pair_dirs):
    """The tiny target alone, two EAGLE heads for it, a prompt file."""
    root = tmp_path_factory.mktemp("eagle_stop")
    pair = load_pair(ModelSpec(path=str(tiny_pair_dirs[0]), device="cpu"), None)
    prompts = root / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": w}) + "\n" for w in PROMPTS))
    return {
        "root": root,
        "pair": pair,
        "prompts": prompts,
        "target": tiny_pair_dirs[0],
        "eagle": eagle_file(pair, root / "eagle.safetensors", 0),
        "other": eagle_file(pair, root / "other.safetensors", 1),
    }


def rounds_args(s, out, *extra):
    return [
        f"target.path={s['target']}",
        "target.gguf_file=null",
        "target.device=cpu",
        "draft.path=''",
        f"prompts={s['prompts']}",
        f"output_dir={out}",
        "labels=eagle_rounds",
        f"eagle_rounds.head={s['eagle']}",
        f"eagle_rounds.k={K}",
        "max_new_tokens=14",
        "chunk_size=3",
        "threads=1",
        *extra,
    ]


@pytest.fixture(scope="module")
def greedy_rounds(setup):
    out = setup["root"] / "greedy"
    assert datagen_main(rounds_args(setup, out, "sampling.do_sample=false")) == 0
    return out


@pytest.fixture(scope="module")
def sampled_rounds(setup):
    out = setup["root"] / "sampled"
    assert datagen_main(rounds_args(setup, out, "sampling.do_sample=true", "seed=3")) == 0
    return out


def candidates(out):
    """Per stored candidate: (row, its index within the row, prefix, candidate, label, outcome, step)."""
    for r, row in enumerate(chunk_rows(out)):
        for i, (start, step, tok) in enumerate(zip(row["round_start"], row["step"], row["draft_token"])):
            earlier = row["draft_token"][i - step + 1 : i]  # the round's candidates before this one
            yield r, i, row["input_ids"][:start] + earlier, tok, row["label"][i], row["outcome"][i], step


@torch.no_grad()
def test_greedy_labels_are_the_targets_argmax_agreement(greedy_rounds, setup):
    target = setup["pair"].target.model
    seen = {1: 0, 0: 0}
    for _, _, prefix, tok, label, outcome, step in candidates(greedy_rounds):
        agree = int(target(torch.tensor([prefix])).logits[0, -1].argmax()) == tok
        assert label == float(agree)
        assert 1 <= step < K
        seen[int(agree)] += 1
    assert seen[0] and seen[1]  # both classes occur
    rows = chunk_rows(greedy_rounds)
    for row in rows:  # the SD rule's outcome: kept while every label so far is 1, then one rejection
        for i, (step, label, outcome) in enumerate(zip(row["step"], row["label"], row["outcome"])):
            first = i - step + 1
            before = row["label"][first:i]
            want = (1 if label else 0) if all(before) else -1
            assert outcome == want
    manifest = json.loads((greedy_rounds / "manifest.json").read_text())
    assert manifest["eagle_rounds"]["eagle"]["tensors_sha256"] == read_metadata(setup["eagle"])["tensors_sha256"]
    assert manifest["eagle_rounds"]["feature"]["model"] == "eagle" and manifest["draft"] is None
    assert manifest["labelled_tokens"] == sum(len(r["label"]) for r in rows)
    side = load_file(str(greedy_rounds / "states" / "chunk-000000.safetensors"))
    assert side["states"].dtype == torch.float16 and side["states"].shape[1] == 32
    assert datagen_main(["verify", f"output_dir={greedy_rounds}"]) == 0


def test_sampled_labels_are_min_one_p_over_q_and_reproducible(sampled_rounds, setup, tmp_path):
    labels = [(row["label"], row["p_token"], row["q_token"]) for row in chunk_rows(sampled_rounds)]
    for ys, ps, qs in labels:
        for y, p, q in zip(ys, ps, qs):
            assert y == pytest.approx(min(1.0, p / q), rel=1e-5)
    assert 0 < sum(sum(ys) for ys, _, _ in labels) < sum(len(ys) for ys, _, _ in labels)
    again = tmp_path / "again"
    assert datagen_main(rounds_args(setup, again, "sampling.do_sample=true", "seed=3")) == 0
    for name in ("data/chunk-000000.parquet", "states/chunk-000001.safetensors"):
        assert (sampled_rounds / name).read_bytes() == (again / name).read_bytes()
    other = tmp_path / "other"
    assert datagen_main(rounds_args(setup, other, "sampling.do_sample=true", "seed=4", "num_prompts=3")) == 0
    assert [r["draft_token"] for r in chunk_rows(other)] != [r["draft_token"] for r in chunk_rows(sampled_rounds)[:3]]


class Recorder(torch.nn.Module):
    """A stop head that records every feature it scores and never stops the round."""

    features = staticmethod(AcceptanceHead.features)

    def __init__(self, confidence: bool = False):
        super().__init__()
        self.seen, self.confidence = [], confidence

    def forward(self, x):
        self.seen.append(x.detach().clone())
        return torch.tensor(10.0)


def test_the_stored_states_are_what_specdecpp_reads(greedy_rounds, setup):
    """SpecDec++ at k_min = k_max = K drafts the datagen run's rounds; it scores y_1..y_{n-2} of a round of n
    (the newest unscored, reference order; y_n never) from the drafter's post-norm states: the stored rows."""
    pair = setup["pair"]
    eagle = load_eagle(str(setup["eagle"]), pair)
    engine = Engine(pair.target.model, None, pair.eos_token_ids, eagle=eagle.module)
    side = [load_file(str(greedy_rounds / "states" / f"chunk-{c:06d}.safetensors")) for c in range(3)]
    states = torch.cat([s["states"] for s in side])
    offsets, base = [], 0
    for s in side:
        offsets += [base + int(x) for x in s["offsets"][:-1]]
        base += int(s["offsets"][-1])
    for r, row in enumerate(chunk_rows(greedy_rounds)):
        head = Recorder()
        out = engine.generate(row["input_ids"][: row["response_start"]], SpecDecPP(head, 0.5, K, K), 14)
        assert out.tokens == row["input_ids"][row["response_start"] :]
        drafted = {}  # round -> its candidates (one more than it stored)
        for start in row["round_start"]:
            drafted[start] = drafted.get(start, 1) + 1
        keep = [
            offsets[r] + i
            for i, (start, step) in enumerate(zip(row["round_start"], row["step"]))
            if step <= drafted[start] - 2
        ]
        assert len(head.seen) == len(keep)
        torch.testing.assert_close(torch.stack(head.seen), states[keep].float(), atol=2e-3, rtol=2e-3)


def stop_args(data, out, *extra):
    return [
        f"data_dir={data}",
        "head=eagle_stop",
        "draft.path=''",
        f"output_dir={out}",
        "batch_size=2",
        "grad_accum=1",
        "epochs=3",
        "lr=1e-2",
        "eval_fraction=0.25",
        "patience=3",
        "threads=1",
        *extra,
    ]


@pytest.fixture(scope="module")
def stop_head(greedy_rounds, setup):
    out = setup["root"] / "stop"
    assert train_main(stop_args(greedy_rounds, out, "depth=1")) == 0
    return out / "head.safetensors"


def test_the_stop_head_trains_and_exports_for_its_eagle_head(stop_head, setup):
    metrics = json.loads((stop_head.parent / "best_metrics.json").read_text())
    for key in ("eval_binary_kl", "eval_auroc", "eval_auroc_confidence", "eval_ece", "eval_brier", "eval_calibration"):
        assert key in metrics
    meta = read_metadata(stop_head)
    assert meta["head_type"] == "acceptance" and meta["head_config"] == {
        "hidden_size": 32,
        "depth": 1,
        "confidence": True,
    }
    feature = meta["feature"]
    assert feature["model"] == "eagle" and feature["state"] == "post" and feature["position"] == "own"
    assert feature["eagle"]["tensors_sha256"] == read_metadata(setup["eagle"])["tensors_sha256"]
    assert meta["target"]["fingerprint"] == setup["pair"].target.fingerprint


def test_a_linear_stop_head_is_depth_0(greedy_rounds, tmp_path):
    """DSpark's comparison: linear, on the state alone, plain BCE."""
    assert (
        train_main(stop_args(greedy_rounds, tmp_path / "lin", "depth=0", "w_rej=1", "eagle_stop.confidence=false")) == 0
    )
    assert read_metadata(tmp_path / "lin" / "head.safetensors")["head_config"] == {"hidden_size": 32, "depth": 0}


def test_specdecpp_feeds_the_confidence_head_the_stored_log_q(greedy_rounds, setup):
    """A head with the confidence feature gets, beside each scored state, log q(y) of the scored candidate:
    the stored q_token of the same rows."""
    pair = setup["pair"]
    eagle = load_eagle(str(setup["eagle"]), pair)
    engine = Engine(pair.target.model, None, pair.eos_token_ids, eagle=eagle.module)
    row = chunk_rows(greedy_rounds)[0]
    head = Recorder(confidence=True)
    out = engine.generate(row["input_ids"][: row["response_start"]], SpecDecPP(head, 0.5, K, K), 14)
    assert out.tokens == row["input_ids"][row["response_start"] :]
    drafted = {}
    for start in row["round_start"]:
        drafted[start] = drafted.get(start, 1) + 1
    want = [q for q, start, step in zip(row["q_token"], row["round_start"], row["step"]) if step <= drafted[start] - 2]
    got = [float(x[-1]) for x in head.seen]
    assert len(got) == len(want) > 0
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want).log(), atol=1e-4, rtol=1e-4)


def test_eagle_stop_needs_eagle_rounds_data(tmp_path, capsys):
    data = tmp_path / "acceptance"
    data.mkdir()
    (data / "manifest.json").write_text(json.dumps({"labels": "acceptance"}))
    assert train_main(stop_args(data, tmp_path / "x")) == 2
    assert "labels=eagle_rounds" in capsys.readouterr().err


def decode_args(s, out, *extra):
    return [
        f"target.path={s['target']}",
        "target.gguf_file=null",
        "target.device=cpu",
        f"prompts={s['prompts']}",
        "max_new_tokens=12",
        "num_prompts=4",
        f"output_dir={out}",
        *extra,
    ]


def outputs(out):
    return [json.loads(x)["tokens"] for x in (out / "outputs.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def target_alone(setup):
    out = setup["root"] / "ar"
    assert decode_main(decode_args(setup, out, "policy=ar")) == 0
    return outputs(out)


@pytest.mark.parametrize(
    "extra",
    [
        ["policy=specdecpp", "specdecpp.h=0.5"],
        ["policy=specdecpp", "specdecpp.stop=cost", "specdecpp.k_max=6"],
        ["policy=confidence_stop", "confidence_stop.stop=cost", "confidence_stop.k_max=6"],
    ],
    ids=["specdecpp", "specdecpp-cost", "confidence-cost"],
)
def test_heads_decode_with_the_stop_head_equals_the_target_alone(extra, stop_head, setup, target_alone, tmp_path):
    out = tmp_path / "d"
    head = [f"specdecpp.head={stop_head}"] if "policy=specdecpp" in extra else []
    assert decode_main(decode_args(setup, out, *extra, *head, f"eagle={setup['eagle']}")) == 0
    assert outputs(out) == target_alone
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["drafted"] > 0 and metrics["draft_forwards"] > 0


def test_the_python_api_decodes_with_the_stop_head(stop_head, setup):
    pair = setup["pair"]
    eagle = load_eagle(str(setup["eagle"]), pair)
    policy = make_policy("specdecpp", pair, head=str(stop_head), threshold=0.5, eagle=eagle)
    got = Decoder(pair, policy, max_new_tokens=12, eagle=eagle).decode("the cat sat")
    assert got.tokens == Decoder(pair, "ar", max_new_tokens=12).decode("the cat sat").tokens
    assert got.stats.drafted > 0
    other = load_eagle(str(setup["other"]), pair)
    with pytest.raises(UserError, match="another"):
        Decoder(pair, policy, max_new_tokens=12, eagle=other)
    with pytest.raises(UserError, match="eagle="):
        Decoder(pair, policy, max_new_tokens=12)
    with pytest.raises(UserError, match="another"):
        make_policy("specdecpp", pair, head=str(stop_head), eagle=other)


def test_a_head_for_another_drafter_is_a_one_line_error(stop_head, setup, tiny_pair_dirs, tmp_path, capsys):
    def fails(*extra):
        out = tmp_path / str(len(list(tmp_path.iterdir())))
        assert decode_main(decode_args(setup, out, "policy=specdecpp", *extra)) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1
        return err

    assert "another" in fails(f"specdecpp.head={stop_head}", f"eagle={setup['other']}")
    assert "eagle=" in fails(f"specdecpp.head={stop_head}", f"draft.path={tiny_pair_dirs[1]}")
    on_draft = tmp_path / "draft_head.safetensors"
    draft = load_pair(
        ModelSpec(path=str(tiny_pair_dirs[0]), device="cpu"), ModelSpec(path=str(tiny_pair_dirs[1]), device="cpu")
    ).draft
    save_head(
        on_draft,
        AcceptanceHead(32, 0),
        "acceptance",
        {
            "head_config": {"hidden_size": 32, "depth": 0},
            "hidden_size": 32,
            "draft": {"name": draft.name, "fingerprint": draft.fingerprint},
            "feature": {"model": "draft", "state": "post", "layer": -1, "position": "own"},
        },
    )
    assert "draft model's states" in fails(f"specdecpp.head={on_draft}", f"eagle={setup['eagle']}")


@pytest.mark.parametrize(
    "bad, message", [("eagle_rounds.head=''", "eagle_rounds.head="), ("eagle_rounds.k=1", "eagle_rounds.k")]
)
def test_bad_eagle_rounds_settings_are_one_line_errors(bad, message, setup, tmp_path, capsys):
    assert datagen_main(rounds_args(setup, tmp_path / "x", bad)) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


def test_an_eagle_head_for_another_target_is_a_one_line_error(setup, tmp_path, capsys):
    alien = eagle_file(setup["pair"], tmp_path / "alien.safetensors", 0, fingerprint="sha256:another")
    assert datagen_main(rounds_args(setup, tmp_path / "x", f"eagle_rounds.head={alien}")) == 2
    err = capsys.readouterr().err.strip()
    assert "fingerprint" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "x" / "data").exists()


# --- judge.mine_eagle: swap mining on the EAGLE head's mismatches ------------------------------------------------


def test_mining_predicts_the_eagle_heads_first_draft_step(greedy_rounds, setup):
    """eagle_predict's token after a prefix is the candidate the drafter proposed first from that prefix while
    decoding (labels=eagle_rounds, greedy), and it is causal: a later token does not change it."""
    from specheads.datagen.mining import eagle_predict

    pair = setup["pair"]
    head = load_eagle(setup["eagle"], pair).module
    predict = eagle_predict(pair.target.model, head, pad=0)
    firsts = [(prefix, tok) for _, _, prefix, tok, _, _, step in candidates(greedy_rounds) if step == 1]
    assert len(firsts) > 5
    got = predict([p + [t] for p, t in firsts], [[len(p)] for p, _ in firsts])  # one padded batch
    assert [g[0] for g in got] == [tok for _, tok in firsts]
    prefix, tok = firsts[-1]
    assert predict([prefix + [0, 0, 0]], [[len(prefix)]]) == [[tok]]  # what follows p does not count


def test_mining_never_computes_the_targets_logits_or_keeps_every_layer(setup):
    """eagle_predict's target pass runs the decoder body with hooks on the head's layers: no output layer
    (full-vocabulary logits for the batch) and no ``output_hidden_states`` (every layer), which at 405B are
    tens of GB a batch (issue 59 item 3)."""
    from specheads.datagen.mining import eagle_predict

    pair = setup["pair"]
    model = pair.target.model
    head = load_eagle(setup["eagle"], pair).module
    calls = []
    hook = model.get_output_embeddings().register_forward_hook(lambda *a: calls.append("lm_head"))
    real = model.model.forward

    def body(*args, **kwargs):
        calls.append("hidden_states" if kwargs.get("output_hidden_states") else "body")
        return real(*args, **kwargs)

    try:
        with mock.patch.object(model.model, "forward", body):
            eagle_predict(model, head, pad=0)([[1, 2, 3, 4, 5], [6, 7, 8]], [[3, 4], [2]])
    finally:
        hook.remove()
    assert calls == ["body"]


def mine_args(s, out, *extra):
    return [
        "labels=judge",
        "judge.mining=swap",
        f"target.path={s['target']}",
        "target.gguf_file=null",
        "target.device=cpu",
        "draft.path=''",
        f"judge.mine_eagle={s['eagle']}",
        f"prompts={s['prompts']}",
        f"output_dir={out}",
        "max_new_tokens=12",
        "batch_size=4",
        "chunk_size=4",
        "chat_template=false",
        "judge.checker=exact",
        "threads=1",
        *extra,
    ]


def test_swap_mining_on_the_eagle_head_needs_no_draft(setup, tmp_path):
    out = tmp_path / "mined"
    assert datagen_main(mine_args(setup, out)) == 0
    m = json.loads((out / "manifest.json").read_text())
    assert m["mining"]["drafter"] == "eagle:eagle.safetensors" and m["draft"] is None
    assert (
        m["mining"]["mismatches_tried"]
        == m["mining"]["important"] + m["mining"]["unimportant"] + m["mining"]["undetermined"]
        > 0
    )
    head = load_eagle(setup["eagle"], setup["pair"]).module
    from specheads.datagen.mining import eagle_predict

    predict = eagle_predict(setup["pair"].target.model, head, pad=0)
    tok, checked = setup["pair"].tokenizer, 0
    for line in (out / "mined.jsonl").read_text().splitlines():  # a tried token is the head's prediction
        rec = json.loads(line)
        prompt = format_prompt(tok, PROMPTS[rec["prompt_index"]], False)
        for mark in rec["marks"]:  # the final response holds every position before an important mismatch
            if mark["important"] is not False:
                seq = prompt + rec["response_ids"][: mark["position"] + 1]
                want = mark["draft_id"] if len(prompt) + mark["position"] >= 2 else mark["target_id"]
                assert predict([seq], [[len(prompt) + mark["position"]]]) == [[want]]
                checked += 1
    assert checked
    assert datagen_main(["verify", f"output_dir={out}"]) == 0


@pytest.mark.parametrize(
    "extra, message",
    [(("judge.mine_eagle=/no/such/head.safetensors",), "no such file"), (("engine=vllm",), "engine=specheads")],
)
def test_bad_mine_eagle_settings_are_one_line_errors(extra, message, setup, tmp_path, capsys):
    assert datagen_main(mine_args(setup, tmp_path / "x", *extra)) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


def test_mining_with_an_eagle_head_for_another_target_is_a_one_line_error(setup, tmp_path, capsys):
    alien = eagle_file(setup["pair"], tmp_path / "alien.safetensors", 0, fingerprint="sha256:another")
    assert datagen_main(mine_args(setup, tmp_path / "x", f"judge.mine_eagle={alien}")) == 2
    err = capsys.readouterr().err.strip()
    assert "fingerprint" in err and len(err.splitlines()) == 1


# --- heads-eval eagle=: the sweep's same-vocabulary rows on the EAGLE head ----------------------------------


def eval_args(s, out, *extra):
    table = s["root"] / "costs.json"  # a synthetic cost table: no timing decides a test
    if not table.exists():
        table.write_text(
            json.dumps(CostTable(t_draft_ms=0.5, t_target_ms=[4 + 0.5 * k for k in range(1, 12)]).to_dict())
        )
    return [
        f"target.path={s['target']}",
        "target.gguf_file=null",
        "target.device=cpu",
        "draft.path=''",
        f"prompts={s['prompts']}",
        "offset=0",
        "num_prompts=4",
        "max_new_tokens=12",
        f"output_dir={out}",
        f"profile={table}",
        "ks=[1,2,4]",
        "k_min=1",
        f"k_max={K}",
        "head=null",
        *extra,
    ]


def test_heads_eval_sweeps_the_eagle_head(stop_head, setup, tmp_path, capsys):
    out = tmp_path / "ev"
    assert (
        eval_main(
            eval_args(
                setup,
                out,
                f"eagle={setup['eagle']}",
                f"head={stop_head}",
                "thresholds=[0.5]",
                "confidence.taus=[0.5]",
                "trees=[3x2x5,4x2x6-cost]",
            )
        )
        == 0
    )
    printed = capsys.readouterr().out
    s = json.loads((out / "sweep.json").read_text())
    by = {r["config"]: r for r in s["table"]}
    assert list(by) == [
        "ar",
        "k1",
        "k2",
        "k4",
        "h0.5",
        "h-cost",
        "tree-3x2x5",
        "tree-4x2x6-cost",
        "c0.5",
        "c-cost",
        "c-online-cost",
        "c-entropy-cost",
    ]  # no draft model: no draft row
    rows = [json.loads(x) for x in (out / "rows.jsonl").read_text().splitlines()]
    ar = {r["index"]: r["tokens"] for r in rows if r["config"] == "ar"}
    assert len(rows) == 4 * len(by) and all(r["tokens"] == ar[r["index"]] for r in rows)  # greedy, lossless
    for name in by:
        if name != "ar":
            assert sum(r["drafted"] for r in rows if r["config"] == name) > 0, name
    sha = read_metadata(setup["eagle"])["tensors_sha256"]
    manifest = json.loads((out / "manifest.json").read_text())
    assert s["eagle"]["tensors_sha256"] == manifest["eagle"]["tensors_sha256"] == sha
    assert s["eagle"]["path"] == str(setup["eagle"]) and manifest["draft"] is None and "EAGLE head" in printed
    assert s["t_draft_ms"] == 0.5 and "EAGLE" in s["t_draft_source"]  # the head's step, from the cost table
    assert by["k4"]["gflops_per_token"] > by["ar"]["gflops_per_token"]  # the head's forwards are counted
    # the oracle: SD at k_max's rounds with only their accepted candidates drafted
    k4 = [r for r in rows if r["config"] == "k4"]
    o, p = s["oracle"], s["perfect_head"]
    assert o["tokens"] == by["ar"]["tokens"] and o["discard_rate"] == 0
    assert o["target_calls"] == p["target_calls"] == sum(r["target_calls"] for r in k4)
    assert o["draft_forwards"] == sum(r["accepted"] for r in k4) <= p["draft_forwards"]
    best = max(by[k]["tokens_per_call"] for k in ("k1", "k2", "k4"))  # rounded to 4 decimals
    assert o["tokens"] / o["target_calls"] >= best - 5e-5 and o["target_calls"] < o["tokens"]
    assert "oracle_gain_fraction" in s["ratios"] and "share_of_perfect_head_gain" in s["ratios"]
    assert set(s["calibration"]) == {"h0.5", "h-cost"}


def test_heads_eval_eagle_rows_run_batched(stop_head, setup, tmp_path):
    """batch_size=2: the chain rows (the stop head's included) decode in batches, trees at batch 1; all lossless."""
    out = tmp_path / "ev"
    assert (
        eval_main(
            eval_args(
                setup,
                out,
                f"eagle={setup['eagle']}",
                f"head={stop_head}",
                "thresholds=[0.5]",
                "ks=[2]",
                "trees=[3x2x5]",
                "batch_size=2",
            )
        )
        == 0
    )
    rows = [json.loads(x) for x in (out / "rows.jsonl").read_text().splitlines()]
    ar = {r["index"]: r["tokens"] for r in rows if r["config"] == "ar"}
    assert {r["config"] for r in rows} == {"ar", "k2", "h0.5", "h-cost", "tree-3x2x5"}
    assert all(r["tokens"] == ar[r["index"]] for r in rows)
    assert sum(r["drafted"] for r in rows if r["config"] == "k2") > 0
    batched = {r["config"] for r in rows if "latency_s" in r}  # a batched row's own time in its batch
    assert batched == {"ar", "k2", "h0.5", "h-cost"}


@pytest.mark.parametrize(
    "extra, message",
    [
        (["sprinter.head=v.safetensors"], "sprinter.head="),
        (["hetero.methods=[tli]"], "hetero.methods="),
        (["rows=[{policy: fsd, settings: {head: f.safetensors, divergence: js}, sweep: {T: [0.1]}}]"], "fsd"),
    ],
)
def test_heads_eval_eagle_with_draft_model_rows_is_a_one_line_error(extra, message, setup, tmp_path, capsys):
    if extra[0].startswith("sprinter.head="):  # a verifier on the draft model's states (head=verifier)
        from specheads.heads import VerifierHead

        meta = {"head_config": {"in_features": 32, "depth": 0}, "hidden_size": 32}
        meta["feature"] = {"model": "draft", "state": "post", "layer": -1, "position": "previous"}
        save_head(tmp_path / "v.safetensors", VerifierHead(32, 0), "verifier", meta)
        extra = [f"sprinter.head={tmp_path / 'v.safetensors'}"]
    assert eval_main(eval_args(setup, tmp_path / "x", f"eagle={setup['eagle']}", *extra)) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "eagle=" in err and len(err.splitlines()) == 1


def test_heads_eval_runs_the_lossy_training_free_rows_on_the_eagle_head(setup, tmp_path):
    """FSD (no head) and relaxed acceptance (top-K within delta nats of the top token) draft with the EAGLE
    head: relaxed with delta 0 is lossless (greedy SD), with a huge delta it is top-K."""
    out = tmp_path / "ev"
    relaxed = "{policy: topk_verify, settings: {k: 2, verify_top_k: 3}, sweep: {verify_delta: [0.0, 1000.0]}, "
    relaxed += "name: r-top3-}"
    extra = ["fsd.js=[0.3]", "fsd.k=2", "topk.ks=[3]", "topk.k=2", f"rows=[{relaxed}]", "ks=[2]"]
    assert eval_main(eval_args(setup, out, f"eagle={setup['eagle']}", *extra)) == 0
    rows = [json.loads(x) for x in (out / "rows.jsonl").read_text().splitlines()]
    by = {}
    for r in rows:
        by.setdefault(r["config"], {})[r["index"]] = r["tokens"]
    assert {"ar", "k2", "fsd-js-0.3", "t3", "r-top3-0", "r-top3-1000"} <= set(by)
    assert by["r-top3-0"] == by["ar"] and by["r-top3-1000"] == by["t3"]
    assert sum(r["drafted"] for r in rows if r["config"] == "fsd-js-0.3") > 0


@pytest.mark.parametrize(
    "extra, message",
    [
        (["trees=[3x2]"], "DEPTHxWIDTHxNODES"),
        (["trees=[3x0x5]"], ">= 1"),
        (["trees=[3x2x5-fast]"], "-cost"),
        (["trees=[3x2x5]", "sampling.do_sample=true"], "greedily"),
    ],
)
def test_bad_trees_are_one_line_errors(extra, message, setup, tmp_path, capsys):
    assert eval_main(eval_args(setup, tmp_path / "x", f"eagle={setup['eagle']}", *extra)) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1
    assert eval_main(eval_args(setup, tmp_path / "y", "trees=[3x2x5]")) == 2  # no EAGLE head
    assert "set eagle=" in capsys.readouterr().err


def test_heads_eval_eagle_for_another_target_or_stop_head_is_a_one_line_error(stop_head, setup, tmp_path, capsys):
    def fails(*extra):
        out = tmp_path / str(len(list(tmp_path.iterdir())))
        assert eval_main(eval_args(setup, out, *extra)) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1
        return err

    alien = eagle_file(setup["pair"], tmp_path / "alien.safetensors", 0, fingerprint="sha256:another")
    assert "fingerprint" in fails(f"eagle={alien}")
    assert "another" in fails(f"eagle={setup['other']}", f"head={stop_head}", "thresholds=[0.5]")
    assert "draft.path" in fails()  # neither a draft model nor an EAGLE head
