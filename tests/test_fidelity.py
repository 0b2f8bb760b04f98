"""Quality measured as fidelity to the target: the target's competence per source, the fidelity figures,
the teacher-forced log-probability, and the built-in fact task with its checker."""

import json

import pytest
import torch
from conftest import SHARED, tiny_llama

from specheads.errors import UserError
from specheads.evaluate.competence import competence
from specheads.evaluate.fidelity import fidelity, mean_logprobs
from specheads.facts import NAME, TEMPLATES, correct, first_sentence, fold, rows, table
from specheads.facts import main as facts_main
from specheads.grading import answer, chance, grade
from specheads.prompts import Prompt, load_prompt_files


def _arc(i):
    return Prompt(f"arc-{i}", text="Q", reference="A", source="arc", choices=4)


def _fact(i):
    return Prompt(f"f-{i}", text="Q", reference="Paris", source="facts")


def test_competence_flags_a_source_at_chance_and_trusts_one_far_above_it():
    """ARC at 25% with four choices is at chance: not informative; facts at 90% against chance 0 are."""
    prompts = [_arc(i) for i in range(200)] + [_fact(i) for i in range(200)]
    correct_ar = [int(i % 4 == 0) for i in range(200)] + [int(i % 10 != 0) for i in range(200)]
    block = competence(prompts, correct_ar)
    assert block["arc"]["chance"] == 0.25 and block["arc"]["target_accuracy"] == 0.25
    assert not block["arc"]["informative"] and "not informative" in block["arc"]["note"]
    assert block["facts"]["chance"] == 0.0 and block["facts"]["informative"]
    assert block["facts"]["target_accuracy_low"] < 0.9 < block["facts"]["target_accuracy_high"]
    # 20% on an open task clears chance by more than 10 points; by a 0.5 margin it does not
    weak = competence([_fact(i) for i in range(400)], [int(i % 5 == 0) for i in range(400)])
    assert weak["facts"]["informative"]
    assert not competence([_fact(i) for i in range(400)], [int(i % 5 == 0) for i in range(400)], 0.5)["facts"][
        "informative"
    ]
    assert competence([_arc(0)], [None]) == {}  # ungraded prompts are no source


def test_chance_reads_the_number_of_choices():
    assert chance(Prompt("a", text="Q", reference="B", source="arc", choices=5)) == 0.2
    assert chance(Prompt("a", text="Q", reference="B", source="arc")) == 0.25
    assert chance(Prompt("g", text="Q", reference="12", source="gsm8k")) == 0.0
    arc = load_prompt_files(str(SHARED / "data/arc_challenge/test.jsonl"), limit=3)
    assert all(p.choices in (3, 4, 5) for p in arc)


def test_fidelity_figures_against_the_target():
    """Two prompts: the row copies the target's output on the first and writes another answer on the second."""
    grouped = {"ar": [{"tokens": [5, 6, 7]}, {"tokens": [8, 9]}], "j0.5": [{"tokens": [5, 6, 7]}, {"tokens": [8, 3]}]}
    texts = {"ar": ["the answer is 4", "so it is 12"], "j0.5": ["the answer is 4", "so it is 13"]}
    same = {"ar": [1, 1], "j0.5": [1, 0]}
    seen = []

    def logprob(i, tokens):
        seen.append((i, tokens))
        return {(1, (8, 9)): -0.5, (1, (8, 3)): -2.0}[(i, tuple(tokens))]

    f = fidelity(["j0.5"], grouped, texts, same, ["gsm8k", "gsm8k"], logprob)["j0.5"]
    assert f["agreement"]["gsm8k"]["value"] == 0.5 and f["exact_match"]["value"] == 0.5
    assert f["rouge_l"]["value"] == pytest.approx((1.0 + 0.75) / 2)
    assert f["logprob_gap"]["value"] == pytest.approx((0.0 - 1.5) / 2) and f["logprob_gap"]["prompts"] == 2
    assert all(i == 1 for i, _ in seen)  # an output equal to the target's needs no forward: its gap is 0
    assert "logprob_gap" not in fidelity(["j0.5"], grouped, texts, same, ["gsm8k"] * 2)["j0.5"]


