"""specheads.hf: a SpecDec++ head (or confidence_stop) stopping the drafting of Transformers' assisted generation.
Greedy output equals the target's own greedy output; sampled output follows the target's distribution (and a
planted bug in the candidates' probabilities fails the same test); the head is checked against the draft."""

from __future__ import annotations

import logging

import pytest
import torch
from conftest import tiny_llama, train_args
from scipy.stats import chisquare
from transformers import AutoModelForCausalLM

from specheads.errors import UserError
from specheads.hf import SUPPORTED, Assistant, check_transformers


@pytest.fixture(scope="module")
def head(tiny_pair_dirs, labelled, tmp_path_factory):
    from specheads.train.cli import main as train

    out = tmp_path_factory.mktemp("hf") / "tr"
    assert train(train_args(tiny_pair_dirs, labelled, out, "epochs=1")) == 0
    return out / "head.safetensors"


@pytest.fixture(scope="module")
def models(tiny_pair_dirs):
    """The tiny pair as a user loads it: from_pretrained on the two directories."""
    return tuple(AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32).eval() for p in tiny_pair_dirs)


PROMPTS = [[1, 5, 6, 7], [1, 9], [1, 12, 4, 8, 20, 3], [1, 30, 31]]


def greedy(target, ids, **kw):
    return target.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False, pad_token_id=2, **kw)


@pytest.mark.parametrize("policy", ["specdecpp", "confidence_stop"])
def test_greedy_generate_with_the_assistant_is_the_target_alone(models, head, policy, caplog):
    target, draft = models
    a = Assistant(draft, head, h=0.6) if policy == "specdecpp" else Assistant(draft, policy="confidence_stop")
    drafted = 0
    with caplog.at_level(logging.WARNING):
        for ids in PROMPTS:
            ref = greedy(target, ids)
            out = greedy(target, ids, assistant_model=draft, custom_generate=a)
            assert torch.equal(out, ref), ids
            assert a.stats.rounds >= 1 and a.stats.accepted <= a.stats.drafted
            drafted += a.stats.drafted
    assert drafted > len(PROMPTS)  # some rounds drafted several candidates
    if policy == "specdecpp":  # trained on sampled labels, decoding greedily: a warning, not an error
        assert "trained with sampling" in caplog.text


def test_the_head_decides_where_drafting_stops(models, head):
    """A low h stops every round after k_min candidates; a high one drafts longer rounds."""
    target, draft = models
    short, long = Assistant(draft, head, h=1e-6, k_min=1, k_max=8), Assistant(draft, head, h=1 - 1e-6, k_max=8)
    greedy(target, PROMPTS[0], assistant_model=draft, custom_generate=short)
    greedy(target, PROMPTS[0], assistant_model=draft, custom_generate=long)
    # k_min=1: the first candidate is never scored (own position), the second is, and h ~ 0 stops there
    assert short.stats.drafted <= 2 * short.stats.rounds
    assert long.stats.drafted / long.stats.rounds > short.stats.drafted / short.stats.rounds


@pytest.mark.parametrize("policy", ["specdecpp", "confidence_stop"])
def test_generate_drafts_the_rounds_the_shim_drafts(models, head, policy):
    """The head (or the confidence rule) sees inside Transformers what it sees in the decoding shim: the same
    rounds, candidates drafted and accepted, prompt by prompt, as specheads' own engine with the same policy."""
    from specheads.shim import Engine

    target, draft = models
    kw = dict(h=0.6, k_min=1) if policy == "specdecpp" else dict(policy="confidence_stop", tau=0.3)
    a = Assistant(draft, head if policy == "specdecpp" else None, k_max=6, **kw)
    engine = Engine(target, draft, (), fused=False)
    # Transformers masks every occurrence of pad_token_id out of the draft's attention (a generated token
    # equal to it changes what the draft sees there): a pad id these outputs never contain
    pad = draft.config.vocab_size - 1
    for ids in PROMPTS:
        out = target.generate(
            torch.tensor([ids]),
            max_new_tokens=16,
            do_sample=False,
            pad_token_id=pad,
            eos_token_id=None,
            assistant_model=draft,
            custom_generate=a,
        )
        a.policy.reset()
        g = engine.generate(ids, a.policy, 16)
        assert out[0, len(ids) :].tolist() == g.tokens and pad not in g.tokens
        assert (a.stats.rounds, a.stats.drafted, a.stats.accepted) == (
            g.stats.rounds,
            g.stats.drafted,
            g.stats.accepted,
        ), ids


