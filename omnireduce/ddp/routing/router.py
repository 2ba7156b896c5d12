"""Which way each DDP bucket goes, and who reduces it: the whole path decision, in one place.

Every rank must send a bucket the same way, or ranks wait for each other forever; so every
decision here reads only what every rank holds bit for bit: the dtype and layout of the bucket,
the aggregators agreed on this iteration (:mod:`omnireduce.ddp.routing.agreement`), the union density of
the bucket's previous reduction (:mod:`omnireduce.ddp.densities`), the path choice's agreed
timings (:mod:`omnireduce.ddp.routing.path_choice`), or, for a host bucket seen for the first time under
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
   the buckets take it (``"hier:aggregators"``, ...) or stay flat is part of the measured, agreed
   choice, on whole steps (:mod:`omnireduce.ddp.routing.path_choice`).

Its face is two calls: :meth:`Router.route` for every bucket, in the same order on every rank, and
:meth:`Router.after_last_bucket` once an iteration's last bucket is on its way, which starts the
ranks' agreement (of the aggregators in use and the path choice's timings); the agreement is
applied at the next iteration's first bucket. A bucket whose way nothing can change this iteration
(decided, not in a step check, not due for a measurement: the plan the path choice makes at the
iteration's first bucket, :meth:`PathChoice.plan`) is routed by two dictionary lookups; the rules run
for the others.

The router holds no sockets and starts no reduction: the runtime starts the route's reducer. Any
tensor with a stable key can be routed, not only a DDP bucket (:meth:`omnireduce.ddp.bucket.Bucket.of_tensor`,
:meth:`omnireduce.ddp.runtime.Runtime.reduce_bucket`).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping
from typing import TypedDict

import torch

from omnireduce.ddp.bucket import Bucket, BucketKey
from omnireduce.ddp.options import Mode, Options, engine_name
from omnireduce.ddp.paths.compressed import Compression
from omnireduce.ddp.recorder import Recorder
from omnireduce.ddp.routing.agreement import Agreement
from omnireduce.ddp.routing.path import DENSE, Path
from omnireduce.ddp.routing.path_choice import PathChoice
from omnireduce.ddp.routing.rules import CompressionRule, RailRule, ThresholdRule
from omnireduce.ddp.routing.timing import Trial
from omnireduce.engines.hierarchical import Hierarchical
from omnireduce.engines.reducer import Reducer, TakesWhole
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
    hierarchical: bool = dataclasses.field(init=False)  # (the path's: through the hierarchy)
    compressed: bool = dataclasses.field(init=False)  # (a carrier: compressed)

    def __post_init__(self) -> None:
        object.__setattr__(self, "hierarchical", self.path.hierarchical)
        object.__setattr__(self, "compressed", self.carrier is not None)


class RouterStats(TypedDict):
    """The decision's part of ``OmniReduceState.stats()`` (:meth:`Router.stats`; plain values only)."""

    engine: str
    hierarchy: str
    paths: dict[int, dict[str, object]]
    iterations_measuring: int
    step_checks: list[dict[str, object]]


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


