"""Keep freed large buffers in glibc's heap instead of returning them to the kernel.

Every round moves megabytes through freshly allocated buffers (zmq receive buffers, sums). glibc
serves large allocations with ``mmap`` and returns them to the kernel on ``free``, so each new
buffer page-faults on first touch: at 10% density that was 15-30% of the aggregator's CPU time
(perf: ``clear_page_erms``, ``exc_page_fault`` under ``_copy_to_iter``). Raising the mmap and trim
thresholds makes freed memory get reused, at the price of keeping the process's peak heap. One
arena (``M_ARENA_MAX=1``) matters too: libzmq's I/O thread allocates receive buffers in its own
arena, whose heaps are at most 64 MiB and are unmapped when empty; in the main heap they are reused.
Call it before the zmq context (and its I/O thread) is created.

Page faults are expensive on virtual machines: on the 2-core VM this project is developed on, the
first touch of a fresh 7.6 MB buffer cost 10 ms, the same copy into touched memory 0.35 ms. The
aggregator CLI does this at start, and so does each worker process unless
``OMNIREDUCE_MALLOC_TUNE=0`` (it changes the allocator of the whole process: freed memory below
32 MiB stays with the process instead of going back to the kernel).
"""

from __future__ import annotations

import ctypes
import logging
import platform

from omnireduce.envvars import env

log = logging.getLogger("omnireduce")

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8
_done = False
_mmap_threshold = 0  # (the one set by keep_freed_memory: smaller freed buffers stay in the heap)


def keep_freed_memory(mmap_threshold: int = 32 << 20, trim_threshold: int = (1 << 31) - 1) -> bool:
    """Serve allocations up to ``mmap_threshold`` bytes from the heap and never trim it. Idempotent;
    returns False (and does nothing) where the C library is not glibc."""
    global _done, _mmap_threshold
    if _done:
        return True
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    ok = (bool(mallopt(_M_MMAP_THRESHOLD, mmap_threshold)) and bool(mallopt(_M_TRIM_THRESHOLD, trim_threshold))
          and bool(mallopt(_M_ARENA_MAX, 1)))
    _done = ok
    _mmap_threshold = mmap_threshold if ok else 0
    log.debug("glibc mallopt: mmap threshold %d, trim threshold %d: %s", mmap_threshold, trim_threshold,
              "ok" if ok else "failed")
    return ok


def malloc_tune() -> bool:
    """``OMNIREDUCE_MALLOC_TUNE`` (default on; ``0`` turns it off): keep freed buffers for reuse."""
    return env("OMNIREDUCE_MALLOC_TUNE") != "0"


def heap_keeps(nbytes: int) -> bool:
    """Whether a buffer of ``nbytes`` freed in this process stays in its heap, resident, for the next
    allocation that fits (no page faults then): :func:`keep_freed_memory` is in effect and ``nbytes``
    is under its mmap threshold. (glibc gives each thread an arena of its own: the memory is reused
    by allocations of the threads of the same arena.)"""
    return _done and nbytes < _mmap_threshold