def test_the_target_is_left_as_it_was_after_an_error(models):
    """generate's candidate-generator factory is put back even when decoding fails midway."""
    target, draft = models

    class Broken:
        def put(self, value):
            raise RuntimeError("streamer failed")

        def end(self):
            pass

    a = Assistant(draft, policy="confidence_stop", streamer=Broken())
    with pytest.raises(RuntimeError, match="streamer failed"):
        greedy(target, PROMPTS[0], assistant_model=draft, custom_generate=a)
    assert "_get_candidate_generator" not in target.__dict__ and a.capture is None
    assert torch.equal(greedy(target, PROMPTS[0], assistant_model=draft), greedy(target, PROMPTS[0]))


def test_a_streamer_given_to_the_assistant_sees_every_token(models):
    target, draft = models
    seen = []

    class Collect:
        def put(self, value):
            seen.extend(value.flatten().tolist())

        def end(self):
            pass

    out = greedy(
        target,
        PROMPTS[2],
        assistant_model=draft,
        custom_generate=Assistant(draft, policy="confidence_stop", streamer=Collect()),
    )
    assert seen[-(out.shape[1] - len(PROMPTS[2])) :] == out[0, len(PROMPTS[2]) :].tolist()


def _joint(target, prompt: list[int], vocab: int) -> torch.Tensor:
    """The target's exact distribution of its first two sampled tokens (temperature 1, no truncation)."""
    with torch.no_grad():
        p1 = target(torch.tensor([prompt])).logits[0, -1].softmax(-1)
        seqs = torch.tensor([prompt + [t] for t in range(vocab)])
        p2 = target(seqs).logits[:, -1].softmax(-1)
    return (p1[:, None] * p2).flatten()


def _sample_counts(target, draft, assistant, prompt, vocab, n, seed):
    """Histogram of the first two of 5 sampled tokens (rounds of up to k_max=3 candidates, so the first two
    tokens are often both accepted candidates of one round); also the candidates drafted and the rounds."""
    counts, drafted, rounds = torch.zeros(vocab * vocab), 0, 0
    torch.manual_seed(seed)
    for _ in range(n):
        out = target.generate(
            torch.tensor([prompt]),
            max_new_tokens=5,
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            assistant_model=draft,
            custom_generate=assistant,
            pad_token_id=0,
            eos_token_id=None,
        )
        a, b = out[0, len(prompt) : len(prompt) + 2].tolist()
        counts[a * vocab + b] += 1
        drafted, rounds = drafted + assistant.stats.drafted, rounds + assistant.stats.rounds
    return counts, drafted, rounds


def _chi2(counts, probs) -> float:
    expected = probs * counts.sum()
    keep = expected >= 5  # pool the rare cells
    obs = torch.cat([counts[keep], counts[~keep].sum()[None]])
    exp = torch.cat([expected[keep], expected[~keep].sum()[None]])
    return chisquare(obs.numpy(), exp.numpy() * obs.sum().item() / exp.sum().item()).pvalue


