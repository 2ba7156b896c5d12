"""Blocks of a torch tensor on its device: where they come from and where their sums go.

A :class:`~omnireduce.worker.op.TensorOp` runs the protocol against a *source*, which
:func:`omnireduce.sources.adapt.adapt` picks once per tensor:

- :class:`~omnireduce.sources.host.HostSource` (:mod:`omnireduce.sources.host`): numpy arrays and
  CPU torch tensors, through a flat numpy view of their memory. Non-zero blocks are found with one
  pass of bitwise ORs, gathered per round straight from the tensor, and the sums are scattered back
  into it at the end.
- :class:`DeviceSource` (here): torch tensors on a device (CUDA), which must not cross PCIe whole. On a
  side stream that first waits for the event recorded (when the source was made, in the caller's
  thread) on the stream that produced the tensor, the non-zero blocks are compacted on the device
  (:mod:`omnireduce.cuda.ops`) and copied, with their indices, to pinned host memory in one
  device-to-host copy; rounds gather from that compact copy. At the end, the union of summed blocks
  goes back in one host-to-device copy and the scatter kernel writes them into the tensor. The same
  code runs on CPU tensors with torch ops (used by the tests on machines without a GPU).

Both are a :class:`~omnireduce.sources.base.Source`, the contract every block source keeps (the
sparse COO rows of :mod:`omnireduce.sources.sparse` and a refused tensor's stand-in too): ``layout``,
``dtype``, ``device``; ``defer`` (None, or how preparation is run off the I/O thread);
``nonzero(threshold)`` (the flags of the protocol's one detection pass), ``gather(ids)``,
``finish(staged, divisor)`` (write the sums; returns the CUDA stream that wrote them, or None),
``release()``. Both also offer
``count_nonzero(threshold)`` (a side-effect-free count, for the DDP hook's density), keep the input
untouched until :meth:`finish`, so a failed reduction loses nothing, and a :class:`DeviceSource` adds
``completion`` (below).

Averaging. Both paths write ``sum * s`` with ``s = float32(1 / world_size)``, the product computed
in float32 and rounded once to the tensor's dtype: what the scatter kernel does, and what
``tensor.div_(world_size)`` does on a CUDA tensor (torch multiplies by the float32 reciprocal of a
scalar divisor there), so the host and the device paths give the same bits.

Who waits for the device, and where. The I/O thread never does: it polls.

- Finding the non-zero blocks must wait twice: :func:`omnireduce.cuda.ops.compact` learns the
  number ``k`` of non-zero blocks with one small synchronisation inside the kernel binding (it sizes
  the compact copy), and the compact copy must have reached the host before a round can gather from
  it. The first wait is not short: the side stream first waits for the stream that produced the
  tensor, i.e. for whatever the training step had queued before it (the rest of the backward pass
  for a DDP bucket). So :meth:`DeviceSource.nonzero` runs on a thread of its own per device
  (:meth:`DeviceSource.defer`, in submission order), which blocks in its place; the I/O thread is
  woken when it is done and meanwhile keeps reading the other tensors' results. Splitting it into
  "enqueue, then poll an event" would not help, since the enqueue step itself (``compact``) blocks.
- Writing the sums only enqueues copies and a kernel. A caller that wants the result complete on
  the device when its future completes (``synchronize=True``) gets it through
  :meth:`DeviceSource.completion`, an event the I/O thread polls between socket events.

CUDA work off the caller's thread runs under ``torch.cuda.device(tensor.device)``, so a rank on
``cuda:k`` makes no CUDA context on another GPU. The side stream is one per device that omnireduce
creates for itself (:func:`omnireduce.cuda.runtime.side_stream`), never one of torch's pooled
streams, which NCCL and others draw from too and would serialise compaction behind their collectives.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from omnireduce.blocks import Layout
from omnireduce.cuda import runtime
from omnireduce.dtypes import DType
from omnireduce.sources.base import Staged
from omnireduce.sources.host import raw_numpy
from omnireduce.wire import to_wire, unwire

log = logging.getLogger("omnireduce.worker")


class DeviceSource:
    """Blocks of a flat torch tensor on a device, compacted there and moved as little as possible.

    Made on the caller's thread (it records the producer stream's event there); :meth:`nonzero`
    runs on the device's own thread (:meth:`defer`); :meth:`gather`, :meth:`finish`,
    :meth:`completion` and :meth:`release` on the I/O thread."""

    def __init__(self, flat: Any, dtype: DType, layout: Layout, writeback: Callable[[], None] | None) -> None:
        import torch

        self.torch, self.flat, self.dtype, self.layout, self.writeback = torch, flat, dtype, layout, writeback
        self.device = flat.device
        self.cuda = flat.is_cuda
        self.ready = None  # CUDA: an event on the stream that produced the tensor, for the side stream to wait for
        self.stream = None  # CUDA: the side stream that reads the tensor and writes the result
        if self.cuda:
            with torch.cuda.device(flat.device):
                self.ready = torch.cuda.Event()
                self.ready.record(torch.cuda.current_stream(flat.device))
                self.stream = runtime.side_stream(torch, flat.device)
                # The side stream reads and writes this memory (and a contiguous copy of a
                # non-contiguous input is freed with the source): not to be reused before it is done.
                flat.record_stream(self.stream)
        self._buffers: list[Any] = []
        self._ids: np.ndarray | None = None
        self._blocks: np.ndarray | None = None
        self._dropped: Any = None  # lossy mode: bool per block, non-zero but under the threshold
        self._lock = threading.Lock()
        self._busy = False  # nonzero() is running on the device's thread
        self._released = False

    def _device(self) -> Any:
        return self.torch.cuda.device(self.device) if self.cuda else contextlib.nullcontext()

    @contextlib.contextmanager
    def _on_stream(self) -> Iterator[None]:
        """Under the device's guard, with the side stream current (CUDA)."""
        if not self.cuda:
            yield
            return
        with self.torch.cuda.device(self.device), self.torch.cuda.stream(self.stream):
            yield

    def _host(self, t: Any) -> Any:
        """A host copy of device tensor ``t`` (in a pooled, pinned buffer when on CUDA)."""
        if not self.cuda:
            return t
        buf = runtime.pinned_pool().take(self.torch, str(self.device), t.dtype, t.numel(), pin=True)
        self._buffers.append(buf)
        view = buf[: t.numel()].view(t.shape)
        view.copy_(t, non_blocking=True)
        return view

    def count_nonzero(self, threshold: float) -> Any:
        """A 0-d tensor on the tensor's device, counted on the current stream (nothing waits for it)."""
        from omnireduce.cuda import ops

        with self._device():
            return ops.block_flags(self.flat, self.layout.block_size, threshold).sum()

    def defer(self, work: Callable[[], None], then: Callable[[BaseException | None], None]) -> None:
        """Run ``work`` (which calls :meth:`nonzero`), then ``then(error or None)``, on the thread of
        this tensor's device, after the work submitted before it.

        Neither runs if the source was released first (its tensor failed meanwhile). A
        :meth:`release` while ``work`` runs takes effect when it returns, before ``then``."""

        def job() -> None:
            with self._lock:
                if self._released:
                    return
                self._busy = True
            error: BaseException | None = None
            try:
                work()
            except BaseException as e:
                error = e
            with self._lock:
                self._busy = False
                late = self._released
            if late:
                self._free_buffers()
            then(error)

        runtime.device_thread(self.device).submit(job)

    def nonzero(self, threshold: float) -> np.ndarray:
        """Compact the non-zero blocks and copy them to the host; blocks until the copy is there
        (so it runs on the device's thread, never on the I/O thread: see the module docstring)."""
        from omnireduce.cuda import ops

        B = self.layout.block_size
        with self._on_stream():
            if self.ready is not None:
                if self.stream is None:
                    raise RuntimeError(f"a CUDA event on the producer's stream, but no side stream for {self.device}")
                self.stream.wait_event(self.ready)
            ids, blocks = ops.compact(self.flat, B, threshold)  # learns k: one small sync
            host_ids, host_blocks = self._host(ids), self._host(blocks)
            if threshold > 0.0:  # kept on the device: finish() zeroes these blocks without a sync
                self._dropped = ops.block_flags(self.flat, B)
                self._dropped[ids] = False
            if self.cuda:
                copied = self.torch.cuda.Event()
                copied.record(self.stream)
                copied.synchronize()  # this tensor's copy only, not the rest of the side stream's work
        self._ids = host_ids.numpy()
        self._blocks = raw_numpy(self.torch, host_blocks, self.dtype)
        flags = np.zeros(self.layout.num_blocks, dtype=bool)
        flags[self._ids] = True
        return flags

    def gather(self, ids: np.ndarray) -> np.ndarray:
        assert self._ids is not None and self._blocks is not None
        rows = self._blocks[np.searchsorted(self._ids, ids)]
        return to_wire(rows, self.layout.short_index(ids), self.layout.tail)  # the short block trimmed

    def finish(self, staged: Staged, divisor: int) -> Any:
        """Write the sums (times float32(1/divisor)) into the tensor; returns the CUDA stream the
        writes are queued on (None off CUDA, where they are done). Only enqueues work on CUDA."""
        from omnireduce.cuda import ops

        torch, lay = self.torch, self.layout
        B = lay.block_size
        count = sum(int(ids.size) for ids, _ in staged)
        with self._device():
            pooled = [runtime.pinned_pool().take(torch, str(self.device), torch.int64, count, pin=self.cuda),
                      runtime.pinned_pool().take(torch, str(self.device), self.flat.dtype, count * B, pin=self.cuda)]
        self._buffers += pooled
        host_ids, host = pooled[0][:count], pooled[1][: count * B]
        ids_host = host_ids.numpy()
        blocks = raw_numpy(torch, host, self.dtype).reshape(count, B)
        at = 0
        for ids, data in staged:  # lay the union out contiguously on the host
            n = int(ids.size)
            ids_host[at: at + n] = ids
            blocks[at: at + n] = unwire(data, n, B, lay.short_index(ids), lay.tail)
            at += n
        with self._on_stream():
            # Allocated on the side stream, so the caching allocator ties them to it.
            dev_ids = host_ids.to(self.device, non_blocking=True)
            dev_blocks = host.view(count, B).to(self.device, non_blocking=True)
            if self._dropped is not None:
                ops.zero_blocks(self.flat, B, self._dropped)
            ops.scatter(self.flat, dev_ids, dev_blocks, 1.0 / divisor if divisor > 1 else 1.0)
            if self.writeback is not None:
                self.writeback()
        return self.stream

    def completion(self) -> runtime.Completion:
        """An event after the writes :meth:`finish` queued (CUDA only)."""
        with self._device():
            event = self.torch.cuda.Event()
            event.record(self.stream)
        return runtime.Completion(self.torch, self.device, event)

    def release(self) -> None:
        """Give the pinned buffers back to the pool, to be reused once the copies using them are
        done; deferred to its end while :meth:`nonzero` runs on the device's thread."""
        with self._lock:
            self._released = True
            if self._busy:
                return
        self._free_buffers()

    def _free_buffers(self) -> None:
        buffers, self._buffers = self._buffers, []
        if not buffers:
            return
        after = None
        if self.cuda:
            try:
                with self._device():
                    after = self.torch.cuda.Event()
                    after.record(self.stream)
            except Exception as e:  # e.g. a sticky CUDA error: nobody can tell when the copies are done
                # Not pooled, just dropped: torch's pinned-memory allocator keeps each buffer until
                # the copies recorded on it have run.
                log.debug("omnireduce: %d pinned buffers on %s not reused: %s", len(buffers), self.device, e)
                return
        for buf in buffers:
            runtime.pinned_pool().give(str(self.device), buf, after)
