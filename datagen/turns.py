"""``labels=drafter`` on conversations: ``messages`` rows whose assistant turns the target regenerates, turn by turn.

A drafter learns from the target's own text, so a multi-turn conversation is rebuilt one assistant turn at a time:
part ``drafter.turn=1`` answers each conversation's first user message (after its system message, if any); part
``drafter.turn=t`` answers its ``t``-th user message after the conversation's earlier user messages and, in place of
the data set's assistant messages, the target's own answers of turns ``1 .. t-1``, read from those parts'
``output_dir`` (``drafter.history``, in turn order). Each part is a plain datagen run (any engine, resumable by
chunk); a recipe chains them as ``pipeline.datagen_parts`` and trains on all of them. A conversation with fewer
than ``t`` user messages, or whose earlier turn a part skipped, is left out of part ``t``. The prompt's id stays the
conversation's, so the parts line up by ``prompt_id``.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

from specheads.dataset import shard_paths
from specheads.errors import UserError


def problems(cfg) -> list[str]:
    """One line per invalid turn setting."""
    d = cfg.drafter
    if d.turn < 1:
        return [f"drafter.turn={d.turn} must be >= 1"]
    if len(d.history) != d.turn - 1:
        return [
            f"drafter.turn={d.turn} needs the output_dir of each earlier turn's part in drafter.history "
            f"({d.turn - 1} of them, turn 1 first); got {len(d.history)}"
        ]
    return [
        f"drafter.history: {h} is not a finished heads-datagen run (no manifest.json)"
        for h in d.history
        if not (Path(h) / "manifest.json").is_file()
    ]


def answers(history: list[str], tokenizer) -> dict[str, list[str]]:
    """Per conversation id, the target's answers of the turns in ``history`` (turn order), as text."""
    import pyarrow.parquet as pq

    got: dict[str, list[str]] = {}
    for turn, out in enumerate(history):
        for path in shard_paths(Path(out)):
            table = pq.read_table(str(path), columns=["prompt_id", "input_ids", "response_start"]).to_pylist()
            for row in table:
                done = got.get(row["prompt_id"], [])
                if len(done) == turn:
                    text = tokenizer.decode(row["input_ids"][row["response_start"] :], skip_special_tokens=True)
                    got[row["prompt_id"]] = done + [text]
    return {k: v for k, v in got.items() if len(v) == len(history)}


def at_turn(prompt, turn: int, earlier: dict[str, list[str]]):
    """``prompt`` as part ``turn`` asks it (see the module docstring), or None when it has no such turn."""
    msgs = prompt.messages
    if msgs is None:
        return prompt if turn == 1 else None
    users = [i for i, m in enumerate(msgs) if m["role"] == "user"]
    if len(users) < turn:
        return None
    cut = [dict(m) for m in msgs[: users[turn - 1] + 1]]
    mine = earlier.get(str(prompt.id), []) if turn > 1 else []
    if turn > 1 and len(mine) != turn - 1:
        return None
    said = iter(mine)
    for m in cut:
        if m["role"] == "assistant":
            m["content"] = next(said, None)
    if any(m["content"] is None for m in cut):
        raise UserError(
            f"conversation {prompt.id!r}: more assistant messages than earlier turns before user turn {turn}"
        )
    return replace(prompt, messages=cut)


def turn_items(items: Iterator, cfg, tokenizer_of) -> Iterator:
    """The prompts of part ``drafter.turn``: ``items`` cut at that turn, earlier answers the target's."""
    turn = cfg.drafter.turn
    earlier = answers(list(cfg.drafter.history), tokenizer_of()) if turn > 1 else {}
    for prompt in items:
        got = at_turn(prompt, turn, earlier)
        if got is not None:
            yield got
