"""Heterogeneous-vocabulary speculative decoding (TLI, SLEM): string matching, exactness, losslessness,
tokenizers that do not round-trip text. Two tokenizers are trained here on a small corpus (a byte-level
BPE with ``Ġ`` and a SentencePiece-style BPE with ``▁`` and byte fallback) and tiny Llamas learn it."""

from __future__ import annotations

import itertools
import json
import math

import pytest
import torch
from conftest import BigramLM, tiny_llama
from scipy.stats import chisquare
from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

from specheads.errors import UserError
from specheads.shim.core.sampling import SamplingConfig, probs_from_logits
from specheads.shim.policies import base as sd_rule
from specheads.shim.vocab import hetero_loop as hetero
from specheads.shim.vocab.hetero_loop import HeteroEngine
from specheads.shim.vocab.token_text import Side, VocabMap, token_bytes

CORPUS = [
    "the cat sat on the mat and the dog sat on the log",
    "one two three four five six seven eight nine ten",
    "a caterpillar ate the green leaf and then it slept",
    "hello world, hello there! how are you today?",
    "the sun is hot and the moon is cold at night",
    "red blue green yellow purple orange black white",
    "my dog likes to run in the park every morning",
    "we counted: 12 apples, 7 pears and 3 plums.",
]
PROMPTS = ["the cat sat", "one two three", "a caterpillar", "hello world,", "we counted:", "red blue"]
SP_DECODER = decoders.Sequence(
    [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
)  # Llama / Gemma style


def _byte_level() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        CORPUS * 4,
        trainers.BpeTrainer(
            vocab_size=360,
            special_tokens=["<|endoftext|>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        ),
    )
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")


def _sentencepiece(lowercase: bool = False) -> PreTrainedTokenizerFast:
    """BPE over ``▁``-marked words with a prepended ``▁`` (SentencePiece's dummy prefix), byte fallback and BOS."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    tok.train_from_iterator(
        CORPUS * 4, trainers.BpeTrainer(vocab_size=110, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False)
    )
    spec = json.loads(tok.to_str())  # add the 256 byte pieces: the trainer does not make them
    vocab = spec["model"]["vocab"]
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    spec["model"]["byte_fallback"] = True
    tok = Tokenizer.from_str(json.dumps(spec))
    tok.decoder = SP_DECODER
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])  # BOS, as Gemma
    if lowercase:
        tok.normalizer = normalizers.Lowercase()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def _train(model, tokenizer, steps: int = 60):
    rows = [tokenizer(s)["input_ids"] for s in CORPUS]
    width = max(map(len, rows))
    ids = torch.tensor([r + [0] * (width - len(r)) for r in rows])
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
    opt = torch.optim.Adam(model.parameters(), lr=3e-2)
    for _ in range(steps):
        loss = model(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100)).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval().requires_grad_(False)


@pytest.fixture(scope="module")
def toks():
    """name -> tokenizer: byte-level ``bl``, SentencePiece-style ``sp`` and its lower-casing twin ``sp_lower``
    (same vocabulary and ids, a normaliser that makes it non-injective)."""
    return {"bl": _byte_level(), "sp": _sentencepiece(), "sp_lower": _sentencepiece(lowercase=True)}


@pytest.fixture(scope="module")
def trained(toks):
    """name -> a tiny Llama trained on the corpus in that tokenizer (``sp_lower`` shares ``sp``'s model)."""
    out = {name: _train(tiny_llama(len(toks[name]), seed=i), toks[name]) for i, name in enumerate(("bl", "sp"))}
    out["sp_lower"] = out["sp"]
    return out


def _engine(toks, models_, target: str, draft: str) -> HeteroEngine:
    return HeteroEngine(
        models_[target], models_[draft], toks[target], toks[draft], eos_token_ids=[toks[target].eos_token_id]
    )


# ---- token strings and the vocabulary map, against hand-built expectations -----------------


def _hand_byte_level() -> PreTrainedTokenizerFast:
    vocab = {"<|endoftext|>": 0, "Ġthe": 1, "the": 2, "Ċ": 3, "Ã©": 4, "Ġ": 5, "a": 6, "Ã": 7, "</s>": 8}
    tok = Tokenizer(models.BPE(vocab, []))
    tok.decoder = decoders.ByteLevel()
    out = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", additional_special_tokens=["</s>"])
    out.add_tokens([AddedToken(" the", normalized=False)])  # id 9: a second id for " the"
    return out


def _hand_sentencepiece(decoder) -> PreTrainedTokenizerFast:
    vocab = {
        "<unk>": 0,
        "<s>": 1,
        "</s>": 2,
        "▁the": 3,
        "the": 4,
        "<0x0A>": 5,
        "<0xC3>": 6,
        "▁": 7,
        "a": 8,
        "<0x61>": 9,
    }
    tok = Tokenizer(models.BPE(vocab, [], unk_token="<unk>", byte_fallback=True))
    tok.decoder = decoder
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def test_token_bytes_normalise_markers_and_drop_specials():
    assert token_bytes(_hand_byte_level()) == [
        None,
        b" the",
        b"the",
        b"\n",
        "é".encode(),
        b" ",
        b"a",
        b"\xc3",
        None,
        b" the",
    ]
    sp = [None, None, None, b" the", b"the", b"\n", b"\xc3", b" ", b"a", b"a"]
    assert token_bytes(_hand_sentencepiece(SP_DECODER)) == sp
    assert token_bytes(_hand_sentencepiece(decoders.Metaspace("▁", "always"))) == sp  # the other ▁ decoder


def test_vocab_map_by_string_specials_and_duplicates():
    vm = VocabMap.build(_hand_byte_level(), _hand_sentencepiece(SP_DECODER))
    # draft: <eot>, Ġthe, the, Ċ, Ã©, Ġ, a, Ã, </s>(special), " the"(added duplicate of Ġthe)
    assert vm.draft_to_target == [-1, 3, 4, 5, -1, 7, 8, 6, -1, 3]
    # target: <unk>, <s>, </s> never match (the draft's </s> is special too); <0x61> is a duplicate of "a";
    # " the" is represented in the draft by the vocabulary piece Ġthe, not the added token
    assert vm.target_to_draft == [-1, -1, -1, 1, 2, 3, 7, 5, 6, 6]
    assert vm.shared == 7


def test_no_overlap_or_slow_tokenizer_is_a_user_error():
    a = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.BPE({"x": 0}, [])))
    b = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.BPE({"y": 0}, [])))
    assert VocabMap.build(a, b).shared == 0
    engine = HeteroEngine(tiny_llama(3), tiny_llama(3, seed=1), b, a)
    with pytest.raises(UserError, match="share no token string"):
        engine.generate([0], "tli", draft_prompt_ids=[0])
    with pytest.raises(UserError, match="slow tokenizer"):
        token_bytes(object())


