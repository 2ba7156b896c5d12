"""Row vectors and block data as they travel: the array frames of :mod:`omnireduce.wire`'s messages.

Row vectors. ``rows(n)`` is a vector of ``n`` block rows (uint32, :data:`~omnireduce.blocks.INF` =
no row) sent as two frames: a bitmap (one bit per entry, least significant bit first) of the
entries that hold a row, and those rows packed little-endian at the width the tensor's layout needs
(0 bytes when every lane has a single row, which is the common case: then only the bitmap travels).

Block data. Raw elements of the tensor's dtype, blocks one after another; the tensor's short last
block (``numel`` not a multiple of the block size) is trimmed to its real length on the wire, never
padded. :func:`to_wire` and :func:`unwire` convert between ``(count, block_size)`` arrays and that.
Frames are read without copying (:func:`frame_buffer`); anything that does not fit raises
:class:`~omnireduce.errors.WireError`.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from omnireduce.blocks import INF, ROW_DTYPE, Layout
from omnireduce.errors import WireError

_WIDTH_DTYPE: dict[int, np.dtype] = {1: np.dtype("u1"), 2: np.dtype("<u2"), 4: np.dtype("<u4")}


def encode_rows(rows: np.ndarray, width: int) -> tuple[np.ndarray, np.ndarray]:
    """Rows (uint32, INF = none) as two frames: a bitmap of the entries that hold a row (LSB first),
    and those rows packed at ``width`` bytes each (nothing when width is 0: every row is 0)."""
    has = rows != INF
    bitmap = np.packbits(has, bitorder="little")
    if width == 0:
        return bitmap, np.zeros(0, np.uint8)
    return bitmap, rows[has].astype(_WIDTH_DTYPE[width])


def decode_rows(bitmap: Any, packed: Any, n: int, width: int, what: str) -> np.ndarray:
    """Inverse of :func:`encode_rows` (frames or arrays): ``n`` rows as uint32 with INF for empty
    entries, or :class:`WireError` if the frames do not fit ``n`` and ``width``."""
    bits = np.frombuffer(frame_buffer(bitmap), dtype=np.uint8)
    raw = np.frombuffer(frame_buffer(packed), dtype=np.uint8)
    if bits.size != (n + 7) // 8:
        raise WireError(f"{what}: bitmap of {bits.size} bytes, expected {(n + 7) // 8} for {n} entries")
    has = np.unpackbits(bits, count=n, bitorder="little")
    if n % 8 and bits[-1] >> (n % 8):
        raise WireError(f"{what}: bits set past entry {n}")
    if width == 0:  # every row is 0: 1 - bit, wrapping to INF where the bit is clear
        if raw.size:
            raise WireError(f"{what}: {raw.size} bytes of rows, expected 0 (rows of width 0)")
        rows = has.astype(ROW_DTYPE)
        rows -= ROW_DTYPE.type(1)
        return rows
    has = has.view(bool)
    k = int(np.count_nonzero(has))
    if raw.size != k * width:
        raise WireError(f"{what}: {raw.size} bytes of rows, expected {k * width} ({k} rows x {width})")
    rows = np.full(n, INF, dtype=ROW_DTYPE)
    rows[has] = raw.view(_WIDTH_DTYPE[width])
    return rows


def wire_elements(layout: Layout, count: int, has_short: bool) -> int:
    """Elements of ``count`` blocks on the wire, the short last block (if among them) trimmed."""
    return count * layout.block_size - (layout.block_size - layout.tail if has_short else 0)


def to_wire(blocks: np.ndarray, short_pos: int | None, tail: int) -> np.ndarray:
    """``(count, block_size)`` blocks as wire data: flat, the block at ``short_pos`` trimmed to ``tail``."""
    flat = blocks.reshape(-1)
    if short_pos is None:
        return flat
    B = blocks.shape[1]
    return np.concatenate([flat[: short_pos * B + tail], flat[(short_pos + 1) * B:]])


def unwire(data: np.ndarray, count: int, block_size: int, short_pos: int | None, tail: int) -> np.ndarray:
    """Wire data of ``count`` blocks as a ``(count, block_size)`` array, padding the short block with 0."""
    if short_pos is None:
        return data.reshape(count, block_size)
    out = np.zeros((count, block_size), dtype=data.dtype)
    head = short_pos * block_size
    out[:short_pos] = data[:head].reshape(short_pos, block_size)
    out[short_pos, :tail] = data[head: head + tail]
    out[short_pos + 1:] = data[head + tail:].reshape(count - short_pos - 1, block_size)
    return out


def frame_buffer(frame: Any) -> memoryview:
    """A received frame (``zmq.Frame``, bytes, memoryview or array) as a memoryview, without copying."""
    if isinstance(frame, memoryview):
        return frame
    return memoryview(frame.buffer if hasattr(frame, "buffer") else frame)


def u64_frame(frame: Any, count: int, what: str) -> np.ndarray:
    """A frame as exactly ``count`` little-endian uint64 values (zero-copy)."""
    buf = frame_buffer(frame)
    if buf.nbytes != 8 * count:
        raise WireError(f"{what}: frame of {buf.nbytes} bytes, expected {8 * count} ({count} x uint64)")
    return np.frombuffer(buf, dtype="<u8")


def element_frame(frame: Any, storage: np.dtype, what: str, exactly: int | None = None) -> np.ndarray:
    """A frame as values of ``storage`` (zero-copy): ``exactly`` that many, else any whole number."""
    buf = frame_buffer(frame)
    if exactly is not None and buf.nbytes != exactly * storage.itemsize:
        raise WireError(f"{what}: frame of {buf.nbytes} bytes, expected {exactly * storage.itemsize} "
                        f"({exactly} x {storage})")
    if buf.nbytes % storage.itemsize:
        raise WireError(f"{what}: frame of {buf.nbytes} bytes is not a whole number of {storage} elements")
    return np.frombuffer(buf, dtype=storage)
