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
  built on first use with :func:`torch.utils.cpp_extension.load` into a cache directory keyed by a
  hash of the sources, the torch/CUDA/Python versions and the GPUs' compute capabilities, so a later
  process loads it without rebuilding.
- ``torch-ops``: plain torch ops (magnitude-bit masks, ``any``, ``nonzero``, ``index_select``,
  ``index_copy_``), for CPU tensors, and for CUDA tensors when the extension cannot be built (a
  warning is logged once).

Environment: ``OMNIREDUCE_CUDA_KERNELS`` = ``auto`` (default), ``require`` (raise instead of falling
back) or ``off`` (always torch ops); ``OMNIREDUCE_CUDA_BUILD_DIR`` (cache root, default
``$XDG_CACHE_HOME/omnireduce`` or ``~/.cache/omnireduce``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import math
import operator
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

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
_MODES = {"": "auto", "auto": "auto", "1": "auto", "require": "require", "0": "off", "off": "off"}


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


# --- torch-ops backend ----------------------------------------------------------------------------


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


@dataclasses.dataclass
class _LoadState:
    tried: bool = False
    module: Any = None
    error: BaseException | None = None
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)


_state = _LoadState()


def _mode() -> str:
    raw = os.environ.get("OMNIREDUCE_CUDA_KERNELS", "").strip().lower()
    if raw not in _MODES:
        raise ValueError(f"OMNIREDUCE_CUDA_KERNELS must be auto, require or off; got {raw!r}")
    return _MODES[raw]


def _extension_for(x: torch.Tensor) -> Any:
    """The extension module for operations on ``x``, or None for the torch-ops backend."""
    return _kernels() if x.is_cuda else None


def _kernels() -> Any:
    """The loaded extension (building it on first call), or None when it is off or unavailable.

    Raises RuntimeError when ``OMNIREDUCE_CUDA_KERNELS=require`` and the extension cannot be loaded.
    """
    mode = _mode()
    if mode == "off":
        return None
    module = _load_extension()
    if module is None and mode == "require":
        raise RuntimeError(f"OMNIREDUCE_CUDA_KERNELS=require but the omnireduce CUDA kernels could not be built "
                           f"or loaded: {_state.error}") from _state.error
    return module


def _load_extension() -> Any:
    """Build or load the extension once per process; None (and one warning) if that fails."""
    state = _state
    with state.lock:
        if not state.tried:
            state.tried = True
            try:
                state.module = _build()
            except Exception as e:  # no compiler, no CUDA toolkit, a compile error: fall back
                state.error = e
                log.warning("omnireduce CUDA kernels unavailable, using torch ops instead (set "
                            "OMNIREDUCE_CUDA_KERNELS=require to make this an error): %s: %s",
                            type(e).__name__, _first_lines(str(e)))
        return state.module


def _build() -> Any:
    from torch.utils import cpp_extension

    sources = _source_files()
    if not any(p.name == "bindings.cpp" for p in sources):
        raise FileNotFoundError(f"no csrc/bindings.cpp in {_CSRC} (omnireduce installed without its CUDA sources?)")
    build_dir = _cache_root() / f"{_EXT_NAME}-{_build_key(sources, _capabilities())}"
    build_dir.mkdir(parents=True, exist_ok=True)
    cached = any(build_dir.glob(f"{_EXT_NAME}*.so")) or any(build_dir.glob(f"{_EXT_NAME}*.pyd"))
    if not cached:
        log.info("building omnireduce CUDA kernels in %s (once per source/torch/GPU version)", build_dir)
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
        log.debug("loaded omnireduce CUDA kernels from %s in %.2f s", build_dir, elapsed)
    else:
        log.info("built omnireduce CUDA kernels in %.1f s", elapsed)
    return module


def _source_files() -> list[Path]:
    if not _CSRC.is_dir():
        return []
    return sorted(p for p in _CSRC.iterdir() if p.suffix in _SOURCE_SUFFIXES and p.is_file())


def _capabilities() -> list[tuple[int, int]]:
    """Compute capabilities of the visible GPUs (the archs cpp_extension compiles for by default)."""
    return sorted({torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())})


def _build_key(sources: list[Path], capabilities: list[tuple[int, int]]) -> str:
    """A hash of everything the built extension depends on: sources, flags, versions, GPU archs."""
    h = hashlib.sha256()
    for p in sources:
        h.update(p.name.encode() + b"\0" + p.read_bytes() + b"\0")
    meta = [torch.__version__, str(torch.version.cuda), f"{sys.version_info[0]}.{sys.version_info[1]}",
            repr(capabilities), os.environ.get("TORCH_CUDA_ARCH_LIST", ""), repr(_CFLAGS), repr(_CUDA_CFLAGS)]
    h.update("\0".join(meta).encode())
    return h.hexdigest()[:16]


def _cache_root() -> Path:
    root = os.environ.get("OMNIREDUCE_CUDA_BUILD_DIR")
    if root:
        return Path(root)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "omnireduce"


def _first_lines(text: str, lines: int = 20) -> str:
    parts = text.strip().splitlines()
    return "\n".join(parts[:lines]) + (f"\n... ({len(parts) - lines} more lines)" if len(parts) > lines else "")
