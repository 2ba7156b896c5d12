"""Which way each DDP bucket goes, and who reduces it: the whole path decision, in one place.

Every rank must send a bucket the same way, or ranks wait for each other forever; so every
decision here reads only what every rank holds bit for bit: the dtype and layout of the bucket,
the aggregators agreed on this iteration (:mod:`omnireduce.ddp.agreement`), the union density of
the bucket's previous reduction (:mod:`omnireduce.ddp.densities`), the path choice's agreed
timings (:mod:`omnireduce.ddp.path_choice`), or, for a host bucket seen for the first time under
the threshold rule, one number all-reduced (:meth:`ThresholdRule.probe`). :meth:`Router.route`
returns a :class:`Route` that carries the bucket's reducer (:mod:`omnireduce.engines.reducer`), in
this order:

1. a dtype omnireduce does not carry (a warning once): the dense all-reduce;
2. compressed (``OmniReduceState(compression=...)``, :class:`CompressionRule`): the bucket's
   compacted top-k blocks take one of the ways below (through the hierarchy where the dense buckets
   take it), measured under a key of their own; the route's reducer is the compression
   (:mod:`omnireduce.ddp.paths.compressed`) around its ``carrier``;
3. no aggregator usable: the dense all-reduce;
4. a sparse COO gradient omnireduce carries (float32/16, bf16): batched over the backward pass
   (:mod:`omnireduce.ddp.paths.coo`), its rows summed by the job's rows reducer;
5. the state's ``path``: ``"measure"`` (the path choice: timed, agreed, checked on whole steps; a
   flat bucket every way through omnireduce would send by the dense all-reduce whole, the collective
   engine's small ones, goes dense untimed: :class:`~omnireduce.engines.reducer.TakesWhole`),
   ``"threshold"`` (the union density against ``dense_threshold``), or forced. Where every dense
   bucket takes the hierarchy (``hierarchical=True``, or left to ``auto`` with a ``path`` other
   than ``"measure"``), the way says how its shards cross the nodes; under the threshold rule each
   rail applies this module's rule to its own shard (:class:`RailRule`). Where the hierarchy runs
   beside the flat ways and ``hierarchical`` was left to ``auto`` (``measure_hierarchy``), whether
   the buckets take it (``"hier:omnireduce"``, ...) or stay flat is part of the measured, agreed
   choice, on whole steps (:mod:`omnireduce.ddp.path_choice`).

The router holds no sockets and starts no reduction: the runtime starts the route's reducer. Any
tensor with a stable key can be routed, not only a DDP bucket (:meth:`omnireduce.ddp.bucket.Bucket.of_tensor`,
:meth:`omnireduce.ddp.runtime.Runtime.reduce_bucket`).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from omnireduce.compression import BlockTopK
from omnireduce.config import WorkerConfig
from omnireduce.ddp.agreement import Agreement
from omnireduce.ddp.bucket import Bucket, BucketKey
from omnireduce.ddp.densities import Densities
from omnireduce.ddp.options import Mode, Options
from omnireduce.ddp.path import DENSE, Path
from omnireduce.ddp.path_choice import PathChoice, Trial
from omnireduce.ddp.paths.compressed import Compression
from omnireduce.ddp.recorder import Recorder
from omnireduce.engines.dense import as_float, union_density
from omnireduce.engines.hierarchical import Hierarchical
from omnireduce.engines.reducer import Reducer, Reduction, TakesWhole
from omnireduce.engines.ways import Way

log = logging.getLogger("omnireduce.ddp")

SUPPORTED = (torch.float32, torch.float16, torch.bfloat16)  # the dtypes omnireduce carries


@dataclasses.dataclass(frozen=True)
class Route:
    """Where a bucket goes: its ``path`` (a way, flat or through the hierarchy; what its timings and
    ``stats()`` name), the ``reducer`` that reduces it, the ``trial`` that times it when it is being
    measured, whether it joins the backward pass's batch of sparse COO buckets (``batched``: the
    reducer sums their stacked rows), and for a compressed bucket the ``carrier`` its compacted
    blocks take (the reducer is then the compression around it)."""

    path: Path
    reducer: Reducer
    trial: Trial | None = None
    batched: bool = False
    carrier: Reducer | None = None

    @property
    def compressed(self) -> bool:
        return self.carrier is not None


@dataclasses.dataclass(frozen=True)
class Ways:
    """The reducers a bound state's buckets may take, made by binding.

    Args:
        sparse: the ways through omnireduce the buckets may take (the first where nothing is measured).
        flat: each way's reducer over the whole process group (the dense all-reduce among them).
        scanned: the dense all-reduce whose results are scanned for their union density (threshold rule).
        rows: who sums the stacked rows of sparse COO gradients.
        through: each way through the hierarchy (empty: the hierarchy does not run).
        rail_scanned: the rail's dense all-reduce, scanned (the rails' threshold rule; None: not used).
    """

    sparse: tuple[Way, ...]
    flat: Mapping[Way, Reducer]
    scanned: Reducer
    rows: Reducer
    through: Mapping[Way, Hierarchical] = dataclasses.field(default_factory=dict)
    rail_scanned: Reducer | None = None


class CompressionRule:
    """Which buckets go compressed (``OmniReduceState(compression=BlockTopK(...))``): none while
    warming up (the first ``warmup_steps`` iterations), none under ``min_numel`` values; and a
    bucket whose union density (blocks non-zero on some rank: the same number on every rank) was at
    most ``exact_below`` when its compression would start stays exact from then on: omnireduce
    sends it whole at that density. A bucket whose union density is not known then (it went dense
    throughout) is probed once on the host: the ranks all-reduce (SUM) their local densities, at
    least the union's; a CUDA bucket is not probed (it would wait for the device) and goes compressed.
    Reads only what every rank holds."""

    def __init__(self, options: BlockTopK, densities: Densities, group: Any, config: WorkerConfig) -> None:
        self.options, self.densities, self.group, self.config = options, densities, group, config
        self._exact: dict[BucketKey, bool] = {}

    def _density(self, bucket: Bucket) -> float | None:
        density = self.densities.density_of(bucket.key)
        if density is not None or bucket.buffer.is_cuda:
            return density
        total = torch.tensor([as_float(union_density(bucket.buffer, self.config))], dtype=torch.float64)
        dist.all_reduce(total, group=self.group)
        return min(1.0, float(total[0]))

    def __call__(self, bucket: Bucket) -> bool:
        """Whether ``bucket`` goes compressed at this call."""
        opts, key = self.options, bucket.key
        if bucket.coo or bucket.iteration < opts.warmup_steps or bucket.buffer.numel() < max(1, opts.min_numel):
            return False
        exact = self._exact.get(key)
        if exact is None:
            density = self._density(bucket)
            exact = self._exact[key] = density is not None and density <= opts.exact_below
            log.info("omnireduce: bucket %d (%d elements), union density %s: %s from iteration %d", key[0], key[1],
                     "unknown" if density is None else f"{density:.4g}", "exact" if exact else "compressed",
                     bucket.iteration)
        return not exact


class ThresholdRule:
    """The union-density rule: a bucket goes dense once its last union density reached ``threshold``;
    a host bucket seen for the first time is probed: the ranks of ``group`` all-reduce their local
    densities (MAX, one number; the union is at least the largest). CUDA buckets are not probed (it
    would wait for the device): their first reduction goes through omnireduce. Collective: every
    rank sees the same buckets in the same order."""

    def __init__(self, densities: Densities, threshold: float, group: Any, config: WorkerConfig,
                 recorder: Recorder) -> None:
        self.densities, self.threshold, self.group = densities, threshold, group
        self.config, self.recorder = config, recorder

    def __call__(self, buffer: torch.Tensor, key: BucketKey) -> bool:
        """Whether the bucket ``key`` goes dense."""
        return self.densities.reaches(key, self.threshold) or self.probe(buffer, key)

    def probe(self, buffer: torch.Tensor, key: BucketKey) -> bool:
        if buffer.is_cuda or not self.densities.first_sight(key):
            return False
        largest = torch.tensor([as_float(union_density(buffer, self.config))], dtype=torch.float64)
        dist.all_reduce(largest, op=dist.ReduceOp.MAX, group=self.group)
        self.recorder.count(buckets_probed=1)
        return float(largest[0]) >= self.threshold


class RailRule:
    """The threshold rule of this rank's rail, for one bucket, as a reducer of its shard: the shard goes
    through the rail's dense all-reduce (scanned, so its density is known next time) once its union
    density reached the threshold (probed on the rail the first time), else the sparse way. Called
    on the hierarchy's step thread, which takes the buckets in DDP's order on every rank, so every
    member of the rail decides the same."""

    def __init__(self, rule: ThresholdRule, key: BucketKey, dense: Reducer, sparse: Reducer) -> None:
        self.rule, self.key, self.dense, self.sparse = rule, key, dense, sparse

    def allreduce_async(self, tensor: torch.Tensor, *, average: bool, block_size: int | None = None) -> Reduction:
        way = self.dense if self.rule(tensor, self.key) else self.sparse
        return way.allreduce_async(tensor, average=average, block_size=block_size)


class Router:
    """The path decision of one bound state (see the module).

    Args:
        options: the state's options (``path``, ``dense_threshold``, ``measure_trials``, ...).
        ways: the reducers binding made.
        agreement: the per-iteration agreement (whether any aggregator is usable).
        rule: the flat threshold rule; ``rail_rule``: the rails' (the hierarchy on several nodes with
            ``path="threshold"``; None otherwise).
        recorder: where the buckets' union densities are remembered (flat and by rail).
        warn: logs a warning once per key.
        compression: the compressed buckets' part (``OmniReduceState(compression=...)``; None: none).
        measure_hierarchy: the hierarchy runs and the path choice measures whether the buckets take it
            or stay flat (``path="measure"``, ``hierarchical`` left to ``auto``); otherwise, where it
            runs, every dense bucket takes it.
    """

    def __init__(self, options: Options, ways: Ways, agreement: Agreement, rule: ThresholdRule, recorder: Recorder,
                 warn: Callable[[str, str], None], *, rail_rule: ThresholdRule | None = None,
                 compression: Compression | None = None, measure_hierarchy: bool = False) -> None:
        if measure_hierarchy and (not ways.through or options.path != Mode.MEASURE):
            raise ValueError("the router measures flat and hierarchical ways with path='measure' only, where the "
                             "hierarchy runs")
        self.mode, self.threshold = options.path, options.dense_threshold
        self.ways, self.agreement, self.rule, self.rail_rule, self.warn = ways, agreement, rule, rail_rule, warn
        self.sparse = Path(ways.sparse[0])  # the way through omnireduce where nothing measured picks one
        self.hierarchical = bool(ways.through) and not measure_hierarchy  # every dense bucket takes it
        self.densities, self.rail_densities = recorder.densities, recorder.rail_densities
        self.compress = CompressionRule(options.compression, self.densities, rule.group, rule.config) \
            if options.compression is not None else None
        self.compression = compression
        self.choice = PathChoice(trials=options.measure_trials, remeasure_every=options.remeasure_every,
                                 density_of=self.densities.density_of, paths=(*ways.sparse, Way.DENSE),
                                 hierarchy=measure_hierarchy)

    def route(self, bucket: Bucket) -> Route:
        """The way of ``bucket`` at this call, and its reducer (the same on every rank)."""
        buffer = bucket.buffer
        if self.mode == Mode.MEASURE:
            self.choice.mark(bucket.iteration, buffer)  # (the first bucket of an iteration times whole steps)
        if buffer.dtype not in SUPPORTED:
            self.warn(str(buffer.dtype), f"omnireduce_hook: {buffer.dtype} buckets go through the process "
                      "group's all-reduce (omnireduce carries float32, float16 and bfloat16)")
            return self._to(DENSE)
        if self.compress is not None and self.compress(bucket):
            return self._compressed(bucket.as_compressed())
        if self.agreement.none_usable:
            return self._to(DENSE, scanned=self.mode == Mode.THRESHOLD)
        if bucket.coo:
            return Route(self.sparse, self.ways.rows, batched=True)
        path, trial = self._choose(bucket)
        if path is None:  # through the hierarchy, each rail's threshold rule on its own shard
            return self._by_rails(bucket.key)
        if self.hierarchical:
            path = path.through_hierarchy()
        return self._to(path, trial, scanned=path == DENSE and self.mode == Mode.THRESHOLD)

    def _to(self, path: Path, trial: Trial | None = None, *, scanned: bool = False) -> Route:
        """The route of ``path``: its reducer (the dense all-reduce ``scanned`` for its result's density)."""
        if path.hierarchical:
            return Route(path, self.ways.through[path.way], trial)
        return Route(path, self.ways.scanned if scanned else self.ways.flat[path.way], trial)

    def _by_rails(self, key: BucketKey) -> Route:
        path = self.sparse.through_hierarchy()
        rails, rule = self.ways.through[path.way], self.rail_rule
        if rule is None or rails.across is None or self.ways.rail_scanned is None:  # (one node: no rail step)
            return Route(path, rails)
        return Route(path, rails.through(RailRule(rule, key, self.ways.rail_scanned, rails.across)))

    def _compressed(self, bucket: Bucket) -> Route:
        """The route of a compressed bucket: its compacted blocks' way, measured with ``path="measure"``
        (under its own key), else the aggregators' or the process group's (``"omnireduce"``, ``"dense"``;
        ``"threshold"``: dense, the compacted blocks being all non-zero); ``"uncompressed"``: the whole
        bucket and its residual, dense. Through the hierarchy as the dense buckets go (``hierarchical``,
        or the span the step check chose). With no aggregator usable: the process group's, flat."""
        assert self.compression is not None
        trial: Trial | None = None
        if self.agreement.none_usable or self.mode in (Mode.DENSE, Mode.THRESHOLD):
            path = DENSE
        elif self.mode == Mode.OMNIREDUCE:
            path = self.sparse
        else:
            path, trial = self.choice.choose(bucket.key, bucket.iteration, bucket.buffer,
                                             self.densities.density_of(bucket.key), lambda: DENSE)
        if self.hierarchical and not self.agreement.none_usable:
            path = path.through_hierarchy()
        carrier = self._to(Path.of(path.way, path.hierarchical)).reducer
        reducer = self.compression.reducer(bucket, carrier, whole=path.whole)
        return Route(path, reducer, trial, carrier=carrier)

    def _whole(self, buffer: torch.Tensor) -> bool:
        """Whether every way through omnireduce would carry ``buffer`` by the dense all-reduce whole (the
        collective engine's small buckets): then there is nothing to measure, and it goes dense."""
        return all(isinstance(r := self.ways.flat.get(way), TakesWhole) and r.takes_whole(buffer)
                   for way in self.ways.sparse)

    def _choose(self, bucket: Bucket) -> tuple[Path | None, Trial | None]:
        """The path of a dense bucket (where every bucket takes the hierarchy: how its shards cross;
        None: each rail's rule), and the trial to time it by when it is being measured.

        Hierarchical and measured, the whole bucket is timed and agreed as on the flat path but
        without the drift rule (the rails' shards differ in density, and what starts a measurement
        must be the same on every rank), and a bucket waiting for its first decision follows the
        rails' threshold densities."""
        if self.mode == Mode.OMNIREDUCE:
            return self.sparse, None
        if self.mode == Mode.DENSE:
            return DENSE, None
        key = bucket.key
        if self.mode == Mode.THRESHOLD:
            if self.hierarchical:
                return None, None
            return (DENSE if self.rule(bucket.buffer, key) else self.sparse), None
        if not self.ways.through and self._whole(bucket.buffer):
            self.choice.settle(key, bucket.iteration)
            return DENSE, None
        densities = self.rail_densities if self.hierarchical else self.densities
        density = None if self.hierarchical else self.densities.density_of(key)
        return self.choice.choose(key, bucket.iteration, bucket.buffer, density,
                                  lambda: DENSE if densities.reaches(key, self.threshold) else self.sparse)
