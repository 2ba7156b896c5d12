"""The rules that route a bucket without timing it: compression's, the union-density threshold's, and
the rails' under that threshold.

Each reads only what every rank holds bit for bit (a bucket's previous union density, its size,
the iteration) or, the first time a host bucket is seen, one number the ranks all-reduce, so every
rank decides the same; the router (:mod:`omnireduce.ddp.routing.router`) asks them in its order.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from omnireduce.compression import BlockTopK
from omnireduce.config import WorkerConfig
from omnireduce.ddp.bucket import Bucket, BucketKey
from omnireduce.ddp.densities import Densities
from omnireduce.ddp.recorder import Recorder
from omnireduce.engines.dense import as_float, union_density
from omnireduce.engines.reducer import Reducer, Reduction

log = logging.getLogger("omnireduce.ddp")


class CompressionRule:
    """Which buckets go compressed (``OmniReduceState(compression=BlockTopK(...))``): none while
    warming up (the first ``warmup_steps`` iterations), none under ``min_numel`` values; and a
    bucket whose union density (blocks non-zero on some rank: the same number on every rank) was at
    most ``exact_below`` when its compression would start stays exact from then on: omnireduce
    sends it whole at that density. A bucket whose union density is not known then (it went dense
    throughout) is probed once on the host: the ranks all-reduce (SUM) their local densities, at
    least the union's; a CUDA bucket is not probed (it would wait for the device) and goes compressed.
    Reads only what every rank holds."""

    def __init__(self, options: BlockTopK, densities: Densities, group: dist.ProcessGroup | None,
                 config: WorkerConfig) -> None:
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

    def __init__(self, densities: Densities, threshold: float, group: dist.ProcessGroup | None, config: WorkerConfig,
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
