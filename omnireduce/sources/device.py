"""Where a tensor's blocks come from and where their sums go: host memory or a (CUDA) device.

A :class:`~omnireduce.worker.op.TensorOp` runs the protocol against a *source*, which
:func:`omnireduce.worker.tensors.adapt` picks once per tensor:

- :class:`HostSource`: numpy arrays and CPU torch tensors, through a flat numpy view of their
  memory. Non-zero blocks are found with one pass of bitwise ORs, gathered per round straight from
  the tensor, and the sums are scattered back into it at the end.
- :class:`DeviceSource`: torch tensors on a device (CUDA), which must not cross PCIe whole. On a
  side stream that first waits for the event recorded (when the source was made, in the caller's
  thread) on the stream that produced the tensor, the non-zero blocks are compacted on the device
  (``omnireduce.cuda_kernels``) and copied, with their indices, to pinned host memory in one
  device-to-host copy; rounds gather from that compact copy. At the end, the union of summed blocks
  goes back in one host-to-device copy and the scatter kernel writes them into the tensor. The same
  code runs on CPU tensors with torch ops (used by the tests on machines without a GPU).

Both are a :class:`Source`, the contract every block source keeps (the sparse COO rows of
:mod:`omnireduce.worker.sparse` and a refused tensor's stand-in too): ``layout``, ``dtype``, ``device``;
``defer`` (None, or how preparation is run off the I/O thread); ``nonzero(threshold)`` (the flags of
the protocol's one detection pass), ``gather(ids)``, ``finish(staged, divisor)`` (write the sums;
returns the CUDA stream that wrote them, or None), ``release()``. Both also offer
``count_nonzero(threshold)`` (a side-effect-free count, for the DDP hook's density), keep the input
untouched until :meth:`finish`, so a failed reduction loses nothing, and a :class:`DeviceSource` adds
``completion`` (below).

Averaging. Both paths write ``sum * s`` with ``s = float32(1 / world_size)``, the product computed
in float32 and rounded once to the tensor's dtype: what the scatter kernel does, and what
``tensor.div_(world_size)`` does on a CUDA tensor (torch multiplies by the float32 reciprocal of a
scalar divisor there), so the host and the device paths give the same bits.

Who waits for the device, and where. The I/O thread never does: it polls.

- Finding the non-zero blocks must wait twice: :func:`omnireduce.cuda_kernels.compact` learns the
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
creates for itself (:func:`_side_stream`), never one of torch's pooled streams, which NCCL and
others draw from too and would serialise compaction behind their collectives.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import queue
import threading
from collections.abc import Callable, Iterator
from typing import Any, Protocol, runtime_checkable

import numpy as np

from omnireduce.blocks import Layout, block_nonzero, gather_blocks, scatter_blocks, zero_blocks
from omnireduce.dtypes import DType, bf16_to_f32, f32_to_bf16
from omnireduce.wire import to_wire, unwire

log = logging.getLogger("omnireduce.worker")

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

    layout: Layout
    dtype: DType
    device: Any
    defer: Deferrer | None

    def nonzero(self, threshold: float) -> np.ndarray: ...

    def gather(self, ids: np.ndarray) -> np.ndarray: ...

    def finish(self, staged: Staged, divisor: int) -> Any: ...

    def release(self) -> None: ...


class HostSource:
    """Blocks of a flat host array (a view of the user's memory, or a contiguous copy of it)."""

    device = "cpu"
    defer: Deferrer | None = None  # found on the I/O thread: one pass over host memory

    def __init__(self, raw: np.ndarray, dtype: DType, layout: Layout, writeback: Callable[[], None] | None) -> None:
        self.raw, self.dtype, self.layout, self.writeback = raw, dtype, layout, writeback
        self._dropped: np.ndarray | None = None

    def count_nonzero(self, threshold: float) -> int:
        return int(np.count_nonzero(block_nonzero(self.raw, self.dtype, self.layout.block_size, threshold)))

    def nonzero(self, threshold: float) -> np.ndarray:
        flags = block_nonzero(self.raw, self.dtype, self.layout.block_size, threshold)
        if threshold > 0.0:  # blocks dropped here must read 0 afterwards unless another rank sent them
            dropped = block_nonzero(self.raw, self.dtype, self.layout.block_size) & ~flags
            self._dropped = np.flatnonzero(dropped) if dropped.any() else None
        return flags

    def gather(self, ids: np.ndarray) -> np.ndarray:
        return gather_blocks(self.raw, self.layout, ids)

    def finish(self, staged: Staged, divisor: int) -> None:
        if self._dropped is not None:
            zero_blocks(self.raw, self.layout, self._dropped)
        write = _divider(self.dtype, divisor) if divisor > 1 else None
        for ids, data in staged:
            scatter_blocks(self.raw, self.layout, ids, data, write)
        if self.writeback is not None:
            self.writeback()

    def release(self) -> None:
        pass


def _divider(dtype: DType, divisor: int) -> Callable[[np.ndarray, np.ndarray], None]:
    """``write(dst, src)`` storing ``src * float32(1 / divisor)`` in ``dst`` (raw storage of ``dtype``):
    the product in float32, rounded once to the dtype, as the device path's scatter computes it."""
    scale = np.float32(1.0 / divisor)
    if dtype is DType.BFLOAT16:
        def write(dst: np.ndarray, src: np.ndarray) -> None:
            dst[...] = f32_to_bf16(bf16_to_f32(src) * scale)
    elif dtype is DType.FLOAT16:
        def write(dst: np.ndarray, src: np.ndarray) -> None:
            dst[...] = (src.astype(np.float32) * scale).astype(np.float16)
    else:
        def write(dst: np.ndarray, src: np.ndarray) -> None:
            np.multiply(src, scale, out=dst)
    return write


class _PinnedPool:
    """Reusable pinned host buffers (page-locked allocation is slow: never per call), per device.

    A buffer given back with a CUDA event is reused only once the event has completed, i.e. once
    the copies reading it have run; nobody waits for that. The events of a device are queried only
    by :meth:`take` for that device, which its callers run under that device's guard."""

    def __init__(self) -> None:
        self._free: dict[tuple[str, Any, int], list[Any]] = {}
        self._pending: dict[str, list[tuple[Any, Any]]] = {}
        self._lock = threading.Lock()

    def take(self, torch: Any, device: str, dtype: Any, numel: int, pin: bool) -> Any:
        size = 1 << max(0, (max(numel, 1) - 1).bit_length())  # round up to a power of two
        with self._lock:
            pending = self._pending.get(device)
            if pending:
                still = []
                for event, buf in pending:
                    if event.query():
                        self._free.setdefault((device, buf.dtype, buf.numel()), []).append(buf)
                    else:
                        still.append((event, buf))
                self._pending[device] = still
            free = self._free.get((device, dtype, size))
            if free:
                return free.pop()
        return torch.empty(size, dtype=dtype, pin_memory=pin)

    def give(self, device: str, buf: Any, after: Any = None) -> None:
        with self._lock:
            if after is None:
                self._free.setdefault((device, buf.dtype, buf.numel()), []).append(buf)
            else:
                self._pending.setdefault(device, []).append((after, buf))


class _DeviceThread:
    """A daemon thread per device that runs, in submission order, the jobs that block on the device
    (finding a tensor's non-zero blocks: see the module docstring)."""

    def __init__(self, device: Any) -> None:
        self.device = device
        self._jobs: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=f"omnireduce-compact-{device}", daemon=True)
        self._thread.start()

    def submit(self, job: Callable[[], None]) -> None:
        self._jobs.put(job)

    def _run(self) -> None:
        if self.device.type == "cuda":
            try:
                import torch

                torch.cuda.set_device(self.device)  # this thread works on this device only
            except Exception:  # the jobs guard the device themselves; report, do not die
                log.exception("omnireduce: cannot select %s on its compaction thread", self.device)
        while True:
            job = self._jobs.get()
            try:
                job()
            except BaseException:  # jobs report their own errors; this is a bug, not a tensor's failure
                log.exception("omnireduce: a job on the compaction thread of %s failed", self.device)


