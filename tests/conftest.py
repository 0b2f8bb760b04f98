"""Shared fixtures: tiny tokenizers and models built locally (nothing downloaded) and stub LMs."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast
from specheads.export.shim.fused import unfuse

SHARED = Path(__file__).resolve().parents[2] / "shared"
WORDS = ("the cat dog sat on a mat and ran to big red blue sun moon one two three four five six seven eight "
         "nine ten is was why how what when who yes no up down left right").split()


def make_tokenizer(words=WORDS, prefix: str = "") -> PreTrainedTokenizerFast:
    """A word-level tokenizer over ``words`` with <unk>=0, <s>=1, </s>=2 (no chat template)."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for w in words:
        vocab.setdefault(prefix + w, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def tiny_llama(vocab_size: int, seed: int = 0, layers: int = 2, max_positions: int = 256, init: float = 0.3):
    """A random Llama with peaked logits (large init) so greedy near-ties are rare; fp32, eval."""
    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions,
                      bos_token_id=1, eos_token_id=2, pad_token_id=2, initializer_range=init,
                      tie_word_embeddings=False)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()


def perturbed_copy(model, scale: float = 0.05, seed: int = 1):
    """A draft that mostly agrees with ``model``: its weights plus Gaussian noise."""
    draft = tiny_llama(model.config.vocab_size, layers=model.config.num_hidden_layers,
                       max_positions=model.config.max_position_embeddings)
    draft.load_state_dict(model.state_dict())
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale * p.std().clamp_min(1e-3))
    return draft


@pytest.fixture(scope="session")
def tokenizer():
    return make_tokenizer()


@pytest.fixture(scope="session")
def tiny_pair(tokenizer):
    """(target, draft) tiny Llamas over the word-level vocabulary; the draft is a noisy copy."""
    target = tiny_llama(len(tokenizer), seed=0)
    return target, perturbed_copy(target, scale=0.3)


@pytest.fixture(scope="session")
def tiny_pair_dirs(tmp_path_factory, tokenizer, tiny_pair):
    """The tiny pair saved as two Hugging Face directories (model + tokenizer)."""
    root = tmp_path_factory.mktemp("pair")
    out = []
    for name, model in zip(("target", "draft"), tiny_pair):
        unfuse(model)  # an earlier test may have run it on the fused forward (column-major views)
        model.save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
        out.append(root / name)
    return tuple(out)


class BigramLM(torch.nn.Module):
    """A stub causal LM whose next-token logits depend only on the last token: ``table[last]``.

    It speaks the Hugging Face interface the engine uses (``input_ids``, ``past_key_values``,
    ``use_cache``, ``logits_to_keep``) and fills the KV cache with dummies so that lengths
    and trimming behave as with a real model. Its final-norm state for token ``t`` is the
    one-hot vector ``e_t``. ``calls`` records each forward's input length.
    """

    def __init__(self, table: torch.Tensor):
        super().__init__()
        vocab = table.shape[0]
        self.config = LlamaConfig(vocab_size=vocab, hidden_size=vocab, num_hidden_layers=1, num_attention_heads=1,
                                  num_key_value_heads=1, max_position_embeddings=1024)
        self.table = table.float()
        self.embed = torch.nn.Embedding(vocab, vocab)  # one-hot: the "hidden state" of token t is e_t
        with torch.no_grad():
            self.embed.weight.copy_(torch.eye(vocab))
        self.head = torch.nn.Linear(vocab, vocab, bias=False)
        self.norm = torch.nn.Identity()
        self.calls: list[int] = []

    def get_input_embeddings(self):
        return self.embed

    def get_output_embeddings(self):
        return self.head

    def forward(self, input_ids, past_key_values=None, use_cache=True, logits_to_keep=0, **kwargs):
        b, s = input_ids.shape
        self.calls.append(s)
        dummy = torch.zeros(b, 1, s, 1)
        past_key_values.update(dummy, dummy, 0)
        self.norm(self.embed(input_ids))
        logits = self.table[input_ids]
        if logits_to_keep:
            logits = logits[:, -logits_to_keep:]
        return SimpleNamespace(logits=logits)


def bigram(probs: list[list[float]]) -> BigramLM:
    """A BigramLM from next-token probabilities (rows may hold zeros: their logits are -inf)."""
    p = torch.tensor(probs, dtype=torch.float64)
    return BigramLM(torch.log(p).float())


@pytest.fixture(scope="session", autouse=True)
def _own_measurement_cache(tmp_path_factory):
    """Kernel choices and cost tables go to a fresh folder for the session (subprocesses inherit it),
    never to the user's ~/.cache/specheads."""
    import os

    old = os.environ.get("SPECHEADS_CACHE")
    os.environ["SPECHEADS_CACHE"] = str(tmp_path_factory.mktemp("specheads-cache"))
    yield
    if old is None:
        os.environ.pop("SPECHEADS_CACHE", None)
    else:
        os.environ["SPECHEADS_CACHE"] = old
