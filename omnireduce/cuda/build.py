"""Building and loading the CUDA kernels (``csrc/``) as a torch extension, and the build's settings.

The block operations of :mod:`omnireduce.cuda.ops` run these kernels on CUDA tensors when the
extension can be built, and torch ops otherwise. The kernels are plain CUDA C++
(``csrc/block_sparse.cu``, no torch headers) behind ``extern "C"`` launchers; ``csrc/bindings.cpp``
binds them to torch tensors on the current CUDA stream. The extension is built with
:func:`torch.utils.cpp_extension.load` into a cache directory keyed by a hash of the sources, the
torch/CUDA/Python versions, the nvcc version, the compiler flags the environment adds
(``NVCC_APPEND_FLAGS``, ``NVCC_PREPEND_FLAGS``, ``TORCH_CUDA_ARCH_LIST``, ...) and the GPUs' compute
capabilities, so a later process loads it without rebuilding.

Building takes about a minute: :func:`prepare` does it eagerly, on the caller's thread, with a
bounded wait for other processes building the same cache entry (a build lock that a killed process
left behind is cleared). Without it the first block operation on a CUDA tensor builds. Building
needs ``ninja`` (``pip install ninja``), the CUDA toolkit (``nvcc``) and a CUDA build of torch.
When it cannot be built, one warning with the reason is logged (logger ``omnireduce.cuda_kernels``,
the name it always had) and the operations use torch ops.

Environment (read here, through :mod:`omnireduce.envvars`): ``OMNIREDUCE_CUDA_KERNELS`` = ``auto``
(default), ``require`` (raise instead of falling back) or ``off`` (always torch ops);
``OMNIREDUCE_CUDA_BUILD_DIR`` (cache root, default ``$XDG_CACHE_HOME/omnireduce`` or
``~/.cache/omnireduce``); ``OMNIREDUCE_CUDA_BUILD_LOCK_TIMEOUT`` (seconds to wait for another
process's build, default 600).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import functools
import hashlib
import logging
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from omnireduce.envvars import env

log = logging.getLogger("omnireduce.cuda_kernels")

def _find_csrc() -> Path:
    """The CUDA sources: installed as the package data ``omnireduce._csrc``, or the repository's csrc/."""
    try:
        import omnireduce._csrc as sources

        for location in sources.__path__:
            if (Path(location) / "bindings.cpp").is_file():
                return Path(location)
    except ImportError:
        pass
    return Path(__file__).resolve().parents[2] / "csrc"


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


# --- settings -------------------------------------------------------------------------------------

_CUDA_KERNELS_MODES = {"": "auto", "auto": "auto", "1": "auto", "require": "require", "0": "off", "off": "off"}
DEFAULT_CUDA_BUILD_LOCK_TIMEOUT = 600.0  # seconds; a build takes about a minute, several on a loaded machine


def cuda_kernels_mode() -> str:
    """``OMNIREDUCE_CUDA_KERNELS``: ``auto`` (default), ``require`` or ``off``."""
    raw = (env("OMNIREDUCE_CUDA_KERNELS") or "").strip().lower()
    if raw not in _CUDA_KERNELS_MODES:
        raise ValueError(f"OMNIREDUCE_CUDA_KERNELS must be auto, require or off; got {raw!r}")
    return _CUDA_KERNELS_MODES[raw]


def cuda_build_lock_timeout() -> float:
    """``OMNIREDUCE_CUDA_BUILD_LOCK_TIMEOUT``: seconds >= 0 a build waits for another process's."""
    raw = (env("OMNIREDUCE_CUDA_BUILD_LOCK_TIMEOUT") or "").strip()
    if not raw:
        return DEFAULT_CUDA_BUILD_LOCK_TIMEOUT
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not value >= 0.0:
        raise ValueError(f"OMNIREDUCE_CUDA_BUILD_LOCK_TIMEOUT must be a number of seconds >= 0, got {raw!r}")
    return value


def cuda_build_dir() -> str | None:
    """``OMNIREDUCE_CUDA_BUILD_DIR``, if set: where the built kernels are cached."""
    return env("OMNIREDUCE_CUDA_BUILD_DIR")


# --- public API -----------------------------------------------------------------------------------

def prepare(device: torch.device | str | int | None = None, *, lock_timeout: float | None = None) -> str:
    """Build or load the CUDA kernels now, on the calling thread, and return the backend ``device`` gets.

    Call it from the thread that owns the tensors, when a CUDA tensor is first met and before any
    deadline starts: the first build in a cache takes about a minute (compiling ``csrc/``), which
    must not be spent on an I/O thread inside a tensor's timeout.

    Contract:

    - Returns ``"cuda-kernels"`` or ``"torch-ops"``: the backend that the operations of
      :mod:`omnireduce.cuda.ops` use for tensors on ``device`` for the rest of the process
      (what :func:`omnireduce.cuda.ops.backend` says for such a tensor).
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


def extension_for(x: torch.Tensor) -> Any:
    """The extension module for block operations on ``x`` (building it on first use), or None for the
    torch-ops backend (``x`` not on CUDA, the kernels off or unavailable). Raises RuntimeError when
    ``OMNIREDUCE_CUDA_KERNELS=require`` and the extension cannot be loaded."""
    return _kernels() if x.is_cuda else None


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
    return cuda_kernels_mode()


def _lock_timeout() -> float:
    return cuda_build_lock_timeout()


def _as_device(device: torch.device | str | int | None) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if isinstance(device, int) and not isinstance(device, bool):
        return torch.device("cuda", device)
    return torch.device(device)


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
    fcntl = _fcntl_module()
    with open(path, "a+") as f:
        if fcntl is None or not _flock(fcntl, f, path, build_dir, timeout):
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


def _fcntl_module() -> ModuleType | None:
    """The ``fcntl`` module, or None where there is none (not POSIX)."""
    try:
        import fcntl
    except ImportError:
        return None
    return fcntl


def _flock(fcntl: ModuleType, f: Any, path: Path, build_dir: Path, timeout: float) -> bool:
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
    root = cuda_build_dir()
    if root:
        return Path(root)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "omnireduce"


def _first_lines(text: str, lines: int = 20) -> str:
    parts = text.strip().splitlines()
    return "\n".join(parts[:lines]) + (f"\n... ({len(parts) - lines} more lines)" if len(parts) > lines else "")
