"""The one seam between the FSDP hook and the ways a tensor crosses the replicas, and what serves it:
the DDP side's runtime, bound to this rank's replicate group.

The hook (:mod:`omnireduce.integrations.fsdp.hook`) hands every reduce-scatter output to a
:class:`ReplicaReducer` and waits for the future it returns; nothing else of the integration
knows how the tensor travels. The interface:

``reduce(tensor, key, *, iteration, average, block_size) -> torch.futures.Future[torch.Tensor]``
    ``tensor``: one FSDP unit's reduce-scatter output (1-D, contiguous, FSDP's reduce dtype, on its
    device), reduced in place across the replicas (summed; times ``1/R`` when ``average``); the
    future completes with it. On CUDA the future is CUDA-aware and completes on the stream that
    wrote the result, so the waiter's stream waits on the device. ``key``: the unit's index, the
    same on every rank and every step (the way is decided per key); ``iteration``: the backward
    pass it belongs to (:mod:`~omnireduce.integrations.fsdp.passes`). ``block_size``: the blocks'
    size for this tensor (the same on every rank). Called on every rank in the same order (FSDP's
    post-backward order), one reduction at a time. Each reduction is reported to the
    :class:`~omnireduce.integrations.fsdp.recorder.Recorder` the reducer was made with.
``after_backward(iteration, device)``
    Once per backward pass, after its last ``reduce`` (collective over the replicate group).
``close()``
    Let go of threads and groups once the reductions asked for are done (idempotent).

:class:`Replicas` is the reducer made here. Each unit's output is a bucket of the DDP side's
runtime (:meth:`omnireduce.ddp.runtime.Runtime.reduce_bucket` of :meth:`omnireduce.ddp.bucket.Bucket.of_tensor`,
its key the unit's), bound by :func:`omnireduce.ddp.binding.bind` to this rank's replicate group (a
column of the mesh), so its router gives each unit its way as it gives a DDP bucket its way
(docs/explanation/path-choice.md): measured and agreed on every rank of the replicate group, by the
union-density threshold, or forced; and the ways are the DDP side's reducers over that group: the
collective engine, the aggregators (where their addresses are given) and the group's dense all-reduce,
which averages with ``ReduceOp.AVG`` as native HSDP's does. The agreement (of the path choice's
timings, of the aggregators in use) runs at the end of each backward pass (``after_backward``).
Summing rather than averaging (a gradient divide factor) is the bucket's ``average=False``: every way
then sums, nothing is divided and multiplied back.

The groups. ``dist.new_group`` is collective over the default group: every rank of the job must make
every group, in the same order, with the same ranks. Each rank's replicate group is another column
of the mesh, so :func:`column_group` makes one group per column on every rank (in column order) and
keeps this rank's: once for the runtime (its dense all-reduce, its agreement, its probes), and once
more, through binding's ``engine_group``, for each engine of the ranks' own that may carry a unit.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
from typing import Any, Protocol

import torch
import torch.distributed as dist

from omnireduce.ddp.binding import bind, job_name
from omnireduce.ddp.bucket import Bucket
from omnireduce.ddp.options import Options
from omnireduce.ddp.recorder import Recorder as RouteRecorder
from omnireduce.ddp.runtime import Runtime, RuntimeStats
from omnireduce.engines.reducer import ring_bytes
from omnireduce.engines.ways import ENGINES
from omnireduce.errors import OmniReduceError
from omnireduce.integrations.fsdp.recorder import Recorder

__all__ = ["ReplicaReducer", "Replicas", "column_group"]

log = logging.getLogger("omnireduce.integrations")


class ReplicaReducer(Protocol):
    """The seam (see the module)."""

    def reduce(self, tensor: torch.Tensor, key: int, *, iteration: int, average: bool,
               block_size: int) -> torch.futures.Future[torch.Tensor]: ...

    def after_backward(self, iteration: int, device: torch.device) -> None: ...

    def close(self) -> None: ...


def column_group(mesh: Any, timeout: float) -> tuple[Any, list[int]]:
    """A process group over this rank's replicas (``mesh["replicate"]``'s ranks: its column of the
    mesh), with ``timeout``, and their global ranks. Collective over the default group: every rank
    makes every column's group, in column order, and keeps its own."""
    limit = datetime.timedelta(seconds=timeout)
    backend = dist.get_backend(mesh.get_group("replicate"))
    me = dist.get_rank()
    table = mesh.mesh.reshape(mesh.size(0), mesh.size(1))
    mine: tuple[Any, list[int]] | None = None
    for column in range(table.shape[1]):
        ranks = [int(r) for r in table[:, column].tolist()]
        group = dist.new_group(ranks, timeout=limit, backend=backend)
        if me in ranks:
            mine = (group, ranks)
    if mine is None:
        raise ValueError(f"rank {me} is not in the mesh {mesh.mesh.tolist()}")
    return mine


