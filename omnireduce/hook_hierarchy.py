"""The DDP hook's hierarchical path: a dense bucket summed inside the node, reduced across nodes by
rail (omnireduce, or the rail's dense all-reduce), shared inside the node (:mod:`omnireduce.hierarchy`).

Design. :class:`HierarchicalPath` is made when the state binds, where :func:`omnireduce.hierarchy.wanted`
says the hierarchy should run (``OmniReduceState(hierarchical=...)``, ``$OMNIREDUCE_HIERARCHICAL``);
it holds the :class:`~omnireduce.hierarchy.Hierarchy` (the node and rail groups and the step threads)
and a second :class:`omnireduce.Worker`, this rank's member of its rail's omnireduce job
(``JOB.railI``: one rank per node, the node's index as its rank), at the same aggregators as the
flat worker: every node's colocated aggregators serve every rail, rail ``i`` listing them from the
``i``-th on, so that the rails' first slots (all of a shard smaller than a slot) land on different
aggregators.

Decisions. Each rail reduces its shard of the node's sum, through omnireduce or the rail's dense
all-reduce. With ``OmniReduceState(path="measure")`` (the default) the hook picks the way on the
training thread, for the whole bucket, every rank the same, as on the flat path: the bucket is
timed from the hook's call to its future's completion both ways, and the ranks agree on the
slowest rank's medians (the steps inside the node cost the same either way, so the difference is
the rails'); a forced path is taken as it is. With ``path="threshold"`` each rail decides alone,
from information every member of the rail holds bit for bit: the union density of the same
shard's previous reduction (the reduced shard is identical on every member). A shard seen for the
first time on the host is probed (the members' largest local density, MAX over the rail).
Different rails may then decide differently: their shards are independent. Those decisions and
probes run on the step thread that starts the rail's reduction, which takes the buckets in DDP's
order on every rank.

Aggregators in use. The flat path agrees once per iteration on the aggregators every rank reaches
(:mod:`omnireduce.membership`); the rail worker takes the same set, at the first bucket of the next
iteration as the flat worker does, applied on the step thread before that bucket's rail reduction,
so that it changes at the same tensor on every member of the rail.

Engine. With ``OmniReduceState(engine="collective")`` a rail's host shards are summed by the rail's
members themselves through a process group of the rail's own (:mod:`omnireduce.collective`), not
by the aggregators, sparse rows as well as dense shards. With ``engine="auto"`` measuring on Gloo,
the rail's engine is one of the paths a bucket's shards are timed on (sparse rows keep to the
aggregators).

Bytes. ``stats()["bytes_in_node"]`` counts what this rank sends inside its node (the reduce-scatter
and all-gather, at a ring's ``(L-1)/L`` of the buffer each); its rail reductions count in
``bytes_sent`` like the flat path's (omnireduce's bytes, or a ring all-reduce of the shard over the
rail), which is what the rank sends towards other nodes: ``stats()["bytes_across_nodes"]``.
"""

from __future__ import annotations

import datetime
import logging
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from omnireduce.collective import CollectiveEngine
from omnireduce.hierarchy import After, Hierarchy, Topology, discover, wanted
from omnireduce.hook_counters import ring_bytes
from omnireduce.hook_decisions import BucketDecisions, BucketKey, as_float, union_density
from omnireduce.hook_paths import bucket_block_size, failure
from omnireduce.path_choice import COLLECTIVE, DENSE
from omnireduce.worker import Worker

if TYPE_CHECKING:
    from omnireduce.hook_state import OmniReduceState

log = logging.getLogger("omnireduce.ddp")


