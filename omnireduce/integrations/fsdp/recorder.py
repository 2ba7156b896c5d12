"""What the FSDP reductions did, written only here: one record per unit, read by ``stats()``.

The reductions complete on other threads (the collective engine's, the process group's), so
every update takes one lock. Each reduction reports its way (the path the router gave it:
``collective``, the collective engine; ``omnireduce``, the aggregators; ``dense``), the bytes this
rank sent and received for it, what native HSDP's all-reduce of the same tensor would
have sent (a ring all-reduce's ``2 (R-1)/R`` of its bytes over R replicas: the dense-equivalent
bytes), and the union density of its blocks (the fraction non-zero on some replica, identical on
every rank; counted on a CUDA device, it is read from host memory only when ``stats()`` asks).
"""

from __future__ import annotations

import threading
from typing import Any

from omnireduce.ddp.densities import as_float

__all__ = ["COUNTED", "Recorder"]

#: The counters of each unit, summed over the units by :meth:`Recorder.stats`.
COUNTED = ("reductions", "reductions_sparse", "reductions_dense", "bytes_sent", "bytes_received",
           "dense_equivalent_bytes")
DENSE = "dense"


class Recorder:
    """Per unit (by key): counts, bytes, and the last reduction's way, density and block size."""

    def __init__(self, names: list[str]) -> None:
        self.names = list(names)
        self._lock = threading.Lock()
        self._units: list[dict[str, Any]] = [
            {**dict.fromkeys(COUNTED, 0), "path": None, "union_density": None, "block_size": None, "numel": 0}
            for _ in names]

    def reduced(self, key: int, path: str, *, sent: int, received: int, dense_bytes: int, density: Any,
                block_size: int, numel: int) -> None:
        """Unit ``key`` was reduced by ``path`` (``dense``, or a way through omnireduce)."""
        with self._lock:
            u = self._units[key]
            u["reductions"] += 1
            u["reductions_dense" if path == DENSE else "reductions_sparse"] += 1
            u["bytes_sent"] += sent
            u["bytes_received"] += received
            u["dense_equivalent_bytes"] += dense_bytes
            u["path"], u["block_size"], u["numel"] = path, block_size, numel
            if density is not None:
                u["union_density"] = density

    def stats(self) -> dict[str, Any]:
        """The counters summed over the units, ``sent_fraction`` (bytes sent over the dense-equivalent
        bytes), and ``per_module``: each unit's name to its own counters, ``sent_fraction``, last way
        (``path``), last ``union_density``, ``block_size`` and ``numel``."""
        with self._lock:
            units = [dict(u) for u in self._units]
        per_module = {}
        for name, u in zip(self.names, units, strict=True):
            if u["union_density"] is not None:
                u["union_density"] = as_float(u["union_density"])
            u["sent_fraction"] = u["bytes_sent"] / u["dense_equivalent_bytes"] if u["dense_equivalent_bytes"] else 0.0
            per_module[name or "(the model)"] = u
        out: dict[str, Any] = {k: sum(u[k] for u in units) for k in COUNTED}
        dense = out["dense_equivalent_bytes"]
        out["sent_fraction"] = out["bytes_sent"] / dense if dense else 0.0
        out["per_module"] = per_module
        return out