def test_trained_tokenizers_differ(toks):
    text = "yellow purple orange"
    splits = [
        [token_bytes(toks[n])[i] for i in toks[n](text, add_special_tokens=False)["input_ids"]] for n in ("bl", "sp")
    ]
    assert splits[0] != splits[1]  # the same string, tokenised differently
    assert b"".join(splits[0]) == text.encode() and b"".join(splits[1]) == b" " + text.encode()  # SP's dummy prefix
    vm = VocabMap.build(toks["bl"], toks["sp"])
    assert 0 < vm.shared < len(toks["bl"])
    the_sp, the_bl = toks["sp"].convert_tokens_to_ids("▁the"), toks["bl"].convert_tokens_to_ids("Ġthe")
    assert vm.target_to_draft[the_sp] == the_bl and vm.draft_to_target[the_bl] == the_sp  # ▁the == Ġthe


# ---- exactness: greedy output equals the target's greedy output ----------------------------


@pytest.mark.parametrize("method", ["tli", "slem", "slrs"])
@pytest.mark.parametrize("target,draft", [("sp", "bl"), ("bl", "sp")])
def test_greedy_equals_target_greedy(toks, trained, monkeypatch, method, target, draft):
    synced = []  # the draft's text after each round's sync
    commit = hetero._Crossing.commit

    def spy(self, *args):
        commit(self, *args)
        synced.append(bytes(self.drf.text) + self.drf.pending)

    monkeypatch.setattr(hetero._Crossing, "commit", spy)
    engine = _engine(toks, trained, target, draft)
    d_table, t_table = token_bytes(toks[draft]), token_bytes(toks[target])
    accepted = 0
    for prompt in PROMPTS:
        ref = engine.generate_ar(prompt, 20)
        for k in (2, 5):
            synced.clear()
            got = engine.generate(prompt, method, k=k, max_new_tokens=20)
            assert got.tokens == ref.tokens, (prompt, k)
            s = got.stats
            assert s.new_tokens == len(got.tokens) and s.target_calls == s.rounds == len(synced) + s.eos
            assert s.drafted == s.accepted + s.discarded and s.draft_forwards > 0
            if not s.eos:
                assert s.new_tokens == s.accepted + s.rounds  # one target token per round
                # both tokenizers round-trip this text: the draft's ids spell its prompt + the target's output
                d_prompt = b"".join(d_table[i] or b"" for i in toks[draft](prompt)["input_ids"])
                assert synced[-1] == d_prompt + b"".join(t_table[i] or b"" for i in got.tokens)
            accepted += s.accepted
    assert accepted > 2 * len(PROMPTS)  # the drafts agree often: multi-token acceptance is exercised


