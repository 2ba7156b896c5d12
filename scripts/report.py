#!/usr/bin/env python3
"""Render benchmark JSON files (bench_allreduce.py, bench_train.py) as Markdown tables.

    python scripts/report.py results/allreduce_1gbit_W4.json results/bench_train.json

For the lab notebook (docs/log/): its tables were produced by this script from the JSON files kept in
docs/bench/, so they can be regenerated and checked. The tables themselves are
:mod:`ombench.tables`. The current results' tables (docs/BENCHMARKS.md, docs/bench/*.md) are written
by scripts/bench_tables.py.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from ombench.tables import markdown


def main() -> None:
    """Print the tables of every JSON file named on the command line."""
    for path in sys.argv[1:]:
        data = json.loads(Path(path).read_text())
        print(f"\n<!-- {path} -->")
        print(markdown(data))


if __name__ == "__main__":
    main()
