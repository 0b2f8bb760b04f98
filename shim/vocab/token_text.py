"""Token text across two tokenizers: each id's bytes, the two vocabularies matched by string
(:class:`VocabMap`) and re-tokenisation from safe boundaries (:class:`Side`); what TLI and SLEM
(:mod:`.hetero`, where the rules are described) are built on."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from transformers.convert_slow_tokenizer import bytes_to_unicode

from specheads.errors import UserError

_BYTE_OF = {c: b for b, c in bytes_to_unicode().items()}
_BYTE_PIECE = re.compile(r"<0x[0-9A-Fa-f]{2}>")


def _decoders(spec: dict | None) -> list[dict]:
    if not spec:
        return []
    return [d for child in spec.get("decoders", []) for d in _decoders(child)] if spec["type"] == "Sequence" else [spec]


def _token_entries(tokenizer) -> list[tuple[bytes | None, int]]:
    """Per id: (text bytes or None for special tokens and holes, preference rank among equal strings:
    0 vocabulary piece, 1 byte-fallback piece, 2 added token)."""
    if not hasattr(tokenizer, "backend_tokenizer"):
        raise UserError(
            f"{type(tokenizer).__name__} is a slow tokenizer; heterogeneous decoding reads the vocabulary "
            "of a fast one: load it with AutoTokenizer.from_pretrained(..., use_fast=True)"
        )
    spec = json.loads(tokenizer.backend_tokenizer.to_str())
    decs = _decoders(spec.get("decoder"))
    byte_level = any(d["type"] == "ByteLevel" for d in decs)
    byte_fallback = bool(spec.get("model", {}).get("byte_fallback")) or any(d["type"] == "ByteFallback" for d in decs)
    markers = {"▁"} | {d["replacement"] for d in decs if d["type"] == "Metaspace"}
    markers |= {d["pattern"].get("String") for d in decs if d["type"] == "Replace" and d.get("content") == " "}
    markers.discard(None)
    added = tokenizer.added_tokens_decoder
    special = set(tokenizer.all_special_ids) | {i for i, t in added.items() if t.special}
    vocab = tokenizer.get_vocab()
    out: list[tuple[bytes | None, int]] = [(None, 3)] * (max(vocab.values(), default=-1) + 1)
    for piece, i in vocab.items():
        if i in special:
            continue
        if i in added:
            text, rank = added[i].content, 2
        elif byte_level and all(c in _BYTE_OF for c in piece):
            out[i] = (bytes(_BYTE_OF[c] for c in piece), 0)
            continue
        elif byte_fallback and _BYTE_PIECE.fullmatch(piece):
            out[i] = (bytes([int(piece[3:5], 16)]), 1)
            continue
        else:
            text, rank = piece, 0
        if not byte_level:
            for m in markers:
                text = text.replace(m, " ")
        out[i] = (text.encode("utf-8") or None, rank)
    return out


def token_bytes(tokenizer) -> list[bytes | None]:
    """Each id's text as bytes with the leading-space markers (``Ġ``, ``▁``) as spaces; None for special tokens."""
    return [b for b, _ in _token_entries(tokenizer)]


def _canonical(entries: list[tuple[bytes | None, int]]) -> dict[bytes, int]:
    """String -> the id that represents it: the best-ranked, then the lowest id."""
    out: dict[bytes, int] = {}
    for i in sorted(range(len(entries)), key=lambda i: (entries[i][1], i)):
        text = entries[i][0]
        if text is not None:
            out.setdefault(text, i)
    return out


@dataclass
class VocabMap:
    """Draft and target vocabularies matched by token string (TLI) and each id's text.

    Attributes:
        draft_to_target: per draft id, the target id with the same string, or -1.
        target_to_draft: per target id, the draft id with the same string, or -1.
        draft_text / target_text: per id, its bytes (None for special tokens).

    Duplicates: several ids of one vocabulary with the same string all map to one id of the other,
    which represents the string there (a vocabulary piece before a byte-fallback piece before an
    added token, then the lowest id), so TLI's ``q'`` on the target adds up their probabilities.
    """

    draft_to_target: list[int]
    target_to_draft: list[int]
    draft_text: list[bytes | None]
    target_text: list[bytes | None]

    @classmethod
    def build(cls, draft_tokenizer, target_tokenizer) -> "VocabMap":
        """Matches the two tokenizers' vocabularies by token string."""
        d, t = _token_entries(draft_tokenizer), _token_entries(target_tokenizer)
        canon_t, canon_d = _canonical(t), _canonical(d)
        d2t = [canon_t.get(b, -1) if b is not None else -1 for b, _ in d]
        t2d = [canon_d.get(b, -1) if b is not None else -1 for b, _ in t]
        return cls(d2t, t2d, [b for b, _ in d], [b for b, _ in t])

    @property
    def shared(self) -> int:
        """Draft ids whose string is in the target vocabulary."""
        return sum(i >= 0 for i in self.draft_to_target)


