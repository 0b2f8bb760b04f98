"""`heads-train`: head training.

Not implemented yet: it arrives with acceptance-head training.
"""

from __future__ import annotations

from specheads.config import not_implemented_main

PROG = "heads-train"


def main(argv: list[str] | None = None) -> int:
    """Entry point of `heads-train`.

    Args:
        argv: Arguments without the program name; ``None`` takes ``sys.argv[1:]``.

    Returns:
        2 (not implemented yet), or 0 for ``--help``.
    """
    return not_implemented_main(PROG, "arrives with acceptance-head training", argv)


if __name__ == "__main__":
    raise SystemExit(main())
