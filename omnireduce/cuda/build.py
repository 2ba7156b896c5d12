"""Block-sparsity operations on torch tensors: non-zero block flags, compaction, scaled scatter.

These are the three steps a gradient bucket goes through around the wire (docs/protocol.md): find
the non-zero blocks (:func:`block_flags`), pack them contiguously with their indices
(:func:`compact`), and write the received sums back, scaled (:func:`scatter`). The numpy reference
is :mod:`omnireduce.blocks`; these functions give the same results on torch tensors, so a CUDA
bucket never has to visit the host to be inspected.

Two backends, same results (:func:`backend` says which one a tensor gets):

- ``cuda-kernels``: CUDA tensors, when the extension in ``csrc/`` can be built. The kernels are plain
  CUDA C++ (``csrc/block_sparse.cu``, no torch headers) behind ``extern "C"`` launchers;
  ``csrc/bindings.cpp`` binds them to torch tensors on the current CUDA stream. The extension is
  built with :func:`torch.utils.cpp_extension.load` into a cache directory keyed by a hash of the
  sources, the torch/CUDA/Python versions, the nvcc version, the compiler flags the environment adds
  (``NVCC_APPEND_FLAGS``, ``NVCC_PREPEND_FLAGS``, ``TORCH_CUDA_ARCH_LIST``, ...) and the GPUs'
  compute capabilities, so a later process loads it without rebuilding.
- ``torch-ops``: plain torch ops (magnitude-bit masks, ``any``, ``nonzero``, ``index_select``,
  ``index_copy_``), for CPU tensors, and for CUDA tensors when the extension cannot be built (a
  warning with the reason is logged once).

Building takes about a minute: :func:`prepare` does it eagerly, on the caller's thread, with a
bounded wait for other processes building the same cache entry (a build lock that a killed process
left behind is cleared). Without it the first block operation on a CUDA tensor builds. Building
needs ``ninja`` (``pip install ninja``), the CUDA toolkit (``nvcc``) and a CUDA build of torch.

Environment: ``OMNIREDUCE_CUDA_KERNELS`` = ``auto`` (default), ``require`` (raise instead of falling
back) or ``off`` (always torch ops); ``OMNIREDUCE_CUDA_BUILD_DIR`` (cache root, default
``$XDG_CACHE_HOME/omnireduce`` or ``~/.cache/omnireduce``); ``OMNIREDUCE_CUDA_BUILD_LOCK_TIMEOUT``
(seconds to wait for another process's build, default 600).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import functools
import hashlib
import logging
import math
import operator
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from omnireduce import config

log = logging.getLogger("omnireduce.cuda_kernels")

#: The integer view and magnitude mask of each supported dtype: an element is zero iff its bits & mask == 0.
_WORDS: dict[torch.dtype, tuple[torch.dtype, int]] = {
    torch.float32: (torch.int32, 0x7FFFFFFF),
    torch.float16: (torch.int16, 0x7FFF),
    torch.bfloat16: (torch.int16, 0x7FFF),
}

def _find_csrc() -> Path:
    """The CUDA sources: installed as the package data ``omnireduce._csrc``, or the repository's csrc/."""
    try:
        import omnireduce._csrc as sources

        for location in sources.__path__:
            if (Path(location) / "bindings.cpp").is_file():
                return Path(location)
    except ImportError:
        pass
    return Path(__file__).resolve().parent.parent / "csrc"


_CSRC = _find_csrc()
_SOURCE_SUFFIXES = (".cu", ".cpp", ".h", ".cuh")
_EXT_NAME = "omnireduce_cuda_kernels"
_CFLAGS = ["-O3"]
_CUDA_CFLAGS = ["-O3"]  # never --use_fast_math: it flushes subnormals, which must count as non-zero
#: Environment variables that change what cpp_extension/nvcc build, hence part of the cache key.
_BUILD_ENV = ("TORCH_CUDA_ARCH_LIST", "NVCC_APPEND_FLAGS", "NVCC_PREPEND_FLAGS", "PYTORCH_NVCC", "CXX", "CC")
_LOCK_TIMEOUT_ENV = "OMNIREDUCE_CUDA_BUILD_LOCK_TIMEOUT"
_LOCK_NAME = "omnireduce-build.lock"  # our flock, in the build directory
_BATON_NAME = "lock"  # torch.utils.cpp_extension's lock file, in the same directory


# --- public API -----------------------------------------------------------------------------------