def _utf8_prefix(data: bytes) -> str:
    """The longest prefix of ``data`` that is valid UTF-8, decoded."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        return data[: err.start].decode("utf-8")


def spell(table: list[bytes | None], ids: list[int]) -> bytes:
    """The bytes a token sequence spells (tokens without text spell nothing)."""
    return b"".join((table[i] or b"") if 0 <= i < len(table) else b"" for i in ids)


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading ids ``a`` and ``b`` share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class Side:
    """One model's committed ids, the bytes they spell, and re-tokenisation from safe boundaries.

    Args:
        tokenizer: the model's tokenizer.
        table: per id, its bytes (None: special, spells nothing, no window crosses it).
        ids: the prompt's ids.
        lookbehind: most committed tokens a re-tokenisation window covers.
    """

    def __init__(self, tokenizer, table: list[bytes | None], ids: list[int], lookbehind: int):
        self.tokenizer, self.table, self.lookbehind = tokenizer, table, lookbehind
        self.ids: list[int] = []
        self.offs = [0]  # offs[i]: where token i's bytes start; offs[-1]: total
        self.text = bytearray()
        self.pending = b""  # committed bytes not yet tokenised (an incomplete UTF-8 character)
        self.append(ids)

    def spell(self, ids: list[int]) -> bytes:
        return spell(self.table, ids)

    def append(self, ids: list[int]) -> None:
        for i in ids:
            self.ids.append(int(i))
            self.text += self.spell([i])
            self.offs.append(len(self.text))

    def _floor(self) -> int:
        """First index a window may start at: after the last token without text."""
        for s in range(len(self.ids) - 1, max(-1, len(self.ids) - self.lookbehind - 1), -1):
            if not self.spell([self.ids[s]]):
                return s + 1
        return max(0, len(self.ids) - self.lookbehind)

    def _starts(self) -> list[int]:
        """Window starts to try: word starts (most context first), the look-behind limit, no window."""
        n, lo = len(self.ids), self._floor()
        words = [s for s in range(lo, n) if self.text[self.offs[s] : self.offs[s] + 1] == b" "]
        return list(dict.fromkeys(words + [lo, n]))

    def _encode(self, s: int, new: bytes) -> tuple[list[int], bytes, bytes] | None:
        """Encodes the window from ``s`` plus ``new``: (ids, bytes encoded, bytes left over) or None."""
        window = bytes(self.text[self.offs[s] :])
        text = _utf8_prefix(window + new)
        used = len(text.encode("utf-8"))
        if used <= len(window):
            return None
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return ids, (window + new)[:used], (window + new)[used:]

    def continuation(self, new: bytes) -> list[int]:
        """Ids that follow the committed ids and spell ``new`` (SLEM's candidates), committed ids untouched."""
        fallback: list[int] = []
        for s in self._starts():
            enc = self._encode(s, new)
            n = len(self.ids) - s
            if enc is None or enc[0][:n] != self.ids[s:]:
                continue
            tail = enc[0][n:]
            if self.spell(tail) == enc[1][self.offs[-1] - self.offs[s] :]:
                return tail
            fallback = fallback or tail
        return fallback

    def extend(self, new: bytes) -> None:
        """Appends committed text; tokens of the look-behind window may be re-tokenised."""
        self.pending += new
        best = None  # (score, start, ids, left over)
        for s in self._starts():
            enc = self._encode(s, self.pending)
            if enc is None:
                continue
            ids, used, rest = enc
            keeps, exact = ids[: len(self.ids) - s] == self.ids[s:], self.spell(ids) == used
            score = 2 * exact + keeps
            if best is None or score > best[0]:
                best = (score, s, ids, rest)
            if score == 3:
                break
        if best is None:
            return
        _, s, ids, self.pending = best
        del self.ids[s:], self.offs[s + 1 :]
        del self.text[self.offs[s] :]
        self.append(ids)
