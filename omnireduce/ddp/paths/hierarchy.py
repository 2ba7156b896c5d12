"""The hierarchical path: a bucket summed inside the node, reduced across nodes by rail (omnireduce, or
the rail's dense all-reduce), shared inside the node (:mod:`omnireduce.engines.hierarchy`).

Design. :class:`HierarchicalPath` is made when the state binds, where the hierarchy should run
(:mod:`omnireduce.ddp.binding`); it holds the :class:`~omnireduce.engines.hierarchy.Hierarchy` (the node and
rail groups and the step threads) and, with the aggregators, a second :class:`omnireduce.Worker`:
this rank's member of its rail's omnireduce job (``JOB.railI``: one rank per node, the node's index
as its rank), at the same aggregators as the flat worker, listed from the ``i``-th on so that the
rails' first slots (all of a shard smaller than a slot) land on different aggregators. With the
collective engine the rail's members sum each other's blocks through a group of the rail's own.

Decisions. How the shards cross is the router's (:mod:`omnireduce.ddp.router`): the way given with
the bucket, or, with the threshold rule, each rail's own ``rule`` on its shard's union density
(identical on every member of the rail), called on the step thread that starts the rail's
reduction, which takes the buckets in DDP's order on every rank.

Aggregators in use. The flat path agrees once per iteration on the aggregators every rank reaches
(:mod:`omnireduce.ddp.agreement`); the rail worker takes the same set, applied on the step thread
before the bucket's rail reduction, so that it changes at the same tensor on every member of the rail.

Bytes. ``bytes_in_node`` counts what this rank sends inside its node (the reduce-scatter and
all-gather); its rail reductions count in ``bytes_sent`` like the flat path's, which is what the rank
sends towards other nodes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from omnireduce.config import WorkerConfig
from omnireduce.ddp.bucket import Bucket, BucketKey
from omnireduce.ddp.densities import Densities, union_density
from omnireduce.ddp.options import COLLECTIVE, DENSE
from omnireduce.ddp.recorder import Recorder, ring_bytes
from omnireduce.engines.hierarchy import After, Hierarchy

Rule = Callable[[torch.Tensor, BucketKey], bool]  # the rail's threshold rule: does this shard go dense?


class HierarchicalPath:
    """This rank's part of the hierarchy for one state (see the module).

    Args:
        hierarchy: the node and rail groups and the step threads.
        worker: this rank's rail worker (None: one node, or the collective engine sums the rails).
        engine: this rank's rail's collective engine (None: the aggregators).
        offset: where the rail worker's list of aggregators starts in the flat worker's.
        recorder: where the rails report.
        layout: the blocks' layout (to count a dense shard's union density with the threshold rule).
        sparse_path: the way through omnireduce a shard takes when the rule keeps it sparse.
        rule: the rail's threshold rule (None: no threshold rule; the router always gives the way).
        densities: the rail's shards' union densities (read by ``rule``).
    """

    def __init__(self, hierarchy: Hierarchy, worker: Any, engine: Any, offset: int, recorder: Recorder,
                 layout: WorkerConfig, sparse_path: str, rule: Rule | None, densities: Densities) -> None:
        self.hierarchy, self.topology = hierarchy, hierarchy.topology
        self.world_size = self.topology.world_size
        self.worker, self.engine, self.offset = worker, engine, offset
        self.recorder, self.layout, self.sparse_path = recorder, layout, sparse_path
        self.rule, self.densities = rule, densities
        self.nodes = len(self.topology.nodes)
        self._usable: tuple[int, ...] | None = None  # the aggregators the rail worker was last told to use

    def close(self) -> None:
        self.hierarchy.close()
        for part in (self.engine, self.worker):
            if part is not None:
                part.close()

    def reduce(self, bucket: Bucket, usable: tuple[int, ...] | None,
               way: str | None) -> torch.futures.Future[torch.Tensor]:
        """Average the bucket over every rank through the three steps; ``usable``: the aggregators
        agreed on (None: unchanged); ``way``: how the shards cross the nodes (None: the rail's rule).
        Shards are cut at the bucket's block size."""

        def cross(shard: torch.Tensor) -> Any:
            return self._cross(shard, bucket.key, usable, bucket.block_size, way)

        fut = self.hierarchy.reduce(bucket.buffer, cross, divisor=self.world_size, align=bucket.block_size)

        def counted(f: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
            try:
                result = f.value()
            except BaseException as e:
                raise self.recorder.failure(e, bucket.iteration, bucket.index) from e
            self.recorder.count(dense_equivalent_bytes=ring_bytes(bucket.dense_nbytes, self.world_size))
            return result

        return fut.then(counted)

    def _cross(self, shard: torch.Tensor, key: BucketKey, usable: tuple[int, ...] | None, block: int,
               way: str | None) -> Any:
        """Step 2 for one bucket (on the step thread, in DDP's order): this rail's reduction of the shard."""
        if self.nodes == 1:
            self.recorder.count(buckets_dense=1)
            return None
        self._use(usable)
        if way is None:
            way = DENSE if self.rule is not None and self.rule(shard, key) else self.sparse_path
        if way == DENSE:
            return self._dense(shard, key)
        if way == COLLECTIVE and self.engine is not None:  # the rail's members sum each other's blocks
            reduction: Any = self.engine.allreduce_async(shard, block_size=block)
        else:
            reduction = self.worker.allreduce_async(shard, block_size=block)

        def recorded() -> None:
            info = reduction.info
            total = info["blocks_total"]
            self.densities.remember(key, info["blocks_union"] / total if total else 0.0)
            self.recorder.count(buckets_sparse=1, bytes_sent=info["bytes_sent"], bytes_received=info["bytes_received"])

        return After(reduction, recorded)

    def _dense(self, shard: torch.Tensor, key: BucketKey) -> Any:
        work = dist.all_reduce(shard, group=self.hierarchy.rail_group, async_op=True)
        ring = ring_bytes(shard.numel() * shard.element_size(), self.nodes)

        def measured() -> None:
            if self.rule is not None:  # (only the threshold rule reads it: otherwise no scan)
                self.densities.remember(key, union_density(shard, self.layout))
            self.recorder.count(buckets_dense=1, bytes_sent=ring, bytes_received=ring)

        return After(work, measured)

    def _use(self, usable: tuple[int, ...] | None) -> None:
        """The rail worker takes the aggregators agreed on, shifted by its offset."""
        if self.worker is not None and usable is not None and usable != self._usable:
            self._usable = usable
            count = len(self.worker.config.aggregators)
            self.worker.use_aggregators([(u - self.offset) % count for u in usable])

    def reduce_rows(self, stacked: torch.Tensor, first: Bucket) -> torch.futures.Future[tuple[torch.Tensor, int, int]]:
        """Average the rows of a sparse COO gradient (a batch of them stacked) over every rank: the
        node's rows gathered and split over the rails, each rail's reduced across the nodes (rows as
        blocks), the results gathered in the node. Bytes are counted by the rails."""

        def cross(rail: torch.Tensor) -> Any:
            if self.nodes == 1:
                return None
            reducer = self.engine if self.worker is None else self.worker
            reduction = reducer.allreduce_async(rail)

            def recorded() -> None:
                info = reduction.info
                self.recorder.count(bytes_sent=info["bytes_sent"], bytes_received=info["bytes_received"])

            return After(reduction, recorded)

        fut = self.hierarchy.reduce_rows(stacked, cross, divisor=self.world_size)

        def checked(f: torch.futures.Future[torch.Tensor]) -> tuple[torch.Tensor, int, int]:
            try:
                return f.value(), 0, 0
            except BaseException as e:
                raise self.recorder.failure(e, first.iteration, first.index) from e

        return fut.then(checked)

    def stats(self) -> dict[str, Any]:
        engine = self.engine
        return {"bytes_in_node": self.hierarchy.bytes_in_node, "rail_density": self.densities.latest(),
                "rail_collective_reductions": engine.stats()["reductions"] if engine is not None else 0}
