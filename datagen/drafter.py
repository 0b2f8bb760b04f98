"""``labels=drafter``: what a drafter learns from, on the target's own responses.

Per prompt, the target writes its response (greedy or with the deployment sampling), then one
teacher-forced pass over prompt + response keeps the target's residual stream entering the chosen
decoder layers (``drafter.layers``: low, middle, high; default ``2, n/2, n-3`` of ``n`` layers, the
EAGLE-3 choice) at every position. At every response token it also keeps the ``drafter.top_k`` most
likely tokens of the target's distribution that token was chosen from, with their log-probabilities.
An EAGLE-style head (``heads-train head=eagle``) trains on all three; a standalone draft distilled on
the target's distribution (``heads-train head=draft``) needs only the ids and the distributions.

The Parquet file holds :data:`~specheads.dataset.DRAFTER_COLUMNS`; the tensors go to
:class:`~specheads.dataset.DrafterChunkFiles`.
"""

from __future__ import annotations

from pathlib import Path

import torch

from specheads.datagen import shards, turns
from specheads.datagen.acceptance_labels import generate_responses, response_logits
from specheads.datagen.labelling import Job, Labelled, Labeller, skip_record
from specheads.datagen.vllm_job import light_job
from specheads.datagen.vllm_logprobs import top_k as vllm_top_k
from specheads.datagen.vllm_logprobs import top_k_only
from specheads.datagen.vllm_states import drafter_states
from specheads.dataset import DRAFTER_COLUMNS, DrafterChunkFiles, chunk_files
from specheads.errors import UserError
from specheads.runtime.states import sequence_states