class Replicas:
    """A :class:`ReplicaReducer` through the DDP side's runtime (see the module); made by :meth:`bind`."""

    def __init__(self, runtime: Runtime, recorder: Recorder, replicas: int) -> None:
        self.runtime, self.recorder, self.replicas = runtime, recorder, replicas

    @classmethod
    def bind(cls, mesh: Any, options: Options, recorder: Recorder) -> Replicas:
        """This rank's runtime over its replicate group for ``options`` (``hierarchical`` off: FSDP's
        reduce-scatter is the step inside the node). Collective over the default group (every rank, the
        same ``options``). Each column of the mesh is a job of its own at the aggregators (the job's
        name with ``.shard<column>``)."""
        timeout = float(options.timeout) if options.timeout is not None else 60.0
        group, ranks = column_group(mesh, timeout)
        uses_aggregators = options.engine not in ENGINES  # (not an engine of the ranks' own alone)
        base = options.job or (job_name(dist.group.WORLD) if uses_aggregators else "hsdp")
        options = dataclasses.replace(options, job=f"{base}.shard{mesh.get_local_rank('shard')}")
        routes = RouteRecorder(name="omnireduce's FSDP hook", item="FSDP unit")
        warned: set[str] = set()

        def warn(key: str, message: str) -> None:
            if key not in warned:
                warned.add(key)
                log.warning("%s", message)

        runtime = bind(options, group, None, routes, warn, engine_group=lambda: column_group(mesh, timeout)[0],
                       average_op=True)
        return cls(runtime, recorder, len(ranks))

    def reduce(self, tensor: torch.Tensor, key: int, *, iteration: int, average: bool,
               block_size: int) -> torch.futures.Future[torch.Tensor]:
        """The seam's ``reduce`` (see the module): ``tensor`` as the runtime's bucket ``key``."""
        reduction = self.runtime.reduce_bucket(Bucket.of_tensor(tensor, key, iteration, block_size, average=average))
        nbytes = tensor.numel() * tensor.element_size()

        def recorded(f: torch.futures.Future[Any]) -> torch.Tensor:
            try:
                f.value()
            except OmniReduceError as e:  # (the runtime's error names the unit's index: the hook names the unit)
                raise (e.__cause__ if isinstance(e.__cause__, Exception) else e) from None
            info = reduction.info  # (set before it completed)
            self.recorder.reduced(key, str(reduction.path), sent=info.bytes_sent, received=info.bytes_received,
                                  dense_bytes=ring_bytes(nbytes, self.replicas), density=info.union_density,
                                  block_size=block_size, numel=tensor.numel())
            return tensor

        return reduction.then(recorded)

    def after_backward(self, iteration: int, device: torch.device) -> None:
        """The seam's ``after_backward``: the runtime's agreement for ``iteration`` starts."""
        self.runtime.after_last_bucket(iteration, device)

    def stats(self) -> RuntimeStats:
        """The runtime's: the ways (``engine``), the path choice's decisions per unit key (``paths``),
        ``step_checks``, ``iterations_measuring``, the collective engine's exchanges."""
        return self.runtime.stats()

    def close(self) -> None:
        """Close the runtime: the agreement in flight waited for (at most the timeout), then the engines
        and the worker."""
        self.runtime.close()