class HierarchicalPath:
    """This rank's part of the hierarchy for one :class:`~omnireduce.ddp.OmniReduceState` (see the module)."""

    def __init__(self, state: OmniReduceState, topology: Topology, group: Any) -> None:
        self.topology = topology
        self.world_size = topology.world_size
        timeout = float(state.worker.config.timeout)
        self.hierarchy = Hierarchy(topology, backend=str(dist.get_backend(group)), timeout=timeout)
        cfg = state.worker.config
        # Rail i lists the aggregators from the i-th on: slot s of its tensors goes to aggregator
        # (s + i) mod A, so that the rails' first slots (all of a small shard) spread over them.
        self.offset = topology.local_rank % len(cfg.aggregators)
        addresses = list(cfg.aggregators[self.offset:]) + list(cfg.aggregators[:self.offset])
        self.worker = None if len(topology.nodes) == 1 else Worker(  # (one node: no step 2)
            addresses, rank=topology.node, world_size=len(topology.nodes), job=f"{state.job}.rail{topology.local_rank}",
            block_size=cfg.block_size, timeout=timeout, token=cfg.token, lanes=cfg.lanes, slots=cfg.slots,
            threshold=cfg.threshold)
        self.engine = self._rail_engine(state, topology, group, timeout)
        self.decisions = BucketDecisions()
        self._usable: tuple[int, ...] | None = None  # the aggregators the rail worker was last told to use

    @staticmethod
    def _rail_engine(state: OmniReduceState, topology: Topology, group: Any, timeout: float
                     ) -> CollectiveEngine | None:
        """Where the state's buckets may take the collective engine (``engine="collective"``, or
        measured with ``"auto"``) and there are several nodes: this rank's rail's collective engine,
        on a group of its own (every rank makes every rail's group, in the same order)."""
        if COLLECTIVE not in state._sparse_paths or len(topology.nodes) == 1:
            return None
        limit = datetime.timedelta(seconds=timeout)
        backend = str(dist.get_backend(group))
        mine = None
        for i in range(topology.local_size):
            g = dist.new_group(list(topology.rail(i)), timeout=limit, backend=backend)
            if i == topology.local_rank:
                mine = g
        cfg = state.worker.config
        return CollectiveEngine(mine, cfg.block_size, cfg.lanes, cfg.slots, cfg.threshold)

    def close(self) -> None:
        self.hierarchy.close()
        if self.engine is not None:
            self.engine.close()
        if self.worker is not None:
            self.worker.close()

    @property
    def bytes_in_node(self) -> int:
        return self.hierarchy.bytes_in_node

    def reduce(self, state: OmniReduceState, bucket: dist.GradBucket, buffer: torch.Tensor, key: BucketKey,
               iteration: int, usable: tuple[int, ...] | None,
               path: str | None = None) -> torch.futures.Future[torch.Tensor]:
        """Average ``buffer`` over every rank through the three steps; ``usable``: the aggregators
        agreed on for this bucket (None: unchanged); ``path``: how the shards cross the nodes
        (``"omnireduce"`` or ``"dense"``; None: each rail's threshold rule). Shards are cut at the
        bucket's block size (aligned to its largest table's rows with ``state.align_blocks``)."""
        nbytes = buffer.numel() * buffer.element_size()
        block = bucket_block_size(state, bucket) or state.worker.config.block_size

        def cross(shard: torch.Tensor) -> Any:
            return self._cross(state, shard, key, usable, block, path)

        fut = self.hierarchy.reduce(buffer, cross, divisor=self.world_size, align=block)

        def counted(f: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
            try:
                result = f.value()
            except BaseException as e:
                raise failure(state, e, iteration, key[0]) from e
            state._counters.add(dense_equivalent_bytes=ring_bytes(nbytes, self.world_size))
            return result

        return fut.then(counted)

    def _cross(self, state: OmniReduceState, shard: torch.Tensor, key: BucketKey,
               usable: tuple[int, ...] | None, block: int, path: str | None) -> Any:
        """Step 2 for one bucket (on the step thread, in DDP's order): this rail's reduction of the
        shard, by ``path`` or (None) the rail's decision (none on one node)."""
        if self.worker is None:
            state._counters.add(buckets_dense=1)
            return None
        if usable is not None and usable != self._usable:
            self._usable = usable
            count = len(self.worker.config.aggregators)
            self.worker.use_aggregators([(u - self.offset) % count for u in usable])
        nbytes = shard.numel() * shard.element_size()
        members = len(self.topology.nodes)
        if path is None:  # (the threshold rule of this rail)
            path = DENSE if self._goes_dense(state, shard, key) else state._sparse_paths[0]
        if path == DENSE:
            work = dist.all_reduce(shard, group=self.hierarchy.rail_group, async_op=True)

            def measured() -> None:
                if state.path == "threshold":  # (only the threshold rule reads it: otherwise no scan)
                    self.decisions.remember(key, union_density(shard, state.worker.config))
                ring = ring_bytes(nbytes, members)
                state._counters.add(buckets_dense=1, bytes_sent=ring, bytes_received=ring)

            return After(work, measured)
        if path == COLLECTIVE and self.engine is not None:  # the rail's members sum each other's blocks
            reduction: Any = self.engine.allreduce_async(shard, block_size=block)
        else:
            reduction = self.worker.allreduce_async(shard, block_size=block)

        def recorded() -> None:
            info = reduction.info
            total = info["blocks_total"]
            self.decisions.remember(key, info["blocks_union"] / total if total else 0.0)
            state._counters.add(buckets_sparse=1, bytes_sent=info["bytes_sent"],
                                bytes_received=info["bytes_received"])

        return After(reduction, recorded)

    def reduce_rows(self, state: OmniReduceState, x: torch.Tensor, iteration: int,
                    index: int) -> torch.futures.Future[torch.Tensor]:
        """Average the rows of a sparse COO gradient (the state's batch of them stacked) over every
        rank through the hierarchy: the node's rows gathered and split over the rails, each rail's
        reduced across the nodes by omnireduce (rows as blocks), the results gathered in the node.
        Its future's value is a new coalesced COO tensor."""

        def cross(rail: torch.Tensor) -> Any:
            if self.worker is None:
                return None
            # (the rail's members sum each other's rows with engine="collective", else the aggregators do)
            engine = self.engine if state.engine == "collective" else None
            reduction = engine.allreduce_async(rail) if engine is not None else self.worker.allreduce_async(rail)

            def recorded() -> None:
                info = reduction.info
                state._counters.add(bytes_sent=info["bytes_sent"], bytes_received=info["bytes_received"])

            return After(reduction, recorded)

        fut = self.hierarchy.reduce_rows(x, cross, divisor=self.world_size)

        def checked(f: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
            try:
                return f.value()
            except BaseException as e:
                raise failure(state, e, iteration, index) from e

        return fut.then(checked)

    def _goes_dense(self, state: OmniReduceState, shard: torch.Tensor, key: BucketKey) -> bool:
        if not state.dense_fallback:
            return False
        if self.decisions.reaches(key, state.dense_threshold):
            return True
        if shard.is_cuda or not self.decisions.first_sight(key):
            return False
        largest = torch.tensor([as_float(union_density(shard, state.worker.config))], dtype=torch.float64)
        dist.all_reduce(largest, op=dist.ReduceOp.MAX, group=self.hierarchy.rail_group)
        state._counters.add(buckets_probed=1)
        return float(largest[0]) >= state.dense_threshold

    def stats(self) -> dict[str, Any]:
        engine = self.engine
        return {"bytes_in_node": self.bytes_in_node, "rail_density": self.decisions.latest(),
                "rail_collective_reductions": engine.stats()["reductions"] if engine is not None else 0}


def bind(state: OmniReduceState, group: Any, setting: bool | None) -> HierarchicalPath | None:
    """The hierarchical path for a state binding now (collective over the whole default group),
    or None where :func:`omnireduce.hierarchy.wanted` says the flat path is used (logged once, with
    the reason)."""
    if setting is False:
        return None
    topology = discover(group)
    on, why = wanted(setting, topology, group)
    if not on:
        (log.warning if setting else log.info)("omnireduce: not hierarchical: %s", why)
        return None
    log.info("omnireduce: hierarchical: %s", why)
    return HierarchicalPath(state, topology, group)
