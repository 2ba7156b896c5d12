"""One shape for every way a tensor is all-reduced: the :class:`Reducer` protocol, its future and its info.

A reducer takes a tensor and returns at once a :class:`Reduction`, a ``torch.futures.Future`` that
completes with the reduced tensor (the tensor itself, reduced in place; a new coalesced tensor for a
sparse COO input) and whose :attr:`Reduction.info`, a :class:`ReductionInfo`, is set before it
completes: the blocks (total, non-zero here, non-zero on some rank) and this rank's bytes. On CUDA
the future is CUDA-aware: completed under the stream that wrote the result, so a reader's stream
waits for the writes on the device, not the host. A reducer never raises for a failure on the way:
the future fails with the cause (:func:`fail`: whoever reads it gets the cause itself, DDP's
``backward()`` included).

    fut = reducer.allreduce_async(tensor, average=True, block_size=256)
    fut.then(lambda f: f.value())            # the tensor; fut.info says what it cost

The ways, one implementation each, one module per backend:

- the aggregators: :class:`omnireduce.engines.aggregators.WorkerReducer`, an adapter of
  :class:`omnireduce.Worker`, whose own future is a ``concurrent.futures`` one;
- the collective engine: :class:`omnireduce.engines.collective.CollectiveEngine` (the ranks sum each
  other's blocks through a process group of the engine's own);
- the process group's dense all-reduce: :class:`omnireduce.engines.dense.DenseReducer`;
- the hierarchy: :class:`omnireduce.engines.hierarchical.Hierarchical` (in the node, across the nodes
  by rail through any of the others, in the node again).

Adding a way. A new reduction (another exchange of the collective engine, say) is one class that
has ``allreduce_async`` as above and ``close()``, in a module of its own under ``omnireduce/engines/``,
and one entry in :mod:`omnireduce.engines.ways`: a member of :class:`~omnireduce.engines.ways.Way`
(its name in ``stats()`` and in ``OmniReduceState(engine=...)``) and its :class:`~omnireduce.engines.ways.EngineKind`
(how it is built on a process group of its own, and whether ``engine="auto"`` measures it). Nothing
else changes: binding builds every registered engine where the buckets may take it, flat and on each
rail of the hierarchy; the path choice times it against the others (``"hier:"`` and its name through
the hierarchy); the router hands it the buckets that chose it; the recorder reads its info.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from typing import Any, Protocol, TypedDict, runtime_checkable

import torch


@dataclasses.dataclass(frozen=True)
class ReductionInfo:
    """What one reduction did. ``blocks_total``: the tensor's blocks; ``blocks_nonzero``: those
    non-zero on this rank; ``blocks_union``: those non-zero on some rank (the same on every rank);
    ``bytes_sent`` / ``bytes_received``: this rank's bytes. ``dense``: the process group's dense
    all-reduce carried it (its blocks are not counted: ``measured`` holds the result's union density
    where it was scanned, else None)."""

    blocks_total: int = 0
    blocks_nonzero: int = 0
    blocks_union: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    dense: bool = False
    measured: Any = None  # a dense result's union density: a float, or a device count not read yet

    @property
    def union_density(self) -> Any:
        """The fraction of the blocks non-zero on some rank (identical on every rank), or None where
        nothing counted them (a dense all-reduce not scanned)."""
        if self.dense:
            return self.measured
        return self.blocks_union / self.blocks_total if self.blocks_total else 0.0

    @classmethod
    def ring(cls, nbytes: int, world_size: int, measured: Any = None) -> ReductionInfo:
        """A dense all-reduce's info: a ring all-reduce of ``nbytes`` over ``world_size`` ranks
        (:func:`ring_bytes` each way), its union density ``measured`` where its result was scanned."""
        ring = ring_bytes(nbytes, world_size)
        return cls(bytes_sent=ring, bytes_received=ring, dense=True, measured=measured)

    def plus(self, sent: int, received: int) -> ReductionInfo:
        """This info with more bytes (a step of the caller's around the reduction)."""
        return dataclasses.replace(self, bytes_sent=self.bytes_sent + sent,
                                   bytes_received=self.bytes_received + received)


def ring_bytes(nbytes: int, world_size: int) -> int:
    """Bytes each rank sends in a ring all-reduce of ``nbytes`` over ``world_size`` ranks (what a dense
    all-reduce moves: the recorder's ``dense_equivalent_bytes``)."""
    return 2 * (world_size - 1) * nbytes // world_size if world_size > 1 else 0


_NOTHING = ReductionInfo()
_OBSERVING = threading.Lock()  # (:meth:`Reduction.observe`: whichever of the finishing and the observing thread
# comes second tells the observer, once)


class Reduction(torch.futures.Future[Any]):
    """A reducer's future (see the module): completes with the reduced tensor; :attr:`info` is set
    before it completes, :attr:`failure` when it failed. Whoever hands it on (a DDP hook) may
    :meth:`observe` it: its observer runs before anyone waiting on it can read its value."""

    def __init__(self, tensor: torch.Tensor | None = None) -> None:
        super().__init__(devices=[tensor.device] if tensor is not None and tensor.is_cuda else None)
        self.info = _NOTHING
        self.path: str | None = None  # the way a router sent it by, where one did (its name in stats())
        self.failure: Failure | None = None  # set when it failed (what its value raises)
        self._on_done: Callable[[ReductionInfo], None] | None = None
        self._namer: Callable[[BaseException], BaseException] | None = None
        self._finished = False  # complete() or fail() began (under _OBSERVING)
        # set by a reducer whose reduction may run on the thread that waits for it (:meth:`wait`)
        self.run_here: Callable[[], None] | None = None

    def wait(self) -> Any:
        """Block until it completes and return its value (raises its failure), as ``Future.wait``; a
        reduction not begun yet whose reducer allows it (``run_here``) runs on this thread meanwhile,
        instead of waking the reducer's (:meth:`omnireduce.engines.collective.CollectiveEngine.allreduce_async`)."""
        run_here = self.run_here
        if run_here is not None:
            run_here()
        return super().wait()

    def complete(self, result: Any, info: ReductionInfo, stream: Any = None) -> None:
        """Set ``info``, tell the observer, then set the result; ``stream``: the CUDA stream that wrote it
        (None: the current one)."""
        with _OBSERVING:
            self.info, self._finished = info, True
            on_done = self._on_done
        if on_done is not None:
            on_done(info)
        if stream is None:
            self.set_result(result)
            return
        with torch.cuda.device(stream.device), torch.cuda.stream(stream):
            self.set_result(result)

    def fail(self, cause: BaseException) -> None:
        """Fail with ``cause`` (see :func:`fail`), unless complete already."""
        fail(self, cause)

    def observe(self, on_done: Callable[[ReductionInfo], None],
                namer: Callable[[BaseException], BaseException]) -> None:
        """Call ``on_done(info)`` once it completes, and have a failure raise ``namer(cause)`` instead
        of its cause (an error that says which bucket failed, say): both before anyone waiting on it
        can read it, and once, whether it finished already or finishes later, on whichever thread."""
        with _OBSERVING:
            self._on_done, self._namer = on_done, namer
            finished, failure = self._finished, self.failure
            if failure is not None and not failure.named:
                failure.cause, failure.named = namer(failure.cause), True
        if finished and failure is None:
            on_done(self.info)


class Reducer(Protocol):
    """One way to all-reduce a tensor over the ranks (see the module)."""

    def allreduce_async(self, tensor: torch.Tensor, *, average: bool,
                        block_size: int | None = None) -> Reduction:
        """Start reducing ``tensor`` (summed, or averaged over the ranks with ``average``); returns a
        :class:`Reduction` at once. ``block_size``: this tensor's blocks (None: the reducer's own)."""
        ...


class EngineStats(TypedDict):
    """What an :class:`Engine` has done (its ``stats()``; an engine may say more): ``reductions`` made,
    ``kernel_reductions`` among them through fused kernels, and how many each of its exchanges carried."""

    reductions: int
    kernel_reductions: int
    exchanges: dict[str, int]


class Engine(Reducer, Protocol):
    """A reducer of the ranks' own that owns what it runs on (a thread, a process group): closed by
    whoever built it; ``stats()`` says what it has done (plain values only)."""

    def close(self) -> None: ...

    def stats(self) -> EngineStats: ...


@runtime_checkable
class TakesWhole(Protocol):
    """A reducer that carries some tensors by the process group's dense all-reduce whole, with nothing
    sparse about them (the collective engine's small buckets): ``takes_whole`` says which, from what
    every rank knows alike (the size, the dtype), so a router need not time it against that all-reduce."""

    def takes_whole(self, tensor: torch.Tensor) -> bool: ...



def fail(fut: torch.futures.Future[Any], cause: BaseException) -> None:
    """Complete ``fut`` (unless complete already) with ``cause``: ``value()`` and ``wait()`` raise it, and
    so does DDP's ``backward()`` when a communication hook returns ``fut``. A :class:`Reduction` keeps the
    :class:`Failure` (its ``failure``), whose cause a caller may name better before anyone reads it.

    ``Future.set_exception`` would leave the exception as the future's value, which DDP's reducer
    then fails to cast to a tensor: the user would read ``RuntimeError: Unable to cast <the cause> to
    Tensor``; and a callback that raises (``then``) gives torch's ``Got the following error when
    running the callback: ...``. Here the value is a :class:`Failure` whose ``str()`` raises the
    cause, which is what that cast calls first: DDP raises the cause itself, its type and message
    (should a later torch not call it, the message still holds the cause)."""
    if fut.done():
        return
    failure = Failure(cause)
    if isinstance(fut, Reduction):
        with _OBSERVING:  # (named before it completes: a waiter reads it as soon as it does)
            if fut._namer is not None:
                failure.cause, failure.named = fut._namer(cause), True
            fut.failure, fut._finished = failure, True
    fut._set_unwrap_func(_raise)
    fut.set_result(failure)


class Failure:
    """A failed future's value (see :func:`fail`): ``cause`` is what reading it raises."""

    def __init__(self, cause: BaseException) -> None:
        self.cause = cause
        self.named = False  # (:meth:`Reduction.observe`)

    def __str__(self) -> str:
        raise self.cause

    def __repr__(self) -> str:
        return f"<failed: {self.cause!r}>"


def _raise(value: Any) -> Any:
    if isinstance(value, Failure):
        raise value.cause
    return value
