"""The process group's own all-reduce as a :class:`~omnireduce.engines.reducer.Reducer`, and the union
density of a reduced tensor.

:class:`DenseReducer` averages as torch's ``allreduce_hook`` does: a strided tensor is divided by the
world size before the all-reduce, on the calling thread, so the division overlaps the reductions
queued before it instead of delaying this one's completion (or, asked to, as native HSDP does: the
backend's ``ReduceOp.AVG``); a sparse COO tensor's average is a new tensor. Its bytes are a ring
all-reduce's. With ``measure`` (a blocks' layout) the result is scanned for its union density
(:func:`union_density`), so a bucket the dense way took can come back to omnireduce when it turns
sparse. The result is scanned and the future completed on a thread of ours, never on the backend's
(:mod:`omnireduce.engines.completer` says why).

:func:`union_density` counts the non-zero blocks of a reduced tensor with the block source the
sparse ways would use (identical on every rank). Counted on a CUDA device it is a
:class:`DeviceDensity`: a count copied to pinned host memory without blocking, read an iteration
later, so nothing waits for the device.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.distributed as dist

from omnireduce.config import WorkerConfig
from omnireduce.engines.completer import Completer
from omnireduce.engines.reducer import Reduction, ReductionInfo
from omnireduce.sources.adapt import adapt
from omnireduce.sources.base import Counting


class DenseReducer:
    """The all-reduce of ``group`` (None: the default group) as a reducer (see the module). With
    ``average_op`` a strided tensor is averaged by the backend's ``ReduceOp.AVG`` instead (native
    HSDP's all-reduce: the sum divided once, the same bits as FSDP's own)."""

    def __init__(self, group: Any, measure: WorkerConfig | None = None, *, average_op: bool = False,
                 completer: Completer | None = None) -> None:
        self.group, self.measure, self.average_op = group, measure, average_op
        self.world_size = dist.get_world_size(group)
        self.completer = completer or Completer("omnireduce-dense")
        self._infos: dict[int, ReductionInfo] = {}  # bytes -> an unscanned reduction's info (made once a size)
        # a float tensor's all-reduce straight on the group (what dist.all_reduce issues, without its checks)
        self._pg: Any = group if group is not None else dist.group.WORLD
        self._opts = {op: _options(op) for op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG)}

    def close(self) -> None:
        """End the thread that completes this all-reduce's reductions (shared with :meth:`measured`'s
        copies) once what is in flight has completed; a reduction asked for later starts it again."""
        self.completer.close()

    def measured(self, config: WorkerConfig) -> DenseReducer:
        """The same all-reduce, its results scanned for their union density in ``config``'s blocks."""
        return DenseReducer(self.group, config, average_op=self.average_op, completer=self.completer)

    def allreduce_async(self, tensor: torch.Tensor, *, average: bool, block_size: int | None = None) -> Reduction:
        op = dist.ReduceOp.SUM
        strided = tensor.layout == torch.strided
        if strided and average and self.world_size > 1:  # (over one rank the average is the tensor: no pass over it)
            if self.average_op:
                op = dist.ReduceOp.AVG
            else:
                tensor.div_(self.world_size)
        if strided and tensor.is_floating_point():
            work = self._pg.allreduce([tensor], self._opts[op])
        else:  # (a sparse or complex tensor: dist.all_reduce knows what to do)
            work = dist.all_reduce(tensor, op=op, group=self.group, async_op=True)
        out = Reduction(tensor)
        done = self._strided if strided else self._sparse
        self.completer.submit(work.get_future(), functools.partial(done, out, average))  # (not on Gloo's thread)
        return out

    def _strided(self, out: Reduction, average: bool, f: torch.futures.Future[list[torch.Tensor]]) -> None:
        try:
            result = f.value()[0]
            nbytes = result.numel() * result.element_size()
            if self.measure is not None:
                info = ReductionInfo.ring(nbytes, self.world_size, union_density(result, self.measure))
            else:
                info = self._infos.get(nbytes) or self._infos.setdefault(nbytes, ReductionInfo.ring(nbytes,
                                                                                                    self.world_size))
            out.complete(result, info)
        except BaseException as e:
            out.fail(e)

    def _sparse(self, out: Reduction, average: bool, f: torch.futures.Future[list[torch.Tensor]]) -> None:
        """A sparse COO tensor's: its average is a new tensor; no ring's bytes are counted."""
        try:
            result = f.value()[0]
            if average:
                result = result / self.world_size
            density = union_density(result, self.measure) if self.measure is not None else None
            out.complete(result, ReductionInfo(dense=True, measured=density))
        except BaseException as e:
            out.fail(e)


def _options(op: Any) -> dist.AllreduceOptions:
    """The options of an asynchronous all-reduce with ``op``, as ``dist.all_reduce`` makes them."""
    opts = dist.AllreduceOptions()
    opts.reduceOp = op
    if hasattr(opts, "asyncOp"):
        opts.asyncOp = True
    return opts


def union_density(t: torch.Tensor, cfg: WorkerConfig) -> float | DeviceDensity:
    """Fraction of the reduced tensor's blocks that are non-zero, counted by the block source the
    sparse path would use (identical on every rank). Counted on a CUDA device, it is a
    :class:`DeviceDensity`, so that nothing waits for the device here."""
    if t.numel() == 0:
        return 0.0
    source = adapt(t, cfg.block_size, cfg.lanes, cfg.slots)
    if not isinstance(source, Counting):
        raise TypeError(f"union density: {type(source).__name__} does not count its blocks (a dense tensor's "
                        "source does)")
    count = source.count_nonzero(cfg.threshold)
    if isinstance(count, torch.Tensor):
        if count.is_cuda:
            return DeviceDensity(count, source.layout.num_blocks)
        count = int(count)  # the device path on a CPU tensor: nothing to wait for
    return count / source.layout.num_blocks


class DeviceDensity:
    """A union density whose block count was computed on a CUDA device: copied, as it is queued, to
    pinned host memory without blocking, with an event after the copy. Read a bucket's iteration
    later, when the copy has long run; if it has not, reading waits for that one event."""

    def __init__(self, count: torch.Tensor, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.device = count.device
        self._value: float | None = None
        with torch.cuda.device(self.device):
            self.host = torch.empty(1, dtype=count.dtype, pin_memory=True)
            self.host.copy_(count.reshape(1), non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()

    def value(self) -> float:
        if self._value is None:
            with torch.cuda.device(self.device):
                if not self.event.query():
                    self.event.synchronize()
            self._value = int(self.host[0]) / self.num_blocks  # host memory: no device access
        return self._value


def as_float(density: float | DeviceDensity) -> float:
    return density.value() if isinstance(density, DeviceDensity) else float(density)
