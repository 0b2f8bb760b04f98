"""Training a SpecDec++ stop head for an EAGLE drafter (``head=eagle_stop``) on ``labels=eagle_rounds`` data.

No model is loaded: the datagen run decoded with the EAGLE head and stored its post-norm state at every labelled
candidate (fp16), with the soft label ``min(1, p/q)`` (greedy: 1/0 agreement). The head is an
:class:`~specheads.heads.AcceptanceHead` (``depth`` residual blocks) on the state and, with
``eagle_stop.confidence`` (the default), the drafter's ``log q(y)`` of the candidate: SpecDec++'s features.
``depth=0 eagle_stop.confidence=false w_rej=1`` is DSpark's linear confidence head on the state, the comparison
fitted with the weighted soft BCE (``w_acc``, ``w_rej``; ``w_rej=1``: plain BCE). The best epoch has the lowest
held-out binary KL; the held-out metrics add AUROC against the binarised label, ECE and Brier, and
``eval_auroc_confidence``, the AUROC of the drafter's own confidence ``q(y)`` (what ``policy=confidence_stop``
reads). It exports as ``head_type=acceptance``, so ``heads-decode policy=specdecpp specdecpp.head=... eagle=...``
reads it; its ``feature`` names the EAGLE head it reads (``model: eagle`` and that head's ``tensors_sha256``), and
decoding with another is an error.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from specheads.dataset import (
    EAGLE_ROUNDS_COLUMNS,
    EAGLE_ROUNDS_SIGNALS,
    DrafterChunkFiles,
    require_columns,
    shard_paths,
)
from specheads.errors import UserError
from specheads.heads import AcceptanceHead
from specheads.heads.acceptance_head import SIGNALS, signal_values
from specheads.outputs import atomic_write_json
from specheads.train.config import TrainConfig
from specheads.train.loss import binary_kl, weighted_soft_bce
from specheads.train.side_rows import SideRows, read_small
from specheads.train.task import Task, calibration_metrics, describe, predict, split


@dataclass
class StopExample:
    """One prompt's labelled candidates: rows ``start:end`` of the store."""

    index: int
    start: int
    end: int


