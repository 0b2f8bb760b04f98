"""A vLLM plugin that ends each request's EAGLE-3 draft where its stop rule says (``docs/vllm.md``, "The stop plugin").

vLLM's ``eagle3`` method drafts ``num_speculative_tokens`` (``K``) candidates for every request at every step. With
this plugin selected, each request's round stops at its own length ``0..K``, decided as the candidates are drawn
by one of the toolkit's own policies (the same classes ``heads-decode`` runs), one per request:

* ``c-cost``: the cost rule on the drafter's ``q(y)`` (:class:`~specheads.shim.policies.ConfidenceStop`,
  ``stop="cost"``);
* ``c-online-cost``: the same rule on the online logistic estimate on ``logit(max q)`` (``estimate="online"``);
* ``h-cost``: the cost rule on a learned stop head (``heads-train head=eagle_stop``) on this EAGLE head's states,
  which scores every candidate as it is drawn (lag 0: ``eagle_rounds.position=previous``) from the state that drew
  it and ``q``'s signals (:class:`~specheads.shim.policies.SpecDecPP`, ``stop="cost"``);
* ``fixed``: every request drafts ``k`` (``k <= K``), the bench's fixed-K rows in the same process.

Each is priced by a cost table of vLLM's own steps at the running batch size (:func:`profile_job` measures it
with this plugin's ``profile`` mode), with the draft gate on by default (a request whose recent rounds say drafting
does not pay at this batch drafts nothing). A stopped request's candidates are cut at once (vLLM verifies only what
it keeps), and the remaining draft steps are skipped once every request of the step has stopped.

How it sits in vLLM (0.32):

* installed with this package, it is a ``vllm.general_plugins`` entry point (:func:`register`), which vLLM runs in
  every process, workers included. It changes nothing unless a ``speculative_config`` selects it: the settings
  travel in that config (``draft_load_config.model_loader_extra_config["specheads_stop"]``, under this plugin's
  ``load_format="specheads"``, a loader that is vLLM's default one without this key), never in the environment,
  so ``vllm serve --speculative-config '<json>'`` and Ray workers on other nodes get them as ``LLM(...)`` does;
* the settings are checked when vLLM builds its config from its engine arguments (``EngineArgs.create_engine_config``,
  in the process that starts the engine, before pydantic's validation would wrap the message): a mistake is a
  one-line ``ValueError`` there, before any model loads;
* in each worker it wraps the model runner's ``propose_draft_token_ids`` (``vllm/v1/worker/gpu_model_runner.py``,
  which the CPU runner inherits): per step it hands each request's previous round outcome to its policy (what the
  scheduler verified, ``scheduled_spec_decode_tokens``, and the sampled tokens' count), runs vLLM's own EAGLE
  proposer with the per-step sampling replaced by one that computes the same argmax from the same logits and asks
  every request's policy whether to go on, and returns the drafts as one list per request cut to its length;
* vLLM's async scheduling takes each step's drafts as one ``[requests, K]`` tensor
  (``gpu_model_runner.py:1857``, ``assert isinstance(self._draft_token_ids, torch.Tensor)``), so the plugin turns
  it off when it is left to vLLM's default and refuses it when asked for. It also refuses the draft paths whose
  token choice it does not reproduce (``use_local_argmax_reduction``, ``use_heterogeneous_vocab``, probabilistic
  draft sampling) and ``parallel_drafting``.

``trace`` (the plugin's ``take_trace`` over ``collective_rpc``) returns every round it decided: request, engine
step, batch size, the candidates kept, and vLLM's verdict on the previous one, which ``bench/vllm_stop.py``
replays through the toolkit's own rule on the Transformers target's states.
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SECTION = "specheads_stop"
LOAD_FORMAT = "specheads"
RULES = ("c-cost", "c-online-cost", "h-cost", "fixed")
_REGISTERED = False  # the load format, once per process


class _AllStopped(Exception):
    """Raised inside vLLM's draft loop once every request of the step has stopped: the rest is skipped."""