def test_errors(toks, trained):
    engine = _engine(toks, trained, "sp", "bl")
    with pytest.raises(UserError, match="method='beam'"):
        engine.generate("the cat", "beam")
    with pytest.raises(UserError, match="k=0"):
        engine.generate("the cat", "tli", k=0)


# ---- losslessness: chi-square on sampled outputs of stub models ------------------------------


def _stub_pvalue(
    toks,
    method: str,
    n: int = 1000,
    horizon: int = 3,
    policy=None,
    seen=None,
    draft_tokens=("Ġthe", "Ġcat", "Ġsat", "hello"),
    draft_probs=(0.2, 0.1, 0.3, 0.4),
) -> float:
    """Chi-square p-value of ``n`` sampled ``horizon``-token outputs against the target's exact distribution.

    Stub models whose next-token distribution ignores the context: the target puts its mass on
    ``▁the ▁cat ▁sat`` (shared strings) and ``▁he`` (target only), the draft on ``Ġthe Ġcat Ġsat`` and
    ``hello`` (draft only), so TLI renormalises ``q`` and the target's token often leaves the intersection.
    """
    sp, bl = toks["sp"], toks["bl"]
    vm = VocabMap.build(bl, sp)
    t_ids = sp.convert_tokens_to_ids(["▁the", "▁cat", "▁sat", "▁he"])
    d_ids = bl.convert_tokens_to_ids(list(draft_tokens))
    assert [vm.target_to_draft[t] for t in t_ids] == d_ids[:3] + [-1] and vm.draft_to_target[d_ids[3]] == -1

    def stub(size: int, ids: list[int], probs: list[float]) -> BigramLM:
        row = torch.zeros(size)
        row[ids] = torch.tensor(probs)
        return BigramLM(torch.log(row).expand(size, size).clone())

    engine = HeteroEngine(
        stub(len(sp), t_ids, [0.4, 0.3, 0.1, 0.2]), stub(len(bl), d_ids, list(draft_probs)), sp, bl, vocab_map=vm
    )
    sampling = SamplingConfig(do_sample=True, temperature=0.8)
    p = probs_from_logits(torch.log(torch.tensor([0.4, 0.3, 0.1, 0.2])), sampling)
    exact = {seq: math.prod(float(p[i]) for i in seq) for seq in itertools.product(range(4), repeat=horizon)}
    gen = torch.Generator().manual_seed(7)
    counts = dict.fromkeys(exact, 0)
    prompt = sp("the cat")["input_ids"]
    for _ in range(n):
        if policy is None:
            out = engine.generate(prompt, method, k=2, max_new_tokens=horizon, sampling=sampling, generator=gen).tokens
        else:  # a configured policy instance on the same engine
            g = engine.engine.generate(
                prompt, policy, horizon, sampling, gen, draft_prompt_ids=engine.prompt_ids(prompt)[1]
            )
            out = g.tokens
            if seen is not None:
                seen.append(g.stats)
        counts[tuple(t_ids.index(t) for t in out)] += 1
    big = [seq for seq in exact if exact[seq] * n >= 5]  # pool cells expected fewer than 5 times
    obs = [counts[seq] for seq in big] + [n - sum(counts[seq] for seq in big)]
    exp = [exact[seq] * n for seq in big] + [n - sum(exact[seq] * n for seq in big)]
    return chisquare(obs, exp).pvalue


