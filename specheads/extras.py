"""The optional dependencies of each stage, and the console scripts of the stages that need them.

The base install (``pip install specheads``) decodes with an exported head. ``heads-datagen``,
``heads-vocab`` and ``heads-train`` need the ``[train]`` extra and ``heads-eval`` the ``[eval]`` extra;
their console scripts check the extra before importing the stage, so a missing one ends in one line
naming the extra to install instead of an import traceback::

    heads-train: error: needs the [train] extra (not installed: accelerate, datasets): pip install 'specheads[train]'
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from typing import Callable

from specheads.errors import UserError

# extra -> the import names of the packages it adds that the stage's code imports (pyproject.toml lists them)
EXTRAS: dict[str, tuple[str, ...]] = {
    "train": ("accelerate", "datasets", "pyarrow", "sklearn", "matplotlib"),
    "eval": ("matplotlib", "rouge_score", "scipy", "sklearn"),
}


def missing(extra: str) -> list[str]:
    """The modules of ``extra`` that are not installed."""
    return [m for m in EXTRAS[extra] if importlib.util.find_spec(m) is None]


def require(extra: str) -> None:
    """Raises :class:`UserError` naming the extra and the pip command when any of its modules is missing."""
    gone = missing(extra)
    if gone:
        raise UserError(
            f"needs the [{extra}] extra (not installed: {', '.join(gone)}): pip install 'specheads[{extra}]'"
        )


def _script(prog: str, extra: str, module: str) -> Callable[[list[str] | None], int]:
    def main(argv: list[str] | None = None) -> int:
        try:
            require(extra)
        except UserError as exc:
            print(f"{prog}: error: {exc}", file=sys.stderr)
            return 2
        return importlib.import_module(module).main(argv)

    main.__doc__ = f"Entry point of ``{prog}``: :func:`{module}.main` once the [{extra}] extra is there."
    return main


heads_datagen = _script("heads-datagen", "train", "specheads.datagen.cli")
heads_vocab = _script("heads-vocab", "train", "specheads.datagen.vocab_ranking")
heads_train = _script("heads-train", "train", "specheads.train.cli")
heads_eval = _script("heads-eval", "eval", "specheads.evaluate.cli")
