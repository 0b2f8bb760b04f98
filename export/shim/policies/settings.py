"""A policy's settings: typed, under its own names, with the rules that check them (one place, used by
``heads-decode``, ``heads-eval`` and the constructors alike), and the exported head it reads."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Callable, ClassVar, Mapping

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


@dataclass
class Settings:
    """Base of a policy's settings: ``CHECKS`` (field -> rule) and ``relations()`` (rules between fields).

    ``THRESHOLD`` names the field that ``threshold=`` stands for on the command lines; ``API_ONLY`` the
    fields a config does not set (Python-API knobs that keep their defaults there).
    """

    CHECKS: ClassVar[dict[str, Check]] = {}
    THRESHOLD: ClassVar[str | None] = None
    API_ONLY: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def from_config(cls, cfg) -> "Settings":
        """The settings a flat config (``DecodeConfig``, or any object with these names) gives."""
        values = {f.name: getattr(cfg, f.name) for f in fields(cls)
                  if f.name not in cls.API_ONLY and hasattr(cfg, f.name)}
        alias = getattr(cfg, "threshold", None)
        if cls.THRESHOLD and values.get(cls.THRESHOLD) is None and alias is not None:
            values[cls.THRESHOLD] = alias
        return cls(**values)

    @classmethod
    def config_problems(cls, cfg) -> list[str]:
        """Every problem of the settings a config gives, ``threshold=`` against the policy's own name included."""
        own, alias = getattr(cfg, cls.THRESHOLD or "", None), getattr(cfg, "threshold", None)
        clash = ([f"threshold={alias} and {cls.THRESHOLD}={own} disagree; set only {cls.THRESHOLD} "
                  f"(threshold is its other name)"] if None not in (own, alias) and own != alias else [])
        return clash + cls.from_config(cfg).problems()

    @classmethod
    def sweep(cls, name: str, key: str, values) -> list[str]:
        """The problems of a swept list ``key`` of values of the setting ``name``."""
        return cls.CHECKS[name].sweep(key, values)

    def problems(self, keys: Mapping[str, str] | None = None) -> list[str]:
        """One line per invalid setting; ``keys`` renames settings as the caller's config spells them."""
        keys = keys or {}
        out = [line for name, check in self.CHECKS.items()
               for line in check.problems(getattr(self, name), keys.get(name, name))]
        return out + self.relations()

    def relations(self) -> list[str]:
        """Problems between settings (``k_min <= k_max`` ...)."""
        return []

    def check(self, *extra: str, keys: Mapping[str, str] | None = None) -> None:
        """Raises one UserError naming every problem (with ``extra`` ones the caller found)."""
        problems = [*self.problems(keys), *extra]
        if problems:
            raise UserError("; ".join(problems))


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
