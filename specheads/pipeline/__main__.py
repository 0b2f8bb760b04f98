"""``python -m specheads.pipeline``: the same as ``heads-pipeline``."""

from specheads.pipeline import main

raise SystemExit(main())