def _dispatch(name: str, fallback: Callable[..., Any], x: torch.Tensor, block_size: int, threshold: float) -> Any:
    """Run kernel ``name`` of the built extension on ``x`` taken flat, or ``fallback`` (torch ops)."""
    flat, B = _flat(x, block_size)
    t = _threshold(threshold)
    ext = _extension_for(flat)
    if ext is not None and flat.numel():
        return getattr(ext, name)(flat, B, t)
    return fallback(flat, B, t)


def block_flags(x: torch.Tensor, block_size: int, threshold: float = 0.0) -> torch.Tensor:
    """Which blocks of the contiguous tensor ``x`` (taken flat) are non-zero: a bool tensor of ``nb``.

    Exact mode (``threshold == 0``): a block is non-zero iff some element has a magnitude bit set,
    so NaN and +-Inf count and -0.0 does not. Lossy mode (``threshold > 0``): a block is zero iff
    every element satisfies ``|x| <= threshold``, compared in float32 with the threshold rounded to
    float32 (NaN is never ``<=``, so a block holding NaN is non-zero).
    """
    return _dispatch("block_flags", _flags_torch, x, block_size, threshold)


def compact(x: torch.Tensor, block_size: int, threshold: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """The non-zero blocks of ``x`` (as :func:`block_flags` finds them), packed.

    Returns ``(indices, blocks)``: ``indices`` int64, ascending, ``k`` entries; ``blocks`` of shape
    ``(k, block_size)`` and ``x``'s dtype, row ``i`` a copy of block ``indices[i]``, the short last
    block (if among them) padded with +0. On CUDA this synchronises the stream once (to learn ``k``).
    """
    return _dispatch("compact", _compact_torch, x, block_size, threshold)


def scatter(x: torch.Tensor, indices: torch.Tensor, blocks: torch.Tensor, scale: float = 1.0) -> None:
    """Write ``blocks[i] * scale`` into block ``indices[i]`` of ``x`` (contiguous, taken flat), in place.

    ``blocks`` has shape ``(k, B)`` and ``x``'s dtype; ``B`` is the block size. Only the real
    elements of the short last block are written (the rest of its row is ignored). The product is
    computed in float32 and rounded once to ``x``'s dtype; with ``scale == 1`` (in float32) the bits
    are copied unchanged. Indices must be distinct and in ``[0, nb)``: the torch-ops backend raises
    on an out-of-range index, the CUDA kernels skip it.
    """
    if not isinstance(blocks, torch.Tensor) or blocks.dim() != 2:
        raise ValueError(f"blocks must be a 2-D (k, block_size) tensor, got {_shape(blocks)}")
    flat, _ = _flat(x, blocks.shape[1])
    if blocks.dtype != flat.dtype:
        raise TypeError(f"blocks are {blocks.dtype} but the tensor is {flat.dtype}")
    if not isinstance(indices, torch.Tensor) or indices.dim() != 1 or indices.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"indices must be a 1-D int64 tensor, got {_shape(indices)}")
    if indices.shape[0] != blocks.shape[0]:
        raise ValueError(f"{indices.shape[0]} indices but {blocks.shape[0]} blocks")
    if indices.device != flat.device or blocks.device != flat.device:
        raise ValueError(f"indices ({indices.device}) and blocks ({blocks.device}) must be on {flat.device}")
    if indices.shape[0] == 0 or flat.numel() == 0:
        return
    indices = indices.to(torch.int64).contiguous()
    blocks = blocks.contiguous()
    with np.errstate(over="ignore"):
        s = float(np.float32(scale))  # the float32 value both backends multiply by
    ext = _extension_for(flat)
    if ext is not None:
        ext.scatter(flat, indices, blocks, s)
    else:
        _scatter_torch(flat, indices, blocks, s)


def backend(x: torch.Tensor) -> str:
    """``"cuda-kernels"`` if operations on ``x`` run the CUDA kernels (building them if needed), else
    ``"torch-ops"``."""
    return "cuda-kernels" if _extension_for(x) is not None else "torch-ops"


