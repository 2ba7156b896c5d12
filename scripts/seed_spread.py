"""Validation losses of compression runs against dense fp32's of the same model and seed, and their
spread over seeds: shared by scripts/bench_compression.py (its printed tables) and
scripts/bench_tables.py (the generated ones). Rows are bench_compression.py's result rows."""

from __future__ import annotations

import collections
import statistics
from typing import Any


def against_dense(results: list[dict[str, Any]]) -> list[tuple[dict[str, Any], float]]:
    """Each row with its validation loss against dense fp32's of the same model and seed, in % (0 where
    the run has no dense row)."""
    dense = {(r["model"], r.get("seed", 0)): r for r in results if r["method"] == "dense"}
    return [(r, 100 * (r["val_loss"] / dense.get((r["model"], r.get("seed", 0)), r)["val_loss"] - 1)) for r in results]


def over_seeds(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per model and method: the seeds, the mean validation loss, and its gap to dense fp32's of the same
    seed (mean, smallest, largest, and on how many seeds within 1%)."""
    groups: dict[tuple[str, str], list[tuple[dict[str, Any], float]]] = collections.defaultdict(list)
    for r, rel in against_dense(results):
        groups[(r["model"], r["method"])].append((r, rel))
    return [{"model": m, "method": meth, "seeds": [r.get("seed", 0) for r, _ in rows],
             "val_loss": statistics.mean(r["val_loss"] for r, _ in rows),
             "gap_mean": statistics.mean(g for _, g in rows), "gap_min": min(g for _, g in rows),
             "gap_max": max(g for _, g in rows), "within_1pct": sum(g <= 1.0 for _, g in rows),
             "of_dense_bytes": statistics.mean(r["bytes_per_step_rank"] / r["dense_bytes_per_step_rank"]
                                               for r, _ in rows)}
            for (m, meth), rows in groups.items()]