@pytest.mark.parametrize("method", ["tli", "slem", "slrs"])
def test_sampling_is_distributed_as_target(toks, method):
    assert _stub_pvalue(toks, method) > 1e-3


@pytest.mark.parametrize("budget", [1, 64])
def test_slrs_sampling_is_lossless_with_and_without_the_budget_fallback(toks, budget):
    """SLRS with a budget of one draft forward per step (every tree that goes past its root falls back to the
    target's own token) and with room for the trees: both follow the target; the fallbacks are counted. The
    draft also proposes ``Ġc``, whose string the target's ``▁cat`` extends: its trees go past the root."""
    from specheads.shim.policies import SLRS

    assert any(t.startswith("▁c") and len(t) > 2 for t in toks["sp"].get_vocab()) and "Ġc" in toks["bl"].get_vocab()
    seen = []
    assert (
        _stub_pvalue(
            toks,
            "slrs",
            n=600,
            policy=SLRS(k=2, budget=budget),
            seen=seen,
            draft_tokens=("Ġthe", "Ġcat", "Ġsat", "hello", "Ġc"),
            draft_probs=(0.2, 0.1, 0.2, 0.2, 0.3),
        )
        > 1e-3
    )
    fallbacks = sum(s.counters.get("slrs_fallbacks", 0) for s in seen)
    steps = sum(s.counters.get("slrs_steps", 0) for s in seen)
    forwards = sum(s.counters.get("slrs_tree_forwards", 0) for s in seen)
    assert steps > 0 and (fallbacks > 0 if budget == 1 else fallbacks == 0 and forwards > steps)


def test_chi_square_catches_a_broken_tli(toks, monkeypatch):
    """Planted one-line bug: the correction drawn from p instead of norm(max(0, p - q')) -> must fail."""
    monkeypatch.setattr(sd_rule, "residual", lambda p, q: p)
    assert _stub_pvalue(toks, "tli") < 1e-6


def test_tli_sampling_on_tiny_models_matches_target(toks):
    """The same check on random tiny Llamas, first token only: exact ``p`` against TLI's first tokens."""
    target, draft = tiny_llama(len(toks["sp"]), seed=11, init=1.0), tiny_llama(len(toks["bl"]), seed=12, init=1.0)
    engine = HeteroEngine(target, draft, toks["sp"], toks["bl"])
    sampling, n = SamplingConfig(do_sample=True), 200
    prompt = toks["sp"]("the cat")["input_ids"]
    gen = torch.Generator().manual_seed(3)
    first = [
        engine.generate(prompt, "tli", k=1, max_new_tokens=2, sampling=sampling, generator=gen).tokens[0]
        for _ in range(n)
    ]
    with torch.no_grad():
        p = probs_from_logits(target(torch.tensor([prompt])).logits[0, -1], sampling)
    big = (p * n >= 5).nonzero().view(-1).tolist()
    obs = [first.count(t) for t in big] + [n - sum(first.count(t) for t in big)]
    exp = [float(p[t]) * n for t in big] + [n - sum(float(p[t]) * n for t in big)]
    assert len(big) >= 3 and chisquare(obs, exp).pvalue > 1e-3


