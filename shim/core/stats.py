"""What one generation costs: the counts every decoding method reports (:class:`GenerationStats`)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class GenerationStats:
    """Counts for one prompt (or summed over many). Rates are derived from the sums."""

    prompts: int = 1
    prompt_tokens: int = 0
    new_tokens: int = 0
    target_calls: int = 0
    draft_forwards: int = 0
    drafted: int = 0
    accepted: int = 0
    discarded: int = 0
    rounds: int = 0
    wall_time: float = 0.0
    eos: int = 0
    verifier_calls: int = 0  # learned-verifier evaluations (SPRINTER)
    undrafted_rounds: int = 0  # rounds whose policy chose not to draft (the cost-aware rules' gate)
    target_tokens: int = 0  # tokens after the prompt the target processed (the prompt's prefill is not counted)
    target_context: int = 0  # sum over those tokens of the context each attends to (itself included)
    draft_tokens: int = 0
    draft_context: int = 0
    # {k: target calls over k tokens}: k = the pass's tokens after the prompt's first P - 1 (so the
    # prefill round counts as its candidates + 1, like every other round); see costs.py
    target_pass_sizes: dict[int, int] = field(default_factory=dict)
    # the policy's own counts (Policy.counters) beyond the fields above, e.g. FSD's fuzzy_only; the command
    # lines report them beside the stats, so to_dict leaves them out
    counters: dict[str, float] = field(default_factory=dict)

    def __post_init__(self):
        self.target_pass_sizes = {int(k): int(v) for k, v in self.target_pass_sizes.items()}  # JSON keys are str

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.wall_time if self.wall_time > 0 else 0.0

    @property
    def accepted_per_call(self) -> float:
        """Accepted draft tokens per target call."""
        return self.accepted / self.target_calls if self.target_calls else 0.0

    @property
    def tokens_per_call(self) -> float:
        """Emitted tokens per target call (accepted + 1 per round, less truncation)."""
        return self.new_tokens / self.target_calls if self.target_calls else 0.0

    @property
    def verification_rate(self) -> float:
        """Target calls per emitted token (N_target / N)."""
        return self.target_calls / self.new_tokens if self.new_tokens else 0.0

    @property
    def discard_rate(self) -> float:
        """Drafted tokens not in the output per emitted token (N_discard / N)."""
        return self.discarded / self.new_tokens if self.new_tokens else 0.0

    def fold(self, counters: dict[str, float]) -> None:
        """Adds a policy's counts: to the field of that name, or to ``counters``."""
        for k, v in counters.items():
            if k in COUNTS:
                setattr(self, k, getattr(self, k) + v)
            else:
                self.counters[k] = self.counters.get(k, 0) + v

    def to_dict(self) -> dict:
        out = asdict(self)
        del out["counters"]
        for k in ("tokens_per_s", "accepted_per_call", "tokens_per_call", "verification_rate", "discard_rate"):
            out[k] = getattr(self, k)
        return out

    @staticmethod
    def total(stats: list["GenerationStats"]) -> "GenerationStats":
        """Sums counts and times over prompts; the rates of the result are ratios of sums."""
        out = GenerationStats(prompts=0)
        for s in stats:
            for k in COUNTS:
                setattr(out, k, getattr(out, k) + getattr(s, k))
            for size, v in s.target_pass_sizes.items():
                out.target_pass_sizes[size] = out.target_pass_sizes.get(size, 0) + v
            out.fold(s.counters)
        return out


COUNTS = (
    "prompts",
    "prompt_tokens",
    "new_tokens",
    "target_calls",
    "draft_forwards",
    "drafted",
    "accepted",
    "discarded",
    "rounds",
    "wall_time",
    "eos",
    "verifier_calls",
    "undrafted_rounds",
    "target_tokens",
    "target_context",
    "draft_tokens",
    "draft_context",
)


def count_tokens(stats: GenerationStats, who: str, start: int, n: int, prompt_tokens: int | None = None) -> None:
    """Adds the tokens fed at positions ``start .. start + n - 1`` that lie after the prompt (``prompt_tokens``
    long, default the stats') to ``who``'s token and context counts (the prompt's prefill costs every method
    the same and is left out)."""
    prompt = stats.prompt_tokens if prompt_tokens is None else prompt_tokens
    skip = max(0, min(n, prompt - start))
    start, n = start + skip, n - skip
    setattr(stats, f"{who}_tokens", getattr(stats, f"{who}_tokens") + n)
    setattr(stats, f"{who}_context", getattr(stats, f"{who}_context") + n * start + n * (n + 1) // 2)
