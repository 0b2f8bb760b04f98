"""Draft vocabulary pruning: the ranking step, the pruned output layer, losslessness, head metadata."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from conftest import Q_ROWS, SAMPLINGS, BigramLM, chunk_rows, datagen_args, perturbed_copy, sd_pvalue

from specheads.datagen import vocab_ranking as vocab_cli
from specheads.datagen.cli import main as datagen_main
from specheads.errors import UserError
from specheads.export.package import check_draft_vocab, check_head_against_pair
from specheads.shim.core.sampling import SamplingConfig, usable_logits
from specheads.shim.loop import drafting as engine_mod  # where every drafter draws its candidates
from specheads.shim.loop.engine import Engine
from specheads.shim.policies import StandardSD
from specheads.shim.runners.fused import unfuse
from specheads.shim.runners.model_runner import make_runner
from specheads.shim.runners.models import ModelSpec, load_model
from specheads.shim.runners.vocab_pruning import PrunedHead, prune, subset_from_ranking, unprune, vocab_info


def _ranking_file(tmp_path, ranking, vocab_size):
    path = tmp_path / "vocab.json"
    path.write_text(
        json.dumps(
            {
                "format": "specheads-vocab",
                "version": 1,
                "vocab_size": vocab_size,
                "ranking": ranking,
                "counts": [1] * len(ranking),
            }
        )
    )
    return path


# ---- the ranking step --------------------------------------------------------------------------


def test_heads_vocab_ranks_corpus_tokens_by_count(tiny_pair_dirs, tmp_path):
    corpus = tmp_path / "c.jsonl"
    answers = ["the cat sat", "the dog sat", "the cat ran"]
    corpus.write_text("".join(json.dumps({"prompt": "q", "reference": a}) + "\n" for a in answers))
    out = tmp_path / "v.json"
    t, _ = tiny_pair_dirs
    assert vocab_cli.main([f"target.path={t}", "target.gguf_file=null", f"corpus={corpus}", f"output={out}"]) == 0
    got = json.loads(out.read_text())
    tok = load_model(ModelSpec(path=str(t), device="cpu"), "target").tokenizer
    ids = {w: tok.convert_tokens_to_ids(w) for w in ("the", "cat", "sat", "dog", "ran")}
    assert got["ranking"][0] == ids["the"]  # 3 times
    assert got["ranking"][1:3] == sorted([ids["cat"], ids["sat"]])  # twice each, ties by id
    assert got["tokens_counted"] == sum(got["counts"]) and got["vocab_size"] == len(tok)


def test_heads_vocab_counts_the_targets_responses_in_datagen_output(tiny_pair_dirs, prompts_file, tmp_path):
    dg = tmp_path / "dg"
    assert datagen_main(datagen_args(tiny_pair_dirs, prompts_file, dg, "threads=1")) == 0
    rows = chunk_rows(dg)
    want = {}
    for r in rows:
        for i in r["input_ids"][r["response_start"] :]:
            want[i] = want.get(i, 0) + 1
    out = tmp_path / "v.json"
    t, _ = tiny_pair_dirs
    assert vocab_cli.main([f"target.path={t}", "target.gguf_file=null", f"data_dir={dg}", f"output={out}"]) == 0
    got = json.loads(out.read_text())
    assert dict(zip(got["ranking"], got["counts"])) == want
    assert got["ranking"] == sorted(want, key=lambda i: (-want[i], i))


def test_heads_vocab_needs_exactly_one_source(tiny_pair_dirs, tmp_path, capsys):
    t, _ = tiny_pair_dirs
    assert vocab_cli.main([f"target.path={t}", "target.gguf_file=null", "corpus=null"]) == 2
    assert "nothing to count" in capsys.readouterr().err


def test_subset_keeps_eos_and_takes_the_top_n():
    ranking = {"vocab_size": 10, "ranking": [5, 3, 2, 7, 1]}
    assert subset_from_ranking(ranking, 3, [2], 10) == [2, 5, 3]
    assert subset_from_ranking(ranking, None, [9], 10) == [9, 5, 3, 2, 7, 1]
    with pytest.raises(UserError, match="rebuild it with heads-vocab"):
        subset_from_ranking(ranking, 3, [2], 12)


# ---- the pruned output layer -------------------------------------------------------------------


@pytest.mark.parametrize("fused", [True, False])
def test_pruned_logits_are_the_full_logits_on_the_subset(tiny_pair, fused):
    _, draft = tiny_pair
    ids = torch.tensor([2, 5, 6, 9, 11, 20])
    ids_in = torch.tensor([[1, 5, 9, 6, 20]])
    with torch.inference_mode():
        full, _ = make_runner(draft, None, None, 16, fused).forward(ids_in, n_logits=3)
        prune(draft, ids.tolist())
        try:
            assert isinstance(draft.get_output_embeddings(), PrunedHead)
            got, _ = make_runner(draft, None, None, 16, fused).forward(ids_in, n_logits=3)
        finally:
            unprune(draft)
    assert got.shape == full.shape
    torch.testing.assert_close(got[:, ids], full[:, ids], rtol=1e-5, atol=1e-5)
    outside = torch.ones(full.shape[-1], dtype=torch.bool)
    outside[ids] = False
    assert torch.isneginf(got[:, outside]).all()
    assert usable_logits(got).all()  # -inf is probability 0, not a datagen fault
    q = got.softmax(-1)
    torch.testing.assert_close(q.sum(-1), torch.ones(3))


@pytest.mark.parametrize("k", [1, 3, 6])
@pytest.mark.parametrize("fused", [True, False])
def test_greedy_sd_with_a_pruned_draft_equals_the_target_alone(tiny_pair, tokenizer, k, fused):
    target, _ = tiny_pair
    draft = perturbed_copy(target, scale=0.2, seed=3)
    prune(draft, list(range(0, len(tokenizer), 2)) + [2])  # half the vocabulary: many target tokens outside
    engine = Engine(target, draft, eos_token_ids=[2], fused=fused)
    for prompt in ([1, 4, 5, 6], [1, 9, 12], [1, 30, 31, 3, 4]):
        sd = engine.generate(prompt, StandardSD(k), 24)
        assert sd.tokens == engine.generate_ar(prompt, 24).tokens
        assert sd.stats.drafted and all(
            t % 2 == 0 or t == 2 for t in engine.generate_ar(prompt, 24, use_draft=True).tokens
        )
    unfuse(target)


class _HeadBigram(BigramLM):
    """A bigram stub whose logits come from its output layer (one-hot state times ``table.T``), so the
    output layer can be pruned like a real model's."""

    def __init__(self, table):
        super().__init__(table)
        with torch.no_grad():
            self.head.weight.copy_(self.table.clamp_min(-80).t())

    def set_output_embeddings(self, head):
        self.head = head

    def forward(self, input_ids, past_key_values=None, use_cache=True, logits_to_keep=0, **kwargs):
        super().forward(input_ids, past_key_values, use_cache, logits_to_keep)  # the cache advances
        h = self.embed(input_ids)
        h = h[:, -logits_to_keep:] if logits_to_keep else h
        return SimpleNamespace(logits=self.head(h))