class StopStore:
    """Every chunk's labels and draft confidences in memory, its states read per batch (``side_rows.py``), and
    one example per prompt."""

    def __init__(self, data_dir: str | Path, signals: bool = False):
        import pyarrow.parquet as pq

        root = Path(data_dir)
        labels, conf, target_p, self.examples = [], [], [], []
        extra: dict[str, list] = {"step": [], "outcome": [], "q_entropy": [], "q_margin": []}
        self.states = SideRows("states")
        base = 0
        for path in shard_paths(root):
            require_columns(path, (*EAGLE_ROUNDS_COLUMNS, *(EAGLE_ROUNDS_SIGNALS if signals else ())))
            names = [c for c in extra if signals or c in ("step", "outcome")]
            table = pq.read_table(str(path), columns=["label", "q_token", "p_token", *names])
            side = DrafterChunkFiles(root, int(path.stem.split("-")[1]))
            t, _ = read_small(side.path, ("offsets",))
            off = t["offsets"].tolist()
            rows = table.column("label").to_pylist()
            if len(off) != len(rows) + 1 or any(len(y) != off[i + 1] - off[i] for i, y in enumerate(rows)):
                raise UserError(
                    f"{side.path} does not match {path}; run heads-datagen verify output_dir={root} and relabel"
                )
            for i, y in enumerate(rows):
                if y:
                    self.examples.append(StopExample(len(self.examples), base + off[i], base + off[i + 1]))
                labels += y
            conf += [q for qs in table.column("q_token").to_pylist() for q in qs]
            target_p += [p for ps in table.column("p_token").to_pylist() for p in ps]
            for name in names:
                extra[name] += [v for vs in table.column(name).to_pylist() for v in vs]
            self.states.add(side.path, int(off[-1]))
            base += int(off[-1])
        if not self.examples:
            raise UserError(
                f"{data_dir} holds no labelled candidates; decode longer responses (max_new_tokens) or more prompts"
            )
        self.labels = torch.tensor(labels, dtype=torch.float32)
        self.confidence = torch.tensor(conf, dtype=torch.float32)
        # SPRINTER's ratio q(y)/p(y) (inf where p(y) = 0), head=eagle_verifier's labels at any lambda
        self.ratio = self.confidence / torch.tensor(target_p, dtype=torch.float32)
        self.extra = {k: torch.tensor(v, dtype=torch.float32) for k, v in extra.items() if v}

    def rows(self, examples: list[StopExample]) -> torch.Tensor:
        return torch.cat([torch.arange(e.start, e.end) for e in examples])

    def batch(
        self,
        examples: list[StopExample],
        device,
        confidence: bool = False,
        signals: tuple[str, ...] = (),
        state: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Features ``[N, d]`` (``confidence``: ``[N, d + 1]``, ``log q(y)`` after the state, then ``signals``;
        without ``state``, no state columns) and soft labels ``[N]``."""
        idx = self.rows(examples)
        if state:
            x = self.states.take([(e.start, e.end) for e in examples]).float()
        else:  # the states are never read
            x = torch.zeros(len(idx), 0)
        if confidence:
            e = self.extra
            extra = signal_values(signals, e["q_entropy"][idx], e["q_margin"][idx], e["step"][idx]) if signals else None
            x = AcceptanceHead.features(x, self.confidence[idx].log(), extra)
        return x.to(device), self.labels[idx].to(device)

    def decided(self, examples: list[StopExample]) -> torch.Tensor:
        """Which of the examples' candidates the round reached (all earlier ones accepted): the rows where a stop
        decision is made, SpecDec++'s conditional."""
        return self.extra["outcome"][self.rows(examples)] >= 0


def _auroc(hard, scores) -> float | None:
    from sklearn.metrics import roc_auc_score

    return float(roc_auc_score(hard, scores)) if 0 < hard.sum() < len(hard) else None


class EagleStopTask(Task):
    """The SpecDec++ acceptance head on an EAGLE head's stored states, from ``labels=eagle_rounds`` data."""

    labels = ("eagle_rounds",)
    head_type = "acceptance"  # policy=specdecpp reads it

    def __init__(self, cfg: TrainConfig, manifest: dict, store: StopStore, device):
        self.cfg, self.manifest, self.store, self.device = cfg, manifest, store, device
        self.train_examples, self.eval_examples = split(store.examples, cfg.eval_fraction, cfg.seed)
        self.weights, self.hidden = (cfg.w_acc, cfg.w_rej), int(manifest["hidden_size"])

    @classmethod
    def check(cls, cfg: TrainConfig) -> list[str]:
        out = []
        if cfg.acceptance.label != "soft":
            out.append(
                f"acceptance.label={cfg.acceptance.label}: head=eagle_stop trains on the stored soft labels; expected "
                "and fsd labels are head=acceptance's"
            )
        bad = [s for s in cfg.eagle_stop.signals if s not in SIGNALS]
        if bad or len(set(cfg.eagle_stop.signals)) != len(cfg.eagle_stop.signals):
            out.append(
                f"eagle_stop.signals={list(cfg.eagle_stop.signals)}: choose each at most once from {', '.join(SIGNALS)}"
            )
        elif cfg.eagle_stop.signals and not cfg.eagle_stop.confidence:
            out.append(
                "eagle_stop.signals needs eagle_stop.confidence=true (the signals follow log q(y) in the features)"
            )
        if not cfg.eagle_stop.state and not cfg.eagle_stop.confidence:
            out.append(
                "eagle_stop.state=false needs eagle_stop.confidence=true (a head that reads nothing cannot learn)"
            )
        if cfg.eagle_stop.skip and not cfg.eagle_stop.confidence:
            out.append("eagle_stop.skip=true starts the head at log q(y): it needs eagle_stop.confidence=true")
        return out

    @classmethod
    def setup(cls, cfg: TrainConfig, manifest: dict, acc) -> EagleStopTask:
        if "eagle_rounds" not in manifest:
            raise UserError(
                f"{cfg.data_dir}/manifest.json has no eagle_rounds section; relabel with heads-datagen "
                "labels=eagle_rounds"
            )
        return cls(cfg, manifest, StopStore(cfg.data_dir, bool(cfg.eagle_stop.signals)), acc.device)

    @staticmethod
    def summary(cfg: TrainConfig, metrics: dict) -> str:
        return (
            f"eval binary KL {metrics.get('eval_binary_kl', float('nan')):.4f}, AUROC {metrics.get('eval_auroc')} "
            f"(the drafter's confidence q(y): {metrics.get('eval_auroc_confidence')}); where a stop is decided "
            f"{metrics.get('eval_auroc_decisions')} (q(y): {metrics.get('eval_auroc_confidence_decisions')})"
        )

    def build_head(self) -> AcceptanceHead:
        torch.manual_seed(self.cfg.seed)
        width = self.hidden if self.cfg.eagle_stop.state else 0
        head = AcceptanceHead(
            width, self.cfg.depth, self.cfg.eagle_stop.confidence, self._signals(), self.cfg.eagle_stop.skip
        )
        if head.skip is not None:
            self.calibrate(head)
        return head

    def calibrate(self, head: AcceptanceHead) -> None:
        """Fits the head's linear part alone on the training rounds (plain BCE on ``[log q(y), signals]``, no state):
        with the body's output at zero the head is then the calibrated q. Deterministic (full batch, L-BFGS)."""
        x, y = self.store.batch(self.train_examples, "cpu", True, self._signals(), state=False)
        lin = head.skip
        opt = torch.optim.LBFGS(lin.parameters(), lr=1.0, max_iter=200, line_search_fn="strong_wolfe")

        def closure():
            opt.zero_grad()
            loss = torch.nn.functional.binary_cross_entropy_with_logits(lin(x).squeeze(-1), y)
            loss.backward()
            return loss

        opt.step(closure)
        lin.requires_grad_(True)

    def _signals(self) -> tuple[str, ...]:
        return tuple(s for s in SIGNALS if s in self.cfg.eagle_stop.signals)  # the head's order

    def batch(self, examples: list, epoch: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.store.batch(
            examples, self.device, self.cfg.eagle_stop.confidence, self._signals(), self.cfg.eagle_stop.state
        )

    @torch.no_grad()
    def evaluate(self, head: torch.nn.Module, examples: list) -> dict:
        """Unweighted binary KL, weighted loss, AUROC (the head's and the draft confidence's) and calibration."""
        cfg = self.cfg
        x, y = predict(head, examples, cfg.batch_size, lambda batch: self.batch(batch, 0))
        hard = (y >= 0.5).cpu().numpy()
        conf = self.store.confidence[self.store.rows(examples)].numpy()
        at = self.store.decided(examples).numpy()  # the rows where a stop decision is made
        return {
            "eval_binary_kl": float(binary_kl(y, x)),
            "eval_weighted_loss": float(weighted_soft_bce(x, y, cfg.w_acc, cfg.w_rej)),
            "eval_auroc": _auroc(hard, x.cpu().numpy()),
            "eval_auroc_confidence": _auroc(hard, conf),
            "eval_auroc_decisions": _auroc(hard[at], x.cpu().numpy()[at]),
            "eval_auroc_confidence_decisions": _auroc(hard[at], conf[at]),
            "eval_decision_rows": int(at.sum()),
            "eval_tokens": int(y.numel()),
            "eval_label_mean": float(y.mean()),
            **calibration_metrics(x, y),
        }

    def score(self, metrics: dict) -> float:
        return metrics["eval_binary_kl"]

    def metadata(self, metrics: dict) -> dict:
        rounds = self.manifest["eagle_rounds"]
        eagle = rounds["eagle"]
        feature = {**rounds["feature"], "eagle": {"file": eagle.get("file"), "tensors_sha256": eagle["tensors_sha256"]}}
        return describe(
            self.cfg,
            self.manifest,
            self.hidden,
            metrics,
            label="soft",
            feature=feature,
            eagle_rounds={"k": rounds["k"]},
        )

    def models(self) -> dict[str, tuple]:
        return {}  # the states were stored by the datagen run

    def companions(self, out: Path) -> list[tuple[str, TrainConfig]]:
        return []

    def report(self, out: Path, acc, best: dict) -> dict:
        """With ``eagle_stop.skip``: the calibrated q against the best epoch on the held-out rounds (binary KL); the
        better is the run's head (``chosen``: ``learned`` or ``calibrated_q``, both figures in ``best_metrics.json``
        and the head's metadata). The calibrated q is saved as a head that reads no state (``hidden_size=0``,
        ``depth=0``): the training-free rule's signal with its fitted constants, as cheap to run as q itself."""
        if not self.cfg.eagle_stop.skip:
            return {}
        floor = self.build_head().eval()
        with torch.no_grad():
            for p in (floor.out.weight, floor.out.bias):
                p.zero_()
        got = self.evaluate(floor, self.eval_examples)
        chosen = "calibrated_q" if got["eval_binary_kl"] <= best["eval_binary_kl"] else "learned"
        choice = {
            "chosen": chosen,
            "learned_eval_binary_kl": best["eval_binary_kl"],
            "calibrated_q_eval_binary_kl": got["eval_binary_kl"],
            "calibrated_q_eval_auroc": got["eval_auroc"],
        }
        if chosen == "calibrated_q":
            best.update({k: v for k, v in got.items()}, epoch=None)
        best.update(choice)
        if acc.is_main_process:
            if chosen == "calibrated_q":  # saved as what it is: the fitted line on [log q, signals], no state read
                line = AcceptanceHead(0, 0, True, floor.signals, True)
                line.skip.load_state_dict(floor.skip.state_dict())
                self.save(out, line, best)
            else:  # the learned head as saved, its metadata told of the comparison
                from specheads.export import load_head

                self.save(out, load_head(out / self.artifact).module, best)
            atomic_write_json(out / "best_metrics.json", best)
        acc.wait_for_everyone()
        return choice
