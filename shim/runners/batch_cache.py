"""One model's KV cache for a batch of rows that each go their own way (batched speculative decoding).

Rows of a speculative batch advance by different amounts every round (each keeps its own number of
candidates) and are trimmed by different amounts. The cache here is one preallocated buffer per
layer, ``[rows, kv_heads, capacity, head_dim]``, with a shared write cursor: every forward writes
its ``S`` new tokens per row at slots ``end .. end + S - 1`` of every row (a row with fewer new
tokens, or none, leaves the rest of its slots empty). A row's own sequence is the list of its
slots that hold one of its tokens, in order (``slots[row]``); rotary positions come from that list,
not from the slot, and attention reads a row's filled slots only (a boolean mask). Trimming a row
empties its last slots; nothing is moved. When the cursor reaches the end of the buffer the rows
are compacted (each row's filled slots moved to the front, in order), and the buffer doubles when
that is not enough.

A row that joins (a new prompt) is prefilled in a forward of the joining rows alone, on their own
small buffers, then copied into its row: the other rows skip those slots.

A ``fixed`` buffer (a serving engine's memory budget) is allocated whole at its start-up capacity and never
grows: a joining row is copied into its own row's first slots (it is empty, so they are free and the cursor
does not move for it), and a forward that compaction cannot make room for raises :class:`CacheFull`; the
caller keeps its rows short enough (see :class:`~.row_proposer.RowProposer`).

Runs on the fused forward (:mod:`.fused`), which covers Llama-family models.
"""

from __future__ import annotations

import torch

from specheads.shim.runners.fused import FusedShape, decoder_layers, output_logits, rms_norm, supports


class CacheFull(RuntimeError):
    """A forward needs more slots than a fixed buffer has, even compacted."""


