"""Training the EAGLE-3-style draft head (``head=eagle``) on ``labels=drafter`` data.

The head (:class:`specheads.heads.EagleHead`) reads the target's states the datagen run stored, a batch
at a time (``drafter_data.py``), or states made while it trains (``eagle.states=online|hybrid``,
``eagle_states.py``); of the target it reads from the checkpoint files only its token
embeddings (frozen, never part of the head) and what initialises the head: its last layer, final norm
and the kept output-layer rows (``specheads/runtime/checkpoint_tensors.py``; the whole target is loaded only to
make states online with ``eagle.engine=specheads``).
The loss is the soft cross-entropy against the target's distribution, unrolled ``eagle.ttt_steps`` steps on the
head's own states (training-time test, ``eagle.py``). The best epoch has the longest mean greedy run of
matching steps (``eval_accept_length``: tokens a round at ``k = eagle.ttt_steps`` would keep).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from specheads.errors import UserError
from specheads.heads import EagleConfig, EagleHead
from specheads.outputs import atomic_write_json
from specheads.runtime.checkpoint_tensors import TargetCheckpoint
from specheads.shim import subset_hash
from specheads.train import eagle_data as E
from specheads.train import eagle_states
from specheads.train.config import TrainConfig
from specheads.train.drafter_data import DrafterData
from specheads.train.task import Task, describe, split


class EagleTask(Task):
    """The EAGLE draft head on the target's stored states."""

    labels = ("drafter",)
    head_type = "eagle"
    weights = (1.0, 1.0)  # unused: the loss is its own

    def __init__(
        self,
        cfg: TrainConfig,
        manifest: dict,
        data: DrafterData,
        vocab_ids: list[int],
        target: TargetCheckpoint,
        tensors: dict[str, torch.Tensor],
        device,
        init: dict[str, torch.Tensor] | None = None,
        states: eagle_states.States | None = None,
    ):
        self.cfg, self.manifest, self.data, self.layers, self.device = cfg, manifest, data, data.layers, device
        self.vocab_ids = vocab_ids
        self.init, self.states, self.mode = init, states, "offline" if states is None else states.mode
        self.config, self.target_read = target.config, {"bytes": target.bytes_read, "of": target.bytes_total}
        self.start = {k: v for k, v in tensors.items() if k != "embed"} or None
        # stored dtype (fp32 from GGUF); rows are cast to the head's after the lookup, which is exact
        self.embed = tensors["embed"].detach().contiguous().to(device)
        self.vocab_size = self.embed.shape[0]
        self.index = torch.full((self.vocab_size,), -1, dtype=torch.long)
        self.index[torch.tensor(vocab_ids)] = torch.arange(len(vocab_ids))
        self.hidden = self.config.hidden_size
        self.train_examples, self.eval_examples = split(list(range(len(data))), cfg.eval_fraction, cfg.seed)

    @classmethod
    def check(cls, cfg: TrainConfig) -> list[str]:
        out = []
        if cfg.eagle.ttt_steps < 1:
            out.append(f"eagle.ttt_steps={cfg.eagle.ttt_steps} must be >= 1")
        if not 0 < cfg.eagle.ttt_decay <= 1:
            out.append(f"eagle.ttt_decay={cfg.eagle.ttt_decay} must be in (0, 1]")
        if cfg.vocab_top_n < 1:
            out.append(f"vocab_top_n={cfg.vocab_top_n} must be >= 1")
        if not cfg.target.path:
            out.append("head=eagle needs the target (target.path): its embeddings and layers start the head")
        if cfg.eagle.init_head and cfg.vocab_file:
            out.append("eagle.init_head keeps the vocabulary subset of the head it starts from; drop vocab_file")
        if cfg.eagle.decoder_layers < 1:
            out.append(f"eagle.decoder_layers={cfg.eagle.decoder_layers} must be >= 1")
        if cfg.eagle.init_head and not Path(cfg.eagle.init_head).is_file():
            out.append(f"eagle.init_head={cfg.eagle.init_head!r} is not a file (an EAGLE head.safetensors)")
        return out + eagle_states.problems(cfg)

    @classmethod
    def setup(cls, cfg: TrainConfig, manifest: dict, acc) -> EagleTask:
        dirs = manifest.get("data_dirs") or [cfg.data_dir]
        manifests = [json.loads((Path(d) / "manifest.json").read_text()) for d in dirs]
        layers = {json.dumps((m.get("drafter") or {}).get("layers")) for m in manifests}
        if len(layers) > 1:
            raise UserError(f"{', '.join(dirs)} hold the target's states at other layers ({', '.join(sorted(layers))})")
        stored = all((m.get("drafter") or {}).get("store_states", True) for m in manifests)
        mode = eagle_states.resolve(cfg.eagle.states, stored, dirs)
        data = DrafterData(dirs, states=mode == "offline")
        data.layers = json.loads(layers.pop())
        target = TargetCheckpoint(cfg.target, "target")
        if target.fingerprint != manifest["target"]["fingerprint"]:
            raise UserError(
                f"target {target.name!r} (fingerprint {target.fingerprint}) is not the target the data was "
                f"written with ({manifest['target']['name']!r}); set target.path to that model"
            )
        n_layers = target.layers
        if not all(0 < i < n_layers for i in data.layers):
            raise UserError(
                f"the data's layers {data.layers} lie outside the target's decoder layers 1..{n_layers - 1}"
            )
        eos = target.config.eos_token_id
        eos = [int(i) for i in ([eos] if isinstance(eos, int) else eos or [])]
        init = None
        if cfg.eagle.init_head:
            init, vocab = start_from(cfg.eagle.init_head, manifest, data.layers)
        else:
            vocab = E.vocabulary(cfg, data, eos, target.config.vocab_size)
        # the target's last layer starts the head, or the layers grown onto init_head
        starts = init is None or E.decoder_layers(init) < cfg.eagle.decoder_layers
        tensors = target.tensors(vocab if starts else None)
        states = None
        if mode != "offline":
            maker = eagle_states.Maker(cfg, data.layers, acc.device, data.longest(), acc.local_process_index)
            cache = None
            if mode == "hybrid":
                key = eagle_states.cache_key(manifests, dirs, data.layers, cfg.eagle.engine)
                root = cfg.eagle.cache_dir or str(Path(cfg.output_dir) / "state-cache")
                cache = eagle_states.Cache(root, key, cfg.eagle.cache_gb * eagle_states.GB / acc.num_processes)
            states = eagle_states.States(mode, maker, cache)
        return cls(cfg, manifest, data, vocab, target, tensors, acc.device, init, states)

    @staticmethod
    def summary(cfg: TrainConfig, metrics: dict) -> str:
        steps = ", ".join(f"{metrics.get(f'eval_acc_step{j}', 0):.3f}" for j in range(1, cfg.eagle.ttt_steps + 1))
        return (
            f"eagle head: greedy agreement per step {steps}; accepted per round at k={cfg.eagle.ttt_steps}: "
            f"{metrics.get('eval_accept_length', 0):.3f}"
        )

    def build_head(self) -> EagleHead:
        torch.manual_seed(self.cfg.seed)
        config = EagleConfig.for_target(
            self.config,
            self.layers,
            len(self.vocab_ids),
            vocab_size=self.vocab_size,
            num_layers=self.cfg.eagle.decoder_layers,
        )
        head = EagleHead(config)
        if self.init is not None:
            have = E.decoder_layers(self.init)
            if have > config.num_layers:
                raise UserError(
                    f"eagle.init_head={self.cfg.eagle.init_head!r} has {have} decoder layers; eagle.decoder_layers="
                    f"{config.num_layers} would drop some: set eagle.decoder_layers={have} or more"
                )
            head.load_state_dict(self.init, strict=have == config.num_layers)
            E.grow_from_target(head, self.start, have)
        else:
            E.init_from_target(head, self.start, self.vocab_ids, self.cfg.seed)
        self.start = None  # the head holds them now
        return head

    def batch(self, examples: list, epoch: int) -> tuple[dict, dict]:
        seqs = self.data.rows(examples)
        if self.states is not None:
            self.states.fill(examples, seqs)
        return E.collate(seqs, self.index, self.device)

    def loss(self, head, x: dict, y: dict) -> torch.Tensor:
        return E.unrolled_loss(head, self.embed, x, y, self.cfg.eagle.ttt_steps, self.cfg.eagle.ttt_decay)

    @torch.no_grad()
    def evaluate(self, head: torch.nn.Module, examples: list) -> dict:
        """Per step: greedy agreement with the target's top-1 and loss; the mean greedy run of matching steps."""
        stats: dict = {}
        for i in range(0, len(examples), self.cfg.batch_size):
            x, y = self.batch(examples[i : i + self.cfg.batch_size], 0)
            E.unrolled_loss(head, self.embed, x, y, self.cfg.eagle.ttt_steps, self.cfg.eagle.ttt_decay, stats)
        total, rows = stats.pop("runs")
        runs = total / rows if rows else 0.0
        out = {"eval_accept_length": runs, "eval_rows": rows}
        for j, s in sorted(stats.items()):
            out[f"eval_acc_step{j}"] = s["hits"] / max(s["rows"], 1)
            out[f"eval_loss_step{j}"] = s["loss"] / max(s["kept"], 1)
        out["eval_in_vocab_share"] = stats[1]["kept"] / max(stats[1]["rows"], 1)
        return out

    def score(self, metrics: dict) -> float:
        return -metrics["eval_accept_length"]

    def metadata(self, metrics: dict) -> dict:
        ids = torch.tensor(self.vocab_ids)
        return describe(
            self.cfg,
            self.manifest,
            self.hidden,
            metrics,
            label="drafter",
            feature={"model": "target", "state": "aux", "layers": self.layers},
            draft_vocab={"size": len(self.vocab_ids), "hash": subset_hash(ids)},
            ttt_steps=self.cfg.eagle.ttt_steps,
        )

    def models(self) -> dict[str, tuple]:
        return {"target": (self.embed.dtype, self.embed.device)}

    def companions(self, out: Path) -> list[tuple[str, TrainConfig]]:
        return []

    def report(self, out: Path, acc, best: dict) -> dict:
        """``metrics.json``: the best epoch's held-out figures (without ``eval_``) and its epoch; the manifest gets
        the target bytes read (of the checkpoint files' total) and the data's size."""
        if acc.is_main_process:
            atomic_write_json(
                out / "metrics.json",
                {k[len("eval_") :]: v for k, v in best.items() if k.startswith("eval_")} | {"epoch": best.get("epoch")},
            )
        out = {
            "target_bytes_read": self.target_read["bytes"],
            "target_bytes_total": self.target_read["of"],
            "train_data": {"sequences": len(self.data), "tokens": self.data.tokens()},
            "states": {"mode": self.mode, "engine": None if self.states is None else self.cfg.eagle.engine},
        }
        if self.states is not None:
            out["states"] |= self.states.report()
            self.states.close()
        return out


def start_from(path: str, manifest: dict, layers: list[int]) -> tuple[dict[str, torch.Tensor], list[int]]:
    """An exported EAGLE head's weights (fp32) and vocabulary subset, checked against the data: the same target
    (fingerprint) and the same target layers."""
    from specheads.export.package import load_head

    loaded = load_head(path)
    meta = loaded.metadata
    if meta.get("head_type") != "eagle":
        raise UserError(f"eagle.init_head={path!r} is head_type={meta.get('head_type')!r}; it must be an EAGLE head")
    want = manifest["target"]["fingerprint"]
    if meta.get("target", {}).get("fingerprint") != want:
        raise UserError(
            f"eagle.init_head={path!r} was trained on target {meta.get('target', {}).get('name')!r}, not the "
            f"target the data was written with ({manifest['target']['name']!r})"
        )
    if list(meta.get("feature", {}).get("layers", [])) != list(layers):
        raise UserError(
            f"eagle.init_head={path!r} reads target layers {meta.get('feature', {}).get('layers')} but the "
            f"data holds layers {layers}"
        )
    state = {k: v.float() if v.is_floating_point() else v for k, v in loaded.module.state_dict().items()}
    return state, state["vocab_ids"].tolist()