@pytest.mark.slow  # 3,000 generate calls
def test_sampled_generate_follows_the_target_and_a_planted_bug_fails(monkeypatch):
    """The first two sampled tokens over a 6-token vocabulary, 1500 draws: the joint histogram matches the
    target's exact distribution; candidates whose probabilities are reported as uniform (not the draft's) do not."""
    vocab, prompt = 6, [1, 3]
    target, draft = tiny_llama(vocab, seed=3, init=0.6), tiny_llama(vocab, seed=4, layers=1, init=0.6)
    probs = _joint(target, prompt, vocab)
    a = Assistant(draft, policy="confidence_stop", tau=0.05, k_min=2, k_max=3)
    counts, drafted, rounds = _sample_counts(target, draft, a, prompt, vocab, 1500, seed=0)
    assert _chi2(counts, probs) > 1e-3
    assert drafted > 1.5 * rounds  # multi-candidate rounds: the sampled acceptance chain is exercised

    from specheads import hf

    cls = hf._generator_class()
    real = cls._generate_candidates

    def uniform_q(self, args):  # the planted bug: q reported uniform while the draft samples from its own
        ids, logits = real(self, args)
        return ids, torch.zeros_like(logits)

    monkeypatch.setattr(cls, "_generate_candidates", uniform_q)
    monkeypatch.setattr(hf, "_generator_class", lambda: cls)
    bad, _, _ = _sample_counts(
        target,
        draft,
        Assistant(draft, policy="confidence_stop", tau=0.05, k_min=2, k_max=3),
        prompt,
        vocab,
        1500,
        seed=0,
    )
    assert _chi2(bad, probs) < 1e-6


@pytest.mark.slow  # 800 generate calls
def test_sampled_generate_with_a_specdecpp_head_follows_the_target(tmp_path):
    """The head's stop decisions (which depend on the draft's sampled path) leave sampled output exact: the
    joint histogram of the first two tokens over a 6-token vocabulary matches the target's distribution."""
    from specheads.export import save_head
    from specheads.heads import AcceptanceHead
    from specheads.hf import _loaded
    from specheads.shim import SamplingConfig

    vocab, prompt = 6, [1, 3]
    target, draft = tiny_llama(vocab, seed=3, init=0.6), tiny_llama(vocab, seed=4, layers=1, init=0.6)
    draft.save_pretrained(tmp_path / "draft")  # a local directory: the head is checked against its fingerprint
    draft = AutoModelForCausalLM.from_pretrained(tmp_path / "draft", dtype=torch.float32).eval()
    seen = _loaded(draft, None)
    torch.manual_seed(1)
    module = AcceptanceHead(draft.config.hidden_size, depth=1)
    path = save_head(
        tmp_path / "acceptance.safetensors",
        module,
        "acceptance",
        {
            "head_config": module.config(),
            "hidden_size": draft.config.hidden_size,
            "feature": {"model": "draft", "state": "post", "layer": -1, "position": "own"},
            "draft": {"name": seen.name, "fingerprint": seen.fingerprint, "vocab": None},
            "target": {"name": "tiny-target", "fingerprint": "unknown"},
            "sampling": SamplingConfig(do_sample=True, temperature=1.0, top_k=0, top_p=1.0).to_dict(),
            "default_threshold": 0.9,
        },
    )
    a = Assistant(draft, path, k_min=1, k_max=3, strict=True)
    counts, drafted, rounds = _sample_counts(target, draft, a, prompt, vocab, 800, seed=0)
    assert _chi2(counts, _joint(target, prompt, vocab)) > 1e-3
    assert rounds < drafted < 3 * rounds  # the head stopped rounds at different lengths


def test_transformers_without_the_internals_it_builds_on_is_a_one_line_error(monkeypatch):
    from specheads import hf

    monkeypatch.setitem(hf.INTERNALS, "transformers.generation.utils:GenerationMixin", ("_assisted_decoding_v9",))
    with pytest.raises(UserError) as err:
        check_transformers()
    assert "GenerationMixin._assisted_decoding_v9" in str(err.value) and "\n" not in str(err.value)


