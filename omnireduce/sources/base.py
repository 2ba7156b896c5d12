"""The contract every block source keeps (:class:`Source`), and the types it speaks in.

A reduction (the worker's :class:`~omnireduce.worker.op.TensorOp`, or a collective engine) runs
against a *source*: where a tensor's blocks come from and where their sums go.
:func:`omnireduce.sources.adapt.adapt` picks one per tensor: :class:`~omnireduce.sources.host.HostSource`,
:class:`~omnireduce.sources.device.DeviceSource` or :class:`~omnireduce.sources.sparse.SparseSource`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy as np

from omnireduce.blocks import Layout
from omnireduce.dtypes import DType

if TYPE_CHECKING:
    from omnireduce.cuda.runtime import Completion

Staged = list[tuple[np.ndarray, np.ndarray]]  # (block ids, wire data) per received RESULT

#: ``defer(work, then)``: run ``work()`` on another thread, then ``then(error or None)``.
Deferrer = Callable[[Callable[[], None], Callable[[BaseException | None], None]], None]


@runtime_checkable
class Source(Protocol):
    """Where a :class:`~omnireduce.worker.op.TensorOp` reads its blocks and writes their sums.

    ``layout`` and ``dtype`` describe the tensor; ``device`` says where it lives (for messages);
    ``defer`` is None when preparing the tensor (:meth:`nonzero`, called through the op's
    ``prepare``) may run on the I/O thread, else the function that runs it on a thread of its own
    and reports back. :meth:`gather` returns the blocks ``ids`` in wire form; :meth:`finish` writes
    the sums (``staged``) divided by ``divisor`` and returns the CUDA stream that wrote them, or
    None; :meth:`release` frees what the source holds, whatever happened."""

    @property
    def layout(self) -> Layout: ...

    @property
    def dtype(self) -> DType: ...

    @property
    def device(self) -> Any: ...

    @property
    def defer(self) -> Deferrer | None: ...

    def nonzero(self, threshold: float) -> np.ndarray: ...

    def gather(self, ids: np.ndarray) -> np.ndarray: ...

    def finish(self, staged: Staged, divisor: int) -> Any: ...

    def release(self) -> None: ...


@runtime_checkable
class Counting(Protocol):
    """A source that also counts its non-zero blocks without side effects (the dense ones:
    :class:`~omnireduce.sources.host.HostSource`, :class:`~omnireduce.sources.device.DeviceSource`):
    an int, or a 0-d tensor on the tensor's device."""

    def count_nonzero(self, threshold: float) -> Any: ...


@runtime_checkable
class Completing(Protocol):
    """A source whose :meth:`Source.finish` may return a CUDA stream, with an event after the writes
    queued there (:class:`~omnireduce.sources.device.DeviceSource`)."""

    def completion(self) -> Completion: ...
