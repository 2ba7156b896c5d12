"""The hierarchy as a :class:`~omnireduce.engines.reducer.Reducer`: in the node, across the nodes by rail
through another reducer, in the node again (:class:`omnireduce.engines.hierarchy.Hierarchy`).

:class:`Hierarchical` runs a tensor through the hierarchy's three steps, its shard crossing the nodes
through ``across``, a reducer on this rank's rail (the aggregators, the collective engine or the
rail's dense all-reduce, or one that picks between them per shard). Shards are cut at the tensor's
block size, so that no block straddles two shards. A sparse COO table of rows (``R x D``) takes the
same steps by rows (:meth:`Hierarchy.reduce_rows`); any other sparse tensor goes ``flat``.

Its info is the rail's reduction's (the bytes this rank sent towards other nodes; what it moved
inside the node is the hierarchy's ``bytes_in_node``); on one node there is no rail step, and the
info says dense with no bytes.

``prepare``: called on the caller's thread when a tensor is handed over; what it returns runs on the
hierarchy's step thread just before the tensor's rail reduction (the DDP hook makes the rail's
worker take the aggregators agreed on at that tensor, the same one on every member of the rail).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from omnireduce.engines.hierarchy import Hierarchy
from omnireduce.engines.reducer import Reducer, Reduction, ReductionInfo

Prepare = Callable[[], Callable[[], None] | None]


class Hierarchical:
    """A tensor through the hierarchy, its shard across the rail by ``across`` (None: one node, no
    rail step); see the module. Closes nothing: the hierarchy and the rail's reducers are the caller's."""

    def __init__(self, hierarchy: Hierarchy, across: Reducer | None, flat: Reducer | None = None,
                 prepare: Prepare | None = None) -> None:
        self.hierarchy, self.across, self.flat, self.prepare = hierarchy, across, flat, prepare
        self.world_size = hierarchy.topology.world_size

    def through(self, across: Reducer | None) -> Hierarchical:
        """The same hierarchy with another rail reducer."""
        return Hierarchical(self.hierarchy, across, self.flat, self.prepare)

    def allreduce_async(self, tensor: torch.Tensor, *, average: bool, block_size: int | None = None) -> Reduction:
        sparse = tensor.layout != torch.strided
        if sparse and tensor.dim() != 2 and self.flat is not None:
            return self.flat.allreduce_async(tensor, average=average, block_size=block_size)
        before = self.prepare() if self.prepare is not None else None
        rails: list[Reduction] = []
        across = self.across

        def cross(shard: torch.Tensor) -> Any:
            if across is None:
                return None
            if before is not None:
                before()
            rail = across.allreduce_async(shard, average=False, block_size=None if sparse else block_size)
            rails.append(rail)
            return rail

        divisor = self.world_size if average else 1
        if sparse:
            steps = self.hierarchy.reduce_rows(tensor, cross, divisor=divisor)
        else:
            steps = self.hierarchy.reduce(tensor, cross, divisor=divisor, align=block_size or 1)
        out = Reduction(tensor if not sparse else None)

        def done(f: torch.futures.Future[Any]) -> None:
            try:
                result = f.value()
                out.complete(result, rails[0].info if rails else ReductionInfo(dense=True))
            except BaseException as e:
                out.fail(e)

        steps.add_done_callback(done)
        return out