# ---- tokenizers that do not round-trip text ------------------------------------------------


def test_non_injective_tokenizer_is_non_injective(toks):
    tok = toks["sp_lower"]
    text = "The Cat"
    assert tok.decode(tok(text)["input_ids"], skip_special_tokens=True) != text  # lower-cased
    ids = tok.convert_tokens_to_ids(["▁", "<0x61>"])
    assert tok(tok.decode(ids), add_special_tokens=False)["input_ids"] != ids  # " a" re-encodes as ▁a


def test_continuation_never_changes_committed_tokens(toks):
    tok = toks["sp_lower"]
    side = Side(tok, token_bytes(tok), tok("The c")["input_ids"], lookbehind=8)
    committed = list(side.ids)
    assert tok.convert_ids_to_tokens(committed) == ["<s>", "▁the", "▁c"]
    assert side.text == b" the c"  # what the committed tokens spell (lower-cased, dummy prefix)
    # " the c" + "at" is tokenised [▁the, ▁cat]: that would re-tokenise the committed ▁c, so no window
    # reproduces the committed ids and the tail comes from the new text alone, where SentencePiece adds
    # its dummy-prefix space: used as is (exact match keeps it safe), committed ids untouched
    assert tok(" the cat", add_special_tokens=False)["input_ids"][:2] != committed[1:]
    merged = side.continuation(b"at")
    assert merged == tok("at", add_special_tokens=False)["input_ids"] and side.spell(merged) == b" at"
    # a word start after the committed text: the window reproduces them and the tail spells the text exactly
    assert side.continuation(b" sat") == tok(" sat", add_special_tokens=False)["input_ids"]
    assert side.spell(side.continuation(b" sat")) == b" sat"
    assert side.continuation(b" Sat") == side.continuation(b" sat")  # rewritten by the normaliser, used as is
    assert side.continuation("é".encode()[:1]) == []  # an incomplete character waits
    assert side.spell(side.continuation(" é".encode())) == " é".encode()
    assert side.ids == committed and side.text == b" the c"


def test_draft_side_extend_rewrites_and_buffers(toks):
    tok = toks["sp_lower"]
    side = Side(tok, token_bytes(tok), tok("the cat")["input_ids"], lookbehind=8)
    side.extend(b" Sat")
    assert side.text == b" the cat sat" and side.pending == b""  # the draft's own (lower-cased) view
    side.extend("é".encode()[:1])
    assert side.text == b" the cat sat" and side.pending == b"\xc3"
    side.extend("é".encode()[1:])
    assert side.text == " the cat saté".encode() and side.pending == b""
    assert side.spell(side.ids) == bytes(side.text) and side.offs[-1] == len(side.text)
    side = Side(tok, token_bytes(tok), tok("the c")["input_ids"], lookbehind=8)
    side.extend(b"at")  # unlike the target's, the draft's window tokens may be re-tokenised: ▁c + at -> ▁cat
    assert tok.convert_ids_to_tokens(side.ids) == ["<s>", "▁the", "▁cat"] and side.text == b" the cat"


@pytest.mark.parametrize("method", ["tli", "slem", "slrs"])
@pytest.mark.parametrize("target,draft", [("sp_lower", "bl"), ("bl", "sp_lower")])
def test_non_injective_greedy_equals_target_greedy(toks, trained, method, target, draft):
    engine = _engine(toks, trained, target, draft)
    accepted = 0
    for prompt in [
        "The Cat sat",
        "ONE two  three",
        "Hello World,",
        "a caterpillar é",
        "one two Three four",
        "my dog likes to Run",
    ]:
        got = engine.generate(prompt, method, k=4, max_new_tokens=16)
        assert got.tokens == engine.generate_ar(prompt, 16).tokens, prompt
        accepted += got.stats.accepted
    assert accepted > 0