def prepare(device: torch.device | str | int | None = None, *, lock_timeout: float | None = None) -> str:
    """Build or load the CUDA kernels now, on the calling thread, and return the backend ``device`` gets.

    Call it from the thread that owns the tensors, when a CUDA tensor is first met and before any
    deadline starts: the first build in a cache takes about a minute (compiling ``csrc/``), which
    must not be spent on an I/O thread inside a tensor's timeout.

    Contract:

    - Returns ``"cuda-kernels"`` or ``"torch-ops"``: the backend that :func:`block_flags`,
      :func:`compact` and :func:`scatter` use for tensors on ``device`` for the rest of the process
      (what :func:`backend` says for such a tensor).
    - ``device``: a ``torch.device``, a string (``"cuda:1"``), a CUDA ordinal, or None (CUDA if
      available, else CPU). A non-CUDA device gets ``"torch-ops"`` at once; nothing is built.
    - Idempotent and thread-safe: one attempt per process, made by the first call (or the first
      block operation on a CUDA tensor, if that comes first): it builds the extension into the cache
      under ``OMNIREDUCE_CUDA_BUILD_DIR``, or loads an earlier build of the same sources, torch,
      toolchain and GPUs (about a second). Threads calling meanwhile, and block operations on CUDA
      tensors, wait for that attempt; later calls return its outcome at once. One extension serves
      every visible GPU.
    - Bounded wait for other processes: when another process (another rank) holds the build lock of
      the same cache entry, the attempt waits at most ``lock_timeout`` seconds (default
      ``OMNIREDUCE_CUDA_BUILD_LOCK_TIMEOUT``, else 600) and then fails with an error that names the
      lock file, its holder and what to do. A lock left by a build that was killed is detected and
      cleared, not waited for. The compile itself is not bounded. ``lock_timeout`` only matters to
      the call that makes the attempt.
    - Failure (``ninja`` or the CUDA toolkit missing, a CPU build of torch, a compile error, the
      lock wait above): with ``OMNIREDUCE_CUDA_KERNELS=auto`` (default) one warning with the reason
      is logged per process and ``"torch-ops"`` is returned (those synchronise the stream more
      often); with ``require`` a RuntimeError is raised, by this and by every later operation on a
      CUDA tensor; with ``off`` nothing is built and ``"torch-ops"`` is returned.
    - The outcome is logged once per process: INFO naming the kernels (built or loaded, how long),
      or the WARNING above.
    """
    if lock_timeout is not None and not lock_timeout >= 0:
        raise ValueError(f"lock_timeout must be a number of seconds >= 0, got {lock_timeout!r}")
    if _as_device(device).type != "cuda":
        return "torch-ops"
    return "cuda-kernels" if _kernels(lock_timeout) is not None else "torch-ops"


# --- torch-ops backend ----------------------------------------------------------------------------


def describe() -> str:
    """One line saying which backend CUDA tensors would get here, without building anything: the
    kernels (already built, or to be built on first use) or torch ops, and why."""
    mode = _mode()
    if mode == "off":
        return "torch ops (OMNIREDUCE_CUDA_KERNELS=off)"
    if _state.tried:
        return "CUDA kernels (loaded)" if _state.module is not None else f"torch ops ({_state.error})"
    missing = _missing_prerequisites()
    if missing:
        return f"torch ops ({'; '.join(missing)})"
    if not torch.cuda.is_available():
        return "torch ops for CPU tensors; CUDA kernels buildable, but no GPU is visible"
    build_dir = _cache_root() / f"{_EXT_NAME}-{_build_key(_source_files(), _capabilities())}"
    built = any(build_dir.glob(f"{_EXT_NAME}*.so"))
    return f"CUDA kernels ({'built, in ' + str(build_dir) if built else 'built on first use, about a minute'})"


