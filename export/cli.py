"""``heads-export``: package a trained head as one safetensors file (arrives with the first head)."""

from __future__ import annotations

from specheads.config import not_implemented_main


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``heads-export``."""
    return not_implemented_main("heads-export", "arrives with the SpecDec++ acceptance head", argv)


if __name__ == "__main__":
    raise SystemExit(main())
