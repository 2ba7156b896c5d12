"""Fixed cost and cost per MiB: a straight line through (tensor size, cost) points, for
scripts/bench_scaling.py. Pure arithmetic (numpy only)."""

from __future__ import annotations

import numpy as np


def fit_line(sizes: list[float], values: list[float]) -> tuple[float, float]:
    """``(fixed, per_mib)`` of ``value = fixed + per_mib * size``, least squares on relative residuals
    (each point divided by its value, so a 64 KiB tensor counts as much as a 400 MiB one); neither
    is negative (a negative term is dropped and the other refitted alone)."""
    x, y = np.asarray(sizes, float), np.asarray(values, float)
    w = 1.0 / np.maximum(np.abs(y), 1e-12)
    (fixed, per_mib), *_ = np.linalg.lstsq(np.stack([w, w * x], axis=1), w * y, rcond=None)
    if fixed < 0:  # no fixed cost to be seen: a line through 0
        return 0.0, float(np.sum(w * w * x * y) / np.sum(w * w * x * x))
    if per_mib < 0:
        return float(np.sum(w * w * y) / np.sum(w * w)), 0.0
    return float(fixed), float(per_mib)