_pool = _PinnedPool()
_streams: dict[str, Any] = {}
_threads: dict[str, _DeviceThread] = {}
_registry_lock = threading.Lock()


def _forget_after_fork() -> None:
    """A forked child has none of its parent's threads, and no usable CUDA state."""
    global _pool, _registry_lock
    _pool = _PinnedPool()
    _registry_lock = threading.Lock()
    _streams.clear()
    _threads.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_after_fork)


def _device_thread(device: Any) -> _DeviceThread:
    with _registry_lock:
        thread = _threads.get(str(device))
        if thread is None:
            thread = _threads[str(device)] = _DeviceThread(device)
        return thread


def _side_stream(torch: Any, device: Any) -> Any:
    """omnireduce's own stream on CUDA ``device`` (one per device and process)."""
    with _registry_lock:
        stream = _streams.get(str(device))
        if stream is None:
            stream = _streams[str(device)] = _dedicated_stream(torch, device)
        return stream


def _dedicated_stream(torch: Any, device: Any) -> Any:
    """A CUDA stream nobody else uses, wrapped as a ``torch.cuda.ExternalStream``.

    Why not ``torch.cuda.Stream()``: it hands out one of 32 streams per device and priority, round
    robin, from the pools that ``ProcessGroupNCCL`` (priority 0, or the highest priority with
    ``TORCH_NCCL_HIGH_PRIORITY``), FSDP (priority -1) and any other library draw from too; sharing
    NCCL's stream would queue compaction behind dense collectives. torch's only way to create a
    stream outside the pools, ``torch.cuda.cudart().cudaStreamCreate``, makes a *blocking* stream,
    which synchronises with the legacy default stream that training runs on, so compaction would
    no longer overlap the backward pass. So the stream is created with the CUDA driver API
    (``cuStreamCreateWithPriority``, ``CU_STREAM_NON_BLOCKING``, priority 0 like torch's pools) in
    the device's primary context, which torch's runtime uses. It lives as long as the process.
    Where that fails (no ``libcuda.so.1``, ROCm), the priority -1 pool is used, which NCCL does
    not draw from (with the default number of priority levels); the reason is logged at debug level.
    """
    if torch.version.hip is None:
        try:
            return torch.cuda.ExternalStream(_driver_stream(device.index), device=device)
        except Exception as e:
            log.debug("no dedicated CUDA stream on %s (%s); using torch's priority -1 stream pool", device, e)
    return torch.cuda.Stream(device=device, priority=-1)


