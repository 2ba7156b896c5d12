"""Block-sparsity operations on torch tensors: non-zero block flags, compaction, scaled scatter,
and the float32-to-dtype rounding of sums.

These are the three steps a gradient bucket goes through around the wire (docs/reference/protocol.md): find
the non-zero blocks (:func:`block_flags`), pack them contiguously with their indices
(:func:`compact`), and write the received sums back, scaled (:func:`scatter`). The numpy reference
is :mod:`omnireduce.blocks`; these functions give the same results on torch tensors, so a CUDA
bucket never has to visit the host to be inspected. :func:`narrow` rounds float32 sums to a
tensor's dtype as :func:`omnireduce.dtypes.narrow` does in numpy (the torch side of the package's
one bfloat16 rounding).

Two backends, same results (:func:`backend` says which one a tensor gets):

- ``cuda-kernels``: CUDA tensors, when the extension in ``csrc/`` can be built
  (:mod:`omnireduce.cuda.build`, which also says how and where it is cached).
- ``torch-ops``: plain torch ops (magnitude-bit masks, ``any``, ``nonzero``, ``index_select``,
  ``index_copy_``), for CPU tensors, and for CUDA tensors when the extension cannot be built (a
  warning with the reason is logged once).
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from omnireduce.blocks import block_nonzero
from omnireduce.cuda import build
from omnireduce.dtypes import DType

#: The integer view and magnitude mask of each supported dtype: an element is zero iff its bits & mask == 0.
_WORDS: dict[torch.dtype, tuple[torch.dtype, int]] = {
    torch.float32: (torch.int32, 0x7FFFFFFF),
    torch.float16: (torch.int16, 0x7FFF),
    torch.bfloat16: (torch.int16, 0x7FFF),
}


def _dispatch(name: str, fallback: Callable[..., Any], x: torch.Tensor, block_size: int, threshold: float) -> Any:
    """Run kernel ``name`` of the built extension on ``x`` taken flat, or ``fallback`` (torch ops)."""
    flat, B = _flat(x, block_size)
    t = _threshold(threshold)
    ext = build.extension_for(flat)
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


def flags_of(flat: torch.Tensor, block_size: int, threshold: float) -> torch.Tensor:
    """:func:`block_flags` of a flat contiguous tensor of a supported dtype, with a block size and a
    threshold (>= 0) checked already: the engine's, per bucket, without the checks."""
    if threshold:
        threshold = _threshold(threshold)
    ext = build.extension_for(flat) if flat.is_cuda else None
    if ext is not None and flat.numel():
        return ext.block_flags(flat, block_size, threshold)
    return _flags_torch(flat, block_size, threshold)


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
    ext = build.extension_for(flat)
    if ext is not None:
        ext.scatter(flat, indices, blocks, s)
    else:
        _scatter_torch(flat, indices, blocks, s)


def backend(x: torch.Tensor) -> str:
    """``"cuda-kernels"`` if operations on ``x`` run the CUDA kernels (building them if needed), else
    ``"torch-ops"``."""
    return "cuda-kernels" if build.extension_for(x) is not None else "torch-ops"


# --- torch-ops backend ----------------------------------------------------------------------------


def _flags_torch(flat: torch.Tensor, B: int, t: float) -> torch.Tensor:
    if flat.device.type == "cpu" and flat.numel():  # host memory: the numpy scan, ten times faster than these ops
        return _flags_host(flat, B, t)
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


def _flags_host(flat: torch.Tensor, B: int, t: float) -> torch.Tensor:
    """:func:`omnireduce.blocks.block_nonzero` on a CPU tensor's memory (no copy): the same flags."""
    dtype = _DTYPES[flat.dtype]
    raw = flat.view(torch.int16).numpy().view(np.uint16) if dtype is DType.BFLOAT16 else flat.numpy()
    return torch.from_numpy(block_nonzero(raw, dtype, B, t))


_DTYPES = {torch.float32: DType.FLOAT32, torch.float16: DType.FLOAT16, torch.bfloat16: DType.BFLOAT16}


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


# --- rounding sums --------------------------------------------------------------------------------


def narrow(acc: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float32 sums to ``dtype``, rounded once to nearest-even; bfloat16 by the same bit arithmetic as
    :func:`omnireduce.dtypes.f32_to_bf16` (a NaN keeps its sign and payload's top bits), so that the
    host and the device paths give the same bits."""
    if dtype != torch.bfloat16:
        return acc.to(dtype)
    bits = acc.view(torch.int32)
    rounded = bits + (0x7FFF + ((bits >> 16) & 1))
    out = (rounded >> 16) & 0xFFFF
    out = torch.where(torch.isnan(acc), ((bits >> 16) & 0xFFFF) | 0x0040, out)
    return torch.where(out >= 0x8000, out - 0x10000, out).to(torch.int16).view(torch.bfloat16)


def zero_blocks(flat: torch.Tensor, block_size: int, dropped: torch.Tensor) -> None:
    """Write 0 into the blocks of ``flat`` that ``dropped`` flags (one bool per block, the last block
    possibly short): the blocks a lossy ``threshold`` dropped here and no rank sent. The torch side of
    :func:`omnireduce.blocks.zero_blocks`."""
    full = flat.numel() // block_size
    flat[: full * block_size].view(-1, block_size).masked_fill_(dropped[:full, None], 0)
    if flat.numel() > full * block_size:
        flat[full * block_size:].masked_fill_(dropped[full], 0)
