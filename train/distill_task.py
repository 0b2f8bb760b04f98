"""Distilling a standalone draft model (``head=draft``) on ``labels=drafter`` data: DistillSpec.

DistillSpec (Zhou et al. 2023) trains the draft to match the target's token distribution on
sequences the models themselves wrote (rather than on a fixed corpus), with a divergence chosen
for the task and decoding (``distill.divergence``: forward KL by default; reverse KL, Jensen-Shannon and
total variation are offered). Here the sequences are the target's own responses and the target's
distribution is its stored top-``K`` (``distill.py`` says how the rest of its mass counts). The draft
(``distill_model.py``) starts from ``distill.init`` and is trained whole (``distill.freeze_embeddings`` keeps the
embeddings and output layer); the best epoch, by held-out greedy agreement (the draft's argmax is the
target's top-1: what greedy speculative decoding accepts), is written as a Hugging Face model
directory ``draft/`` with ``draft/specheads.json``; ``metrics.json`` holds the held-out figures of the
untrained start (``before``) and of the best epoch (``after``).
"""

from __future__ import annotations

import copy
import logging
from pathlib import Path

import torch

from specheads.errors import UserError
from specheads.outputs import atomic_write_json
from specheads.runtime.target_shell import load_shell
from specheads.shim import eos_ids, subset_hash
from specheads.train import distill as D
from specheads.train import distill_model as M
from specheads.train import eagle_data as E
from specheads.train import zero
from specheads.train.config import TrainConfig
from specheads.train.drafter_data import DrafterData
from specheads.train.task import Task, split

log = logging.getLogger(__name__)