@dataclass
class StopSettings:
    """The plugin's settings (``speculative_config(...)``'s arguments past the EAGLE head and ``k``)."""

    rule: str = "c-cost"
    head: str | None = None  # h-cost: an exported stop head on this EAGLE head's states (heads-train head=eagle_stop)
    costs: str | None = None  # a cost table of vLLM's own steps (profile_job / bench/vllm_stop.py write one)
    gate: bool = True  # the draft gate of the cost rules
    k_min: int = 1  # fewest candidates of a drafted round
    fixed_k: int | None = None  # rule=fixed: every request's length
    trace: bool = False  # keep every round (take_trace)
    profile: bool = False  # price vLLM's steps: every request drafts step % (K + 1) candidates, timed

    def problems(self, k: int) -> list[str]:
        """What is wrong with these settings for ``k`` = vLLM's ``num_speculative_tokens`` (an empty list: none)."""
        out = []
        if self.rule not in RULES:
            out.append(f"rule={self.rule!r}: expected one of {', '.join(RULES)}")
        if self.rule == "h-cost" and not self.head:
            out.append("rule=h-cost needs head= (an exported stop head on this EAGLE head's states)")
        if self.head and not Path(self.head).exists():
            out.append(f"head={self.head!r} does not exist")
        if self.rule == "fixed" and not (self.fixed_k is not None and 0 <= self.fixed_k <= k):
            out.append(f"rule=fixed needs 0 <= fixed_k <= num_speculative_tokens={k}; got fixed_k={self.fixed_k}")
        if self.rule.endswith("cost") and not self.profile:
            if not self.costs:
                out.append(f"rule={self.rule} needs costs= (a cost table of vLLM's steps: specheads.vllm.stop_plugin)")
            elif not Path(self.costs).is_file():
                out.append(f"costs={self.costs!r} is not a file")
        if not 1 <= self.k_min <= k:
            out.append(f"k_min={self.k_min} must be in [1, num_speculative_tokens={k}]")
        return out


def speculative_config(eagle: str, k: int, **settings: Any) -> dict:
    """vLLM's ``speculative_config`` for EAGLE-3 head directory ``eagle`` (``heads-export format=speculators``, or
    one speculators or SpecForge wrote) at most ``k`` candidates a round, stopped by this plugin (``settings``:
    :class:`StopSettings`' fields). Checked here: a mistake is a one-line :class:`~specheads.errors.UserError`."""
    from specheads.errors import UserError

    names = {f.name for f in dataclasses.fields(StopSettings)}
    unknown = sorted(set(settings) - names)
    if unknown:
        raise UserError(f"the stop plugin has no setting {', '.join(unknown)}; its settings: {sorted(names)}")
    s = StopSettings(**settings)
    bad = s.problems(int(k)) + ([] if Path(eagle, "config.json").is_file() else [f"{eagle!r} has no config.json"])
    if bad:
        raise UserError("; ".join(bad))
    for key in ("head", "costs"):  # vLLM's workers may start elsewhere: absolute paths
        if getattr(s, key):
            setattr(s, key, str(Path(getattr(s, key)).resolve()))
    return {
        "method": "eagle3",
        "model": str(Path(eagle).resolve()),
        "num_speculative_tokens": int(k),
        "draft_load_config": {
            "load_format": LOAD_FORMAT,
            "model_loader_extra_config": {SECTION: dataclasses.asdict(s)},
        },
    }


def settings_of(spec_config) -> StopSettings | None:
    """The plugin's settings in vLLM's ``SpeculativeConfig`` (None: not selected)."""
    load = getattr(spec_config, "draft_load_config", None) if spec_config is not None else None
    raw = (getattr(load, "model_loader_extra_config", None) or {}).get(SECTION) if load is not None else None
    return StopSettings(**raw) if raw is not None else None