class Router:
    """The path decision of one bound state (see the module).

    Args:
        options: the state's options (``path``, ``dense_threshold``, ``measure_trials``, ...).
        ways: the reducers binding made.
        agreement: the per-iteration agreement (whether any aggregator is usable; it carries the path
            choice's timings), on the state's process group.
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
        self._measure = self.mode == Mode.MEASURE
        self._iteration = -1  # the iteration of the last bucket routed
        self._steady: Mapping[BucketKey, Path] = {}  # this iteration's decided buckets (PathChoice.plan)
        self._called: list[BucketKey] = []  # the buckets routed by it since (told at the next mark)
        self._forced: dict[BucketKey, Path] = {}  # a forced way's buckets (path "dense" or "omnireduce"): their path
        self._plain: dict[Path, Route] = {}  # a path's route without a trial (made once a path)
        self._whole: dict[BucketKey, bool] = {}  # flat buckets every way would carry whole (by size: never changes)

    # -- the face ------------------------------------------------------------------------------------

    def route(self, bucket: Bucket) -> Route:
        """The way of ``bucket`` at this call, and its reducer (the same on every rank)."""
        if bucket.iteration != self._iteration:
            self._begin(bucket)
        if self._steady:
            key = bucket.key
            path = self._steady.get(key)  # (never a sparse COO bucket's)
            if path is not None:
                if self._measure:
                    self._called.append(key)
                return self._to(path.through_hierarchy() if self.hierarchical else path)
        route = self._route(bucket)
        if self._steady is self._forced and not bucket.coo and route.trial is None and not route.batched \
                and route.path.way in (Way.DENSE, self.sparse.way) and bucket.buffer.dtype in SUPPORTED:
            self._forced[bucket.key] = route.path.flat
        return route

    def after_last_bucket(self, iteration: int, device: torch.device) -> None:
        """Once the last bucket of ``iteration`` is on its way: start the ranks' agreement (collective),
        which the next iteration's first bucket applies."""
        self.agreement.after_last_bucket(iteration, device, self.choice if self._measure else None)

    def stats(self) -> RouterStats:
        """The decision's part of ``OmniReduceState.stats()``: the ways (``engine``), whether dense buckets
        take the hierarchy (``hierarchy``: ``"on"``, ``"off"`` or ``"measured"``), and the path choice's
        ``paths``, ``iterations_measuring`` and ``step_checks`` (plain values only)."""
        choice = self.choice
        hierarchy = "off" if not self.ways.through else "on" if self.hierarchical else "measured"
        return {"engine": engine_name(self.ways.sparse), "hierarchy": hierarchy, "paths": choice.stats(),
                "iterations_measuring": choice.iterations_measuring, "step_checks": choice.check_stats()}

    # -- behind it -----------------------------------------------------------------------------------

    def _begin(self, bucket: Bucket) -> None:
        """The first bucket of an iteration: the last iteration's agreement applied (the same bucket on
        every rank), then the path choice's start of the iteration."""
        self._iteration = bucket.iteration
        self.agreement.at_bucket(bucket.iteration, self.choice if self._measure else None)
        if self._measure:  # (the first bucket of an iteration times whole steps; the plan: the decided buckets')
            called, self._called = self._called, []
            self.choice.mark(bucket.iteration, bucket.buffer, called)
            if self.compress is None and not self.agreement.none_usable:
                self._steady = self.choice.plan(bucket.iteration)
                return
        elif self.mode in (Mode.DENSE, Mode.OMNIREDUCE) and self.compress is None and not self.agreement.none_usable:
            self._steady = self._forced  # (a forced way: each bucket's route found once, kept while all is usable)
            return
        self._steady = {}

    def _route(self, bucket: Bucket) -> Route:
        """:meth:`route` by the rules, in the module's order."""
        buffer = bucket.buffer
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
        if trial is None and not scanned:
            route = self._plain.get(path)
            if route is None:
                route = self._plain[path] = self._made(path, None, False)
            return route
        return self._made(path, trial, scanned)

    def _made(self, path: Path, trial: Trial | None, scanned: bool) -> Route:
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

    def _taken_whole(self, key: BucketKey, buffer: torch.Tensor) -> bool:
        """Whether every way through omnireduce would carry ``buffer`` by the dense all-reduce whole (the
        collective engine's small buckets): then there is nothing to measure, and it goes dense. Asked
        once a bucket (its size and dtype decide)."""
        whole = self._whole.get(key)
        if whole is None:
            whole = self._whole[key] = all(isinstance(r := self.ways.flat.get(way), TakesWhole) and
                                           r.takes_whole(buffer) for way in self.ways.sparse)
        return whole

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
        if not self.ways.through and self._taken_whole(key, bucket.buffer):
            self.choice.settle(key, bucket.iteration)
            return DENSE, None
        densities = self.rail_densities if self.hierarchical else self.densities
        density = None if self.hierarchical else self.densities.density_of(key)
        return self.choice.choose(key, bucket.iteration, bucket.buffer, density,
                                  lambda: DENSE if densities.reaches(key, self.threshold) else self.sparse)
