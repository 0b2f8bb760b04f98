"""A tiny Llama pair that vLLM's CPU attention takes (head_dim 64), saved with a word-level tokenizer: the target
and a perturbed copy as the draft. Needs torch, tokenizers and transformers only (it runs in vLLM's venv too)."""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast

WORDS = "the cat dog sat on a mat and ran to big red blue sun moon one two three four five six why is".split()


def save_pair(root: Path, noise: float = 0.15, layers: int = 2) -> tuple[Path, Path]:
    """Writes ``root/target`` and ``root/draft`` (model + tokenizer, ``layers`` decoder layers); returns their paths."""
    vocab = {w: i for i, w in enumerate(["<unk>", "<s>", "</s>", *WORDS])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    cfg = LlamaConfig(
        vocab_size=len(vocab),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
        initializer_range=0.3,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    target = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    draft = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    draft.load_state_dict(target.state_dict())
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=g) * noise * p.std().clamp_min(1e-3))
    for name, model in (("target", target), ("draft", draft)):
        model.save_pretrained(root / name)
        tok.save_pretrained(root / name)
    return root / "target", root / "draft"
