"""`heads-datagen`: label generation.

Not implemented yet: it arrives with SpecDec++ acceptance labels.
"""

from __future__ import annotations

from specheads.config import not_implemented_main

PROG = "heads-datagen"


def main(argv: list[str] | None = None) -> int:
    """Entry point of `heads-datagen`.

    Args:
        argv: Arguments without the program name; ``None`` takes ``sys.argv[1:]``.

    Returns:
        2 (not implemented yet), or 0 for ``--help``.
    """
    return not_implemented_main(PROG, "arrives with SpecDec++ acceptance labels", argv)


if __name__ == "__main__":
    raise SystemExit(main())
