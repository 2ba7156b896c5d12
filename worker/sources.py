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
  goes back in one host-to-device copy and the scatter kernel writes them into the tensor, scaled by
  1/world_size when averaging. Nothing waits for the device in the caller's thread; the I/O thread
  waits only for the one copy it must read. The same code runs on CPU tensors with torch ops (used
  by the tests on machines without a GPU).

Both offer the same interface: ``layout``, ``dtype``; ``nonzero(threshold)`` (the flags of the
protocol's one detection pass), ``gather(ids)``, ``finish(staged, divisor)`` (write the sums;
returns the CUDA stream that wrote them, or None), ``release()``; and ``count_nonzero(threshold)``
(a side-effect-free count, for the DDP hook's density). Both keep the input untouched until
:meth:`finish`, so a failed reduction loses nothing.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from omnireduce.blocks import Layout, block_nonzero, gather_blocks, scatter_blocks, zero_blocks
from omnireduce.dtypes import DType, bf16_to_f32, f32_to_bf16
from omnireduce.wire import to_wire, unwire

Staged = list[tuple[np.ndarray, np.ndarray]]  # (block ids, wire data) per received RESULT


class HostSource:
    """Blocks of a flat host array (a view of the user's memory, or a contiguous copy of it)."""

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
    """``write(dst, src)`` storing ``src / divisor`` in ``dst`` (raw storage of ``dtype``)."""
    if dtype is DType.BFLOAT16:
        def write(dst: np.ndarray, src: np.ndarray) -> None:
            dst[...] = f32_to_bf16(bf16_to_f32(src) / np.float32(divisor))
    else:
        def write(dst: np.ndarray, src: np.ndarray) -> None:
            np.divide(src, divisor, out=dst)
    return write


class _PinnedPool:
    """Reusable pinned host buffers (page-locked allocation is slow: never per call).

    A buffer given back with a CUDA event is reused only once the event has completed, i.e. once
    the copies reading it have run; nobody waits for that."""

    def __init__(self) -> None:
        self._free: dict[tuple[Any, int], list[Any]] = {}
        self._pending: list[tuple[Any, Any]] = []
        self._lock = threading.Lock()

    def take(self, torch: Any, dtype: Any, numel: int, pin: bool) -> Any:
        size = 1 << max(0, (max(numel, 1) - 1).bit_length())  # round up to a power of two
        with self._lock:
            still = []
            for event, buf in self._pending:
                if event.query():
                    self._free.setdefault((buf.dtype, buf.numel()), []).append(buf)
                else:
                    still.append((event, buf))
            self._pending = still
            free = self._free.get((dtype, size))
            if free:
                return free.pop()
        return torch.empty(size, dtype=dtype, pin_memory=pin)

    def give(self, buf: Any, after: Any = None) -> None:
        with self._lock:
            if after is None:
                self._free.setdefault((buf.dtype, buf.numel()), []).append(buf)
            else:
                self._pending.append((after, buf))


_pool = _PinnedPool()
_streams: dict[Any, Any] = {}
_streams_lock = threading.Lock()


def _side_stream(torch: Any, device: Any) -> Any:
    with _streams_lock:
        stream = _streams.get(device)
        if stream is None:
            stream = _streams[device] = torch.cuda.Stream(device=device)
        return stream


class DeviceSource:
    """Blocks of a flat torch tensor on a device, compacted there and moved as little as possible."""


    def __init__(self, flat: Any, dtype: DType, layout: Layout, writeback: Callable[[], None] | None) -> None:
        import torch

        self.torch, self.flat, self.dtype, self.layout, self.writeback = torch, flat, dtype, layout, writeback
        self.cuda = flat.is_cuda
        self.ready = None  # CUDA: an event on the stream that produced the tensor, for the side stream to wait for
        self.stream = None  # CUDA: the side stream that reads the tensor and writes the result
        if self.cuda:
            self.ready = torch.cuda.Event()
            self.ready.record(torch.cuda.current_stream(flat.device))
            self.stream = _side_stream(torch, flat.device)
        self._buffers: list[Any] = []
        self._ids: np.ndarray | None = None
        self._blocks: np.ndarray | None = None
        self._dropped: Any = None  # lossy mode: bool per block, non-zero but under the threshold

    def _on_stream(self) -> Any:
        import contextlib

        return self.torch.cuda.stream(self.stream) if self.cuda else contextlib.nullcontext()

    def _host(self, t: Any) -> Any:
        """A host copy of device tensor ``t`` (in a pooled, pinned buffer when on CUDA)."""
        if not self.cuda:
            return t
        buf = _pool.take(self.torch, t.dtype, t.numel(), pin=True)
        self._buffers.append(buf)
        view = buf[: t.numel()].view(t.shape)
        view.copy_(t, non_blocking=True)
        return view

    def count_nonzero(self, threshold: float) -> Any:
        """A 0-d tensor on the tensor's device, counted on the current stream (nothing waits for it)."""
        from omnireduce import cuda_kernels

        return cuda_kernels.block_flags(self.flat, self.layout.block_size, threshold).sum()

    def nonzero(self, threshold: float) -> np.ndarray:
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
            self.stream.synchronize()  # the one wait the data dependency needs: reading the compact copy
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
        """Write the sums into the tensor; returns the CUDA stream the writes are queued on (None
        off CUDA, where they are done)."""
        from omnireduce import cuda_kernels

        torch, lay = self.torch, self.layout
        B = lay.block_size
        count = sum(int(ids.size) for ids, _ in staged)
        pooled = [_pool.take(torch, torch.int64, count, pin=self.cuda),
                  _pool.take(torch, self.flat.dtype, count * B, pin=self.cuda)]
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
            dev_ids = host_ids.to(self.flat.device, non_blocking=True)
            dev_blocks = host.view(count, B).to(self.flat.device, non_blocking=True)
            if self._dropped is not None:
                full = lay.full_blocks
                self.flat[: full * B].view(-1, B).masked_fill_(self._dropped[:full, None], 0)
                if lay.tail:
                    self.flat[full * B:].masked_fill_(self._dropped[full], 0)
            cuda_kernels.scatter(self.flat, dev_ids, dev_blocks, 1.0 / divisor if divisor > 1 else 1.0)
            if self.writeback is not None:
                self.writeback()
        return self.stream

    def release(self) -> None:
        """Give the pinned buffers back to the pool, to be reused once the copies using them are done."""
        after = None
        if self.cuda and self._buffers:
            after = self.torch.cuda.Event()
            after.record(self.stream)
        for buf in self._buffers:
            _pool.give(buf, after)
        self._buffers.clear()


def _raw_numpy(torch: Any, t: Any, dtype: DType) -> np.ndarray:
    """A host tensor's memory as a numpy array of the dtype's storage type (no copy)."""
    if dtype is DType.BFLOAT16:
        return t.view(torch.int16).numpy().view(np.uint16)
    return t.numpy()


Source = HostSource | DeviceSource