def config_problems(engine_args) -> list[str]:
    """Why vLLM's engine arguments cannot run the plugin (an empty list: it can, or it is not selected); turns async
    scheduling off when it is left to vLLM's default. Runs where vLLM builds its config from them, in the process
    that starts the engine, so a mistake is one line there."""
    spec = engine_args.speculative_config
    if isinstance(spec, str):
        spec = json.loads(spec)
    if not isinstance(spec, dict):
        return []
    load = spec.get("draft_load_config") or {}
    extra = (load.get("model_loader_extra_config") if isinstance(load, dict) else None) or {}
    raw = extra.get(SECTION) if isinstance(extra, dict) else None
    if raw is None:
        return []
    names = {f.name for f in dataclasses.fields(StopSettings)}
    unknown = sorted(set(raw) - names)
    if unknown:
        return [f"the stop plugin has no setting {', '.join(unknown)}; its settings: {sorted(names)}"]
    out = []
    if spec.get("method") != "eagle3":
        out.append(f"the stop plugin runs on method='eagle3' (EAGLE-3 heads); got method={spec.get('method')!r}")
    for flag in ("use_local_argmax_reduction", "use_heterogeneous_vocab", "parallel_drafting"):
        if spec.get(flag):
            out.append(f"the stop plugin does not run with {flag}=True (its draft tokens are chosen elsewhere)")
    if spec.get("draft_sample_method", "greedy") != "greedy":
        out.append("the stop plugin needs draft_sample_method='greedy' (vLLM's default)")
    if spec.get("disable_padded_drafter_batch"):
        out.append("the stop plugin needs the padded drafter batch (disable_padded_drafter_batch=False, the default)")
    if engine_args.async_scheduling:
        out.append(
            "the stop plugin needs async scheduling off (--no-async-scheduling / async_scheduling=False): with it "
            "vLLM takes each step's drafts as one [requests, K] tensor (vllm/v1/worker/gpu_model_runner.py:1857)"
        )
    elif engine_args.async_scheduling is None:
        engine_args.async_scheduling = False
    return out + StopSettings(**raw).problems(int(spec.get("num_speculative_tokens") or 0))


# ---- the policies --------------------------------------------------------------------------------------------


def make_policy(s: StopSettings, k: int, eagle_meta: dict | None):
    """The toolkit policy that decides one request's rounds (forked per request), as ``heads-decode`` builds it."""
    from specheads.shim.costs.cost_table import load_table
    from specheads.shim.policies import ConfidenceStop, SpecDecPP, StandardSD

    if s.profile or s.rule == "fixed":
        return StandardSD(k=k)  # the length is set per round (begin)
    costs = load_table(s.costs) if s.costs else None
    if s.rule in ("c-cost", "c-online-cost"):
        estimate = "online" if s.rule == "c-online-cost" else "q"
        return ConfidenceStop(stop="cost", k_max=k, k_min=s.k_min, costs=costs, gate=s.gate, estimate=estimate)
    from specheads.export import load_head
    from specheads.export.package import check_stop_drafter

    head = load_head(s.head)
    if head.metadata.get("head_type") != "acceptance":
        raise ValueError(f"head={s.head!r} is a {head.metadata.get('head_type')} head; rule=h-cost reads a stop head")
    feature = head.metadata.get("feature", {})
    check_stop_drafter(feature, eagle_meta)
    policy = SpecDecPP(
        head.module.float().eval(),
        position=feature.get("position", "own"),
        stop="cost",
        costs=costs,
        k_min=s.k_min,
        k_max=k,
        gate=s.gate,
    )
    policy.head_file = s.head
    return policy


def _survival(rnd) -> tuple[float, float, float]:
    """A round's ``S_n`` (all its candidates accepted), ``sum_i S_i`` and the estimate for its next candidate, from
    the cost rules' round state (:class:`~specheads.shim.policies.ConfidenceStop`'s or
    :class:`~specheads.shim.policies.SpecDecPP`'s); a round that drafted nothing: ``(1, 0, 0)``."""
    import math

    s = rnd.state
    if not rnd.n or s is None:
        return 1.0, 0.0, 0.0
    if hasattr(s, "log_keep"):  # SpecDecPP: the newest score is the next candidate's estimate
        keep = math.exp(s.log_keep)
        return keep, s.total, 1.0 if s.beta is None else s.beta
    return s.keep, s.total, s.beta


# ---- the controller (one per worker) ------------------------------------------------------------------------


@dataclass
class _Step:
    """One step's rounds: per batch row its request, round, length (None: still drafting)."""

    reqs: list[str]
    rounds: list[Any]
    lengths: list[int | None]
    capped: list[bool] = field(default_factory=list)  # the batch cap ended the row's round
    drawn: int = 0
    started: float = 0.0
    last: float = 0.0


