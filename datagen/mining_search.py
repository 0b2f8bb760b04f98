"""The state of a judge-mining search: a marked swap, the search over a prompt's answer and its budget."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Mark:
    """One tried mismatch: the response position, the target's and the draft's token, the verdict (None:
    undetermined, the swapped response ran to the length limit)."""

    position: int
    target_token: int
    draft_token: int
    important: bool | None
    answer_after: Any


@dataclass
class Search:
    """One prompt's search state."""

    prompt: Any
    prompt_ids: list[int]
    response: list[int]
    answer: Any
    limit: int  # response length
    position: int = 0  # where the next mismatch is looked for
    marks: list[Mark] = field(default_factory=list)
    generated: int = 0  # continuation tokens
    budget_hit: bool = False
    searchable: bool = True  # False: its own response ran to the limit or gives no answer
    done: bool = False
    draft: list[int] | None = None  # the draft's greedy token at each response position (None: stale)

    def next_mismatch(self) -> int | None:
        return next((j for j in range(self.position, len(self.response)) if self.draft[j] != self.response[j]), None)


@dataclass
class Budget:
    """A prompt's limits: response length, mismatches tried, continuation tokens generated."""

    max_new_tokens: int
    max_mismatches: int
    max_tokens: int


def _groups(items: list, size: int):
    for i in range(0, len(items), size):
        yield items[i : i + size]
