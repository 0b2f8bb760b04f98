"""SPRINTER ratio-threshold labels: hand computation per lambda, the four prefix categories, datagen files."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import SPRINTER_PROMPTS, chunk_rows, sprinter_args

from specheads.datagen import sprinter_labels as sprinter
from specheads.datagen.cli import main
from specheads.runtime.ratio import label_distributions, ratio_label
from specheads.shim.core.sampling import SamplingConfig


def test_ratio_labels_match_hand_computation():
    # Two prefixes over a 3-token vocabulary; the draft's greedy token is token 0 in both.
    q = torch.tensor([[0.5, 0.3, 0.2], [0.6, 0.2, 0.2]])
    p = torch.tensor([[0.45, 0.45, 0.1], [0.2, 0.7, 0.1]])
    out = label_distributions(p.log(), q.log(), SamplingConfig(do_sample=False), None)
    assert out["draft_token"].tolist() == [0, 0]
    torch.testing.assert_close(out["q_token"], torch.tensor([0.5, 0.6]))
    torch.testing.assert_close(out["p_token"], torch.tensor([0.45, 0.2]))
    torch.testing.assert_close(out["ratio"], torch.tensor([0.5 / 0.45, 3.0]))
    torch.testing.assert_close(out["tv"], torch.tensor([0.15, 0.5]))
    # q/p = 1.11 and 3.0: rejected at lambda 1, the first accepted at 1.2 and 1.5, the second never.
    for lam, want in ((1.0, [0, 0]), (1.2, [1, 0]), (1.5, [1, 0]), (3.5, [1, 1])):
        assert ratio_label(out["q_token"], out["p_token"], lam).tolist() == want


def test_ratio_label_handles_zero_target_probability():
    q = torch.tensor([[0.0, 1.0], [1.0, 0.0]])
    p = torch.tensor([[1.0, 0.0], [1.0, 0.0]])
    gen = torch.Generator().manual_seed(0)
    out = label_distributions(p.log(), q.log(), SamplingConfig(do_sample=True), gen)
    assert out["draft_token"].tolist() == [1, 0]
    assert out["ratio"][0] == float("inf") and out["ratio"][1] == 1.0
    assert ratio_label(out["q_token"], out["p_token"], 1.5).tolist() == [0, 1]


def test_balance_keeps_equal_shares():
    contexts = [
        ([1] * 10, list(range(3, 11))),
        ([1] * 9, [5, 6, 7]),
        ([1] * 20, list(range(4, 20))),
        ([1] * 12, list(range(4, 9))),
    ]
    cats = ["prompt", "draft", "target", "mixed"]
    kept = sprinter.balance(contexts, cats, torch.Generator().manual_seed(0))
    assert [len(k) for k in kept] == [3, 3, 3, 3]
    for k, (_, allowed) in zip(kept, contexts):
        assert set(k) <= set(allowed) and k == sorted(k)


@pytest.fixture()
def prompts_file(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps({"prompt": w}) + "\n" for w in SPRINTER_PROMPTS))
    return path


@pytest.mark.parametrize("do_sample", [False, True])
def test_datagen_sprinter_four_equal_categories(tiny_pair_dirs, prompts_file, tmp_path, do_sample):
    out = tmp_path / "dg"
    assert main(sprinter_args(tiny_pair_dirs, prompts_file, out, f"sampling.do_sample={str(do_sample).lower()}")) == 0
    rows = chunk_rows(out)
    assert [r["prompt_index"] for r in rows] == list(range(len(SPRINTER_PROMPTS)))
    assert [r["category"] for r in rows] == list(sprinter.CATEGORIES) * 2
    counts = {c: sum(len(r["positions"]) for r in rows if r["category"] == c) for c in sprinter.CATEGORIES}
    assert len(set(counts.values())) == 1 and counts["prompt"] > 0
    for r in rows:
        n = len(r["positions"])
        assert len(r["draft_token"]) == len(r["q_token"]) == len(r["p_token"]) == len(r["ratio"]) == n
        assert all(1 <= t <= len(r["input_ids"]) for t in r["positions"])
        for q, p, ratio in zip(r["q_token"], r["p_token"], r["ratio"]):
            assert ratio == pytest.approx(q / p, rel=1e-5) if p > 0 else ratio == float("inf")
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["labels"] == "sprinter"
    assert manifest["category_shares"] == {c: 0.25 for c in sprinter.CATEGORIES}
    assert manifest["prefixes_per_category"] == counts
    means = manifest["label_mean_by_lambda"]
    assert means["1"] <= means["1.2"] <= means["1.5"]
    # Same seed, same labels.
    again = tmp_path / "again"
    assert main(sprinter_args(tiny_pair_dirs, prompts_file, again, f"sampling.do_sample={str(do_sample).lower()}")) == 0
    assert chunk_rows(again) == rows


def test_datagen_sprinter_labels_equal_teacher_forced_probabilities(tiny_pair, tiny_pair_dirs, prompts_file, tmp_path):
    """The stored q(x) and p(x) are the models' softmax at the stored prefix (greedy: raw T = 1)."""
    out = tmp_path / "dg"
    assert main(sprinter_args(tiny_pair_dirs, prompts_file, out, "sampling.do_sample=false")) == 0
    target, draft = tiny_pair
    for r in chunk_rows(out)[:4]:
        for t, x, q, p in list(zip(r["positions"], r["draft_token"], r["q_token"], r["p_token"]))[:3]:
            ids = torch.tensor([r["input_ids"][:t]])
            with torch.no_grad():
                qd = draft(input_ids=ids).logits[0, -1].softmax(-1)
                pt = target(input_ids=ids).logits[0, -1].softmax(-1)
            assert x == int(qd.argmax())
            assert q == pytest.approx(float(qd[x]), rel=1e-4, abs=1e-6)
            assert p == pytest.approx(float(pt[x]), rel=1e-4, abs=1e-6)


def test_datagen_sprinter_rejects_bad_chunk_size(tiny_pair_dirs, prompts_file, tmp_path, capsys):
    code = main(sprinter_args(tiny_pair_dirs, prompts_file, tmp_path / "x", "chunk_size=6"))
    assert code == 2 and "multiple of 4" in capsys.readouterr().err