@dataclass
class Controller:
    """The plugin's state in one worker: the settings, one policy per request, the trace and the profile."""

    settings: StopSettings
    k: int
    eagle_meta: dict | None
    proto: Any = None
    policies: dict = field(default_factory=dict)  # request id -> its policy
    pending: dict = field(default_factory=dict)  # request id -> candidates it was given last step
    trace: list = field(default_factory=list)
    samples: dict = field(default_factory=dict)  # profile: "t_t B k", "t_d B", "t_first B" -> ms
    steps: int = 0
    costs: Any = None
    step: _Step | None = None
    _last: tuple | None = None  # profile: (end time, request ids, n) of the previous step

    def __post_init__(self):
        self.configure(self.settings)

    def configure(self, s: StopSettings) -> None:
        """Takes new settings (checked); every request starts again from the new policy."""
        bad = s.problems(self.k)
        if bad:
            raise ValueError("; ".join(bad))
        self.settings, self.proto = s, make_policy(s, self.k, self.eagle_meta)
        self.costs = None if s.profile or s.rule == "fixed" else self.proto.costs  # the batch cap's prices
        self.policies, self.pending, self._last = {}, {}, None

    def outcomes(self, scheduler_output, req_ids: list[str], sampled) -> None:
        """Hands each request's previous round to its policy: ``drafted`` = the candidates vLLM verified, ``accepted`` =
        the sampled tokens past the first."""
        import torch

        for req in getattr(scheduler_output, "finished_req_ids", ()) or ():
            self.policies.pop(req, None)
            self.pending.pop(req, None)
        if not self.pending:
            return
        verified = scheduler_output.scheduled_spec_decode_tokens or {}
        counts = None
        for row, req in enumerate(req_ids):
            if req not in self.pending:
                continue
            self.pending.pop(req)
            drafted = len(verified.get(req, ()))
            accepted = 0
            if drafted:
                if counts is None:
                    counts = (
                        (sampled != -1).sum(-1).tolist()
                        if isinstance(sampled, torch.Tensor)
                        else [len(t) for t in sampled]
                    )
                accepted = max(0, min(drafted, counts[row] - 1))
            self.policies[req].end_round(drafted, accepted)
            if self.settings.trace:
                self.trace.append({"req": req, "step": self.steps, "verified": drafted, "accepted": accepted})

    def begin(self, req_ids: list[str]) -> None:
        """A step's rounds start: one per request, the gate asked first."""
        from specheads.shim.core.sampling import SamplingConfig
        from specheads.shim.policies.base import Round

        now = time.perf_counter()
        if self.settings.profile and self._last is not None:
            end, before, n = self._last
            if before == req_ids:  # the same requests: vLLM's step verified n + 1 tokens each
                self.samples.setdefault(f"t_t {len(req_ids)} {n + 1}", []).append(1000 * (now - end))
        self.steps += 1
        rounds, lengths = [], []
        for req in req_ids:
            policy = self.policies.get(req)
            if policy is None:
                policy = self.policies[req] = self.proto.fork()
                policy.reset()
            policy.batch = len(req_ids)
            rnd = Round(sampling=SamplingConfig(), generator=None, limit=self.k, position=0)
            policy.start_round(rnd)
            if self.settings.profile:
                n = (self.steps - 1) % (self.k + 1)
            elif self.settings.rule == "fixed":
                n = int(self.settings.fixed_k or 0)
            else:
                n = None if policy.draft_round() else 0
            rounds.append(rnd)
            lengths.append(0 if n == 0 else None)
            if n:
                rnd.limit = n
        self.step = _Step(list(req_ids), rounds, lengths, [False] * len(rounds), started=now, last=now)

    def drawn(self, hidden, logits, tokens) -> None:
        """Candidate ``j`` of every row was drawn (``hidden``: the post-norm states that drew them, ``logits``: over
        the EAGLE head's vocabulary, ``tokens`` its ids there): each request still drafting asks its policy; all
        stopped raises :class:`_AllStopped`."""
        st = self.step
        now = time.perf_counter()
        st.drawn += 1
        j = st.drawn
        if self.settings.profile:
            key = f"t_first {len(st.reqs)}" if j == 1 else f"t_d {len(st.reqs)}"
            self.samples.setdefault(key, []).append(1000 * (now - st.last))
        st.last = now
        for r, req in enumerate(st.reqs):
            if st.lengths[r] is not None:
                continue
            rnd = st.rounds[r]
            rnd.tokens.append(tokens[r])
            rnd.draft_logits.append(logits[r])
            rnd.draft_hidden.append(hidden[r])
            policy = self.policies[req]
            if rnd.n >= rnd.limit or policy.stop_drafting(rnd) or rnd.n >= self.k:
                st.lengths[r] = rnd.n
        if j < self.k and len(st.reqs) > 1 and self.costs is not None and not self._batch_pays(st, j):
            for r, n in enumerate(st.lengths):
                if n is None:
                    st.lengths[r], st.capped[r] = st.rounds[r].n, True
        if j < self.k and all(n is not None for n in st.lengths):
            raise _AllStopped

    def _batch_pays(self, st: _Step, j: int) -> bool:
        """Whether one more draft step pays for the batch (the batch cap; ``B > 1``). Each request's rule prices its
        round as if every request drafted alike, but a step's draft loop runs as long as its longest round: one more
        step costs the whole batch ``t_d(B)`` plus the verification of the candidates it adds, for the expected
        tokens of the requests still drafting (each ``S_n * beta``: its survival and its newest estimate). It pays
        when that gain per ms beats the step's expected tokens per ms so far."""
        t, b = self.costs, len(st.reqs)
        tokens, gain, active = 0.0, 0.0, 0
        for r, rnd in enumerate(st.rounds):
            keep, total, beta = _survival(rnd)
            tokens += 1.0 + total
            if st.lengths[r] is None:
                gain += keep * beta
                active += 1
        mean = sum(rnd.n for rnd in st.rounds) / b
        cost = j * t.t_draft(b) + t.t_target(mean + 1, b)
        extra = t.t_draft(b) + t.t_target(mean + 1 + active / b, b) - t.t_target(mean + 1, b)
        return gain * cost > tokens * extra

    def finish(self, drafts: list[list[int]]) -> list[list[int]]:
        """The step's drafts (vLLM's ``[requests, candidates drawn]``) cut to each request's length."""
        st, self.step = self.step, None
        out = []
        for r, req in enumerate(st.reqs):
            n = st.lengths[r] if st.lengths[r] is not None else len(drafts[r])
            out.append([int(t) for t in drafts[r][:n]])
            self.pending[req] = n
            if self.settings.trace:
                rec = {"req": req, "step": self.steps, "batch": len(st.reqs), "draft": out[-1]}
                self.trace.append(rec | ({"capped": True} if st.capped[r] else {}))
        if self.settings.profile:
            self._last = (time.perf_counter(), list(st.reqs), len(out[0]) if out else 0)
        return out


