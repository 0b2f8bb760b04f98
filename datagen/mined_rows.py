"""The rows and record a judge-mining chunk writes: a mined prompt's judge tuples, its record, the counts."""

from __future__ import annotations

from specheads.datagen.mining_search import Search
from specheads.datagen.tuples import IGNORE


def judge_rows(s: Search, tuple_id: str, label_matches: bool, ignore: int = IGNORE) -> list[dict]:
    """The judge rows of one searched prompt (``side``, ``input_ids``, ``answer_start``, ``labels``).

    ``mined``: the final response, label 1 at every unimportant mismatch (and, with ``label_matches``, at
    every other token of the final response too: the target's own tokens, which the judge must accept),
    ``ignore`` elsewhere. ``important``: one row per important
    mismatch (``important-<j>``), the final response's first ``j`` tokens and the draft's token, labelled 0 there.
    An unsearchable prompt gives none.
    """
    if not s.searchable:  # nothing was checked
        return []
    start = len(s.prompt_ids)
    kept = {m.position for m in s.marks if m.important is False}
    labels = [1 if j in kept or label_matches else ignore for j in range(len(s.response))]
    rows = []
    if any(v != ignore for v in labels):
        rows.append(
            {
                "tuple_id": tuple_id,
                "side": "mined",
                "input_ids": s.prompt_ids + s.response,
                "answer_start": start,
                "labels": labels,
            }
        )
    for m in s.marks:
        if m.important:
            rows.append(
                {
                    "tuple_id": tuple_id,
                    "side": f"important-{m.position}",
                    "input_ids": s.prompt_ids + s.response[: m.position] + [m.draft_token],
                    "answer_start": start,
                    "labels": [ignore] * m.position + [0],
                }
            )
    return rows


def record(s: Search, prompt, index: int, token_text) -> dict:
    """The reviewable record of one searched prompt (``mined.jsonl``; ``heads-datagen ... show`` prints it)."""
    question = prompt.text if prompt.text is not None else "\n".join(m["content"] for m in prompt.messages)
    return {
        "prompt_id": str(prompt.id),
        "prompt_index": index,
        "source": prompt.source,
        "question": question,
        "answer": None if s.answer is None else str(s.answer),
        "response_ids": s.response,
        "response_tokens": [token_text(t) for t in s.response],
        "marks": [
            {
                "position": m.position,
                "important": m.important,
                "target_token": token_text(m.target_token),
                "draft_token": token_text(m.draft_token),
                "target_id": m.target_token,
                "draft_id": m.draft_token,
                "answer_after": None if m.answer_after is None else str(m.answer_after),
            }
            for m in s.marks
        ],
        "mismatches_tried": len(s.marks),
        "continuation_tokens": s.generated,
        "budget_hit": s.budget_hit,
        "searchable": s.searchable,
    }


def counts(searches: list[Search]) -> dict:
    """The chunk's mining counts (:data:`COUNTS`)."""
    return {
        "prompts": len(searches),
        "mismatches_tried": sum(len(s.marks) for s in searches),
        "important": sum(m.important is True for s in searches for m in s.marks),
        "unimportant": sum(m.important is False for s in searches for m in s.marks),
        "undetermined": sum(m.important is None for s in searches for m in s.marks),
        "unsearchable": sum(not s.searchable for s in searches),
        "budget_hits": sum(s.budget_hit for s in searches),
        "continuation_tokens": sum(s.generated for s in searches),
    }
