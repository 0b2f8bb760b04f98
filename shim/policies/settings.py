"""A policy's settings: typed, under its own names, with the rules that check them (one place, used by
``heads-decode``, ``heads-eval`` and the constructors alike), and the exported head it reads."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Mapping, TypeVar

from specheads.errors import UserError


@dataclass(frozen=True)
class Check:
    """The rule of one setting: ``ok(value)``, else the line ``one`` (``{key}``: the setting as the
    user spelled it, ``{value}``) or, for a swept list, ``every`` (``{key}``, ``{values}``)."""

    ok: Callable[[Any], bool]
    one: str
    every: str = ""

    def problems(self, value, key: str) -> list[str]:
        """The line for a value the rule refuses (None, unset, is never refused)."""
        return [] if value is None or self.ok(value) else [self.one.format(key=key, value=value)]

    def sweep(self, key: str, values) -> list[str]:
        """The line(s) for a swept list holding a value the rule refuses."""
        bad = [v for v in values if not self.ok(v)]
        if not bad:
            return []
        if self.every:
            return [self.every.format(key=key, values=list(values))]
        return [self.one.format(key=key, value=v) for v in bad]


def bounds(k_min: int, k_max: int) -> list[str]:
    """The rule between the fewest and the most candidates of a round."""
    return [] if 1 <= k_min <= k_max else [f"need 1 <= k_min <= k_max, got k_min={k_min}, k_max={k_max}"]


K = Check(lambda k: k >= 1, "{key}={value} must be >= 1 (candidates per round)", "{key}={values}: every K must be >= 1")


#: What each setting means, shown by ``heads-decode --help`` under ``<policy>.<setting>`` (a policy's own
#: ``HELP`` overrides a line).
HELP = {
    "k": "candidates per round (tree: the draft tree's depth; tli, slem: draft tokens per round; slrs: most "
    "target tokens per round)",
    "head": "the exported head (.safetensors) the policy reads",
    "h": "stop threshold in (0, 1) (default: the head's); not used with stop=cost",
    "eta": "approval threshold in [0, 1] (default: the head's)",
    "delta": "judge threshold in [0, 1] (default: the head's; 1 is SD)",
    "T": "divergence threshold >= 0 (required)",
    "tau": "draft-confidence threshold in [0, 1] (default 0.4); not used with stop=cost",
    "stop": "threshold (stop at the threshold) | cost (no threshold: draft on while one more candidate raises "
    "the round's expected tokens per ms of the profiled cost table, see profile)",
    "gate": "with stop=cost: skip drafting in a round when the recent rounds say the draft does not pay",
    "k_min": "fewest candidates per round",
    "k_max": "most candidates per round",
    "max_run": "most verifier-approved tokens in a row before the target is called (null: no cap)",
    "tree_width": "children per expanded node and leaves expanded per level of the draft tree",
    "tree_nodes": "draft tokens the target verifies per round (the tree's size; k is its depth)",
    "verify_top_k": "a candidate is accepted while it is among the target's verify_top_k most likely tokens",
    "divergence": "kl (KL(p||q)) | kl_rev (KL(q||p)) | js | tv, natural log, p target, q draft",
    "fsd_top_k": "0 = divergence over the whole vocabulary, else over the target's top fsd_top_k tokens plus one "
    "bucket for the rest",
    "fsd_rule": "paper (accept while Div < T, else a token from p) | or (accept when SD accepts or Div < T, else "
    "the SD residual; T=0 is SD)",
    "fsd_dist": "raw (softmax of the unwarped logits) | warped (after sampling.temperature/top_k/top_p)",
    "lookbehind": "committed tokens a re-tokenisation window may cover",
    "lookahead": "most draft tokens per step (0: the pair's n_max, computed from the two vocabularies and cached)",
    "budget": "most prefix-tree nodes per step to compute psi; a larger tree falls back to the target's own "
    "token for that step (lossless, counted as slrs_fallbacks)",
}


@dataclass
class Settings:
    """Base of a policy's settings: ``CHECKS`` (field -> rule) and ``relations()`` (rules between fields).

    ``THRESHOLD`` names the field that ``threshold=`` stands for (the policy's threshold under one name);
    ``HELP`` the policy's own help lines (else :data:`HELP`'s).
    """

    CHECKS: ClassVar[dict[str, Check]] = {}
    THRESHOLD: ClassVar[str | None] = None
    HELP: ClassVar[dict[str, str]] = {}

    @classmethod
    def help(cls, name: str) -> str:
        """The help line of setting ``name``."""
        return cls.HELP.get(name) or HELP.get(name, "")

    @classmethod
    def sweep(cls, name: str, key: str, values) -> list[str]:
        """The problems of a swept list ``key`` of values of the setting ``name``."""
        return cls.CHECKS[name].sweep(key, values)

    def problems(self, keys: Mapping[str, str] | None = None) -> list[str]:
        """One line per invalid setting; ``keys`` renames settings as the caller's config spells them."""
        keys = keys or {}
        out = [
            line
            for name, check in self.CHECKS.items()
            for line in check.problems(getattr(self, name), keys.get(name, name))
        ]
        return out + self.relations()

    def relations(self) -> list[str]:
        """Problems between settings (``k_min <= k_max`` ...)."""
        return []

    def check(self, *extra: str, keys: Mapping[str, str] | None = None) -> None:
        """Raises one UserError naming every problem (with ``extra`` ones the caller found)."""
        problems = [*self.problems(keys), *extra]
        if problems:
            raise UserError("; ".join(problems))


class Unset:
    """A constructor argument left out: the policy's Settings give its value (written there once)."""

    def __repr__(self) -> str:
        return "UNSET"


UNSET: Any = Unset()
S = TypeVar("S", bound=Settings)


def settle(
    cls: type[S],
    settings: S | None,
    given: Mapping[str, Any],
    extra: Callable[[S], list[str]] | None = None,
    keys: Mapping[str, str] | None = None,
) -> S:
    """A policy's settings: ``settings`` (default: ``cls()``, the defaults) with the constructor's ``given``
    arguments that were passed over it, checked (with ``extra(settings)``: what the constructor's other
    arguments make of them, e.g. ``stop=cost`` without a cost table; ``keys``: the constructor's names of
    settings it spells otherwise)."""
    passed = {k: v for k, v in given.items() if not isinstance(v, Unset)}
    out = dataclasses.replace(settings if settings is not None else cls(), **passed)
    out.check(*(extra(out) if extra else []), keys=keys)
    return out


@dataclass(frozen=True)
class HeadSpec:
    """The exported head a policy reads: its ``head_type``, the model whose states it reads, the
    threshold used when neither the settings nor the head's metadata give one, whether it is required."""

    type: str
    model: str
    threshold: float
    required: bool = True

    def threshold_for(self, own: float | None, head) -> float:
        """``own`` when set, else the loaded head's ``default_threshold``, else ours."""
        if own is not None:
            return own
        return head.threshold if head is not None and head.threshold is not None else self.threshold