# ---- inside vLLM ----------------------------------------------------------------------------------------------


def _controller(runner) -> Controller | None:
    ctl = getattr(runner, "_specheads_stop", None)
    if ctl is None:
        s = settings_of(getattr(runner, "speculative_config", None))
        if s is None:
            return None
        meta = None
        cfg = Path(runner.speculative_config.model, "config.json")
        if cfg.is_file():
            meta = json.loads(cfg.read_text()).get("specheads")
        ctl = runner._specheads_stop = Controller(s, int(runner.speculative_config.num_speculative_tokens), meta)
    return ctl


def _draw(model, hidden):
    """vLLM's greedy draft step: the logits over the EAGLE head's own vocabulary, their argmax there, and that
    token's target id (``compute_logits`` then argmax, as vLLM's ``_greedy_sample``, without the scatter into the
    target's vocabulary: the scores the rules read are the same, over a sixth of the width on the shared pair)."""
    d2t = getattr(model, "draft_id_to_target_id", None)
    if d2t is None or not hasattr(model, "logits_processor"):
        logits = model.compute_logits(hidden)
        ids = logits.argmax(dim=-1)
        return logits, ids, ids
    logits = model.logits_processor(model.lm_head, hidden)
    ids = logits.argmax(dim=-1)
    return logits, ids, ids + d2t[ids]


def _propose(original):
    def propose_draft_token_ids(self, scheduler_output, sampled_token_ids, *args, **kwargs):
        ctl = _controller(self)
        if ctl is None:
            return original(self, scheduler_output, sampled_token_ids, *args, **kwargs)
        req_ids = list(self.input_batch.req_ids)
        ctl.outcomes(scheduler_output, req_ids, sampled_token_ids)
        ctl.begin(req_ids)
        drafter = self.drafter
        model = drafter.model
        drawn: list = []

        def sample(hidden, sampling_metadata):
            logits, ids, tokens = _draw(model, hidden)
            drawn.append(tokens)
            ctl.drawn(hidden, logits, ids)
            return tokens, None

        drafter._sample_draft_tokens = sample
        try:
            original(self, scheduler_output, sampled_token_ids, *args, **kwargs)
        except _AllStopped:
            pass
        finally:
            del drafter._sample_draft_tokens  # back to the class's
        ids = [t.view(-1, 1) for t in drawn]
        import torch

        drafts = torch.cat(ids, 1).tolist() if ids else [[] for _ in req_ids]
        return ctl.finish(drafts)

    propose_draft_token_ids._specheads = True
    return propose_draft_token_ids


