"""Which Transformers versions specheads.hf works with, and the internals it relies on (checked when an
Assistant is built); the counts of a generate call."""

from __future__ import annotations

from dataclasses import dataclass

from specheads.errors import UserError

SUPPORTED = (">=5.24", "<6")  # keep in step with pyproject.toml's transformers pin


def check_transformers(version: str | None = None) -> None:
    """UserError (one line, naming :data:`SUPPORTED`) when the installed Transformers is outside it."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    if version is None:
        import transformers

        version = transformers.__version__
    if not SpecifierSet(",".join(SUPPORTED)).contains(Version(version), prereleases=True):
        raise UserError(
            f"specheads.hf supports transformers {','.join(SUPPORTED)}; this environment has {version} "
            f"(pip install 'transformers{','.join(SUPPORTED)}')"
        )
    missing = _missing_internals()
    if missing:  # a release inside the range that moved what assisted generation is built from
        raise UserError(
            f"specheads.hf needs Transformers' assisted-generation internals {missing}, absent from "
            f"transformers {version}; install a release specheads is tested on "
            f"(pip install 'transformers{','.join(SUPPORTED)}') and report the version"
        )


# What specheads.hf builds on inside Transformers (private API): checked up front, never failing mid-generate.
INTERNALS = {
    "transformers.generation.utils:GenerationMixin": ("_assisted_decoding", "_get_candidate_generator"),
    "transformers.generation.candidate_generator:AssistedCandidateGenerator": (
        "_prepare_generation_args",
        "get_candidates",
        "update_candidate_strategy",
    ),
}


def _missing_internals() -> list[str]:
    import importlib

    missing = []
    for where, names in INTERNALS.items():
        module, _, cls = where.partition(":")
        try:
            obj = getattr(importlib.import_module(module), cls)
        except (ImportError, AttributeError):
            missing.append(where)
            continue
        missing += [f"{cls}.{n}" for n in names if not callable(getattr(obj, n, None))]
    return missing


@dataclass
class Stats:
    """The last ``generate`` call: rounds (one target call each), candidates drafted, candidates accepted."""

    rounds: int = 0
    drafted: int = 0
    accepted: int = 0

    @property
    def accepted_per_call(self) -> float | None:
        return self.accepted / self.rounds if self.rounds else None
