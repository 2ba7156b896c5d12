"""The union densities of DDP buckets: what the path decision reads, identical on every rank.

Design. Which path a bucket takes must be the same on every rank, or ranks wait for each other
forever; so the decision reads only what every rank holds bit for bit: the union density of the
same bucket's previous reduction (the fraction of the reduced result's blocks that are non-zero,
:func:`omnireduce.engines.dense.union_density`), remembered per bucket by :class:`Densities`. A host
bucket seen for the first time has none: the router's probe all-reduces the ranks' local densities
(MAX, one number) instead (:mod:`omnireduce.ddp.routing.router`). Counted on a CUDA device, a density stays
a :class:`~omnireduce.engines.dense.DeviceDensity` (a count copied to pinned host memory without
blocking) until a decision an iteration later reads it, so nothing here waits for the device.
Pickled, the densities are plain floats.
"""

from __future__ import annotations

import threading
from typing import TypedDict

from omnireduce.ddp.bucket import BucketKey
from omnireduce.engines.dense import DeviceDensity, as_float, union_density

__all__ = ["Densities", "DeviceDensity", "as_float", "union_density"]


class SavedDensities(TypedDict):
    """What a pickled :class:`Densities` holds: every density as a float."""

    density: dict[BucketKey, float]
    seen: set[BucketKey]
    latest: dict[int, float]


class Densities:
    """The union densities the dense/sparse decision reads, per bucket; thread-safe (recorded on
    the threads that complete reductions, read on the autograd thread)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._density: dict[BucketKey, float | DeviceDensity] = {}  # a bucket's last measured union density
        self._seen: set[BucketKey] = set()  # buckets asked about (probed or not) before
        self._latest: dict[int, float | DeviceDensity] = {}  # bucket index -> latest union density (stats)

    def reaches(self, key: BucketKey, threshold: float) -> bool:
        """Whether bucket ``key``'s last union density reached ``threshold`` (False: none yet). Read
        from host memory: a density counted on a CUDA device was copied there an iteration ago."""
        with self._lock:
            density = self._density.get(key)
        return density is not None and as_float(density) >= threshold

    def first_sight(self, key: BucketKey) -> bool:
        """True the first time bucket ``key`` is asked about (it has no density yet), then False."""
        with self._lock:
            if key in self._density or key in self._seen:
                return False
            self._seen.add(key)
            return True

    def remember(self, key: BucketKey, density: float | DeviceDensity) -> None:
        with self._lock:
            self._density[key] = density
            self._latest[key[0]] = density

    def density_of(self, key: BucketKey) -> float | None:
        """Bucket ``key``'s last union density, or None (read from host memory, see :meth:`reaches`)."""
        with self._lock:
            density = self._density.get(key)
        return None if density is None else as_float(density)

    def latest(self) -> dict[int, float]:
        """The last union density of each bucket, keyed by bucket index."""
        with self._lock:
            latest = sorted(self._latest.items())
        return {k: as_float(v) for k, v in latest}

    def stored(self) -> list[float | DeviceDensity]:
        """The densities as stored (a CUDA one not read yet is a :class:`DeviceDensity`)."""
        with self._lock:
            return list(self._density.values())

    def __getstate__(self) -> SavedDensities:
        with self._lock:
            density, seen, latest = dict(self._density), set(self._seen), dict(self._latest)
        return {"density": {k: as_float(v) for k, v in density.items()}, "seen": seen,
                "latest": {k: as_float(v) for k, v in latest.items()}}

    def __setstate__(self, saved: SavedDensities) -> None:
        self._lock = threading.Lock()
        self._density, self._seen, self._latest = dict(saved["density"]), saved["seen"], dict(saved["latest"])
