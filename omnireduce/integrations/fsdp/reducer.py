"""The one seam between the FSDP hook and the ways a tensor crosses the replicas.

The hook (:mod:`omnireduce.integrations.fsdp.hook`) hands every reduce-scatter output to a
:class:`ReplicaReducer` and waits for the future it returns; nothing else of the integration
knows how the tensor travels. The interface:

``reduce(tensor, key, *, average, block_size) -> torch.futures.Future[torch.Tensor]``
    ``tensor``: one FSDP unit's reduce-scatter output (1-D, contiguous, FSDP's reduce dtype, on its
    device), reduced in place across the replicas (summed; times ``1/R`` when ``average``); the
    future completes with it. On CUDA the future is CUDA-aware and completes on the stream that
    wrote the result, so the waiter's stream waits on the device. ``key``: the unit's index, the
    same on every rank and every step (the way is decided per key). ``block_size``: the blocks'
    size for this tensor (the same on every rank). Called on every rank in the same order (FSDP's
    post-backward order), one reduction at a time. Each reduction is reported to the
    :class:`~omnireduce.integrations.fsdp.recorder.Recorder` the reducer was made with.
``close()``
    Let go of threads and groups once the reductions asked for are done (idempotent).

:class:`EngineOrDense` is the reducer made here: omnireduce's collective engine
(:class:`omnireduce.engines.collective.CollectiveEngine`, the ranks of the replicate group summing
each other's non-zero blocks through its collectives) or the group's dense all-reduce, chosen per
key by :class:`PathRule`. Every input of the rule is identical on every rank (a union density:
from the engine's all-gathered bitmaps, or counted on the dense result, which every rank holds
alike), so every rank takes the same way without a collective to agree on it. The dense way is the
all-reduce native HSDP makes (``ReduceOp.AVG`` when averaging): a dense module's parameters are
native HSDP's bit for bit, whatever the dtype and the number of replicas. The engine's ``gather``
and ``owners`` exchanges sum in float32 in rank order and round once (its ``union`` exchange sums
as the backend does): with bf16 or fp16 and more than two replicas its sums can then be closer to
the exact ones than Gloo's or NCCL's, which round after each addition, and differ from them.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
from typing import Any, Protocol

import torch
import torch.distributed as dist

from omnireduce.config import WorkerConfig
from omnireduce.ddp.densities import as_float, union_density
from omnireduce.engines.collective import CollectiveEngine
from omnireduce.integrations.fsdp.recorder import DENSE, OMNIREDUCE, Recorder, ring_bytes

__all__ = ["PATHS", "EngineOrDense", "PathRule", "ReplicaReducer", "replica_groups"]

log = logging.getLogger("omnireduce.integrations")

THRESHOLD = "threshold"
PATHS = (THRESHOLD, OMNIREDUCE, DENSE)


class ReplicaReducer(Protocol):
    """The seam (see the module)."""

    def reduce(self, tensor: torch.Tensor, key: int, *, average: bool,
               block_size: int) -> torch.futures.Future[torch.Tensor]: ...

    def close(self) -> None: ...


class PathRule:
    """Each key's way: ``path="omnireduce"`` or ``"dense"`` always that way; ``"threshold"``: dense
    for a key's first reduction (whose result's union density is counted: the same on every rank),
    then omnireduce while the key's last union density is below ``dense_threshold``, dense while it
    is at or above it (the dense result's density is counted too, so a key can come back). A dense
    module never meets the engine; a sparse one pays one dense reduction."""

    def __init__(self, path: str, dense_threshold: float) -> None:
        if path not in PATHS:
            raise ValueError(f"path must be one of {', '.join(PATHS)}; got {path!r}")
        if not 0.0 < dense_threshold <= 1.0:
            raise ValueError(f"dense_threshold must be in (0, 1], got {dense_threshold}")
        self.path, self.dense_threshold = path, dense_threshold
        self._density: dict[int, Any] = {}  # key -> last union density (a float, or a DeviceDensity on CUDA)

    def choose(self, key: int) -> str:
        if self.path != THRESHOLD:
            return self.path
        last = self._density.get(key)
        return DENSE if last is None or as_float(last) >= self.dense_threshold else OMNIREDUCE

    @property
    def counts_dense(self) -> bool:
        """Whether the dense way must count its result's density (only the threshold rule reads it)."""
        return self.path == THRESHOLD

    def observe(self, key: int, density: Any) -> None:
        self._density[key] = density


@dataclasses.dataclass(frozen=True)
class Groups:
    """This rank's replicate groups of the integration's own: one for the engine's collectives, one
    for the dense all-reduce (each with the integration's timeout); ``ranks`` their global ranks."""

    engine: Any
    dense: Any
    ranks: list[int]


def replica_groups(mesh: Any, timeout: float) -> Groups:
    """Process groups over this rank's replicas (``mesh["replicate"]``'s ranks), two of them, with
    ``timeout``. Collective over the default group: every rank makes every replicate set's groups,
    in the same order (a column of the mesh is one set), and keeps its own."""
    limit = datetime.timedelta(seconds=timeout)
    backend = dist.get_backend(mesh.get_group("replicate"))
    me = dist.get_rank()
    table = mesh.mesh.reshape(mesh.size(0), mesh.size(1))
    mine: Groups | None = None
    for column in range(table.shape[1]):
        ranks = [int(r) for r in table[:, column].tolist()]
        engine = dist.new_group(ranks, timeout=limit, backend=backend)
        dense = dist.new_group(ranks, timeout=limit, backend=backend)
        if me in ranks:
            mine = Groups(engine, dense, ranks)
    if mine is None:
        raise ValueError(f"rank {me} is not in the mesh {mesh.mesh.tolist()}")
    return mine


class EngineOrDense:
    """A :class:`ReplicaReducer`: the collective engine or the dense all-reduce, by :class:`PathRule`.

    ``groups``: this rank's replicate groups (:func:`replica_groups`); ``layout``: the blocks'
    lanes, slots and lossy ``threshold`` (a :class:`~omnireduce.config.WorkerConfig` made without
    aggregators); ``timeout``: seconds the engine waits for a collective before the reduction
    fails."""

    def __init__(self, groups: Groups, layout: WorkerConfig, rule: PathRule, recorder: Recorder,
                 timeout: float) -> None:
        self.groups, self.layout, self.rule, self.recorder = groups, layout, rule, recorder
        self.replicas = len(groups.ranks)
        self.engine = CollectiveEngine(groups.engine, layout.block_size, layout.lanes, layout.slots,
                                       layout.threshold, timeout)

    def reduce(self, tensor: torch.Tensor, key: int, *, average: bool,
               block_size: int) -> torch.futures.Future[torch.Tensor]:
        """The seam's ``reduce`` (see the module): ``tensor`` through the way the rule gives ``key``."""
        way = self.rule.choose(key)
        if way == OMNIREDUCE:
            return self._sparse(tensor, key, average, block_size)
        return self._dense(tensor, key, average, block_size)

    def _sparse(self, t: torch.Tensor, key: int, average: bool, block: int) -> torch.futures.Future[torch.Tensor]:
        reduction = self.engine.allreduce_async(t, average=average, block_size=block)
        nbytes = t.numel() * t.element_size()

        def done(f: torch.futures.Future[Any]) -> torch.Tensor:
            f.value()  # (raises the reduction's error)
            info = reduction.info  # (set before it completed)
            density = info.union_density
            if density is not None:
                self.rule.observe(key, float(density))
            self.recorder.reduced(key, OMNIREDUCE, sent=info.bytes_sent, received=info.bytes_received,
                                  dense_bytes=ring_bytes(nbytes, self.replicas), density=density,
                                  block_size=block, numel=t.numel())
            return t

        return reduction.then(done)

    def _dense(self, t: torch.Tensor, key: int, average: bool, block: int) -> torch.futures.Future[torch.Tensor]:
        """On the calling thread, as native HSDP's all-reduce (``ReduceOp.AVG`` when averaging, the op
        it uses for fp32 and bf16: the same bits): on Gloo it blocks, on NCCL it queues on the current
        stream (FSDP's). Returns a completed future (no thread hand-off for the dense way)."""
        fut: torch.futures.Future[Any] = torch.futures.Future()
        try:
            dist.all_reduce(t, op=dist.ReduceOp.AVG if average else dist.ReduceOp.SUM, group=self.groups.dense)
            density = union_density(t, dataclasses.replace(self.layout, block_size=block)) \
                if self.rule.counts_dense else None
            if density is not None:
                self.rule.observe(key, density)
            ring = ring_bytes(t.numel() * t.element_size(), self.replicas)
            self.recorder.reduced(key, DENSE, sent=ring, received=ring, dense_bytes=ring, density=density,
                                  block_size=block, numel=t.numel())
        except Exception as e:
            fut.set_exception(e)
            return fut
        fut.set_result(t)
        return fut

    def close(self) -> None:
        """Stop the engine's thread once its reductions are done, and let go of its group."""
        self.engine.release()
