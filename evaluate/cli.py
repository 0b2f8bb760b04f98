"""`heads-eval`: head evaluation.

Not implemented yet: it arrives with head evaluation and policy benchmarks.
"""

from __future__ import annotations

from specheads.config import not_implemented_main

PROG = "heads-eval"


def main(argv: list[str] | None = None) -> int:
    """Entry point of `heads-eval`.

    Args:
        argv: Arguments without the program name; ``None`` takes ``sys.argv[1:]``.

    Returns:
        2 (not implemented yet), or 0 for ``--help``.
    """
    return not_implemented_main(PROG, "arrives with head evaluation and policy benchmarks", argv)


if __name__ == "__main__":
    raise SystemExit(main())