_CU_STREAM_NON_BLOCKING = 0x1


def _driver_stream(index: int) -> int:
    """A new non-blocking stream in the primary context of CUDA device ``index``: its handle."""
    cuda = ctypes.CDLL("libcuda.so.1")

    def check(result: int, what: str) -> None:
        if result != 0:
            raise RuntimeError(f"{what} failed with CUresult {result}")

    dev, ctx, stream, popped = ctypes.c_int(), ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_void_p()
    check(cuda.cuInit(ctypes.c_uint(0)), "cuInit")  # (done already by torch's runtime: a no-op)
    check(cuda.cuDeviceGet(ctypes.byref(dev), ctypes.c_int(index)), "cuDeviceGet")
    # The context torch's runtime uses; retained for good, since the stream needs it.
    check(cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
    check(cuda.cuCtxPushCurrent_v2(ctx), "cuCtxPushCurrent")
    try:
        check(cuda.cuStreamCreateWithPriority(ctypes.byref(stream), ctypes.c_uint(_CU_STREAM_NON_BLOCKING),
                                              ctypes.c_int(0)), "cuStreamCreateWithPriority")
    finally:
        cuda.cuCtxPopCurrent_v2(ctypes.byref(popped))
    if not stream.value:
        raise RuntimeError("cuStreamCreateWithPriority returned no stream")
    return int(stream.value)


class Completion:
    """Whether the work queued on a CUDA stream up to a point has run: an event the I/O thread polls."""

    def __init__(self, torch: Any, device: Any, event: Any) -> None:
        self.torch, self.device, self.event = torch, device, event

    def done(self) -> bool:
        with self.torch.cuda.device(self.device):
            return bool(self.event.query())


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
                self.stream = _side_stream(torch, flat.device)
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
        buf = _pool.take(self.torch, str(self.device), t.dtype, t.numel(), pin=True)
        self._buffers.append(buf)
        view = buf[: t.numel()].view(t.shape)
        view.copy_(t, non_blocking=True)
        return view

    def count_nonzero(self, threshold: float) -> Any:
        """A 0-d tensor on the tensor's device, counted on the current stream (nothing waits for it)."""
        from omnireduce import cuda_kernels

        with self._device():
            return cuda_kernels.block_flags(self.flat, self.layout.block_size, threshold).sum()

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

        _device_thread(self.device).submit(job)

    def nonzero(self, threshold: float) -> np.ndarray:
        """Compact the non-zero blocks and copy them to the host; blocks until the copy is there
        (so it runs on the device's thread, never on the I/O thread: see the module docstring)."""
        from omnireduce import cuda_kernels

        B = self.layout.block_size
        with self._on_stream():
            if self.ready is not None:
                self.stream.wait_event(self.ready)
            ids, blocks = cuda_kernels.compact(self.flat, B, threshold)  # learns k: one small sync
            host_ids, host_blocks = self._host(ids), self._host(blocks)
            if threshold > 0.0:  # kept on the device: finish() zeroes these blocks without a sync
                self._dropped = cuda_kernels.block_flags(self.flat, B)
                self._dropped[ids] = False
            if self.cuda:
                copied = self.torch.cuda.Event()
                copied.record(self.stream)
                copied.synchronize()  # this tensor's copy only, not the rest of the side stream's work
        self._ids = host_ids.numpy()
        self._blocks = _raw_numpy(self.torch, host_blocks, self.dtype)
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
        from omnireduce import cuda_kernels

        torch, lay = self.torch, self.layout
        B = lay.block_size
        count = sum(int(ids.size) for ids, _ in staged)
        with self._device():
            pooled = [_pool.take(torch, str(self.device), torch.int64, count, pin=self.cuda),
                      _pool.take(torch, str(self.device), self.flat.dtype, count * B, pin=self.cuda)]
        self._buffers += pooled
        host_ids, host = pooled[0][:count], pooled[1][: count * B]
        ids_host = host_ids.numpy()
        blocks = _raw_numpy(torch, host, self.dtype).reshape(count, B)
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
                full = lay.full_blocks
                self.flat[: full * B].view(-1, B).masked_fill_(self._dropped[:full, None], 0)
                if lay.tail:
                    self.flat[full * B:].masked_fill_(self._dropped[full], 0)
            cuda_kernels.scatter(self.flat, dev_ids, dev_blocks, 1.0 / divisor if divisor > 1 else 1.0)
            if self.writeback is not None:
                self.writeback()
        return self.stream

    def completion(self) -> Completion:
        """An event after the writes :meth:`finish` queued (CUDA only)."""
        with self._device():
            event = self.torch.cuda.Event()
            event.record(self.stream)
        return Completion(self.torch, self.device, event)

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
            _pool.give(str(self.device), buf, after)


def _raw_numpy(torch: Any, t: Any, dtype: DType) -> np.ndarray:
    """A host tensor's memory as a numpy array of the dtype's storage type (no copy)."""
    if dtype is DType.BFLOAT16:
        return t.view(torch.int16).numpy().view(np.uint16)
    return t.numpy()

