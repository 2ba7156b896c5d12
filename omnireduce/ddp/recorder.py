"""What the DDP hook has done, written only here: the recorder every path reports to.

Data flows one way through the hook (hook -> runtime -> router -> reducer -> future); on the way
back nothing is written but a :class:`Recorder`: each reduced bucket (its way, its bytes from the
reducer's :class:`~omnireduce.engines.reducer.ReductionInfo`, what a ring all-reduce would have
sent, and the union density that steers the next decision: the whole bucket's, or through the
hierarchy its rail's shard's) and each failure. The state owns one recorder, pickles it with its
counts and densities, and reads it for ``stats()`` and for the path decision
(:mod:`omnireduce.ddp.routing.router`).

Counters. The hook's paths complete on different threads (the worker's I/O thread, the process
group's, the autograd thread when something fails at once), so every count goes through
:meth:`HookCounters.add`, which takes the lock once for all the increments of one event (a bucket
reduced: its path, its bytes, what a ring all-reduce would have sent), and :meth:`HookCounters.snapshot`
reads them all at once. The set of counters is fixed (:data:`COUNTERS`): a misspelt name raises.
Pickled with its values, unpickled with a fresh lock.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
from typing import TypedDict, cast

from omnireduce.ddp.bucket import BucketKey
from omnireduce.ddp.densities import Densities
from omnireduce.engines.reducer import Reduction, ReductionInfo, ring_bytes
from omnireduce.errors import OmniReduceError

log = logging.getLogger("omnireduce.ddp")


class Counters(TypedDict):
    """The counters (:meth:`HookCounters.snapshot`), in the order ``OmniReduceState.stats()`` reports
    them (its docstring explains each)."""

    buckets_sparse: int
    buckets_dense: int
    buckets_failed: int
    buckets_probed: int
    buckets_coo: int
    bytes_sent: int
    bytes_received: int
    dense_equivalent_bytes: int


_BUCKET_FIELDS = ("numel", "way", "bytes_sent", "compressed")  # a bucket's last reduction (stats)
COUNTERS = tuple(Counters.__annotations__)  # the counters' names, in order


class _SavedCounters(TypedDict):
    """What a pickled :class:`HookCounters` holds."""

    values: dict[str, int]


class _SavedRecorderBase(TypedDict):
    counters: HookCounters
    densities: Densities


class SavedRecorder(_SavedRecorderBase, total=False):
    """What a pickled :class:`Recorder` holds (older pickles lack the optional keys)."""

    rail_densities: Densities
    buckets: dict[int, dict[str, object]]
    name: str
    item: str


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

    def add_reduced(self, dense: bool, coo: bool, sent: int, received: int, equivalent: int) -> None:
        """One bucket reduced (:meth:`Recorder.reduced`'s increments, without :meth:`add`'s name checks)."""
        with self._lock:
            v = self._values
            v["buckets_dense" if dense else "buckets_sparse"] += 1
            v["buckets_coo"] += coo
            v["bytes_sent"] += sent
            v["bytes_received"] += received
            v["dense_equivalent_bytes"] += equivalent

    def snapshot(self) -> Counters:
        """Every counter, read at one moment."""
        with self._lock:
            return cast(Counters, dict(self._values))  # (its keys are COUNTERS: add() refuses any other)

    def __getstate__(self) -> _SavedCounters:
        with self._lock:
            return {"values": dict(self._values)}

    def __setstate__(self, saved: _SavedCounters) -> None:
        self._lock = threading.Lock()
        self._values = dict.fromkeys(COUNTERS, 0)
        self._values.update({k: int(v) for k, v in saved["values"].items() if k in self._values})


class Recorder:
    """Where the reductions report (see the module): counters, and the buckets' union densities
    (``densities``: the whole buckets'; ``rail_densities``: their shards' on this rank's rail of the
    hierarchy). ``name`` and ``item`` say in a failure's message who failed and what a bucket index
    counts (an integration that routes tensors of its own names them)."""

    def __init__(self, name: str = "omnireduce_hook", item: str = "bucket") -> None:
        self.name, self.item = name, item
        self.counters = HookCounters()
        self.densities = Densities()
        self.rail_densities = Densities()
        self._lock = threading.Lock()
        self._buckets: dict[int, tuple[object, ...]] = {}  # bucket index -> its last reduction (_BUCKET_FIELDS)

    def __getstate__(self) -> SavedRecorder:
        return {"counters": self.counters, "densities": self.densities, "rail_densities": self.rail_densities,
                "buckets": self.buckets(), "name": self.name, "item": self.item}

    def __setstate__(self, saved: SavedRecorder) -> None:
        self.counters, self.densities = saved["counters"], saved["densities"]
        self.rail_densities = saved.get("rail_densities") or Densities()
        self._lock = threading.Lock()
        self._buckets = {int(i): tuple(b[f] for f in _BUCKET_FIELDS) for i, b in saved.get("buckets", {}).items()}
        self.name, self.item = saved.get("name", "omnireduce_hook"), saved.get("item", "bucket")

    def buckets(self) -> dict[int, dict[str, object]]:
        """Per bucket index, its last reduction: ``numel``, ``way`` (``dense``, ``sparse``: through
        omnireduce, ``coo``: a sparse COO gradient, batched; through the hierarchy, how its shard crossed
        the nodes), ``bytes_sent`` (a batch of sparse COO buckets counts its bytes with the first of
        them), ``compressed`` (its compacted blocks went that way: ``OmniReduceState(compression=...)``)."""
        with self._lock:
            last = sorted(self._buckets.items())
        return {i: dict(zip(_BUCKET_FIELDS, b, strict=True)) for i, b in last}

    def watch(self, reduction: Reduction, key: BucketKey, iteration: int, nbytes: int, world_size: int,
              rails: bool = False) -> Reduction:
        """Record ``reduction`` of bucket ``key`` as it completes (:meth:`reduced`: before anyone waiting
        on it reads it, so its density steers the bucket's next route on every rank); if it fails, its
        error names the iteration and the bucket, and is counted (:meth:`failure`). Returns ``reduction``."""
        reduction.observe(functools.partial(self._completed, key, nbytes, world_size, rails),
                          functools.partial(self.failure, iteration=iteration, index=key[0]))
        return reduction

    def _completed(self, key: BucketKey, nbytes: int, world_size: int, rails: bool, info: ReductionInfo) -> None:
        try:
            self.reduced(key, info, nbytes=nbytes, world_size=world_size, rails=rails)
        except Exception:  # (a count lost is logged; the bucket's result stands)
            log.exception("omnireduce: recording bucket %d", key[0])

    def reduced(self, key: BucketKey, info: ReductionInfo, *, nbytes: int, world_size: int, rails: bool = False,
                coo: bool = False) -> None:
        """A bucket reduced, as its reducer's ``info`` says (``nbytes``: DDP's bucket, what a dense
        all-reduce would have reduced; ``rails``: through the hierarchy, the info its rail's; ``coo``:
        a sparse COO gradient, whose density steers nothing). A union density not counted (a dense
        all-reduce not scanned) does not steer the decision."""
        if not coo and (info.measured is not None or not info.dense):
            (self.rail_densities if rails else self.densities).remember(key, info.union_density)
        dense = info.dense
        with self._lock:
            self._buckets[key[0]] = (key[1], "coo" if coo else "dense" if dense else "sparse", info.bytes_sent,
                                     len(key) > 2)
        self.counters.add_reduced(dense, coo, info.bytes_sent, info.bytes_received, ring_bytes(nbytes, world_size))

    def count(self, **increments: int) -> None:
        """Add to the named counters (the hierarchy's rails count their parts of a bucket so)."""
        self.counters.add(**increments)

    def failure(self, cause: BaseException, iteration: int, index: int) -> OmniReduceError:
        """The error DDP raises for a failed bucket (the cause's kind if it is an OmniReduceError),
        counted in ``buckets_failed`` and logged."""
        kind = type(cause) if isinstance(cause, OmniReduceError) else OmniReduceError
        err = kind(f"{self.name} failed at iteration {iteration}, {self.item} {index}: {cause}")
        err.__cause__ = cause
        with contextlib.suppress(Exception):
            self.counters.add(buckets_failed=1)
        log.error("%s", err)
        return err

    def failed(self, cause: BaseException, iteration: int, index: int) -> Reduction:
        """A future that has already failed with :meth:`failure`'s error for the bucket."""
        fut = Reduction()
        fut.fail(self.failure(cause, iteration, index))
        return fut
