"""The aggregators as a :class:`~omnireduce.engines.reducer.Reducer`: an adapter of :class:`omnireduce.Worker`.

The worker's own future is a ``concurrent.futures`` one, completed on its I/O thread, with the
reduction's counts in ``info`` and, on CUDA, the side stream that wrote the result in ``stream``.
:class:`WorkerReducer` hands the tensor to the worker without waiting for the device
(``synchronize=False``) and completes its :class:`~omnireduce.engines.reducer.Reduction` under that
stream: a reader's stream then waits for the writes on the device, and no thread waits on the host.
It never closes the worker (whoever made it does). Written against the worker's shape (nothing here
imports it: the worker is a layer of its own beside the engines).
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Sequence
from typing import Any, Protocol

import torch

from omnireduce.engines.reducer import Reduction, ReductionInfo


class _Worker(Protocol):
    """What of :class:`omnireduce.Worker` the adapter uses."""

    def allreduce_async(self, x: Any, *, average: bool = False, synchronize: bool = True,
                        block_size: int | None = None) -> concurrent.futures.Future[Any]: ...

    def use_aggregators(self, indices: Any) -> None: ...


class WorkerReducer:
    """A :class:`omnireduce.Worker` as a reducer (see the module). ``offset``: where this worker's list
    of aggregators starts in the job's (a rail's worker lists them from its rail's on): the
    aggregators agreed on are shifted by it (:meth:`use`)."""

    def __init__(self, worker: _Worker, offset: int = 0, count: int = 1) -> None:
        self.worker, self.offset, self.count = worker, offset, count
        self._usable: tuple[int, ...] | None = None  # the aggregators it was last told to use

    def allreduce_async(self, tensor: torch.Tensor, *, average: bool, block_size: int | None = None) -> Reduction:
        out = Reduction(tensor)
        reduction = self.worker.allreduce_async(tensor, average=average, synchronize=False, block_size=block_size)

        def done(f: Any) -> None:
            try:
                result = f.result()
                out.complete(result, ReductionInfo(**f.info), f.stream)
            except BaseException as e:
                out.fail(e)

        reduction.add_done_callback(done)
        return out

    def use(self, usable: Sequence[int] | None) -> None:
        """Take the aggregators agreed on (indices in the job's list; None: unchanged), from the next tensor."""
        if usable is not None and tuple(usable) != self._usable:
            self._usable = tuple(usable)
            self.worker.use_aggregators([(u - self.offset) % self.count for u in usable])
