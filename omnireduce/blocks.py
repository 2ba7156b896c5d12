"""Block and lane arithmetic, non-zero block detection, and block gather/scatter.

A tensor of ``n`` elements is cut into ``nb = ceil(n / B)`` blocks of ``B`` elements; the last block
may be short (``tail`` elements) and is never padded on the wire. Block ``b`` belongs to lane
``b mod T`` and row ``b div T``; lane ``l`` belongs to slot ``l div L``, and slot ``s`` is served by
aggregator ``s mod A``. ``T = S * L``. Interleaving lanes like this spreads a dense region of the
tensor (the hot rows of an embedding table) over every slot and every aggregator.

The geometry of one tensor is fixed by ``(n, B, L, S)``: :class:`Layout` shrinks ``L`` and ``S`` for
small tensors so that a tensor of a few blocks is one slot of a few lanes, and a tensor of zero
elements is still one (empty) slot, so that every rank still meets every other at the aggregator and
disagreements are caught.

Everything here is vectorised with numpy; nothing loops over blocks in Python.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import numpy as np

from omnireduce.dtypes import DType

#: "No further non-zero block in this lane" (a row that does not exist).
INF = 0xFFFFFFFF
ROW_DTYPE = np.dtype("<u4")
#: Most bytes of block data one message of a slot carries (a round: one block per lane; the lanes are
#: capped to fit). glibc serves an allocation above its mmap threshold (at most 32 MiB) with fresh
#: pages, returned to the kernel when freed, so a larger receive buffer page-faults on every touch,
#: every time: measured with 32 MiB frames (32768 lanes of 1 KiB blocks, a 400 MiB tensor), ~99,000
#: page faults per all-reduce and rank; with 30 MiB frames ~1,100.
MAX_FRAME_BYTES = 30 << 20
#: Fewest lanes per slot a tensor is split into (unless it has fewer blocks, or lanes are capped lower).
MIN_LANES = 1024


@dataclasses.dataclass(frozen=True)
class Layout:
    """The block geometry of one tensor, identical on every rank that reduces it. (Its derived
    quantities are computed once per instance: they are read for every message.)"""

    numel: int
    block_size: int
    lanes: int  # L: lanes per slot for this tensor
    slots: int  # S: slots of this tensor

    @classmethod
    def for_tensor(cls, numel: int, block_size: int, max_lanes: int, max_slots: int, itemsize: int = 4) -> Layout:
        """The layout of a tensor of ``numel`` elements (of ``itemsize`` bytes) under the configured
        lane and slot limits.

        Blocks are spread over all ``max_slots`` slots first (so every aggregator gets work), with
        at least ``min(max_lanes, MIN_LANES)`` lanes per slot (so a small tensor is one slot, not
        many tiny ones); lanes grow up to ``max_lanes`` before rows do. A tensor of up to
        ``max_lanes * max_slots`` blocks therefore has one row per lane: one data round per slot.
        ``max_lanes`` is first capped so that a round's blocks (one per lane) fit in
        :data:`MAX_FRAME_BYTES`.
        """
        if block_size < 1 or max_lanes < 1 or max_slots < 1:
            raise ValueError(f"block_size, lanes and slots must be >= 1 (got {block_size}, "
                             f"{max_lanes}, {max_slots})")
        max_lanes = max(1, min(max_lanes, MAX_FRAME_BYTES // (block_size * max(1, itemsize))))
        nb = -(-numel // block_size)
        lanes = min(max_lanes, max(min(max_lanes, MIN_LANES), -(-nb // max_slots)))
        lanes = max(1, min(lanes, nb))
        slots = max(1, min(max_slots, -(-nb // lanes)))
        return cls(numel, block_size, lanes, slots)

    @functools.cached_property
    def num_blocks(self) -> int:
        return -(-self.numel // self.block_size)

    @functools.cached_property
    def full_blocks(self) -> int:
        """Blocks holding exactly ``block_size`` elements."""
        return self.numel // self.block_size

    @functools.cached_property
    def tail(self) -> int:
        """Elements in the last block if it is short, else 0."""
        return self.numel % self.block_size

    @functools.cached_property
    def total_lanes(self) -> int:
        return self.lanes * self.slots

    @functools.cached_property
    def rows(self) -> int:
        """Rows per lane: ``ceil(nb / T)``."""
        return -(-self.num_blocks // self.total_lanes)

    @functools.cached_property
    def one_round(self) -> bool:
        """Every lane holds at most one row: each non-zero block is summed in the slot's first round,
        so ranks send their blocks with the bootstrap (no instruction needed first)."""
        return self.rows <= 1

    @functools.cached_property
    def row_width(self) -> int:
        """Bytes per row number on the wire: 0 when every lane has one row (it is always 0)."""
        r = self.rows
        return 0 if r <= 1 else 1 if r <= 1 << 8 else 2 if r <= 1 << 16 else 4

    def slot_blocks(self, slot: int, lanes: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """Block indices of ``(row, lane)`` pairs of ``slot`` (lanes local to the slot)."""
        return rows.astype(np.int64) * self.total_lanes + (slot * self.lanes) + lanes.astype(np.int64)

    def short_index(self, ids: np.ndarray) -> int | None:
        """Position within the block ids ``ids`` of the tensor's short last block, or None if it is
        not among them (or every block is full). The one place that answers this question."""
        if not self.tail or ids.size == 0:
            return None
        hit = np.flatnonzero(ids == self.num_blocks - 1)
        return int(hit[0]) if hit.size else None

    def holds_short(self, slot: int) -> bool:
        """Whether ``slot`` holds the short last block (so its rounds may carry a trimmed block)."""
        return bool(self.tail) and (self.num_blocks - 1) % self.total_lanes // self.lanes == slot

    def valid_rows(self, slot: int) -> np.ndarray:
        """For each local lane of ``slot``: how many rows hold a block (blocks past nb do not exist).
        Read-only (shared between the slots of tensors of the same geometry)."""
        return _valid_rows(self, slot)


@functools.lru_cache(maxsize=256)
def _valid_rows(layout: Layout, slot: int) -> np.ndarray:
    first = slot * layout.lanes + np.arange(layout.lanes, dtype=np.int64)
    rows = np.maximum(0, -(-(layout.num_blocks - first) // layout.total_lanes))
    rows.flags.writeable = False
    return rows


def _word_view(raw: np.ndarray, dtype: DType, block_size: int) -> tuple[np.ndarray, int]:
    """The full blocks of ``raw`` as a 2-D array of the widest unsigned words that tile a block,
    and the magnitude mask replicated over one word."""
    word, width, mask = _words(dtype, block_size)
    full = raw.size // block_size
    words: np.ndarray = raw[: full * block_size].view(word).reshape(full, block_size * dtype.itemsize // width)
    return words, mask


@functools.lru_cache(maxsize=64)
def _words(dtype: DType, block_size: int) -> tuple[type, int, int]:
    """The word type that tiles a block of ``block_size`` elements of ``dtype``, its width in bytes, and the
    magnitude mask replicated over one word (worked out once per dtype and block size)."""
    nbytes = block_size * dtype.itemsize
    width = 8 if nbytes % 8 == 0 else (4 if nbytes % 4 == 0 else 2)
    word = {8: np.uint64, 4: np.uint32, 2: np.uint16}[width]
    elem_bits = dtype.itemsize * 8
    mask = 0
    for i in range(max(1, width // dtype.itemsize)):
        mask |= dtype.magnitude_mask << (i * elem_bits)
    mask &= (1 << (width * 8)) - 1
    return word, width, mask


#: Blocks scanned per pass of :func:`block_nonzero`: its temporaries stay at a few hundred KiB
#: whatever the tensor's size (one pass over a 256 MiB tensor used to allocate 4 MiB of words, and
#: 320 MiB in lossy mode), which matters on threads whose heap keeps what it once held.
SCAN_BLOCKS = 1 << 14


def block_nonzero(raw: np.ndarray, dtype: DType, block_size: int, threshold: float = 0.0) -> np.ndarray:
    """Which blocks of the flat array ``raw`` (elements in ``dtype.storage``) hold a non-zero element.

    Exact mode (``threshold == 0``): a block is non-zero iff some element has a magnitude bit set, so
    NaN and Inf count and -0.0 does not. One pass: bitwise OR of each block's words, then the mask.
    Lossy mode (``threshold > 0``): a block is zero iff every ``|x| <= threshold`` (NaN is not).
    Both scan :data:`SCAN_BLOCKS` blocks at a time (the flags are the only array of the tensor's size).
    """
    nb = -(-raw.size // block_size)
    flags = np.empty(nb, dtype=bool)
    full = raw.size // block_size
    if threshold > 0.0:
        from omnireduce.dtypes import widen

        for a in range(0, full, SCAN_BLOCKS):
            b = min(full, a + SCAN_BLOCKS)
            blocks = widen(raw[a * block_size: b * block_size], dtype).reshape(b - a, block_size)
            flags[a:b] = ~np.all(np.abs(blocks) <= threshold, axis=1)
        if full < nb:
            tail = widen(raw[full * block_size:], dtype)
            flags[full] = not np.all(np.abs(tail) <= threshold)
        return flags
    if full:
        words, mask = _word_view(raw, dtype, block_size)
        scratch = np.empty(SCAN_BLOCKS, dtype=words.dtype) if full > SCAN_BLOCKS else None  # (one pass: none)
        for a in range(0, full, SCAN_BLOCKS):
            b = min(full, a + SCAN_BLOCKS)
            ored = np.bitwise_or.reduce(words[a:b], axis=1, out=None if scratch is None else scratch[: b - a])
            np.bitwise_and(ored, words.dtype.type(mask), out=ored)
            np.not_equal(ored, 0, out=flags[a:b])
    if full < nb:
        tail = raw[full * block_size:].view(np.uint32 if dtype.itemsize == 4 else np.uint16)
        flags[full] = bool(np.any(tail & tail.dtype.type(dtype.magnitude_mask)))
    return flags


class LaneIndex:
    """A rank's non-zero blocks ordered by lane, then row, and each lane's next unsent row.

    ``next[l]`` is the row of lane ``l``'s next non-zero block not yet sent (INF if none), for all
    ``T`` lanes; ``pending(slot)`` is a view of one slot's lanes, and ``advance`` moves the lanes
    that just sent on to their following non-zero row. Work is proportional to the lanes that
    move, not to the slot's lanes. With one row per lane (the common case) no ordering is needed.

    Built from flags of every block (``LaneIndex(layout, nonzero)``), or from the sorted ids of the
    non-zero blocks (:meth:`from_ids`): then nothing of the tensor's block count is allocated, only
    arrays of the ``T`` lanes and of the ids, which is what a sparse tensor of a huge table needs.
    """

    _ids: np.ndarray | None = None  # from_ids() with one row per lane: the non-zero lanes (for reset)

    def __init__(self, layout: Layout, nonzero: np.ndarray) -> None:
        self.layout = layout
        T, R = layout.total_lanes, layout.rows
        self.next = np.full(T, INF, dtype=ROW_DTYPE)
        self._nonzero: np.ndarray | None = nonzero  # kept (not copied) for reset(); the caller keeps it
        if R <= 1:
            self.next[: nonzero.size][nonzero] = 0
            self._rows = self._ptr = self._end = None
            return
        grid = np.zeros(T * R, dtype=bool)
        grid[: nonzero.size] = nonzero
        order = np.flatnonzero(grid.reshape(R, T).T)  # lane-major: lane * R + row
        self._rows = np.append((order % R).astype(ROW_DTYPE), ROW_DTYPE.type(INF))  # INF sentinel
        counts = np.bincount(order // R, minlength=T)
        self._end = np.cumsum(counts, dtype=_positions(order.size))  # (int32 where it fits: arrays of every lane)
        self._ptr = self._end - counts.astype(self._end.dtype, copy=False)
        has = counts > 0
        self.next[has] = self._rows[self._ptr[has]]

    @classmethod
    def from_ids(cls, layout: Layout, ids: np.ndarray) -> LaneIndex:
        """The index of the non-zero blocks ``ids`` (ascending, unique, each ``< layout.num_blocks``).

        The same index as ``LaneIndex(layout, flags)`` with ``flags[ids]`` set, in O(k log k + T)
        time and memory for k ids and T lanes, whatever the tensor's size."""
        self = cls.__new__(cls)
        self.layout = layout
        T, R = layout.total_lanes, layout.rows
        self.next = np.full(T, INF, dtype=ROW_DTYPE)
        self._nonzero = None
        ids = np.asarray(ids, dtype=np.int64)
        if R <= 1:  # block id == lane
            self._ids = ids
            self.next[ids] = 0
            self._rows = self._ptr = self._end = None
            return self
        lane, row = ids % T, ids // T
        order = np.argsort(lane * R + row, kind="stable")  # lane-major, rows ascending within a lane
        self._rows = np.append(row[order].astype(ROW_DTYPE), ROW_DTYPE.type(INF))  # INF sentinel
        counts = np.bincount(lane, minlength=T)
        self._end = np.cumsum(counts, dtype=_positions(ids.size))
        self._ptr = self._end - counts.astype(self._end.dtype, copy=False)
        has = counts > 0
        self.next[has] = self._rows[self._ptr[has]]
        return self

    def reset(self, slot: int) -> None:
        """Forget what ``slot``'s lanes have sent: they start again at their first non-zero row.

        (Rare: only after an aggregator restart, so the starting state is derived, not stored.)"""
        lo, hi = slot * self.layout.lanes, (slot + 1) * self.layout.lanes
        if self._ptr is None or self._end is None or self._rows is None:
            self.next[lo:hi] = INF
            if self._nonzero is not None:
                flags = self._nonzero[lo:hi]
                self.next[lo: lo + flags.size][flags] = 0
            elif self._ids is not None:
                a, b = np.searchsorted(self._ids, [lo, hi])
                self.next[self._ids[a:b]] = 0
            return
        start = np.empty(hi - lo, dtype=self._end.dtype)  # lane l's first entry is where lane l-1's end
        start[0] = self._end[lo - 1] if lo else 0
        start[1:] = self._end[lo: hi - 1]
        self._ptr[lo:hi] = start
        end = self._end[lo:hi]
        self.next[lo:hi] = np.where(start < end, self._rows[np.minimum(start, self._rows.size - 1)], INF)

    def pending(self, slot: int) -> np.ndarray:
        """Next unsent row of each lane of ``slot`` (INF where none is left); a view, do not modify."""
        return self.next[slot * self.layout.lanes: (slot + 1) * self.layout.lanes]

    def advance(self, slot: int, lanes: np.ndarray) -> np.ndarray:
        """Mark the current blocks of ``lanes`` (of ``slot``) sent; returns their new next rows."""
        g = slot * self.layout.lanes + lanes.astype(np.int64)
        if self._rows is None:
            self.next[g] = INF
            return np.full(lanes.size, INF, dtype=ROW_DTYPE)
        assert self._ptr is not None and self._end is not None
        p = self._ptr[g] + 1
        self._ptr[g] = p
        nxt = np.where(p < self._end[g], self._rows[np.minimum(p, self._rows.size - 1)], INF).astype(ROW_DTYPE)
        self.next[g] = nxt
        return nxt


def _positions(count: int) -> type[np.integer]:
    """The integer type of positions in ``count`` entries: int32 where it holds them, else int64."""
    return np.int32 if count < 2**31 else np.int64


def _is_run(ids: np.ndarray) -> bool:
    return ids.size > 0 and int(ids[-1]) - int(ids[0]) == ids.size - 1 and bool(np.all(np.diff(ids) == 1))


def gather_blocks(raw: np.ndarray, layout: Layout, ids: np.ndarray) -> np.ndarray:
    """The blocks ``ids`` of the flat array ``raw``, concatenated as they go on the wire.

    A run of consecutive blocks is returned as a view (no copy); the short last block is trimmed.
    """
    B, n = layout.block_size, layout.numel
    if ids.size == 0:
        return raw[:0]
    if _is_run(ids):
        return raw[int(ids[0]) * B: min(n, (int(ids[-1]) + 1) * B)]
    full = layout.full_blocks
    p = layout.short_index(ids)
    if p is None:
        return raw[: full * B].reshape(full, B)[ids].reshape(-1)
    blocks = raw[: full * B].reshape(full, B)
    return np.concatenate([blocks[ids[:p]].reshape(-1), raw[full * B:], blocks[ids[p + 1:]].reshape(-1)])


def scatter_blocks(raw: np.ndarray, layout: Layout, ids: np.ndarray, data: np.ndarray,
                   write: Callable[[np.ndarray, np.ndarray], None] | None = None) -> None:
    """Write wire-format ``data`` (the blocks ``ids``, short block trimmed) into ``raw`` in place.

    ``write(dst, src)`` may be given to store a function of the data (e.g. divided by the world
    size) into ``dst``, a writable array of ``raw``'s dtype shaped like ``src``.
    """
    if ids.size == 0:
        return
    B, n, full = layout.block_size, layout.numel, layout.full_blocks

    def put(dst: np.ndarray, src: np.ndarray) -> None:
        if write is None:
            dst[...] = src
        else:
            write(dst, src)

    if _is_run(ids):
        put(raw[int(ids[0]) * B: min(n, (int(ids[-1]) + 1) * B)], data)
        return
    blocks = raw[: full * B].reshape(full, B)

    def put_rows(sel: np.ndarray, src: np.ndarray) -> None:
        if sel.size == 0:
            return
        src = src.reshape(sel.size, B)
        if write is None:
            blocks[sel] = src
        else:
            tmp = np.empty_like(src, dtype=raw.dtype)
            write(tmp, src)
            blocks[sel] = tmp

    p = layout.short_index(ids)
    if p is None:
        put_rows(ids, data)
        return
    head, mid = p * B, p * B + layout.tail
    put_rows(ids[:p], data[:head])
    put(raw[full * B:], data[head:mid])
    put_rows(ids[p + 1:], data[mid:])


def zero_blocks(raw: np.ndarray, layout: Layout, ids: np.ndarray) -> None:
    """Set the blocks ``ids`` of ``raw`` to +0."""
    full, B = layout.full_blocks, layout.block_size
    raw[: full * B].reshape(full, B)[ids[ids < full]] = 0
    if layout.tail and ids.size and ids[-1] >= full:
        raw[full * B:] = 0