def _pruned_bigram_sd_pvalue(sampling=SamplingConfig(do_sample=True)):
    draft = _HeadBigram(torch.log(torch.tensor(Q_ROWS, dtype=torch.float64)).float())
    prune(draft, [0, 1, 2])  # token 3 can never be drafted; the target still emits it
    return sd_pvalue(sampling, draft=draft)


@SAMPLINGS
def test_sampled_sd_with_a_pruned_draft_follows_the_target(sampling):
    assert _pruned_bigram_sd_pvalue(sampling) > 1e-3


def test_chi_square_catches_an_unrenormalised_pruned_q(monkeypatch):
    """Planted bug: the SD rule gets q as the full softmax's mass on the subset, not renormalised."""
    pick = engine_mod.pick_token

    def broken(logits, sampling, generator):
        tok, q = pick(logits, sampling, generator)
        return tok, (q * 0.6 if q is not None else q)

    monkeypatch.setattr(engine_mod, "pick_token", broken)
    assert _pruned_bigram_sd_pvalue() < 1e-6


def test_prune_refuses_ids_of_another_tokenizer(tiny_pair):
    _, draft = tiny_pair
    with pytest.raises(UserError, match="another tokenizer"):
        prune(draft, [0, 10_000])
    assert vocab_info(draft) is None


# ---- loading and head metadata -----------------------------------------------------------------


def test_load_model_prunes_the_draft_only(tiny_pair_dirs, tmp_path):
    t, d = tiny_pair_dirs
    vocab_size = len(load_model(ModelSpec(path=str(d), device="cpu"), "draft").tokenizer)
    path = _ranking_file(tmp_path, [5, 6, 7, 8, 9, 10], vocab_size)
    draft = load_model(ModelSpec(path=str(d), device="cpu", vocab_file=str(path), vocab_top_n=4), "draft")
    assert draft.vocab["size"] == 4  # EOS (2) and the three most frequent
    assert torch.equal(draft.model.get_output_embeddings().ids, torch.tensor([2, 5, 6, 7]))
    with pytest.raises(UserError, match="only the draft"):
        load_model(ModelSpec(path=str(t), device="cpu", vocab_file=str(path)), "target")
    with pytest.raises(UserError, match="draft.vocab_file is not"):
        load_model(ModelSpec(path=str(d), device="cpu", vocab_top_n=4), "draft")


def test_head_trained_on_a_pruned_draft_refuses_another_subset():
    sub = {"size": 8192, "sha256": "abc", "full": 49152}
    meta = {"feature": {"model": "draft"}, "hidden_size": 4, "draft": {"name": "d", "fingerprint": "f", "vocab": sub}}
    pair = SimpleNamespace(draft=SimpleNamespace(hidden_size=4, fingerprint="f", name="d", vocab=dict(sub)))
    check_head_against_pair(meta, pair)  # same subset: fine
    pair.draft.vocab = None
    with pytest.raises(UserError, match="8192-token subset"):
        check_head_against_pair(meta, pair)
    pair.draft.vocab = {**sub, "sha256": "other"}
    with pytest.raises(UserError, match="draft.vocab_file"):
        check_head_against_pair(meta, pair)
    with pytest.raises(UserError, match="full vocabulary"):
        check_draft_vocab({"draft": {"vocab": None}}, sub)
    check_draft_vocab({"draft": {"vocab": None}}, None)
    check_draft_vocab({"draft": {}}, sub)  # a head from before pruning: warns only


def test_datagen_with_a_pruned_draft_records_the_subset(tiny_pair_dirs, prompts_file, tmp_path):
    t, d = tiny_pair_dirs
    vocab_size = len(load_model(ModelSpec(path=str(d), device="cpu"), "draft").tokenizer)
    path = _ranking_file(tmp_path, list(range(3, vocab_size, 2)), vocab_size)
    out = tmp_path / "dg"
    assert datagen_main(datagen_args(tiny_pair_dirs, prompts_file, out, f"draft.vocab_file={path}", "threads=1")) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["draft"]["vocab"]["size"] == len(range(3, vocab_size, 2)) + 1
    assert manifest.get("skipped_nonfinite", 0) == 0 and chunk_rows(out)
