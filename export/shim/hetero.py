"""Speculative decoding across different vocabularies (ALGORITHMS.md section 5): TLI and SLEM.

Both methods are lossless and return the TARGET's token ids; the draft works in its own vocabulary.

* TLI (token-level intersection): draft and target ids are matched by token string
  (:class:`VocabMap`). The draft's warped distribution ``q`` is restricted to the intersection and
  renormalised to ``q'``; candidates are mapped to target ids and verified with the standard rule
  (section 0) with ``q'`` in the ratio and in the residual. Greedy: the draft's argmax over the
  intersection, kept while it equals the target's argmax.
* SLEM (string-level exact match): the draft drafts freely; its text is re-tokenised with the target
  tokenizer and the target keeps the candidates while they equal its own greedy (or sampled) tokens.

Text. A token's text is its bytes: byte-level BPE pieces mapped back through the byte alphabet
(``Ġ`` becomes a space), SentencePiece pieces with ``▁`` as a space and ``<0xNN>`` as that byte,
added tokens as their content; special tokens have no text and never match. Each model's committed
ids spell its text (the concatenation of their bytes); ``tokenizer.decode`` is not used because it
drops SentencePiece's leading space, skips special tokens and turns a partial UTF-8 character into
U+FFFD.

Tokenizers that do not round-trip text. ``decode(encode(s)) != s`` (lower-casing, Unicode or space
normalisers, SentencePiece's dummy-prefix space) and ``encode(decode(ids)) != ids`` (a word split
differently) are handled as follows:

1. Committed target ids are never re-tokenised. SLEM's candidates are the tail of
   ``encode(window + draft text)``, where the window is the text of the last ``lookbehind`` committed
   target tokens starting at a word start (a token whose text begins with a space); the tail is used
   only when the encoding reproduces the window's committed ids exactly. Later starts are tried in
   turn, down to the empty window (the draft text alone, which cannot disturb committed ids); with
   nothing encodable (an incomplete character) the round has no candidates (a plain target step).
2. Among those, a tail that spells the draft text exactly is preferred; when the tokenizer rewrites
   the text, the rewritten tail is used as it is. Exact-match verification keeps any candidate
   safe: the output is the target's own tokens, only acceptance can suffer.
3. The draft side keeps its own accepted proposals while their text is a prefix of the committed
   text and re-tokenises the rest with the same look-behind (its window tokens may change; its KV
   cache is trimmed to the longest common prefix of what it holds and its new ids). A draft
   tokenizer that rewrites text leaves the draft conditioned on its rewritten version: this only
   changes proposals, never the output.
4. Text handed to a tokenizer is cut at the last complete UTF-8 character; the rest of the bytes
   waits for the next round.

Counting (:class:`GenerationStats`): ``drafted``/``accepted``/``discarded`` are in target tokens (the
candidates verified), ``draft_forwards`` counts the draft's forwards, ``target_calls`` the target's.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass

import torch
from transformers.convert_slow_tokenizer import bytes_to_unicode

from specheads.errors import UserError

from .engine import Engine, Generation, GenerationStats, _count
from .kv import make_runner
from .policies import greedy_accept, speculative_accept
from .sampling import SamplingConfig, probs_from_logits, sample

METHODS = ("tli", "slem")
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
        raise UserError(f"{type(tokenizer).__name__} is a slow tokenizer; heterogeneous decoding reads the vocabulary "
                        "of a fast one: load it with AutoTokenizer.from_pretrained(..., use_fast=True)")
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
        if entries[i][0] is not None:
            out.setdefault(entries[i][0], i)
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


def _spell(table: list[bytes | None], ids: list[int]) -> bytes:
    """The bytes a token sequence spells (tokens without text spell nothing)."""
    return b"".join((table[i] or b"") if 0 <= i < len(table) else b"" for i in ids)


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class _Side:
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
        return _spell(self.table, ids)

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
        words = [s for s in range(lo, n) if self.text[self.offs[s]:self.offs[s] + 1] == b" "]
        return list(dict.fromkeys(words + [lo, n]))

    def _encode(self, s: int, new: bytes) -> tuple[list[int], bytes, bytes] | None:
        """Encodes the window from ``s`` plus ``new``: (ids, bytes encoded, bytes left over) or None."""
        window = bytes(self.text[self.offs[s]:])
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
            if self.spell(tail) == enc[1][self.offs[-1] - self.offs[s]:]:
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
            keeps, exact = ids[:len(self.ids) - s] == self.ids[s:], self.spell(ids) == used
            score = 2 * exact + keeps
            if best is None or score > best[0]:
                best = (score, s, ids, rest)
            if score == 3:
                break
        if best is None:
            return
        _, s, ids, self.pending = best
        del self.ids[s:], self.offs[s + 1:]
        del self.text[self.offs[s]:]
        self.append(ids)


@dataclass
class HeteroMethod:
    """TLI or SLEM as a decoding policy: :class:`~specheads.export.api.Decoder` (``heads-decode``,
    ``heads-eval``) runs it on a :class:`HeteroEngine` instead of the same-vocabulary engine.

    Args:
        name: ``tli`` or ``slem``.
        k: draft tokens per round.
        lookbehind: committed tokens a re-tokenisation window may cover.
    """

    name: str
    k: int = 2
    lookbehind: int = 8

    def __post_init__(self):
        if self.name not in METHODS:
            raise UserError(f"heterogeneous-vocabulary method {self.name!r}: expected one of {list(METHODS)}")
        if self.k < 1 or self.lookbehind < 1:
            raise UserError(f"k={self.k} and lookbehind={self.lookbehind} must both be >= 1")


class HeteroEngine:
    """Lossless speculative decoding with a draft whose tokenizer differs from the target's.

    Args:
        target, draft: Hugging Face causal LMs in eval mode.
        target_tokenizer, draft_tokenizer: their (fast) tokenizers.
        eos_token_ids: target ids after which generation stops.
        lookbehind: committed tokens a re-tokenisation window may cover.
        vocab_map: a prebuilt :class:`VocabMap` (built from the tokenizers when None).
        fused: run Llama-family models on the fused forward (same outputs, faster).
    """

    def __init__(self, target, draft, target_tokenizer, draft_tokenizer, eos_token_ids=(), lookbehind: int = 8,
                 vocab_map: VocabMap | None = None, fused: bool = True):
        if lookbehind < 1:
            raise UserError(f"lookbehind={lookbehind} must be >= 1")
        self.target, self.draft, self.fused, self.lookbehind = target, draft, fused, lookbehind
        self.target_tokenizer, self.draft_tokenizer = target_tokenizer, draft_tokenizer
        self.eos = set(int(i) for i in eos_token_ids)
        self.vmap = vocab_map or VocabMap.build(draft_tokenizer, target_tokenizer)
        vt, vd = (m.get_output_embeddings().weight.shape[0] for m in (target, draft))
        self._vt = vt
        self._d2t = (self.vmap.draft_to_target + [-1] * vd)[:vd]
        self._t2d = (self.vmap.target_to_draft + [-1] * vt)[:vt]
        dev = draft.get_input_embeddings().weight.device
        d2t = torch.tensor(self._d2t, device=dev)
        self._d_idx = (d2t >= 0).nonzero().view(-1)  # draft ids in the intersection
        self._t_idx = d2t[self._d_idx]  # their target ids
        has_text = [i < len(self.vmap.draft_text) and self.vmap.draft_text[i] is not None for i in range(vd)]
        self._masks = {"tli": d2t >= 0, "slem": torch.tensor(has_text, device=dev)}

    def prompt_ids(self, prompt: str | list[int], draft_prompt_ids: list[int] | None = None) -> tuple[list[int], list[int]]:
        """(target ids, draft ids) of a prompt given as text (each tokenizer encodes it) or as target ids
        (the draft gets ``draft_prompt_ids`` or the re-encoded text)."""
        t_ids = self.target_tokenizer(prompt)["input_ids"] if isinstance(prompt, str) else [int(i) for i in prompt]
        if draft_prompt_ids is None:
            text = prompt if isinstance(prompt, str) else self.target_tokenizer.decode(t_ids, skip_special_tokens=True)
            draft_prompt_ids = self.draft_tokenizer(text)["input_ids"]
        if not t_ids or not draft_prompt_ids:
            raise UserError(f"prompt {str(prompt)[:40]!r} is empty after tokenisation; give a non-empty prompt")
        return t_ids, list(draft_prompt_ids)

    def generate_ar(self, prompt: str | list[int], max_new_tokens: int, sampling: SamplingConfig | None = None,
                    generator: torch.Generator | None = None) -> Generation:
        """Target-only autoregressive decoding of the same prompt (the baseline)."""
        t_ids = self.target_tokenizer(prompt)["input_ids"] if isinstance(prompt, str) else list(prompt)
        if not t_ids:
            raise UserError(f"prompt {str(prompt)[:40]!r} is empty after tokenisation; give a non-empty prompt")
        engine = Engine(self.target, None, self.eos, fused=self.fused)
        return engine.generate_ar(t_ids, max_new_tokens, sampling, generator)

    @torch.inference_mode()
    def generate(self, prompt: str | list[int], method: str = "tli", k: int = 4, max_new_tokens: int = 64,
                 sampling: SamplingConfig | None = None, generator: torch.Generator | None = None,
                 draft_prompt_ids: list[int] | None = None) -> Generation:
        """Speculative decoding of one prompt; the output is target ids.

        Args:
            prompt: text, or target token ids.
            method: ``tli`` or ``slem``.
            k: draft tokens per round (TLI: candidates; SLEM: the target candidates are their re-tokenisation).
            max_new_tokens: cap on emitted target tokens.
            sampling: greedy when None or ``do_sample=False``.
            generator: RNG for all draws.
            draft_prompt_ids: the draft's prompt ids when ``prompt`` is given as target ids.
        """
        if method not in METHODS:
            raise UserError(f"method={method!r}: expected one of {list(METHODS)}")
        if k < 1 or max_new_tokens < 1:
            raise UserError(f"k={k} and max_new_tokens={max_new_tokens} must both be >= 1")
        if method == "tli" and not self.vmap.shared:
            raise UserError("draft and target vocabularies share no token string; TLI needs an overlap, use method=slem")
        sampling = sampling or SamplingConfig()
        start = time.perf_counter()
        t_ids, d_ids = self.prompt_ids(prompt, draft_prompt_ids)
        stats, dstats = GenerationStats(prompt_tokens=len(t_ids)), GenerationStats(prompt_tokens=len(d_ids))
        cap = max(len(t_ids), len(d_ids)) + 2 * (max_new_tokens + k + self.lookbehind)
        target = make_runner(self.target, None, None, cap, self.fused)
        draft = make_runner(self.draft, None, None, cap, self.fused)
        tgt = _Side(self.target_tokenizer, self.vmap.target_text, t_ids, self.lookbehind)
        drf = _Side(self.draft_tokenizer, self.vmap.draft_text, d_ids, self.lookbehind)
        held: list[int] = []  # ids in the draft's cache
        out: list[int] = []
        try:
            while len(out) < max_new_tokens:
                remaining = max_new_tokens - len(out)
                keep = min(_common_prefix(held, drf.ids), len(drf.ids) - 1)  # the draft consumes >= 1 token
                draft.trim(keep)
                del held[keep:]
                drafted, qs = self._draft(draft, drf, held, min(k, remaining - 1), method, sampling, generator, dstats)
                if method == "tli":
                    cand = [self._d2t[d] for d in drafted]
                else:
                    cand = tgt.continuation(drf.spell(drafted))[:remaining - 1] if drafted else []
                t_in = torch.tensor([tgt.ids[target.length:] + cand], device=target.device)
                _count(stats, "target", target.length, t_in.shape[1])
                size = t_in.shape[1] - max(0, stats.prompt_tokens - 1 - target.length)  # candidates + 1 (costs.py)
                stats.target_pass_sizes[size] = stats.target_pass_sizes.get(size, 0) + 1
                logits, _ = target.forward(t_in, n_logits=len(cand) + 1)
                stats.target_calls += 1
                m, token = self._verify(method, logits, cand, qs, sampling, generator)
                new = cand[:m] + [token]
                for i, t in enumerate(new):  # stop after the first EOS
                    if t in self.eos:
                        new, stats.eos = new[: i + 1], 1
                        break
                new = new[:remaining]
                kept = min(m, len(new))
                stats.rounds += 1
                stats.drafted += len(cand)
                stats.accepted += kept
                stats.discarded += len(cand) - kept
                tgt.append(new)
                out.extend(new)
                if stats.eos:
                    break
                target.trim(len(tgt.ids) - 1)
                self._sync(method, drf, drafted, kept, new)
        finally:
            target.close()
            draft.close()
        stats.new_tokens = len(out)
        stats.draft_forwards = draft.forwards
        stats.draft_tokens, stats.draft_context = dstats.draft_tokens, dstats.draft_context
        stats.wall_time = time.perf_counter() - start
        return Generation(out, stats)

    def _draft(self, draft, drf: _Side, held: list[int], room: int, method: str, sampling: SamplingConfig,
               generator, dstats: GenerationStats) -> tuple[list[int], list[torch.Tensor]]:
        """Up to ``room`` draft ids from tokens with text (TLI: in the intersection) and, for TLI sampling,
        each one's ``q'`` pushed onto the target vocabulary ``[V_target]``."""
        mask = self._masks[method]
        drafted: list[int] = []
        qs: list[torch.Tensor] = []
        pending = drf.ids[len(held):]
        for _ in range(room):
            _count(dstats, "draft", draft.length, len(pending))
            logits, _ = draft.forward(torch.tensor([pending], device=draft.device), n_logits=1)
            held.extend(pending)
            if not sampling.do_sample:
                d = int(logits[0].masked_fill(~mask, float("-inf")).argmax())
            else:
                q = probs_from_logits(logits[0], sampling) * mask
                mass = q.sum()
                if not mass > 0:  # the warped draft puts nothing on usable tokens: verify what we have
                    break
                q = q / mass
                d = int(sample(q, generator))
                if method == "tli":
                    qs.append(q.new_zeros(self._vt).index_add_(0, self._t_idx, q[self._d_idx]))
            drafted.append(d)
            pending = [d]
        return drafted, qs

    def _verify(self, method: str, logits: torch.Tensor, cand: list[int], qs: list[torch.Tensor],
                sampling: SamplingConfig, generator) -> tuple[int, int]:
        """(accepted candidates, the target's token) from the target logits ``[n+1, V]``."""
        c = torch.tensor(cand, dtype=torch.long, device=logits.device)
        if not sampling.do_sample:
            v = greedy_accept(c, logits)
            return v.accepted, v.token
        p = probs_from_logits(logits, sampling)
        if method == "tli":
            q = torch.stack(qs).to(p.device) if qs else p[:0]
            v = speculative_accept(p, q, c, generator)
            return v.accepted, v.token
        draws = sample(p, generator).tolist()  # SLEM: exact match against the target's own draws
        m = _common_prefix(cand, draws)
        return m, draws[m]

    def _sync(self, method: str, drf: _Side, drafted: list[int], kept: int, new: list[int]) -> None:
        """Brings the draft's ids up to the committed text after a round: its own accepted proposals
        (TLI: and the target's token when it is in the intersection) as they are, the rest re-tokenised."""
        text = _spell(self.vmap.target_text, new)
        ids: list[int] = []
        if drf.pending:  # bytes of an unfinished character wait: re-tokenise everything with them
            pass
        elif method == "tli":
            last = self._t2d[new[-1]] if len(new) > kept else -1
            ids = drafted[:kept] + ([last] if last >= 0 else [])
        else:
            for d in drafted:
                if not text.startswith(drf.spell(ids + [d])):
                    break
                ids.append(d)
        drf.append(ids)
        done = len(drf.spell(ids))
        if done < len(text):
            drf.extend(text[done:])
