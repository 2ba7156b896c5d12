"""Which way each DDP bucket goes: the whole path decision, in one place.

Every rank must send a bucket the same way, or ranks wait for each other forever; so every
decision here reads only what every rank holds bit for bit: the dtype and layout of the bucket,
the aggregators agreed on this iteration (:mod:`omnireduce.ddp.agreement`), the union density of
the bucket's previous reduction (:mod:`omnireduce.ddp.densities`), the path choice's agreed
timings (:mod:`omnireduce.ddp.path_choice`), or, for a host bucket seen for the first time under
the threshold rule, one number all-reduced (:meth:`ThresholdRule.probe`). :meth:`Router.route`
returns a :class:`Route`, in this order:

1. ``coo``: a sparse COO gradient omnireduce carries (float32/16, bf16), while some aggregator is
   usable: batched over the backward pass (:mod:`omnireduce.ddp.paths.coo`).
2. ``compressed`` (``OmniReduceState(compression=...)``, :class:`CompressionRule`): the bucket's
   compacted top-k blocks take one of the ways below (through the hierarchy where the dense buckets
   take it), measured under a key of their own.
3. ``dense``: a dtype omnireduce does not carry (a warning once), or no aggregator usable.
4. ``hierarchical``: the hierarchy runs for every dense bucket (``hierarchical=True``, or left to
   ``auto`` with a ``path`` other than ``"measure"``); the route says how the shards cross the nodes
   (None: each rail's threshold rule, on its own shard).
5. the state's ``path``: ``"measure"`` (the path choice: timed, agreed, checked on whole steps),
   ``"threshold"`` (the union density against ``dense_threshold``), or forced. Measured where the
   hierarchy runs and ``hierarchical`` was left to ``auto`` (``layouts``), whether the buckets take
   the hierarchy (``"hier:omnireduce"``, ...) or stay flat is part of the measured, agreed choice,
   on whole steps (:mod:`omnireduce.ddp.path_choice`).

The router holds no sockets and starts no reduction; the hook hands the route to its path.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from omnireduce.compression import BlockTopK
from omnireduce.config import WorkerConfig
from omnireduce.ddp.agreement import Agreement
from omnireduce.ddp.bucket import Bucket, BucketKey
from omnireduce.ddp.densities import Densities, as_float, union_density
from omnireduce.ddp.options import DENSE, MEASURE, OMNIREDUCE, THRESHOLD, Options
from omnireduce.ddp.path_choice import PathChoice, Trial, split
from omnireduce.ddp.recorder import Recorder

log = logging.getLogger("omnireduce.ddp")

SUPPORTED = (torch.float32, torch.float16, torch.bfloat16)  # the dtypes omnireduce carries
COO, HIERARCHICAL = "coo", "hierarchical"


@dataclasses.dataclass(frozen=True)
class Route:
    """Where a bucket goes: ``way`` (``"coo"``, ``"dense"``, ``"omnireduce"``: the aggregators,
    ``"collective"``: the collective engine, ``"hierarchical"``), how a hierarchical bucket's shards
    cross the nodes (``rail``; None: each rail's rule), the trial that times it when it is being
    measured, whether a dense bucket's result is scanned for its union density (``measure``), and
    whether the bucket goes compressed (``compressed``: its compacted blocks take ``way``, or
    through the hierarchy ``rail``; ``"uncompressed"``: the whole bucket and its residual, dense)."""

    way: str
    rail: str | None = None
    trial: Trial | None = None
    measure: bool = False
    compressed: bool = False


class CompressionRule:
    """Which buckets go compressed (``OmniReduceState(compression=BlockTopK(...))``): none while
    warming up (the first ``warmup_steps`` iterations), none under ``min_numel`` values; and a
    bucket whose union density (blocks non-zero on some rank: the same number on every rank) was at
    most ``exact_below`` when its compression would start stays exact from then on: omnireduce
    sends it whole at that density. A bucket whose union density is not known then (it went dense
    throughout) is probed once on the host: the ranks all-reduce (SUM) their local densities, at
    least the union's; a CUDA bucket is not probed (it would wait for the device) and goes compressed.
    Reads only what every rank holds."""

    def __init__(self, options: BlockTopK, densities: Densities, group: Any, layout: WorkerConfig) -> None:
        self.options, self.densities, self.group, self.layout = options, densities, group, layout
        self._exact: dict[BucketKey, bool] = {}

    def _density(self, bucket: Bucket) -> float | None:
        density = self.densities.density_of(bucket.key)
        if density is not None or bucket.buffer.is_cuda:
            return density
        total = torch.tensor([as_float(union_density(bucket.buffer, self.layout))], dtype=torch.float64)
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

    def __init__(self, densities: Densities, threshold: float, group: Any, layout: WorkerConfig,
                 recorder: Recorder) -> None:
        self.densities, self.threshold, self.group = densities, threshold, group
        self.layout, self.recorder = layout, recorder

    def __call__(self, buffer: torch.Tensor, key: BucketKey) -> bool:
        """Whether the bucket ``key`` goes dense."""
        return self.densities.reaches(key, self.threshold) or self.probe(buffer, key)

    def probe(self, buffer: torch.Tensor, key: BucketKey) -> bool:
        if buffer.is_cuda or not self.densities.first_sight(key):
            return False
        largest = torch.tensor([as_float(union_density(buffer, self.layout))], dtype=torch.float64)
        dist.all_reduce(largest, op=dist.ReduceOp.MAX, group=self.group)
        self.recorder.count(buckets_probed=1)
        return float(largest[0]) >= self.threshold


class Router:
    """The path decision of one bound state (see the module).

    Args:
        options: the state's options (``path``, ``dense_threshold``, ``measure_trials``, ...).
        sparse_paths: the ways through omnireduce this job's buckets may take (``"omnireduce"``,
            ``"collective"``, or both, measured); the first is taken where nothing is measured.
        agreement: the per-iteration agreement (whether any aggregator is usable).
        rule: the flat threshold rule.
        hierarchical: whether every dense bucket takes the hierarchy; ``rail_densities``: its rails' densities.
        warn: logs a warning once per key.
        layouts: the hierarchy runs, and the path choice measures whether the buckets take it or stay
            flat (``path="measure"``; ``hierarchical`` then False).
    """

    def __init__(self, options: Options, sparse_paths: tuple[str, ...], agreement: Agreement, rule: ThresholdRule,
                 hierarchical: bool, rail_densities: Densities | None, warn: Callable[[str, str], None],
                 layouts: bool = False) -> None:
        if layouts and (hierarchical or options.path != MEASURE):
            raise ValueError("the router measures flat and hierarchical ways with path='measure' only, and then "
                             "does not send every bucket through the hierarchy")
        self.path, self.threshold = options.path, options.dense_threshold
        self.sparse_paths, self.agreement, self.rule = sparse_paths, agreement, rule
        self.hierarchical, self.rail_densities, self.warn = hierarchical, rail_densities, warn
        self.layouts = layouts
        self.densities = rule.densities
        self.compress = CompressionRule(options.compression, self.densities, rule.group, rule.layout) \
            if options.compression else None
        self.choice = PathChoice(trials=options.measure_trials, remeasure_every=options.remeasure_every,
                                 density_of=self.densities.density_of, paths=(*sparse_paths, DENSE), layouts=layouts)

    def route(self, bucket: Bucket) -> Route:
        """The way of ``bucket`` at this call (the same on every rank)."""
        buffer = bucket.buffer
        if self.path == MEASURE:
            self.choice.mark(bucket.iteration, buffer)  # (the first bucket of an iteration times whole steps)
        if buffer.dtype not in SUPPORTED:
            self.warn(str(buffer.dtype), f"omnireduce_hook: {buffer.dtype} buckets go through the process "
                      "group's all-reduce (omnireduce carries float32, float16 and bfloat16)")
            return Route(DENSE)
        if self.compress is not None and self.compress(bucket):
            return self._compressed(bucket.as_compressed())
        if self.agreement.none_usable:
            return Route(DENSE, measure=self.path == THRESHOLD)
        if bucket.coo:
            return Route(COO)
        way, trial = self._choose(bucket)
        if self.layouts:
            assert way is not None
            through, way = split(way)
            if through:
                return Route(HIERARCHICAL, rail=way, trial=trial)
            return Route(way, trial=trial)
        if self.hierarchical:
            return Route(HIERARCHICAL, rail=way, trial=trial)
        assert way is not None
        return Route(way, trial=trial, measure=way == DENSE and self.path == THRESHOLD)

    def _compressed(self, bucket: Bucket) -> Route:
        """The way of a compressed bucket's compacted blocks: measured with ``path="measure"`` (under
        its own key), else the aggregators' or the process group's (``"omnireduce"``, ``"dense"``;
        ``"threshold"``: dense, the compacted blocks being all non-zero). Through the hierarchy as the
        dense buckets go (``hierarchical``, or the layout the step check chose): the way then says how
        the payload's shards cross the nodes. With no aggregator usable: the process group's, flat."""
        if self.agreement.none_usable:
            return Route(DENSE, compressed=True)
        trial: Trial | None = None
        if self.path in (DENSE, THRESHOLD):
            way = DENSE
        elif self.path == OMNIREDUCE:
            way = self.sparse_paths[0]
        else:
            way, trial = self.choice.choose(bucket.key, bucket.iteration, bucket.buffer,
                                            self.densities.density_of(bucket.key), lambda: DENSE)
        through, way = split(way)
        if through or self.hierarchical:
            return Route(HIERARCHICAL, rail=way, trial=trial, compressed=True)
        return Route(way, trial=trial, compressed=True)

    def _choose(self, bucket: Bucket) -> tuple[str | None, Trial | None]:
        """The way of a dense bucket (hierarchical: how its shards cross; None: each rail's rule),
        and the trial to time it by when it is being measured.

        Hierarchical and measured, the whole bucket is timed and agreed as on the flat path but
        without the drift rule (the rails' shards differ in density, and what starts a measurement
        must be the same on every rank), and a bucket waiting for its first decision follows the
        rails' threshold densities."""
        sparse = self.sparse_paths[0]  # the way through omnireduce where no measurement picks one
        if self.path in (OMNIREDUCE, DENSE):
            return (sparse if self.path == OMNIREDUCE else DENSE), None
        key = bucket.key
        if self.path == THRESHOLD:
            if self.hierarchical:
                return None, None
            return (DENSE if self.rule(bucket.buffer, key) else sparse), None
        densities = self.rail_densities if self.hierarchical and self.rail_densities is not None else self.densities
        density = None if self.hierarchical else self.densities.density_of(key)
        return self.choice.choose(key, bucket.iteration, bucket.buffer, density,
                                  lambda: DENSE if densities.reaches(key, self.threshold) else sparse)
