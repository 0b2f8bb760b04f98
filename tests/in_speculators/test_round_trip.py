"""EAGLE-3 heads between this toolkit and the ``speculators`` package (0.9), both ways, in a virtualenv of its own
(CI's fourth step: ``pip install speculators==0.9.0 pytest``, then this package with ``--no-deps``):

- a head ``heads-export format=speculators`` wrote, loaded by speculators' own ``Eagle3DraftModel.from_pretrained``,
  drafts the same first-step tokens as the toolkit's head on the target's states (its embedding the target's: without
  it speculators' loader keeps the embedding as allocated, zeros or garbage, and the draft differs);
- a directory speculators saved (its own ``config.json``, no ``specheads`` metadata) reads back here with the same
  first-step tokens, and decodes with the toolkit's engine exactly as the target alone does (greedy).

Run: ``<venv>/bin/python -m pytest -q tests/in_speculators --confcutdir=tests/in_speculators -p no:cacheprovider``
"""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

if importlib.util.find_spec("speculators") is None:  # this package's own venv: the test runs in CI's fourth step
    pytest.skip("the speculators package is not installed here", allow_module_level=True)
import speculators as speculators_pkg  # noqa: E402,F401  (installed but broken: an error, never a skip)

LAYERS, VOCAB, HIDDEN = 6, 96, 32


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A tiny Llama target saved as a Hugging Face directory, an EAGLE head on three of its layers (a pruned draft
    vocabulary, random weights), exported by heads-export format=speculators."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    from specheads.export import save_head
    from specheads.export.cli import main as export_main
    from specheads.heads import EagleHead
    from specheads.shim import ModelSpec, load_model

    root = tmp_path_factory.mktemp("spec")
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=64,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )
    target_dir = root / "target"
    LlamaForCausalLM(cfg).eval().save_pretrained(target_dir)
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, VOCAB)}}
    words = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=words, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    tok.save_pretrained(target_dir)
    target = load_model(ModelSpec(path=str(target_dir), dtype="float32", device="cpu"), "target")
    head = EagleHead(
        hidden_size=HIDDEN,
        layers=[1, 3, 4],
        draft_vocab_size=48,
        vocab_size=VOCAB,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        intermediate_size=64,
    )
    with torch.no_grad():
        for p in head.parameters():
            p.copy_(0.5 * torch.randn_like(p))
        head.vocab_ids.copy_(torch.randperm(VOCAB)[:48].sort().values)
    train = root / "train"
    meta = {
        "head_config": head.config(),
        "hidden_size": HIDDEN,
        "feature": {"model": "target", "state": "aux", "layers": [1, 3, 4]},
        "target": {"name": str(target_dir), "fingerprint": target.fingerprint},
        "sampling": {"temperature": 0.0},
        "ttt_steps": 3,
    }
    save_head(train / "head.safetensors", head, "eagle", meta)
    out = root / "export"
    assert export_main([f"train_dir={train}", "format=speculators", f"output_dir={out}"]) == 0
    ids = torch.randint(0, VOCAB, (1, 40), generator=torch.Generator().manual_seed(3))
    return {"root": root, "target_dir": target_dir, "target": target.model, "head": head.eval(), "out": out, "ids": ids}


def _ours(head, target, ids) -> torch.Tensor:
    """The toolkit's first draft step at every position (target ids)."""
    from specheads.vllm.stop_check import reference_rounds

    return reference_rounds(head, target, ids[0].tolist(), 1)[0][:, 0]


def _theirs(model, head, target, ids) -> torch.Tensor:
    """speculators' Eagle-3 forward, one test-time step, on the same states (its draft ids mapped to the target's)."""
    with torch.no_grad():
        hs = target(ids, output_hidden_states=True).hidden_states
        aux = torch.cat([hs[j] for j in head.layer_ids], -1)
        out = model(
            hidden_states=aux[:, :-1], input_ids=ids[:, 1:], document_ids=torch.zeros_like(ids[:, 1:]), ttt_steps=1
        )
    return head.vocab_ids[out[0][0]]


def test_our_export_loads_in_speculators_and_drafts_our_tokens(setup):
    from speculators.models.eagle3 import Eagle3DraftModel

    from specheads.export import speculators

    model = Eagle3DraftModel.from_pretrained(str(setup["out"])).float().eval()
    embed = setup["target"].get_input_embeddings().weight
    assert torch.equal(model.embed_tokens.weight, embed)  # the target's own, not zeros
    ours = _ours(setup["head"], setup["target"], setup["ids"])
    assert torch.equal(_theirs(model, setup["head"], setup["target"], setup["ids"]), ours)
    # written without it (embed_tokens=false, or before this fix) speculators' loader keeps what it allocated
    bare = speculators.write(
        setup["root"] / "bare", setup["head"], json.loads((setup["out"] / "config.json").read_text())["specheads"]
    )
    zero = Eagle3DraftModel.from_pretrained(str(bare)).float().eval()
    assert not torch.equal(zero.embed_tokens.weight, embed)  # left as allocated (zeros, or garbage)
    assert not torch.equal(_theirs(zero, setup["head"], setup["target"], setup["ids"]), ours)


def test_a_directory_speculators_saved_reads_here_and_decodes_exactly(setup):
    from speculators.models.eagle3 import Eagle3DraftModel

    from specheads.decode import generate
    from specheads.export import speculators
    from specheads.shim import ModelSpec, load_pair

    model = Eagle3DraftModel.from_pretrained(str(setup["out"])).float().eval()
    saved = setup["root"] / "theirs"
    model.save_pretrained(saved)
    cfg = json.loads((saved / "config.json").read_text())
    cfg.pop("specheads", None)  # as speculators writes a head of its own: no metadata of this toolkit
    (saved / "config.json").write_text(json.dumps(cfg))
    back = speculators.read(saved)
    assert back.metadata["written_by"] == "speculators" and back.metadata["feature"]["layers"] == [1, 3, 4]
    assert torch.equal(_ours(back.module.float().eval(), setup["target"], setup["ids"]), _theirs(
        model, setup["head"], setup["target"], setup["ids"]
    ))  # fmt: skip
    pair = load_pair(ModelSpec(path=str(setup["target_dir"]), dtype="float32", device="cpu"), None)
    prompts = ["w5 w17 w33 w60 w11", "w40 w41 w9"]
    alone = generate(pair, prompts, "ar", max_new_tokens=16, chat_template=False)
    eagle = generate(pair, prompts, "sd", eagle=str(saved), k=3, max_new_tokens=16, chat_template=False)
    assert [r.tokens for r in eagle] == [r.tokens for r in alone]
    assert sum(r.stats.draft_tokens for r in eagle) > 0  # the head drafted