def test_heads_decode_runs_tli_and_slem_and_refuses_same_vocab_policies(toks, trained, tmp_path, capsys):
    """``heads-decode policy=tli|slem`` on saved models with different tokenizers: the target's greedy
    output; a same-vocabulary policy on that pair is a one-line error naming TLI and SLEM."""
    from specheads.decode.decode_cli import main as decode

    dirs = {}
    for name in ("sp", "bl"):
        dirs[name] = tmp_path / name
        model = type(trained[name])(trained[name].config)  # a clean copy: earlier decoding leaves fused views
        model.load_state_dict({k: v.contiguous() for k, v in trained[name].state_dict().items()})
        model.save_pretrained(dirs[name])
        toks[name].save_pretrained(dirs[name])
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS[:3]), encoding="utf-8")
    common = [
        f"target.path={dirs['sp']}",
        "target.gguf_file=null",
        f"draft.path={dirs['bl']}",
        "target.device=cpu",
        "draft.device=cpu",
        f"prompts={prompts}",
        "num_prompts=null",
        "max_new_tokens=12",
        "offset=0",
    ]
    outs = {}
    for policy in ("ar", "tli", "slem"):
        own = [f"{policy}.k=3"] if policy != "ar" else []
        assert decode([*common, f"policy={policy}", *own, f"output_dir={tmp_path / policy}"]) == 0
        rows = [json.loads(x) for x in (tmp_path / policy / "outputs.jsonl").read_text().splitlines()]
        outs[policy] = [r["tokens"] for r in rows]
    assert outs["tli"] == outs["ar"] and outs["slem"] == outs["ar"] and len(outs["ar"]) == 3
    summary = json.loads((tmp_path / "slem" / "metrics.json").read_text())
    assert summary["target_calls"] <= summary["new_tokens"]
    capsys.readouterr()
    assert decode([*common, "policy=sd", f"output_dir={tmp_path / 'sd'}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "tokenizers differ" in err[0] and "tli, slem" in err[0]
    # heads-eval puts both methods next to target-only and draft-only on the same prompts.
    from specheads.evaluate.cli import main as evaluate

    ev = [
        *common[:6],
        f"prompts={prompts}",
        "num_prompts=null",
        "offset=0",
        "max_new_tokens=12",
        "hetero.methods=[tli,slem]",
        "hetero.k=3",
        "ks=[]",
        "head=null",
        "judge.head=null",
        "sprinter.head=null",
        "topk.ks=[]",
        "fsd.js=[]",
        "fsd.tv=[]",
        "fsd.kl=[]",
        "fsd.kl_rev=[]",
        "confidence.taus=[]",
    ]
    assert evaluate([*ev, f"output_dir={tmp_path / 'ev'}"]) == 0
    rows = [json.loads(x) for x in (tmp_path / "ev" / "rows.jsonl").read_text().splitlines()]
    by = {(r["config"], r["index"]): r["tokens"] for r in rows}
    for method in ("tli", "slem"):
        assert [by[(f"v-{method}-k3", i)] for i in range(3)] == outs["ar"]
    sweep = json.loads((tmp_path / "ev" / "sweep.json").read_text())
    assert {r["config"] for r in sweep["table"]} == {"ar", "draft", "v-tli-k3", "v-slem-k3"}
    assert all(r["predicted_ms_per_token"] > 0 for r in sweep["table"])  # TLI / SLEM count their pass sizes too
    capsys.readouterr()
    narrow = [a for a in ev if not a.startswith(("hetero.methods=", "ks="))]
    assert evaluate([*narrow, "hetero.methods=[slem]", "ks=[2]", f"output_dir={tmp_path / 'ev2'}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "ks=[2]" in err[0] and "hetero.methods=[tli,slem,slrs]" in err[0]
