"""``python -m omnireduce.bench``: the ``omnireduce-bench`` command (:mod:`omnireduce.bench.cli`)."""

from __future__ import annotations

import sys

from omnireduce.bench.cli import main

if __name__ == "__main__":
    sys.exit(main())