def _config_check(original):
    def create_engine_config(self, *args, **kwargs):
        bad = config_problems(self)
        if bad:
            raise ValueError("; ".join(bad))
        return original(self, *args, **kwargs)

    create_engine_config._specheads = True
    return create_engine_config


def register() -> None:
    """vLLM's ``vllm.general_plugins`` entry point (every vLLM process): the ``specheads`` load format and the two
    wrappers. Idempotent; inert until a ``speculative_config`` carries the plugin's settings."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader import register_model_loader
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    if not getattr(GPUModelRunner.propose_draft_token_ids, "_specheads", False):
        GPUModelRunner.propose_draft_token_ids = _propose(GPUModelRunner.propose_draft_token_ids)
    if not getattr(EngineArgs.create_engine_config, "_specheads", False):
        EngineArgs.create_engine_config = _config_check(EngineArgs.create_engine_config)

    global _REGISTERED
    if _REGISTERED:
        return
    _REGISTERED = True

    @register_model_loader(LOAD_FORMAT)
    class SpecheadsLoader(DefaultModelLoader):
        """vLLM's default loader, for a draft whose load config also carries the stop plugin's settings."""

        def __init__(self, load_config):
            own = dataclasses.replace(
                load_config,
                load_format="auto",
                model_loader_extra_config={
                    k: v for k, v in (load_config.model_loader_extra_config or {}).items() if k != SECTION
                },
            )
            super().__init__(own)


# ---- collective_rpc helpers (the bench, the tests) ----------------------------------------------------------


def configure(worker, settings: dict) -> bool:
    """``llm.collective_rpc(configure, args=(settings,))``: new settings for the next requests (none in flight)."""
    ctl = _controller(worker.model_runner)
    if ctl is None:
        return False
    ctl.configure(StopSettings(**settings))
    return True


def take_trace(worker) -> dict | None:
    """``llm.collective_rpc(take_trace)``: the rounds kept since the last call (``trace=True``) and the profile's
    samples; both are cleared."""
    ctl = getattr(worker.model_runner, "_specheads_stop", None)
    if ctl is None:
        return None
    out = {"trace": ctl.trace, "samples": ctl.samples}
    ctl.trace, ctl.samples = [], {}
    return out


# ---- the cost table of vLLM's own steps ---------------------------------------------------------------------


def table_from_samples(samples: dict[str, list[float]], k: int, batches: list[int]) -> dict:
    """The cost-table fields from the profile's samples (medians). A round of ``n >= 1`` candidates costs vLLM's
    first draft pass (it also draws ``y_1``), ``n - 1`` draft steps and a target step over ``n + 1`` tokens per
    request; ``round_ms(n) = n t_d + t_t(n + 1)``, so ``t_t(1)`` holds the first pass and ``t_t(k >= 2)`` the
    first pass less one draft step."""
    import statistics

    def med(key: str) -> float | None:
        got = samples.get(key)
        return statistics.median(got) if got else None

    def prices(b: int) -> tuple[float, list[float]]:
        first, step = med(f"t_first {b}"), med(f"t_d {b}")
        if first is None or step is None:
            raise ValueError(f"the stop plugin's profile timed no draft pass at batch {b}: decode longer (steps=)")
        out, last = [], None
        for n in range(1, k + 2):
            t = med(f"t_t {b} {n}")
            last = t if t is not None else last
            out.append(last)
        known = [t for t in out if t is not None]
        if not known:
            raise ValueError(f"the stop plugin's profile timed no target step at batch {b}: decode longer (steps=)")
        out = [known[0] if t is None else t for t in out]
        return step, [t + first - (step if n >= 2 else 0.0) for n, t in enumerate(out, start=1)]

    t_d1, t_t1 = prices(1)
    more = [prices(b) for b in batches]
    return {
        "t_draft_ms": t_d1,
        "t_target_ms": t_t1,
        "batches": list(batches),
        "t_draft_batch_ms": [d for d, _ in more],
        "t_target_batch_ms": [t for _, t in more],
    }


def profile(
    target: str, eagle: str, k: int, batches: list[int], out: str, steps: int = 160, prefix: int = 100, **llm_kw
) -> dict:
    """Measures the cost table of vLLM's steps for ``eagle`` on ``target`` at up to ``k`` candidates (batch 1 and
    ``batches``) and writes it to ``out``; run in vLLM's Python (``python -m specheads.vllm.stop_plugin profile``)."""
    import random

    import torch
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from specheads.machine import cpu_model

    sizes = [1, *batches]
    llm = LLM(
        model=target,
        max_model_len=prefix + steps + k + 64,
        max_num_seqs=max(sizes),
        seed=0,
        speculative_config=speculative_config(eagle, k, profile=True),
        **llm_kw,
    )
    vocab = llm.get_tokenizer().vocab_size
    rng = random.Random(0)
    params = SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True)
    llm.generate([TokensPrompt(prompt_token_ids=[5] * prefix)], SamplingParams(max_tokens=8), use_tqdm=False)
    llm.collective_rpc(take_trace)  # the warm-up's samples dropped
    samples: dict[str, list[float]] = {}
    for b in sizes:
        prompts = [TokensPrompt(prompt_token_ids=[rng.randrange(3, vocab) for _ in range(prefix)]) for _ in range(b)]
        llm.generate(prompts, params, use_tqdm=False)
        got = next(r for r in llm.collective_rpc(take_trace) if r is not None)
        for key, v in got["samples"].items():
            samples.setdefault(key, []).extend(v)
    table = {
        **table_from_samples(samples, k, list(batches)),
        "machine": cpu_model(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "target_runner": f"vllm {vllm.__version__}",
        "draft_runner": "vllm eagle3 (specheads stop plugin)",
        "target_fingerprint": Path(target).name,
        "draft_fingerprint": str(
            (json.loads(Path(eagle, "config.json").read_text()).get("specheads") or {}).get(
                "tensors_sha256", Path(eagle).name
            )
        ),
        "prefix_tokens": prefix,
        "reps": steps,
        "samples": samples,
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(str(out) + ".tmp")
    tmp.write_text(json.dumps(table, indent=1))
    tmp.replace(out)
    return table


def _value(v: str):
    low = v.lower()
    if low in ("true", "false"):
        return low == "true"
    if low in ("null", "none"):
        return None
    try:
        return int(v)
    except ValueError:
        return v


def main(argv: list[str] | None = None) -> int:
    """The stop plugin's two commands (``key=value`` arguments):

    python -m specheads.vllm.stop_plugin config eagle=DIR k=6 rule=c-cost costs=FILE [head=FILE gate=true k_min=1]
        prints the ``speculative_config`` JSON for ``LLM(...)`` or ``vllm serve --speculative-config``;
    python -m specheads.vllm.stop_plugin profile target=DIR eagle=DIR k=6 batches=2,4,8,16 out=FILE
        [steps=160 dtype=auto enforce_eager=true] (in vLLM's Python) measures the cost table the rules read.
    """
    import sys

    from specheads.errors import UserError

    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(main.__doc__)
        return 0 if args else 2
    command, rest = args[0], args[1:]
    bad = [a for a in rest if "=" not in a]
    if command not in ("config", "profile") or bad:
        print(f"stop_plugin: expected config|profile and key=value arguments; got {' '.join(bad) or command}",
              file=sys.stderr)  # fmt: skip
        return 2
    kv = {k: v for k, v in (a.split("=", 1) for a in rest)}
    need = ("eagle", "k") if command == "config" else ("target", "eagle", "k", "out")
    missing = [k for k in need if k not in kv]
    if missing:
        print(f"stop_plugin {command}: missing {', '.join(missing)}", file=sys.stderr)
        return 2
    try:
        if command == "config":
            eagle, k = kv.pop("eagle"), int(kv.pop("k"))
            print(json.dumps(speculative_config(eagle, k, **{key: _value(v) for key, v in kv.items()})))
            return 0
        batches = [int(b) for b in kv.get("batches", "").split(",") if b]
        extra = {"dtype": kv.get("dtype", "auto"), "enforce_eager": kv.get("enforce_eager", "true") == "true"}
        t = profile(kv["target"], kv["eagle"], int(kv["k"]), batches, kv["out"], int(kv.get("steps", 160)), **extra)
    except (UserError, ValueError) as e:
        print(f"stop_plugin {command}: {e}", file=sys.stderr)
        return 2
    print(f"cost table -> {kv['out']}: t_d {t['t_draft_ms']:.3g} ms, t_t(k) {[round(x, 3) for x in t['t_target_ms']]}")
    return 0


if __name__ == "__main__":
    import os

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    raise SystemExit(main())
