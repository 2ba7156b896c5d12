"""Blocks of host memory: numpy arrays and CPU torch tensors, through a flat numpy view.

Non-zero blocks are found with one pass of bitwise ORs, gathered per round straight from the
tensor, and the sums are scattered back into it at the end. Averaging writes ``sum * s`` with
``s = float32(1 / world_size)``, the product computed in float32 and rounded once to the tensor's
dtype, as the device path's scatter does (:mod:`omnireduce.sources.device`), so both give the same
bits.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from omnireduce.blocks import Layout, block_nonzero, gather_blocks, scatter_blocks, zero_blocks
from omnireduce.dtypes import DType, bf16_to_f32, f32_to_bf16
from omnireduce.sources.base import Deferrer, Staged


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


def raw_numpy(torch: Any, t: Any, dtype: DType) -> np.ndarray:
    """A host tensor's memory as a numpy array of the dtype's storage type (no copy)."""
    if dtype is DType.BFLOAT16:
        return t.view(torch.int16).numpy().view(np.uint16)
    return t.numpy()