def test_mean_logprobs_equals_one_sequence_at_a_time():
    """Batched by length with padding, the projection on output positions only: the same numbers as each sequence
    alone through the full model."""
    model = tiny_llama(40, seed=3)
    g = torch.Generator().manual_seed(0)
    items = [
        (torch.randint(3, 40, (n,), generator=g).tolist(), torch.randint(3, 40, (m,), generator=g).tolist())
        for n, m in ((5, 3), (9, 1), (2, 6), (7, 0), (4, 4), (1, 3))
    ]
    shared = items[0][0]  # one prompt's outputs share its cache, over several forwards (batch_tokens)
    items += [(shared, torch.randint(3, 40, (m,), generator=g).tolist()) for m in (2, 5, 1, 4)]
    got = mean_logprobs(model, items, pad=2, batch_tokens=12)
    for (p, o), value in zip(items, got):
        if not o:
            assert value is None
            continue
        with torch.no_grad():
            logits = model(torch.tensor([p + o])).logits[0, len(p) - 1 : -1]
        want = torch.log_softmax(logits, -1).gather(-1, torch.tensor(o)[:, None]).mean()
        assert value == pytest.approx(float(want), abs=1e-5)


# ---- the fact task -----------------------------------------------------------------------------


def test_fact_table_and_generator():
    facts = table()
    assert len(facts) >= 300 and {f["kind"] for f in facts} == set(TEMPLATES)
    items = rows()
    assert items == rows() and items != rows(seed=1)  # seeded
    assert len({r["id"] for r in items}) == len(items) == len(facts)
    for r in items:  # an answer spelled in its own question would always grade right
        assert not correct(r["question"], r["answers"]), r
    kinds = [r["kind"] for r in items[: len(items) // 2]]
    assert len(set(kinds)) == len(TEMPLATES)  # shuffled: both halves mix the kinds


@pytest.mark.parametrize(
    "text, answers, ok",
    [
        ("The capital of France is Paris.", ["Paris"], True),
        ("Paris", ["Paris"], True),
        ("\n\nThe capital of Brazil is Brasília. It is not Rio.", ["Brasilia", "Brasília"], True),
        ("It is Lyon. Paris is the largest city.", ["Paris"], False),  # the first sentence only
        ("The capital of the United States is Washington, D.C. It was", ["Washington, D.C.", "Washington"], True),
        ("The chemical symbol for cobalt is Co.", ["Co"], True),
        ("The chemical symbol for cobalt is CO.", ["Co"], False),  # a symbol keeps its case
        ('The plural of "woman" is "women".', ["women"], True),
        ('The opposite of "unhappy" is "sad".', ["happy"], False),  # whole words
        ("", ["Paris"], False),
    ],
)
def test_fact_checker(text, answers, ok):
    assert correct(text, answers) is ok


def test_fact_prompts_grade_and_answer():
    prompts = load_prompt_files(NAME)
    assert len(prompts) == len(rows()) and all(p.source == "facts" for p in prompts)
    p = next(p for p in prompts if p.id == "facts-capital-france")
    assert grade(p, "The capital of France is Paris.") and not grade(p, "Lyon.")
    assert answer(p, "Paris, of course.") == answer(p, "The capital is Paris.") == "Paris"  # both right: the same
    assert answer(p, "Lyon. Paris") == "lyon" != answer(p, "Marseille.")  # two wrong answers differ
    assert [q.id for q in load_prompt_files(NAME, limit=3, offset=2)] == [q.id for q in prompts[2:5]]
    with pytest.raises(UserError, match="none after offset"):
        load_prompt_files(NAME, offset=len(prompts))
    assert fold("Chișinău") == "chisinau" and first_sentence("  \n Yes. No.") == "Yes"


def test_fact_file_round_trip(tmp_path):
    """``python -m specheads.facts`` writes the same questions as a prompt file; bad rows fail in one line."""
    out = tmp_path / "facts.jsonl"
    assert facts_main([str(out)]) == 0
    assert [(p.id, p.text, p.reference) for p in load_prompt_files(str(out))] == [
        (p.id, p.text, p.reference) for p in load_prompt_files(NAME)
    ]
    assert facts_main([]) == 2
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"question": "Q?", "answers": []}) + "\n")
    with pytest.raises(UserError, match="'answers' must be a non-empty list"):
        load_prompt_files(str(bad))


def test_prompt_file_slices(tmp_path):
    """``file[a:b]`` takes rows a..b-1 of that file, whatever limit and offset say for the others."""
    f = tmp_path / "p.jsonl"
    f.write_text("".join(json.dumps({"prompt": f"p{i}"}) + "\n" for i in range(10)))
    got = load_prompt_files(f"{f}[3:6],{f}", limit=2, offset=1)
    assert [p.text for p in got] == ["p3", "p4", "p5", "p1", "p2"]
    assert [p.text for p in load_prompt_files(f"{f}[8:]")] == ["p8", "p9"]
    with pytest.raises(UserError, match="slice is empty"):
        load_prompt_files(f"{f}[5:5]")
