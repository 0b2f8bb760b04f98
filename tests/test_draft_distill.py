"""``heads-train head=draft``: a standalone draft distilled on ``labels=drafter`` data of a tiny 4-layer target
(DistillSpec). The divergences against hand-computed values; training raises held-out agreement; the written
directory loads in Transformers (assisted generation) and in the engine, where greedy SD equals the target
alone; same seed and a resumed run give the same weights; bad settings are one-line errors."""

from __future__ import annotations

import json
import math
import random

import pytest
import torch
from conftest import WORDS, make_tokenizer
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, LlamaConfig

from specheads.shim import Engine, ModelSpec, SamplingConfig, StandardSD, load_pair
from specheads.train import distill as D
from specheads.train.cli import main


@pytest.fixture(scope="module")
def setting(tmp_path_factory):
    """A tied 4-layer target (as SmolLM2 is) and ``labels=drafter`` data of 60 prompts, greedy, top-8."""
    from specheads.datagen.cli import main as datagen

    root = tmp_path_factory.mktemp("distill")
    tok = make_tokenizer()
    cfg = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
        initializer_range=0.3,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(root / "target")
    tok.save_pretrained(root / "target")
    rng = random.Random(0)
    prompts = root / "p.jsonl"
    prompts.write_text(
        "".join(
            json.dumps({"prompt": " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 6)))}) + "\n"
            for _ in range(60)
        )
    )
    for name, offset in (("dg", 0), ("dg2", 40)):
        assert (
            datagen(
                [
                    f"target.path={root / 'target'}",
                    "target.gguf_file=null",
                    f"draft.path={root / 'target'}",
                    "target.device=cpu",
                    "draft.device=cpu",
                    f"prompts={prompts}",
                    f"output_dir={root / name}",
                    "num_prompts=null" if name == "dg" else "num_prompts=20",
                    f"offset={offset}",
                    "max_new_tokens=12",
                    "batch_size=8",
                    "chunk_size=8",
                    "labels=drafter",
                    "drafter.top_k=8",
                    "sampling.do_sample=false",
                ]
            )
            == 0
        )
    return root


def args(root, out, *extra):
    return [
        f"data_dir={root / 'dg'}",
        "head=draft",
        "distill.init=truncate:2",
        f"target.path={root / 'target'}",
        "target.gguf_file=null",
        "draft.gguf_file=null",
        f"output_dir={out}",
        "batch_size=4",
        "grad_accum=1",
        "epochs=3",
        "lr=3e-3",
        "eval_fraction=0.2",
        "patience=3",
        "threads=1",
        *extra,
    ]


@pytest.fixture(scope="module")
def trained(setting):
    out = setting / "tr"
    assert main(args(setting, out)) == 0
    return out


def test_bucketed_divergences_match_hand_computed_values():
    """K=2 of V=4 (one id outside a pruned subset: its mass joins the bucket); every divergence by hand."""
    logits = torch.tensor([[1.0, 0.0, -1.0, 0.5]])
    q = torch.softmax(logits, -1)[0].tolist()
    p_top = [0.6, 0.3]
    got_q, got_p, ok = D.bucketed(logits, torch.tensor([[0, 3]]), torch.log(torch.tensor([p_top])))
    Q, P = [q[0], q[3], q[1] + q[2]], [0.6, 0.3, 0.1]
    torch.testing.assert_close(got_q.exp()[0], torch.tensor(Q))
    torch.testing.assert_close(got_p.exp()[0], torch.tensor(P))
    m = [(a + b) / 2 for a, b in zip(P, Q)]
    want = {
        "fkl": sum(a * math.log(a / b) for a, b in zip(P, Q)),
        "rkl": sum(b * math.log(b / a) for a, b in zip(P, Q)),
        "js": 0.5 * sum(a * math.log(a / c) + b * math.log(b / c) for a, b, c in zip(P, Q, m)),
        "tvd": 0.5 * sum(abs(a - b) for a, b in zip(P, Q)),
    }
    for kind, value in want.items():
        torch.testing.assert_close(D.divergence(got_q, got_p, ok, kind), torch.tensor([value]))
    # a top-k id outside the subset (-1): no entry of its own, its 0.3 in the target's bucket
    lq, lp, ok = D.bucketed(logits, torch.tensor([[0, -1]]), torch.log(torch.tensor([p_top])))
    assert ok.tolist() == [[True, False, True]]
    torch.testing.assert_close(lp.exp()[0, [0, 2]], torch.tensor([0.6, 0.4]))
    torch.testing.assert_close(lq.exp()[0, [0, 2]], torch.tensor([q[0], 1 - q[0]]))
    stats = {}
    D.loss_and_stats(logits, {"tid": torch.tensor([[0, 3]]), "logp": torch.log(torch.tensor([p_top]))}, "fkl", stats)
    assert stats["hits"] == 1 and stats["accept"] == pytest.approx(min(0.6, q[0]) + min(0.3, q[3]))


def test_distillation_raises_agreement_and_writes_a_draft_every_loader_reads(setting, trained):
    metrics = json.loads((trained / "metrics.json").read_text())
    assert metrics["after"]["agreement"] > metrics["before"]["agreement"] + 0.05
    rows = [json.loads(x) for x in (trained / "metrics.jsonl").read_text().splitlines()]
    losses = {e: [r["loss"] for r in rows if "loss" in r and r["epoch"] == e] for e in range(3)}
    assert sum(losses[2]) / len(losses[2]) < 0.8 * sum(losses[0]) / len(losses[0])
    manifest = json.loads((trained / "manifest.json").read_text())
    assert manifest["head"] == "draft" and manifest["eval_before"]["eval_agreement"] == metrics["before"]["agreement"]
    meta = json.loads((trained / "draft" / "specheads.json").read_text())
    assert meta["divergence"] == "fkl" and meta["draft_init"] == "truncate:2" and meta["data"]["top_k"] == 8
    data_manifest = json.loads((setting / "dg" / "manifest.json").read_text())
    assert meta["target"]["fingerprint"] == data_manifest["target"]["fingerprint"]
    draft = AutoModelForCausalLM.from_pretrained(trained / "draft", dtype=torch.float32).eval()
    assert draft.config.num_hidden_layers == 2 and draft.config.specheads["divergence"] == "fkl"
    assert draft.lm_head.weight.data_ptr() == draft.model.embed_tokens.weight.data_ptr()  # still tied
    target = AutoModelForCausalLM.from_pretrained(setting / "target", dtype=torch.float32).eval()
    ids = torch.tensor([[1, 5, 9, 12, 7]])
    alone = target.generate(ids, max_new_tokens=16, do_sample=False, min_new_tokens=16)
    assisted = target.generate(ids, assistant_model=draft, max_new_tokens=16, do_sample=False, min_new_tokens=16)
    assert torch.equal(alone, assisted)
    pair = load_pair(
        ModelSpec(path=str(setting / "target"), device="cpu"), ModelSpec(path=str(trained / "draft"), device="cpu")
    )
    engine = Engine(pair.target.model, pair.draft.model, eos_token_ids=[])
    greedy = SamplingConfig(do_sample=False)
    for prompt in ([1, 5, 9, 12, 7], [1, 20, 3], [1, 8, 8, 30, 11, 4]):
        ar = engine.generate_ar(prompt, 24, greedy)
        sd = engine.generate(prompt, StandardSD(3), 24, greedy)
        assert sd.tokens == ar.tokens
        assert sd.stats.target_calls < 24  # the draft's tokens are accepted: fewer target calls than tokens


def test_same_seed_same_weights_and_a_resumed_run_ends_the_same(setting, trained, monkeypatch):
    from specheads.train import checkpoint

    again, cut = setting / "again", setting / "cut"
    assert main(args(setting, again)) == 0
    save = checkpoint.save

    def killed_after_first_checkpoint(*a, **k):
        save(*a, **k)
        raise KeyboardInterrupt

    monkeypatch.setattr(checkpoint, "save", killed_after_first_checkpoint)
    assert main(args(setting, cut)) == 130
    monkeypatch.setattr(checkpoint, "save", save)
    assert main(args(setting, cut)) == 0
    want = load_file(trained / "draft" / "model.safetensors")
    for other in (again, cut):
        got = load_file(other / "draft" / "model.safetensors")
        assert got.keys() == want.keys()
        for k in want:
            assert torch.equal(got[k], want[k]), k


def test_continue_from_a_directory_frozen_embeddings_pruned_vocab_two_data_sets(setting, trained):
    ranking = setting / "vocab.json"
    size = len(make_tokenizer())
    ranking.write_text(json.dumps({"format": "specheads-vocab", "ranking": list(range(3, size)), "vocab_size": size}))
    out = setting / "more"
    assert (
        main(
            args(
                setting,
                out,
                f"data_dir={setting / 'dg'},{setting / 'dg2'}",
                f"distill.init={trained / 'draft'}",
                "distill.freeze_embeddings=true",
                f"vocab_file={ranking}",
                "vocab_top_n=20",
                "distill.divergence=js",
                "epochs=1",
            )
        )
        == 0
    )
    meta = json.loads((out / "draft" / "specheads.json").read_text())
    assert meta["draft_vocab"]["size"] == 20 and meta["divergence"] == "js"
    assert meta["data"]["dirs"] == [str(setting / "dg"), str(setting / "dg2")]
    assert meta["draft_init"] == str(trained / "draft")
    pair = load_pair(
        ModelSpec(path=str(setting / "target"), device="cpu"),  # decoded with the subset it trained
        ModelSpec(path=str(out / "draft"), device="cpu", vocab_file=str(out / "draft" / "vocab.json")),
    )
    assert pair.draft.vocab["size"] == 20 and pair.draft.vocab["sha256"] == meta["draft_vocab"]["sha256"]
    engine, greedy = Engine(pair.target.model, pair.draft.model, eos_token_ids=[]), SamplingConfig(do_sample=False)
    prompt = [1, 5, 9, 12, 7]
    assert engine.generate(prompt, StandardSD(3), 20, greedy).tokens == engine.generate_ar(prompt, 20, greedy).tokens
    before, after = load_file(trained / "draft" / "model.safetensors"), load_file(out / "draft" / "model.safetensors")
    assert torch.equal(before["model.embed_tokens.weight"], after["model.embed_tokens.weight"])
    assert not torch.equal(before["model.layers.0.mlp.up_proj.weight"], after["model.layers.0.mlp.up_proj.weight"])
    for kind in ("rkl", "tvd"):
        assert main(args(setting, setting / kind, f"distill.divergence={kind}", "max_steps=3", "epochs=1")) == 0
        rows = [json.loads(x) for x in (setting / kind / "metrics.jsonl").read_text().splitlines()]
        assert all(math.isfinite(r["loss"]) for r in rows if "loss" in r)


@pytest.mark.parametrize(
    "bad, message",
    [
        ("distill.init=truncate:0", "truncate:N with N >= 1"),
        ("distill.init=truncate:x", "truncate:N with N >= 1"),
        ("distill.init=truncate:9", "the target has 4 decoder layers"),
        ("distill.divergence=kl", "distill.divergence='kl': choose one of fkl, rkl, js, tvd"),
        ("eval_fraction=0", "set eval_fraction > 0"),
        ("distill.init=/nonexistent/draft", "does not exist"),
    ],
)
def test_bad_settings_are_one_line_errors(setting, tmp_path, capsys, bad, message):
    assert main(args(setting, tmp_path / "bad", bad)) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert len(err) == 1 and message in err[0] and "Traceback" not in err[0]
