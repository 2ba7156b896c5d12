"""The CUDA runtime omnireduce keeps per process: its own side stream per device, a pool of pinned
host buffers, and one thread per device for the work that blocks on it.

Shared by the worker's device source (:mod:`omnireduce.sources.device`) and the collective engine
(:mod:`omnireduce.engines.collective`): both run their device work on :func:`side_stream`, one
stream per device that omnireduce creates for itself, never one of torch's pooled streams, which
NCCL and others draw from too and would serialise compaction behind their collectives.

torch is not imported here: the functions that need it are handed the module (``torch``), so the
worker can import this module for numpy arrays without loading torch. A forked child starts with
none of its parent's threads, streams or buffers.
"""

from __future__ import annotations

import ctypes
import logging
import os
import queue
import threading
from collections.abc import Callable
from typing import Any

log = logging.getLogger("omnireduce.worker")


class PinnedPool:
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


class DeviceThread:
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


_pool = PinnedPool()
_streams: dict[str, Any] = {}
_threads: dict[str, DeviceThread] = {}
_registry_lock = threading.Lock()


def _forget_after_fork() -> None:
    """A forked child has none of its parent's threads, and no usable CUDA state."""
    global _pool, _registry_lock
    _pool = PinnedPool()
    _registry_lock = threading.Lock()
    _streams.clear()
    _threads.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_after_fork)


def device_thread(device: Any) -> DeviceThread:
    """The thread of ``device`` (one per device and process) that runs the jobs blocking on it."""
    with _registry_lock:
        thread = _threads.get(str(device))
        if thread is None:
            thread = _threads[str(device)] = DeviceThread(device)
        return thread


def side_stream(torch: Any, device: Any) -> Any:
    """omnireduce's own stream on CUDA ``device`` (one per device and process), made on first use
    (``torch``: the torch module, so that this module loads without it)."""
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


def pinned_pool() -> PinnedPool:
    """The process's pool of reusable pinned host buffers (a new one in a forked child)."""
    return _pool