class DraftTask(Task):
    """A standalone draft model distilled on the target's distributions along its own responses."""

    labels = ("drafter",)
    head_type = "draft"
    artifact = "draft"  # what the run writes instead of head.safetensors (a model directory)
    weights = (1.0, 1.0)  # unused: the loss is its own

    def __init__(
        self,
        cfg: TrainConfig,
        manifest: dict,
        data: DrafterData,
        model,
        tokenizer,
        source: dict,
        vocab_ids: list[int] | None,
        device,
    ):
        self.cfg, self.manifest, self.data, self.device = cfg, manifest, data, device
        self.model, self.tokenizer, self.source, self.vocab_ids = model, tokenizer, source, vocab_ids
        self.hidden = int(model.config.hidden_size)
        self.pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self.index = None
        if vocab_ids is not None:
            self.index = torch.full((model.get_input_embeddings().weight.shape[0],), -1, dtype=torch.long)
            self.index[torch.tensor(vocab_ids)] = torch.arange(len(vocab_ids))
        self.train_examples, self.eval_examples = split(list(range(len(data))), cfg.eval_fraction, cfg.seed)
        self.before: dict = {}

    @classmethod
    def check(cls, cfg: TrainConfig) -> list[str]:
        out = []
        if cfg.distill.divergence not in D.DIVERGENCES:
            out.append(f"distill.divergence={cfg.distill.divergence!r}: choose one of {', '.join(D.DIVERGENCES)}")
        try:
            M.parse_init(cfg.distill.init)
        except UserError as err:
            out.append(str(err))
        if not cfg.target.path:
            out.append("head=draft needs the target (target.path): the one the data was written with")
        if cfg.vocab_file and cfg.vocab_top_n < 1:
            out.append(f"vocab_top_n={cfg.vocab_top_n} must be >= 1")
        if cfg.eval_fraction <= 0:
            out.append("head=draft picks the best epoch by held-out agreement: set eval_fraction > 0 (e.g. 0.1)")
        return out

    @classmethod
    def setup(cls, cfg: TrainConfig, manifest: dict, acc) -> DraftTask:
        dirs = manifest.get("data_dirs") or [cfg.data_dir]
        data = DrafterData(dirs, states=False)
        spec = copy.deepcopy(cfg.target)
        spec.device = "cpu"  # no weights: its config, tokenizer and fingerprint (truncate:N reads its layers alone)
        with zero.unpartitioned(acc):  # whole models: ZeRO-3 partitions the draft when prepared
            target = load_shell(spec)
        if target.fingerprint != manifest["target"]["fingerprint"]:
            raise UserError(
                f"target {target.name!r} (fingerprint {target.fingerprint}) is not the target the data was "
                f"written with ({manifest['target']['name']!r}); set target.path to that model"
            )
        with zero.unpartitioned(acc):
            model, tok, source = M.initial_draft(cfg, target)
        vocab = None
        if cfg.vocab_file:
            vocab = E.vocabulary(
                cfg, data, eos_ids(target.model, target.tokenizer), model.get_input_embeddings().weight.shape[0]
            )
            log.warning(
                "vocab_file: the draft is trained on a %d-token output layer and must decode with it "
                "(draft.vocab_file=%s/draft/%s); Transformers and vLLM score every token and would "
                "decode it much worse",
                len(vocab),
                cfg.output_dir,
                M.VOCAB,
            )
        log.info(
            "draft: %s (%d decoder layers, %.1fM parameters), %d sequences from %s",
            source["draft_init"],
            model.config.num_hidden_layers,
            sum(p.numel() for p in model.parameters()) / 1e6,
            len(data),
            ", ".join(dirs),
        )
        return cls(cfg, manifest, data, model, tok, source, vocab, acc.device)

    @staticmethod
    def summary(cfg: TrainConfig, metrics: dict) -> str:
        before, nan = metrics.get("eval_before") or {}, float("nan")
        return (
            f"draft ({cfg.distill.divergence}): held-out greedy agreement {before.get('eval_agreement', nan):.3f}"
            f" -> {metrics.get('eval_agreement', nan):.3f}, expected acceptance >= "
            f"{before.get('eval_accept_lb', nan):.3f} -> {metrics.get('eval_accept_lb', nan):.3f}"
        )

    def build_head(self) -> M.DraftLM:
        """The initial draft (it is built once per run), with its held-out figures as ``self.before``."""
        if self.model is None:
            raise RuntimeError("DraftTask.build_head is called once per run")
        torch.manual_seed(self.cfg.seed)
        head = M.DraftLM(self.model.to(self.device), self.vocab_ids)
        self.model = None
        head.eval()
        self.before = self.evaluate(head, self.eval_examples)
        log.info(
            "before training: held-out agreement %.4f, expected acceptance >= %.4f, loss %.4f",
            self.before["eval_agreement"],
            self.before["eval_accept_lb"],
            self.before["eval_loss"],
        )
        return head

    def batch(self, examples: list, epoch: int) -> tuple[dict, dict]:
        return D.collate(self.data.rows(examples), self.index, self.pad, self.device)

    def loss(self, head, x: dict, y: dict) -> torch.Tensor:
        return D.loss_and_stats(head(x["ids"], x["mask"], x["sel"]), y, self.cfg.distill.divergence)

    @torch.no_grad()
    def evaluate(self, head: torch.nn.Module, examples: list) -> dict:
        """Greedy agreement with the target's top-1, the top-k lower bound of the acceptance rate, the loss."""
        stats: dict = {}
        for i in range(0, len(examples), self.cfg.batch_size):
            x, y = self.batch(examples[i : i + self.cfg.batch_size], 0)
            D.loss_and_stats(head(x["ids"], x["mask"], x["sel"]), y, self.cfg.distill.divergence, stats)
        return D.summarise(stats)

    def score(self, metrics: dict) -> float:
        return -metrics["eval_agreement"]

    def metadata(self, metrics: dict) -> dict:
        vocab = None
        if self.vocab_ids is not None:
            vocab = {
                "size": len(self.vocab_ids),
                "sha256": subset_hash(torch.tensor(self.vocab_ids)),
                "vocab_file": self.cfg.vocab_file,
                "vocab_top_n": self.cfg.vocab_top_n,
                "decode_with": f"draft.vocab_file=<this directory>/{M.VOCAB} draft.vocab_top_n=null (the rows "
                "outside the subset were not trained: decoding over the full vocabulary, as "
                "Transformers and vLLM do, is much worse)",
            }
        c = self.cfg
        return {
            "format": "specheads-draft",
            "head_type": self.head_type,
            "target": self.manifest["target"],
            "data": {
                "dirs": self.manifest.get("data_dirs") or [c.data_dir],
                "sampling": self.manifest.get("sampling"),
                "datagen_seed": self.manifest.get("seed"),
                "top_k": self.data.top_k,
            },
            "divergence": c.distill.divergence,
            "draft_init": self.source["draft_init"],
            "init": self.source,
            "freeze_embeddings": c.distill.freeze_embeddings,
            "draft_vocab": vocab,
            "train": {
                "lr": c.lr,
                "batch_size": c.batch_size,
                "grad_accum": c.grad_accum,
                "seed": c.seed,
                "eval_fraction": c.eval_fraction,
                "max_steps": c.max_steps,
                "epochs": c.epochs,
            },
            "before": self.before,
            "metrics": metrics,
        }

    def save(self, out: Path, head: M.DraftLM, metrics: dict) -> None:
        """The best epoch's draft as ``out/draft/`` (see :func:`distill_model.save_draft`)."""
        M.save_draft(out, head, self.tokenizer, self.metadata(metrics))

    def models(self) -> dict[str, tuple]:
        return {}

    def companions(self, out: Path) -> list[tuple[str, TrainConfig]]:
        return []

    def report(self, out: Path, acc, best: dict) -> dict:
        """``metrics.json``: held-out figures (without ``eval_``) before training and at the best epoch."""
        strip = lambda m: {k[len("eval_") :]: v for k, v in m.items() if k.startswith("eval_")}  # noqa: E731
        if acc.is_main_process:
            atomic_write_json(
                out / "metrics.json",
                {
                    "before": strip(self.before),
                    "after": strip(best),
                    "epoch": best.get("epoch"),
                    "step": best.get("step"),
                },
            )
        return {"eval_before": self.before, "draft_dir": str(out / self.artifact)}