def _flags_torch(flat: torch.Tensor, B: int, t: float) -> torch.Tensor:
    n = flat.numel()
    nb, full = -(-n // B), n // B
    flags = torch.empty(nb, dtype=torch.bool, device=flat.device)
    if nb == 0:
        return flags
    if t > 0.0:
        nz = ~(flat.float().abs() <= t)  # t is a float32 value, so any compute precision agrees; NaN counts
    else:
        word, mask = _WORDS[flat.dtype]
        nz = flat.view(word) & mask  # non-zero where a magnitude bit is set, whatever the FTZ/DAZ mode
    if full:
        flags[:full] = nz[: full * B].view(full, B).any(dim=1)
    if full < nb:
        flags[full:] = nz[full * B:].any().view(1)
    return flags


def _compact_torch(flat: torch.Tensor, B: int, t: float) -> tuple[torch.Tensor, torch.Tensor]:
    n = flat.numel()
    full, tail = n // B, n % B
    indices = torch.nonzero(_flags_torch(flat, B, t)).view(-1)
    k = indices.numel()
    blocks = torch.empty((k, B), dtype=flat.dtype, device=flat.device)
    if k == 0:
        return indices, blocks
    short = tail != 0 and int(indices[-1]) == full  # ascending: only the last can be the short block
    kf = k - 1 if short else k
    if kf:
        torch.index_select(flat[: full * B].view(full, B), 0, indices[:kf], out=blocks[:kf])
    if short:
        blocks[kf, :tail] = flat[full * B:]
        blocks[kf, tail:] = 0
    return indices, blocks


def _scatter_torch(flat: torch.Tensor, indices: torch.Tensor, blocks: torch.Tensor, s: float) -> None:
    n, B = flat.numel(), blocks.shape[1]
    nb, full, tail = -(-n // B), n // B, n % B
    if s != 1.0:
        blocks = (blocks.float() * s).to(flat.dtype)  # s is float32: one float32 product, rounded once
    if tail == 0:
        flat.view(nb, B).index_copy_(0, indices, blocks)
        return
    is_short = indices == full
    rest = ~is_short
    flat[: full * B].view(full, B).index_copy_(0, indices[rest], blocks[rest])
    short_rows = blocks[is_short]
    if short_rows.shape[0]:
        flat[full * B:] = short_rows[-1, :tail]


# --- argument checks ------------------------------------------------------------------------------


def _flat(x: torch.Tensor, block_size: int) -> tuple[torch.Tensor, int]:
    """``x`` viewed flat and the block size as an int, after checking both."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _WORDS:
        raise TypeError(f"omnireduce block operations take float32, float16 or bfloat16 tensors; got {x.dtype}")
    if not x.is_contiguous():
        raise ValueError("omnireduce block operations need a contiguous tensor (call .contiguous() first)")
    try:
        B = operator.index(block_size)
    except TypeError:
        B = 0
    if isinstance(block_size, bool) or B < 1:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    return x.view(-1), B


def _threshold(threshold: float) -> float:
    """The threshold as the float32 value it is compared as (0.0: exact mode)."""
    t = float(threshold)
    if math.isnan(t) or t < 0.0:
        raise ValueError(f"threshold must be >= 0, got {threshold!r}")
    if t == 0.0:
        return 0.0
    with np.errstate(over="ignore"):
        return float(np.float32(t))  # what numpy (the reference) and the kernels compare with


def _shape(t: object) -> str:
    return f"shape {tuple(t.shape)} {t.dtype}" if isinstance(t, torch.Tensor) else type(t).__name__


# --- loading the extension ------------------------------------------------------------------------


class _Unavailable(RuntimeError):
    """The extension cannot be built here (a prerequisite is missing); the message says which."""


@dataclasses.dataclass
class _LoadState:
    tried: bool = False
    module: Any = None
    error: BaseException | None = None
    off_noted: bool = False
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)


_state = _LoadState()


def _mode() -> str:
    return config.cuda_kernels_mode()


def _lock_timeout() -> float:
    return config.cuda_build_lock_timeout()


def _as_device(device: torch.device | str | int | None) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if isinstance(device, int) and not isinstance(device, bool):
        return torch.device("cuda", device)
    return torch.device(device)


def _extension_for(x: torch.Tensor) -> Any:
    """The extension module for operations on ``x``, or None for the torch-ops backend."""
    return _kernels() if x.is_cuda else None


def _kernels(lock_timeout: float | None = None) -> Any:
    """The loaded extension (building it on first call), or None when it is off or unavailable.

    Raises RuntimeError when ``OMNIREDUCE_CUDA_KERNELS=require`` and the extension cannot be loaded.
    """
    mode = _mode()
    if mode == "off":
        if not _state.off_noted:
            _state.off_noted = True
            log.info("OMNIREDUCE_CUDA_KERNELS=off: block operations on CUDA tensors use torch ops")
        return None
    module = _load_extension(lock_timeout)
    if module is None and mode == "require":
        raise RuntimeError(f"OMNIREDUCE_CUDA_KERNELS=require but the omnireduce CUDA kernels could not be built "
                           f"or loaded: {_state.error}") from _state.error
    return module


def _load_extension(lock_timeout: float | None = None) -> Any:
    """Build or load the extension once per process; None (and one warning) if that fails."""
    state = _state
    with state.lock:
        if not state.tried:
            state.tried = True
            try:
                state.module = _build(lock_timeout)
            except Exception as e:  # no ninja, no toolkit, a compile error, a lock held too long: fall back
                state.error = e
                reason = str(e) if isinstance(e, _Unavailable) else f"{type(e).__name__}: {_first_lines(str(e))}"
                log.warning("CUDA kernels unavailable (%s); using torch ops, which synchronise (set "
                            "OMNIREDUCE_CUDA_KERNELS=require to make this an error)", reason)
        return state.module


def _missing_prerequisites() -> list[str]:
    """What this machine lacks to build the extension (empty: nothing known to be missing)."""
    from torch.utils import cpp_extension

    missing = []
    if not cpp_extension.is_ninja_available():  # load() needs it even to load a cached build
        missing.append("ninja not found: pip install ninja")
    if torch.version.cuda is None:
        missing.append(f"torch {torch.__version__} is a CPU build")
    elif _nvcc_path() is None:
        missing.append("CUDA toolkit not found (no nvcc): install it or set CUDA_HOME")
    return missing


def _build(lock_timeout: float | None = None) -> Any:
    missing = _missing_prerequisites()
    if missing:
        raise _Unavailable("; ".join(missing))
    from torch.utils import cpp_extension

    sources = _source_files()
    if not any(p.name == "bindings.cpp" for p in sources):
        raise FileNotFoundError(f"no csrc/bindings.cpp in {_CSRC} (omnireduce installed without its CUDA sources?)")
    build_dir = _cache_root() / f"{_EXT_NAME}-{_build_key(sources, _capabilities())}"
    build_dir.mkdir(parents=True, exist_ok=True)
    with _build_lock(build_dir, _lock_timeout() if lock_timeout is None else lock_timeout):
        cached = any(build_dir.glob(f"{_EXT_NAME}*.so")) or any(build_dir.glob(f"{_EXT_NAME}*.pyd"))
        if not cached:
            log.info("building omnireduce CUDA kernels in %s (once per source/torch/toolchain/GPU version)",
                     build_dir)
        t0 = time.perf_counter()
        module = cpp_extension.load(
            name=_EXT_NAME,
            sources=[str(p) for p in sources if p.suffix in (".cu", ".cpp")],
            extra_cflags=_CFLAGS,
            extra_cuda_cflags=_CUDA_CFLAGS,
            extra_include_paths=[str(_CSRC)],
            build_directory=str(build_dir),
            verbose=False,
        )
        elapsed = time.perf_counter() - t0
    if cached:
        log.info("loaded the omnireduce CUDA kernels from %s in %.2f s: block operations on CUDA tensors use them",
                 build_dir, elapsed)
    else:
        log.info("built the omnireduce CUDA kernels in %.1f s: block operations on CUDA tensors use them", elapsed)
    return module


@contextlib.contextmanager
def _build_lock(build_dir: Path, timeout: float) -> Iterator[None]:
    """Hold the build lock of ``build_dir`` (waiting at most ``timeout`` seconds for it), and clear
    a lock file that a killed build left behind.

    Why a lock of our own: ``cpp_extension.load`` serialises builds with a lock *file*
    (``<build_dir>/lock``, created with O_EXCL, deleted when its build ends) and waits for it to
    disappear without a bound, so a process killed mid-build leaves every later process waiting
    forever. Ours is an ``flock`` on ``<build_dir>/omnireduce-build.lock``, which the kernel
    releases when its holder exits, however it exits. Every omnireduce process calls ``load()`` on
    ``build_dir`` only while holding it (and no other code uses the directory: its name is a hash
    only this module computes), so a holder that finds ``<build_dir>/lock`` knows that the process
    which created the file is gone, and deletes the file. A live holder (another rank building) is
    waited for at most ``timeout`` seconds; then a RuntimeError names the lock, its holder and what
    to do. Where ``flock`` is unavailable (no fcntl, or a filesystem without locks) only the
    bounded wait on ``<build_dir>/lock`` remains, and a leftover file is reported, not deleted.
    """
    path = build_dir / _LOCK_NAME
    try:
        import fcntl
    except ImportError:  # not POSIX
        fcntl = None
    with open(path, "a+") as f:
        locked = fcntl is not None and _flock(fcntl, f, path, build_dir, timeout)
        if not locked:
            _wait_for_baton(build_dir, timeout)
            yield
            return
        try:
            f.seek(0)
            f.truncate()
            f.write(f"pid {os.getpid()} on {socket.gethostname()} since {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
            f.flush()
            baton = build_dir / _BATON_NAME
            if baton.exists():
                log.warning("removing %s, left behind by an omnireduce CUDA kernel build that was killed (no "
                            "process holds %s)", baton, path)
                baton.unlink(missing_ok=True)
            yield
        finally:
            f.seek(0)
            f.truncate()
            f.flush()
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def _flock(fcntl: Any, f: Any, path: Path, build_dir: Path, timeout: float) -> bool:
    """Take the exclusive flock on ``f``, polling until ``timeout``; False where flock is unsupported."""
    deadline = time.monotonic() + timeout
    announced = False
    while True:
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except OSError as e:
            if e.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                log.warning("cannot flock %s (%s): waiting on torch's lock file alone", path, e)
                return False
        now = time.monotonic()
        if now >= deadline:
            raise RuntimeError(
                f"waited {timeout:g} s for the omnireduce CUDA kernel build lock {path}, held by "
                f"{_holder(path)}: that process is building the kernels into {build_dir}. Wait for it (raise the "
                f"limit with {_LOCK_TIMEOUT_ENV}=<seconds>) or, if it is hung, kill it (the lock is released when "
                f"its holder exits); OMNIREDUCE_CUDA_KERNELS=off skips the kernels")
        if not announced:
            announced = True
            log.info("waiting up to %g s for %s: %s is building the omnireduce CUDA kernels", timeout, path,
                     _holder(path))
        time.sleep(min(0.2, deadline - now))


def _holder(path: Path) -> str:
    try:
        text = path.read_text().strip()
    except OSError:
        text = ""
    return text or "another process"


def _wait_for_baton(build_dir: Path, timeout: float) -> None:
    baton = build_dir / _BATON_NAME
    deadline = time.monotonic() + timeout
    while baton.exists():
        if time.monotonic() >= deadline:
            raise RuntimeError(
                f"waited {timeout:g} s for the CUDA extension build lock file {baton} to go away: another process "
                f"is building the omnireduce CUDA kernels into {build_dir}, or a build was killed and left the file "
                f"behind. If no process is building, delete {baton}; to wait longer, set "
                f"{_LOCK_TIMEOUT_ENV}=<seconds>; OMNIREDUCE_CUDA_KERNELS=off skips the kernels")
        time.sleep(0.2)


def _source_files() -> list[Path]:
    if not _CSRC.is_dir():
        return []
    return sorted(p for p in _CSRC.iterdir() if p.suffix in _SOURCE_SUFFIXES and p.is_file())


def _capabilities() -> list[tuple[int, int]]:
    """Compute capabilities of the visible GPUs (the archs cpp_extension compiles for by default)."""
    return sorted({torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())})


def _nvcc_path() -> str | None:
    """The nvcc that ``cpp_extension`` compiles with: ``$CUDA_HOME/bin/nvcc`` (as torch found CUDA_HOME)."""
    from torch.utils import cpp_extension

    home = cpp_extension.CUDA_HOME or os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if home:
        nvcc = Path(home) / "bin" / "nvcc"
        return str(nvcc) if nvcc.is_file() else None
    return shutil.which("nvcc")


@functools.lru_cache(maxsize=8)
def _nvcc_version(nvcc: str | None) -> str:
    """``nvcc --version`` (release and build), or why there is none."""
    if nvcc is None:
        return "no nvcc"
    try:
        proc = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as e:
        return f"{nvcc}: {type(e).__name__}"
    return proc.stdout.strip() or f"{nvcc}: exit status {proc.returncode}"


def _toolchain() -> list[str]:
    """The build inputs outside the sources: versions, the compilers and the flags the environment adds."""
    nvcc = _nvcc_path()
    env = [f"{k}={os.environ.get(k, '')}" for k in _BUILD_ENV]
    return [torch.__version__, str(torch.version.cuda), f"{sys.version_info[0]}.{sys.version_info[1]}",
            str(nvcc), _nvcc_version(nvcc), *env, repr(_CFLAGS), repr(_CUDA_CFLAGS)]


def _build_key(sources: list[Path], capabilities: list[tuple[int, int]]) -> str:
    """A hash of everything the built extension depends on: sources, flags, versions, GPU archs."""
    h = hashlib.sha256()
    for p in sources:
        h.update(p.name.encode() + b"\0" + p.read_bytes() + b"\0")
    h.update("\0".join([repr(capabilities), *_toolchain()]).encode())
    return h.hexdigest()[:16]


def _cache_root() -> Path:
    root = config.cuda_build_dir()
    if root:
        return Path(root)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "omnireduce"


def _first_lines(text: str, lines: int = 20) -> str:
    parts = text.strip().splitlines()
    return "\n".join(parts[:lines]) + (f"\n... ({len(parts) - lines} more lines)" if len(parts) > lines else "")
