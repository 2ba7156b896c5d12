"""What the DDP hook has done: one counters object per :class:`omnireduce.ddp.OmniReduceState`.

Design. The hook's paths complete on different threads (the worker's I/O thread, the process
group's, the autograd thread when something fails at once), so every count goes through
:meth:`HookCounters.add`, which takes the lock once for all the increments of one event (a bucket
reduced: its path, its bytes, what a ring all-reduce would have sent), and :meth:`HookCounters.snapshot`
reads them all at once. The set of counters is fixed (:data:`COUNTERS`): a misspelt name raises.
Pickled with its values, unpickled with a fresh lock.
"""

from __future__ import annotations

import threading
from typing import Any

# The counters, in the order ``OmniReduceState.stats()`` reports them (its docstring explains each).
COUNTERS = ("buckets_sparse", "buckets_dense", "buckets_failed", "buckets_probed", "buckets_coo", "bytes_sent",
            "bytes_received", "dense_equivalent_bytes")


class HookCounters:
    """Thread-safe counters of the hook's buckets and bytes (see the module)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values: dict[str, int] = dict.fromkeys(COUNTERS, 0)

    def add(self, **increments: int) -> None:
        """Add each increment to its counter, all under one lock (KeyError for an unknown name)."""
        with self._lock:
            for name in increments:
                if name not in self._values:
                    raise KeyError(f"no hook counter named {name!r}")
            for name, n in increments.items():
                self._values[name] += n

    def snapshot(self) -> dict[str, int]:
        """Every counter, read at one moment."""
        with self._lock:
            return dict(self._values)

    def __getstate__(self) -> dict[str, Any]:
        return {"values": self.snapshot()}

    def __setstate__(self, saved: dict[str, Any]) -> None:
        self._lock = threading.Lock()
        self._values = dict.fromkeys(COUNTERS, 0)
        self._values.update({k: int(v) for k, v in saved["values"].items() if k in self._values})


def ring_bytes(nbytes: int, world_size: int) -> int:
    """Bytes each rank sends in a ring all-reduce of ``nbytes``."""
    return 2 * (world_size - 1) * nbytes // world_size if world_size > 1 else 0