def default_layers(num_layers: int) -> list[int]:
    """The EAGLE-3 / vLLM choice of low, middle and high layers: ``2, n // 2, n - 3`` (distinct, in range)."""
    return sorted({max(1, min(i, num_layers - 1)) for i in (2, num_layers // 2, num_layers - 3)})


def layers_for(cfg, model) -> list[int]:
    """The configured layers, or the default for ``model``'s depth."""
    return list(cfg.drafter.layers) or default_layers(model.config.num_hidden_layers)


def top_k(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` most likely ids ``[N, k]`` (int32) and their log-probabilities (fp32) under ``softmax(logits)``."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    vals, ids = logp.topk(min(k, logp.shape[-1]), dim=-1)
    return ids.to(torch.int32).cpu(), vals.cpu()


def label_chunk(job: Job, items: list, chunk: int) -> Labelled:
    """The target's responses to one chunk of prompts, their states and distributions (side file)."""
    cfg, model = job.cfg, job.pair.target.model
    layers = layers_for(cfg, model)
    store = cfg.drafter.store_states
    seed = shards.chunk_seed(cfg.seed, chunk)
    cols: dict[str, list] = {k: [] for k in DRAFTER_COLUMNS}
    states, tops, logps, lengths, rlengths, skipped = [], [], [], [], [], []
    labelled = 0
    for b in range(0, len(items), cfg.batch_size):
        batch = items[b : b + cfg.batch_size]
        ids = job.prompt_ids(batch)
        picked = {}  # engine=vllm: the target's top-k from vLLM, by row
        if job.pregenerated is None:
            responses, logits = generate_responses(
                model, ids, cfg.max_new_tokens, cfg.sampling, seed + b, job.pad, job.eos
            )
            if logits is None:  # a model off the fused path: one teacher-forced pass gives them
                logits = response_logits(model, ids, responses, job.pad)
            keep = [i for i, (r, lg) in enumerate(zip(responses, logits)) if r and bool(torch.isfinite(lg).all())]
            seqs = [ids[i] + responses[i] for i in keep]
            got = sequence_states(model, seqs, layers) if seqs and store else [_none(s) for s in seqs]
        else:  # engine=vllm: the responses from vLLM
            responses, ok = map(
                list, zip(*(job.response(str(job.first_index(chunk) + b + i)) for i in range(len(batch))))
            )
            live = [i for i, r in enumerate(responses) if r and ok[i]]
            seqs, lens = [ids[i] + responses[i] for i in live], [len(responses[i]) for i in live]
            if job.states is not None:  # and the states and top-k from vLLM too: no target pass here
                res = drafter_states(job, seqs, layers, lens, cfg.drafter.top_k)
                picked = {i: r[1] for i, r in zip(live, res)}
                keep = [i for i, r in zip(live, res) if r[2]]
                got = [r[0] for r in res if r[2]]
            elif top_k_only(cfg):  # no states: the top-k from the pass that generated the responses
                keys = [str(job.first_index(chunk) + b + i) for i in live]
                picked = dict(zip(live, vllm_top_k(job, keys, cfg.drafter.top_k) if live else []))
                keep = [i for i in live if bool(torch.isfinite(picked[i][1][:, 0]).all())]
                got = [_none(seqs[live.index(i)]) for i in keep]
            else:
                got, lgs = sequence_states(model, seqs, layers, lens) if live else ([], [])
                logits = dict(zip(live, lgs))
                keep = [i for i in live if bool(torch.isfinite(logits[i]).all())]
                got = [st for i, st in zip(live, got) if i in keep]
        for i, p in enumerate(batch):
            if i not in keep:
                skipped.append(
                    skip_record(
                        p, job.first_index(chunk) + b + i, "empty response" if not responses[i] else "non-finite logits"
                    )
                )
        for i, st in zip(keep, got):
            t_ids, t_logp = picked[i] if picked else top_k(logits[i], cfg.drafter.top_k)
            states.append(st if store else _none(st))
            tops.append(t_ids)
            logps.append(t_logp)
            lengths.append(st.shape[0])
            rlengths.append(len(responses[i]))
            cols["prompt_id"].append(batch[i].id)
            cols["prompt_index"].append(job.first_index(chunk) + b + i)
            cols["input_ids"].append(ids[i] + responses[i])
            cols["response_start"].append(len(ids[i]))
            labelled += len(responses[i])
    width = len(layers) * job.pair.target.hidden_size if store else 0
    k = min(cfg.drafter.top_k, job.pair.target.model.config.vocab_size)
    DrafterChunkFiles(cfg.output_dir, chunk).write(
        {
            "states": torch.cat(states) if states else torch.zeros(0, width, dtype=torch.float16),
            "offsets": _offsets(lengths),
            "top_ids": torch.cat(tops) if tops else torch.zeros(0, k, dtype=torch.int32),
            "top_logp": torch.cat(logps) if logps else torch.zeros(0, k),
            "response_offsets": _offsets(rlengths),
            "layers": torch.tensor(layers, dtype=torch.int64),
        }
    )
    return Labelled(cols, labelled, skipped)


def _none(seq) -> torch.Tensor:
    """A sequence's stored states when ``drafter.store_states=false``: ``[T, 0]`` (the offsets still cut the rows)."""
    return torch.zeros(len(seq), 0, dtype=torch.float16)


def _offsets(lengths: list[int]) -> torch.Tensor:
    out = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    if lengths:
        out[1:] = torch.tensor(lengths, dtype=torch.int64).cumsum(0)
    return out


def summarise(out: Path) -> dict:
    """Counts, the target's mean top-1 probability (``label_mean``: how sure the target is of its own
    text) and the disk the run takes, per 100k response tokens; streamed chunk by chunk."""
    import pyarrow.parquet as pq

    prompts = tokens = positions = 0
    top1 = 0.0
    disk = 0
    layers = None
    for path in chunk_files(out):
        prompts += pq.read_metadata(str(path)).num_rows
        disk += path.stat().st_size
        side = DrafterChunkFiles(out, int(path.stem.split("-")[1]))
        disk += side.path.stat().st_size
        t = side.load()
        layers = t["layers"].tolist()
        tokens += t["top_logp"].shape[0]
        positions += t["states"].shape[0]
        top1 += float(t["top_logp"][:, 0].double().exp().sum()) if t["top_logp"].numel() else 0.0
    return {
        "prompts": prompts,
        "labelled_tokens": tokens,
        "state_positions": positions,
        "layers": layers,
        "label_mean": top1 / tokens if tokens else None,
        "disk_bytes": disk,
        "disk_mb_per_100k_tokens": round(disk / tokens * 1e5 / 2**20, 1) if tokens else None,
    }


class StatesLabeller(Labeller):
    """A family whose chunks keep their tensors in a :class:`~specheads.dataset.DrafterChunkFiles` side file."""

    def side_files(self, out: Path, chunk: int) -> tuple[Path, ...]:
        return (DrafterChunkFiles(out, chunk).path,)

    def shard_entry(self, out: Path, chunk: int) -> dict:
        from specheads.outputs import file_sha256

        path = DrafterChunkFiles(out, chunk).path
        return {"states": {"file": f"states/{path.name}", "bytes": path.stat().st_size, "sha256": file_sha256(path)}}


class DrafterLabeller(StatesLabeller):
    """``labels=drafter``: the target's responses, its states at chosen layers and its top-k distributions."""

    def problems(self, cfg) -> list[str]:
        out = super().problems(cfg)
        if cfg.drafter.top_k < 1:
            out.append(f"drafter.top_k={cfg.drafter.top_k} must be >= 1")
        layers = list(cfg.drafter.layers)
        if any(int(i) < 1 for i in layers):
            out.append(f"drafter.layers={layers} must be decoder-layer indices >= 1 (the stream entering that layer)")
        if len(set(layers)) != len(layers):
            out.append(f"drafter.layers={layers} repeats a layer")
        return out + turns.problems(cfg)

    def items(self, cfg):
        """The prompts, ``messages`` rows cut at ``drafter.turn`` (``datagen/turns.py``)."""
        return turns.turn_items(super().items(cfg), cfg, lambda: light_job(cfg).pair.tokenizer)

    def needs_draft(self, cfg) -> bool:
        return False

    def target_under_vllm(self, cfg) -> str:
        return "config"  # states and top-k from vLLM

    def check_models(self, job: Job) -> None:
        model = job.pair.target.model
        n = model.config.num_hidden_layers
        bad = [i for i in layers_for(job.cfg, model) if not 0 < i < n]
        if bad:
            raise UserError(
                f"drafter.layers={list(job.cfg.drafter.layers)}: layers {bad} lie outside the target's "
                f"decoder layers 1..{n - 1}"
            )

    def label_chunk(self, job: Job, items: list, chunk: int) -> Labelled:
        return label_chunk(job, items, chunk)

    def summarise(self, cfg, out: Path, models: dict) -> tuple[dict, dict]:
        stats = summarise(out)
        return stats, {
            "drafter": {
                "layers": stats.pop("layers"),
                "top_k": cfg.drafter.top_k,
                "hidden_size": models["hidden_size"],
                "store_states": cfg.drafter.store_states,
            }
        }