class BatchRunner:
    """Forward passes of one Llama-family model over ``rows`` independent, trimmable sequences.

    Args:
        model: a causal LM for which :func:`~.fused.supports` is None, in eval mode.
        rows: batch rows (each holds one prompt at a time).
        hidden: ``None``, ``"pre"`` or ``"post"``: the final-norm state returned with the logits.
        vocab_size: logits are cut to this many columns when the model pads its vocabulary.
        capacity: initial slots per row; grows when compaction is not enough.
        aux: decoder-layer indices whose entering residual stream each forward keeps, per row fed, in
            ``aux_states`` (``row -> (first position, [n, len(aux) * d])``: what an EAGLE head reads), or None.
        fixed: allocate ``capacity`` slots per row now and never grow (see the module docstring).
        packed: the projections and MLP of a forward run on the fed rows' real tokens only, packed together
            (a row with 1 new token costs 1 row of the products, not the widest row's count); False pads every
            row up to the widest (and rows not fed below the last fed one) as attention does.
    """

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    valid: torch.Tensor

    def __init__(
        self,
        model,
        rows: int,
        hidden: str | None = None,
        vocab_size: int | None = None,
        capacity: int = 256,
        aux: list[int] | None = None,
        fixed: bool = False,
        packed: bool = True,
    ):
        why = supports(model)
        if why is not None:
            raise ValueError(f"batched decoding runs on the fused forward, which does not cover this model: {why}")
        self.model, self.rows, self.hidden, self.vocab_size = model, rows, hidden, vocab_size
        self.shape = FusedShape(model)
        emb = model.get_input_embeddings()
        self.device, self.dtype = emb.weight.device, emb.weight.dtype
        self.slots: list[list[int]] = [[] for _ in range(rows)]
        self.end = 0
        self.forwards = 0  # forwards with at least one row, prefills included
        self.aux = [int(i) for i in aux] if aux else None
        self.aux_states: dict[int, tuple[int, torch.Tensor]] = {}
        self.capacity, self.fixed, self.packed = 0, fixed, packed
        self.fed_tokens = 0  # real tokens fed to forwards (prefills apart)
        self.computed_tokens = 0  # rows of the products those forwards computed (padding included)
        self._grow(int(capacity) if fixed else max(int(capacity), 8))

    # ---- the buffer ---------------------------------------------------------------------------

    def _grow(self, capacity: int) -> None:
        s = self.shape
        kv = (self.rows, s.kv_heads, capacity, s.head_dim)
        keys = [torch.zeros(kv, dtype=self.dtype, device=self.device) for _ in s.weights.layers]
        values = [torch.zeros(kv, dtype=self.dtype, device=self.device) for _ in s.weights.layers]
        valid = torch.zeros(self.rows, capacity, dtype=torch.bool, device=self.device)
        if self.capacity:
            for new, old in zip(keys + values, self.keys + self.values):
                new[:, :, : self.end] = old[:, :, : self.end]
            valid[:, : self.end] = self.valid[:, : self.end]
        self.keys, self.values, self.valid, self.capacity = keys, values, valid, capacity
        probe = torch.zeros(1, 1, s.head_dim, dtype=self.dtype, device=self.device)
        cos, sin = self.model.model.rotary_emb(probe, torch.arange(capacity, device=self.device).unsqueeze(0))
        self.cos, self.sin = cos[0].to(self.dtype), sin[0].to(self.dtype)  # by position, [capacity, hd]

    def _room(self, width: int) -> None:
        """Makes ``width`` free slots after the cursor: compacts the rows when the buffer is full or when
        the gaps are most of it (attention reads every slot up to the cursor), then doubles if needed."""
        longest = max((len(s) for s in self.slots), default=0)
        if self.end + width <= self.capacity and self.end <= max(2 * longest, 64):
            return
        if longest < self.end:  # gaps to close
            idx = torch.zeros(self.rows, longest, dtype=torch.long, device=self.device)
            for r, s in enumerate(self.slots):
                if s:
                    idx[r, : len(s)] = torch.tensor(s, device=self.device)
            gather = idx[:, None, :, None].expand(-1, self.shape.kv_heads, -1, self.shape.head_dim)
            for buf in (self.keys, self.values):
                for i, layer in enumerate(buf):
                    moved = layer.gather(2, gather)
                    layer[:, :, :longest] = moved
            self.valid.zero_()
            for r, s in enumerate(self.slots):
                self.valid[r, : len(s)] = True
                self.slots[r] = list(range(len(s)))
            self.end = longest
        if self.fixed:
            if self.end + width > self.capacity:
                raise CacheFull(f"{width} new tokens after {self.end} held do not fit {self.capacity} slots per row")
            return
        capacity = self.capacity
        while self.end + width > capacity * 3 // 4:  # keep a quarter free, or compaction runs every step
            capacity *= 2
        if capacity != self.capacity:
            self._grow(capacity)

    # ---- rows ---------------------------------------------------------------------------------

    def length(self, row: int) -> int:
        """Tokens held for ``row``."""
        return len(self.slots[row])

    def trim(self, row: int, length: int) -> None:
        """Keeps the first ``length`` tokens of ``row``."""
        s = self.slots[row]
        if length < len(s):
            self.valid[row, torch.tensor(s[length:], device=self.device)] = False
            del s[length:]

    def clear(self, row: int) -> None:
        """Empties ``row`` (its prompt finished)."""
        self.trim(row, 0)

    # ---- forwards -----------------------------------------------------------------------------

    def prefill(self, tokens: dict[int, list[int]]) -> None:
        """Feeds each empty row in ``tokens`` its prompt (no logits): one forward of those rows alone."""
        self.aux_states = {}
        rows = [r for r, t in tokens.items() if t]
        if not rows:
            return
        width = max(len(tokens[r]) for r in rows)
        if not self.fixed:
            self._room(width)
        elif width > self.capacity:
            raise CacheFull(f"a {width}-token prefill does not fit {self.capacity} slots per row")
        at0 = 0 if self.fixed else self.end  # where the rows' tokens go
        s = self.shape
        b = len(rows)
        ids = torch.zeros(b, width, dtype=torch.long, device=self.device)
        real = torch.zeros(b, width, dtype=torch.bool, device=self.device)
        for i, r in enumerate(rows):
            assert not self.slots[r], "prefill needs an empty row"
            ids[i, : len(tokens[r])] = torch.tensor(tokens[r], device=self.device)
            real[i, : len(tokens[r])] = True
        kv = (b, s.kv_heads, width, s.head_dim)
        keys = [torch.zeros(kv, dtype=self.dtype, device=self.device) for _ in s.weights.layers]
        values = [torch.zeros(kv, dtype=self.dtype, device=self.device) for _ in s.weights.layers]
        causal = torch.ones(width, width, dtype=torch.bool, device=self.device).tril()
        mask = (causal[None] & real[:, None, :]) | torch.eye(width, dtype=torch.bool, device=self.device)[None]
        cos, sin = self.cos[:width], self.sin[:width]  # right-padded: row positions are 0, 1, ...
        seen = dict.fromkeys(self.aux) if self.aux else None
        pack = self._pack(real, sum(len(tokens[r]) for r in rows))  # prompts of unequal length
        decoder_layers(
            s,
            self.model.get_input_embeddings()(ids),
            cos,
            sin,
            keys,
            values,
            0,
            width,
            mask[:, None],
            False,
            seen,
            pack,
        )
        self._keep_aux(seen, {r: (i, 0, len(tokens[r])) for i, r in enumerate(rows)})
        at = torch.tensor(rows, device=self.device)
        for big, small in zip(self.keys + self.values, keys + values):
            big[at, :, at0 : at0 + width] = small
        for i, r in enumerate(rows):
            n = len(tokens[r])
            self.valid[r, at0 : at0 + n] = True
            self.slots[r] = list(range(at0, at0 + n))
        self.end = max(self.end, at0 + width)
        self.forwards += 1

    def forward(
        self, tokens: dict[int, list[int] | torch.Tensor], n_logits: dict[int, int]
    ) -> dict[int, tuple[torch.Tensor, torch.Tensor | None]]:
        """Feeds each row in ``tokens`` its new tokens (ids, or a 1-D tensor: no host sync) after what it
        holds; one forward over the rows up to the last one fed (the buffers' leading rows, as views: rows
        past it cost nothing).

        Returns, per row with ``n_logits[row] > 0``: logits ``[n, V]`` at its last ``n`` new tokens and
        the requested hidden state there ``[n, d]`` (or None).
        """
        self.aux_states = {}
        rows = [r for r, t in tokens.items() if len(t)]
        if not rows:
            return {}
        width = max(len(tokens[r]) for r in rows)
        self._room(width)
        start, end = self.end, self.end + width
        ids = torch.zeros(self.rows, width, dtype=torch.long, device=self.device)
        real = torch.zeros(self.rows, width, dtype=torch.bool, device=self.device)
        pos = torch.zeros(self.rows, width, dtype=torch.long, device=self.device)
        for r in rows:
            n, have = len(tokens[r]), len(self.slots[r])
            t = tokens[r]
            ids[r, :n] = t if isinstance(t, torch.Tensor) else torch.tensor(t, device=self.device)
            real[r, :n] = True
            pos[r] = torch.arange(have, have + width, device=self.device).clamp_max(self.capacity - 1)
        self.valid[:, start:end] = real
        block = torch.ones(width, width, dtype=torch.bool, device=self.device).tril()
        # a row sees its filled slots before the block, the causal part of its own block, and (every
        # query, so that no attention row is empty) its own slot
        mask = torch.cat(
            [
                self.valid[:, None, :start].expand(-1, width, -1),
                (block[None] & real[:, None, :]) | torch.eye(width, dtype=torch.bool, device=self.device)[None],
            ],
            dim=2,
        )
        seen = dict.fromkeys(self.aux) if self.aux else None
        top = max(rows) + 1
        fed = sum(len(tokens[r]) for r in rows)
        pack = self._pack(real[:top], fed)
        self.fed_tokens += fed
        self.computed_tokens += fed if pack is not None else top * width
        x = decoder_layers(
            self.shape,
            self.model.get_input_embeddings()(ids[:top]),
            self.cos[pos[:top]][:, None],
            self.sin[pos[:top]][:, None],
            [k[:top] for k in self.keys],
            [v[:top] for v in self.values],
            start,
            end,
            mask[:top, None],
            False,
            seen,
            pack,
        )
        self._keep_aux(seen, {r: (r, len(self.slots[r]), len(tokens[r])) for r in rows})
        for r in rows:
            self.slots[r].extend(range(start, start + len(tokens[r])))
        self.end = end
        self.forwards += 1
        want = [(r, len(tokens[r]), n_logits.get(r, 0)) for r in rows if n_logits.get(r, 0)]
        if not want:
            return {}
        states = torch.cat([x[r, n - k : n] for r, n, k in want])  # [sum k, d], before the final norm
        normed = rms_norm(self.model.model.norm, states)
        logits = output_logits(self.shape.weights, normed)
        if self.vocab_size is not None and logits.shape[-1] != self.vocab_size:
            logits = logits[..., : self.vocab_size]
        hid = states if self.hidden == "pre" else normed if self.hidden == "post" else None
        out, at = {}, 0
        for r, _, k in want:
            out[r] = (logits[at : at + k], hid[at : at + k] if hid is not None else None)
            at += k
        return out

    def _pack(self, real: torch.Tensor, fed: int) -> torch.Tensor | None:
        """The positions of ``real.flatten()`` that hold the ``fed`` real tokens, when packing is on and saves
        rows (None: every position is computed)."""
        if not self.packed or fed == real.numel():
            return None
        return real.flatten().nonzero().squeeze(1)

    def _keep_aux(self, seen, fed: dict[int, tuple[int, int, int]]) -> None:
        """``aux_states`` of the forward that just ran: per row ``r`` in ``fed`` (``(batch index, first position,
        tokens)``), its states at those positions."""
        if seen is None:
            return
        states = torch.cat([seen[i] for i in self.aux or ()], dim=-1)
        self.aux_states = {r: (first, states[i, :n]) for r, (i, first, n) in fed.items()}

    def close(self) -> None:
        """Nothing to release; kept for interface parity with the batch-1 runners."""