def test_the_head_is_checked_against_the_draft(models, head, tiny_pair_dirs):
    target, draft = models
    other = tiny_llama(draft.config.vocab_size, seed=9)  # not the draft the head was trained on
    with pytest.raises(UserError, match="fingerprint"):
        greedy(target, PROMPTS[0], assistant_model=other, custom_generate=Assistant(other, head))
    wide = tiny_llama(draft.config.vocab_size, seed=9)
    wide.config.hidden_size = 48
    with pytest.raises(UserError, match="hidden_size"):
        greedy(target, PROMPTS[0], assistant_model=wide, custom_generate=Assistant(wide, head))
    with pytest.raises(UserError, match="trained with sampling"):
        greedy(target, PROMPTS[0], assistant_model=draft, custom_generate=Assistant(draft, head, strict=True))
    with pytest.raises(UserError, match="needs head="):
        Assistant(draft)
    with pytest.raises(UserError, match="training-free"):
        Assistant(draft, head, policy="confidence_stop")
    with pytest.raises(UserError, match="stop='cost' needs target="):
        Assistant(draft, head, stop="cost")
    narrow = tiny_llama(draft.config.vocab_size - 1, seed=9)
    with pytest.raises(UserError, match="one vocabulary"):
        greedy(target, PROMPTS[0], assistant_model=narrow, custom_generate=Assistant(narrow, policy="confidence_stop"))
    with pytest.raises(UserError, match="batch size 1"):
        target.generate(
            torch.tensor([PROMPTS[0], PROMPTS[0]]),
            max_new_tokens=4,
            do_sample=False,
            pad_token_id=2,
            assistant_model=draft,
            custom_generate=Assistant(draft, head),
        )


def test_the_cost_aware_rule_runs_inside_generate(models, head, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECHEADS_CACHE", str(tmp_path))
    target, draft = models
    a = Assistant(draft, head, stop="cost", target=target, k_max=6)
    assert torch.equal(greedy(target, PROMPTS[2], assistant_model=draft, custom_generate=a), greedy(target, PROMPTS[2]))
    assert a.policy.stop == "cost" and a.stats.rounds >= 1


def test_other_transformers_versions_are_a_one_line_error():
    check_transformers()  # the installed one is supported
    for version in ("4.46.0", "6.0.0"):
        with pytest.raises(UserError) as err:
            check_transformers(version)
        assert ",".join(SUPPORTED) in str(err.value) and "\n" not in str(err.value)
    check_transformers("5.30.0.dev0")


def test_pyproject_pins_the_supported_range():
    from pathlib import Path

    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    deps = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]["dependencies"]
    pin = next(d for d in deps if d.startswith("transformers"))
    assert pin == "transformers" + ",".join(SUPPORTED)


def test_a_pruned_draft_must_match_the_head(models, head, tiny_pair_dirs, tmp_path):
    """prune_draft prunes as heads-pipeline does; a head trained on the full vocabulary refuses the pruned draft,
    and greedy output with the pruned draft is still the target's."""
    import json

    from specheads.hf import prune_draft
    from specheads.shim.runners.vocab_pruning import FORMAT

    target, _ = models
    draft = AutoModelForCausalLM.from_pretrained(tiny_pair_dirs[1], dtype=torch.float32).eval()
    vocab = draft.config.vocab_size
    ranking = tmp_path / "vocab.json"
    ranking.write_text(json.dumps({"format": FORMAT, "vocab_size": vocab, "ranking": list(range(vocab))[::-1]}))
    info = prune_draft(draft, str(ranking), 12)
    assert info["size"] == 12
    with pytest.raises(UserError, match="output layer"):
        greedy(target, PROMPTS[0], assistant_model=draft, custom_generate=Assistant(draft, head))
    a = Assistant(draft, policy="confidence_stop")
    assert torch.equal(greedy(target, PROMPTS[1], assistant_model=draft, custom_generate=a), greedy(target, PROMPTS[1]))
