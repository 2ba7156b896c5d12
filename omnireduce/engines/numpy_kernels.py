"""The kernel exchange's four calls in numpy, for host tensors: the collective engine's host path.

Design. :func:`omnireduce.engines.exchange_kernels.reduce` drives a reduction through four calls
(``record``, ``counts``, ``rows``, ``sum_blocks``) whose per-item steps ``csrc/exchange_steps.h``
defines; the CUDA extension runs them as kernels. :class:`NumpyKernels` runs each as a few
whole-array numpy operations on a CPU tensor's memory (no copy of the tensor; bfloat16 as its raw
16-bit words), with the same results, byte for byte: the bitmaps in numpy's ``packbits`` order, the
exclusive prefix sums of their bytes' popcounts, the counts vector, rows padded with +0, and every
union block summed in float32 from -0.0 in source (rank) order, rounded once to the element type,
then times ``scale`` in float32 and rounded again when ``scale != 1`` (a float16 NaN is rounded to
``0x7E00`` with its sign, as torch's conversion and the kernels' do). A block's row among a source's
is its place among that source's set bits, found from the unpacked bitmap.

Why: a host bucket through :mod:`omnireduce.engines.exchange_device`'s torch ops pays for about fifty
op dispatches and their Python per reduction; here it is about twenty numpy calls. A float32
tensor's sums are made in the tensor itself by torch's ``index_fill_`` and ``index_add_`` (one pass
over the rows each, where numpy's indexed add makes a gather, a sum and a scatter); a half type's
in float32 a chunk of :data:`CHUNK_BLOCKS` union blocks at a time. No temporary grows with the
union, and an all-gather's parts are read where they arrived (``takes_parts``), never stacked.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from omnireduce.blocks import block_nonzero
from omnireduce.dtypes import DType, bf16_to_f32, f32_to_bf16

Rows = torch.Tensor | list[torch.Tensor]
"""Every source's rows: one ``[sources, rows, B]`` tensor, or a list of ``[rows, B]`` ones."""

CHUNK_BLOCKS = 1024
"""Union blocks summed at a time by :meth:`NumpyKernels.sum_blocks` (its float32 temporaries are this
many blocks)."""

NUMPY_ROWS = 64
"""Rows summed or filled by numpy's indexing up to this many (a call costs less), by torch's index ops
above (one pass over the rows, where numpy's indexed add gathers, adds and scatters)."""

_DTYPES = {torch.float32: DType.FLOAT32, torch.float16: DType.FLOAT16, torch.bfloat16: DType.BFLOAT16}
_POPCOUNT = np.array([bin(v).count("1") for v in range(256)], dtype=np.int32)


class NumpyKernels:
    """The kernel exchange's calls on CPU tensors (see the module; the arguments are the CUDA
    extension's, ``csrc/bindings.cpp``, whose record is at least ``head`` bytes even without rows:
    here a bitmap alone is its ``nbytes``)."""

    pads_bitmaps = False
    takes_parts = True  # (an all-gather's parts as a list of each rank's, not stacked)

    def record(self, x: torch.Tensor, B: int, threshold: float, out: torch.Tensor, head: int,
               cap: int) -> torch.Tensor:
        """This rank's bitmap into ``out[:nbytes]`` and its first ``cap`` non-zero blocks as rows from
        byte ``head`` on; returns the prefix sums of the bitmap's popcounts (``nbytes + 1``, int32)."""
        raw, dtype = _raw(x)
        nb = -(-raw.size // B)
        flags = block_nonzero(raw, dtype, B, threshold) if nb else np.zeros(0, dtype=bool)
        o = out.numpy()
        nbytes = -(-nb // 8)
        o[:nbytes] = np.packbits(flags)
        if cap:
            rows = o[head: head + cap * B * dtype.itemsize].view(dtype.storage).reshape(cap, B)
            _take(raw, B, np.flatnonzero(flags)[:cap], rows)
        return torch.from_numpy(_prefix(o[:nbytes]))

    def rows(self, x: torch.Tensor, B: int, bitmap: torch.Tensor, prefix: torch.Tensor, mask: torch.Tensor | None,
             lo: int, hi: int, out: torch.Tensor) -> None:
        """The blocks ``bitmap`` has whose places among its set blocks are in ``[lo, hi)``, as rows of
        ``out`` from its first (a block ``mask`` lacks written as +0)."""
        raw, _ = _raw(x)
        nb = -(-raw.size // B)
        ids = np.flatnonzero(_unpack(bitmap.numpy(), nb))[lo:hi]
        dst = _raw(out)[0]
        _take(raw, B, ids, dst)
        if mask is not None:
            lacking = ~_unpack(mask.numpy(), nb)[ids]
            dst[: ids.size][lacking] = 0

    def counts(self, gathered: torch.Tensor | list[torch.Tensor], nb: int, lanes: int,
               pairs: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Every rank's bitmap (the first bytes of ``gathered``'s rows, or of its parts) and their union
        as ``[W + 1, nbytes]``, the prefix sums of their popcounts over that whole array, and the counts
        vector (:meth:`omnireduce.engines.plan.Counts.from_flat`)."""
        W, nbytes = len(gathered), -(-nb // 8)
        bits = np.empty((W + 1, nbytes), dtype=np.uint8)
        for r in range(W):
            bits[r] = gathered[r][:nbytes].numpy()
        if nb % 8:  # (the last byte's padding bits cleared)
            bits[:W, -1] &= np.uint8((0xFF << (8 - nb % 8)) & 0xFF)
        np.bitwise_or.reduce(bits[:W], axis=0, out=bits[W])
        ones = _POPCOUNT[bits]
        per_row = ones.sum(axis=1, dtype=np.int64)
        last = (int(bits[W, (nb - 1) >> 3]) >> (7 - ((nb - 1) & 7))) & 1 if nb else 0
        parts = [per_row, np.array([last], dtype=np.int64)]
        if pairs:
            flags = _unpack(bits, nb)
            owner = _owners(nb, lanes, W)
            parts += [np.concatenate([np.bincount(owner[flags[s]], minlength=W) for s in range(W)]),
                      np.bincount(owner[flags[W]], minlength=W)]
        prefix = np.zeros(ones.size + 1, dtype=np.int32)
        np.cumsum(ones.reshape(-1), out=prefix[1:])
        return torch.from_numpy(bits), torch.from_numpy(prefix), torch.from_numpy(np.concatenate(parts))

    def sum_blocks(self, x: torch.Tensor, B: int, bits: torch.Tensor, prefix: torch.Tensor, target: int,
                   src_row: int, nsrc: int, first: Rows | None, rest: Rows | None, scale: float) -> None:
        """Every block of bitmap row ``target`` = the sum of its rows over the sources ``src_row ..
        src_row + nsrc - 1`` that have it: source ``s``'s row at place ``p`` is ``first[s, p]`` below
        ``first``'s ``cap`` rows, else ``rest[s, p - cap]`` (see the module for the rounding). Inf and
        NaN are summed without a numpy warning: an AMP step that overflowed is no error here."""
        with np.errstate(invalid="ignore", over="ignore"):
            self._sum_blocks(x, B, bits, target, src_row, nsrc, first, rest, scale)

    @staticmethod
    def _scaled(dest: torch.Tensor, rows: torch.Tensor | np.ndarray, scale: np.float32,
                scratch: torch.Tensor | None = None) -> None:
        """``dest``'s ``rows`` times ``scale``: one float32 product each, rounded once, a chunk of rows at a time,
        each chunk read into ``scratch`` (a ``[chunk rows, B]`` tensor of ``dest``'s dtype kept by the caller)
        where one is given, else into a fresh tensor."""
        rows = torch.from_numpy(rows) if isinstance(rows, np.ndarray) else rows
        step = CHUNK_BLOCKS if scratch is None else scratch.shape[0]
        for lo in range(0, rows.numel(), step):
            chunk = rows[lo: lo + step]
            got = dest.index_select(0, chunk) if scratch is None else \
                torch.index_select(dest, 0, chunk, out=scratch[: chunk.numel()])
            dest.index_copy_(0, chunk, got.mul_(float(scale)))

    @staticmethod
    def _sum_blocks(x: torch.Tensor, B: int, bits: torch.Tensor, target: int, src_row: int, nsrc: int,
                    first: Rows | None, rest: Rows | None, scale: float) -> None:
        raw, dtype = _raw(x)
        n = raw.size
        nb, full = -(-n // B), n // B
        flags = _unpack(bits.numpy(), nb)
        targets = np.flatnonzero(flags[target])
        if targets.size == 0:
            return
        cap = first[0].shape[0] if first is not None else 0
        s32 = np.float32(scale)
        within = not (flags[src_row: src_row + nsrc] & ~flags[target]).any()  # (the exchanges' case)
        if dtype is DType.FLOAT32 and full and within:
            _sum_in_place(x, B, flags[src_row: src_row + nsrc], targets, cap, _sources(first), _sources(rest), s32)
            return
        heads, tails = _arrays(first), _arrays(rest)
        body = raw[: full * B].reshape(full, B)
        sources = [(s, flags[src_row + s], np.cumsum(flags[src_row + s]) - 1) for s in range(nsrc)]
        for lo in range(0, targets.size, CHUNK_BLOCKS):
            ids = targets[lo: lo + CHUNK_BLOCKS]
            acc = np.full((ids.size, B), -0.0, dtype=np.float32)
            for s, has, place in sources:
                here = np.flatnonzero(has[ids])  # (rows of acc this source adds to)
                if here.size == 0:
                    continue
                p = place[ids[here]]
                whole = here.size == ids.size and p[-1] - p[0] == ids.size - 1  # (a run of this source's rows)
                if whole and (p[-1] < cap or p[0] >= cap):
                    rows = heads[s][p[0]: p[-1] + 1] if p[-1] < cap else tails[s][p[0] - cap: p[-1] + 1 - cap]
                    acc += _widen(rows, dtype)
                    continue
                inside = p < cap
                if inside.all():
                    acc[here] += _widen(heads[s][p], dtype)
                    continue
                if inside.any():
                    acc[here[inside]] += _widen(heads[s][p[inside]], dtype)
                acc[here[~inside]] += _widen(tails[s][p[~inside] - cap], dtype)
            out = _narrow(acc, dtype)
            if s32 != np.float32(1.0):
                out = _narrow(_widen(out, dtype) * s32, dtype)
            short = ids[-1] == full  # (ascending: only the last can be the short block)
            if short:
                raw[full * B:] = out[-1, : n - full * B]
                ids, out = ids[:-1], out[:-1]
            body[ids] = out


def _sum_in_place(x: torch.Tensor, B: int, has: np.ndarray, targets: np.ndarray, cap: int,
                  heads: list[torch.Tensor], tails: list[torch.Tensor], scale: np.float32) -> None:
    """:meth:`NumpyKernels.sum_blocks` for a float32 tensor of a whole block or more, summed in the
    tensor itself (the sources' rows are copies elsewhere): :func:`sums_in_place`."""
    sums_in_place(x.numpy(), B, has, targets, cap, [h.numpy() for h in heads], [t.numpy() for t in tails], scale)


def sums_in_place(raw: np.ndarray, B: int, every: np.ndarray, targets: np.ndarray, cap: int,
                  heads: list[np.ndarray], tails: list[np.ndarray], scale: np.float32,
                  scratch: torch.Tensor | None = None) -> None:
    """The union's sums of a float32 tensor of a whole block or more, in the tensor itself: its
    ``targets`` (ascending block ids) set to -0.0, every rank's rows (``every[s]``'s blocks: its first
    ``cap`` in ``heads[s]``, the rest in ``tails[s]``) added in rank order, then times ``scale``, each a
    float32 operation rounded once (Inf and NaN summed without a numpy warning).
    The short last block, if a target, is summed in one row of its own. Few rows go by numpy's
    indexing, many by torch's index ops (:data:`NUMPY_ROWS`), scaled a chunk at a time through
    ``scratch`` (a float32 ``[rows, B]`` buffer the engine keeps: no fresh tensor per chunk)."""
    with np.errstate(invalid="ignore", over="ignore"):
        _sums(raw, B, every, targets, cap, heads, tails, scale, scratch)


def _sums(raw: np.ndarray, B: int, every: np.ndarray, targets: np.ndarray, cap: int, heads: list[np.ndarray],
          tails: list[np.ndarray], scale: np.float32, scratch: torch.Tensor | None = None) -> None:
    n = raw.size
    full = n // B
    short = targets[-1] == full  # (ascending: only the last can be the short block)
    whole = targets[:-1] if short else targets
    body = raw[: full * B].reshape(full, B)
    big = whole.size > NUMPY_ROWS
    dest = torch.from_numpy(body) if big else None
    if dest is not None:
        dest.index_fill_(0, torch.from_numpy(whole), -0.0)
    else:
        body[whole] = -0.0
    tail = np.full(B, -0.0, dtype=np.float32) if short else None
    for s in range(every.shape[0]):
        ids = np.flatnonzero(every[s])
        if ids.size == 0:
            continue
        if tail is not None and ids[-1] == full:
            p = ids.size - 1
            tail += heads[s][p] if p < cap else tails[s][p - cap]
            ids = ids[:-1]
        k = min(ids.size, cap)
        for at, rows in ((ids[:k], heads[s][:k] if k else None), (ids[k:], tails[s][: ids.size - k] if ids.size > k
                                                                  else None)):
            if rows is None:
                continue
            if dest is not None and at.size > NUMPY_ROWS:
                dest.index_add_(0, torch.from_numpy(at), torch.from_numpy(rows))
            else:
                body[at] += rows
    if scale != np.float32(1.0):
        if dest is not None:
            NumpyKernels._scaled(dest, whole, scale, scratch)
        else:
            body[whole] *= scale
        if tail is not None:
            tail *= scale
    if tail is not None:
        raw[full * B:] = tail[: n - full * B]


def _sources(rows: Rows | None) -> list[torch.Tensor]:
    """Every source's rows, a ``[rows, B]`` tensor per source (none for None)."""
    return [] if rows is None else list(rows)


def _arrays(rows: Rows | None) -> list[np.ndarray]:
    """Every source's rows in numpy (their storage type), a ``[rows, B]`` array per source (none for None)."""
    if rows is None:
        return []
    return [_raw(r)[0] for r in rows]  # (a tensor's first dimension, or a list's items: the sources)


def _raw(t: torch.Tensor) -> tuple[np.ndarray, DType]:
    """A CPU tensor's memory as numpy (its storage type: bfloat16 as uint16 words) and its dtype."""
    dtype = _DTYPES[t.dtype]
    t = t.detach()
    return (t.view(torch.int16).numpy().view(np.uint16) if dtype is DType.BFLOAT16 else t.numpy()), dtype


def _take(raw: np.ndarray, B: int, ids: np.ndarray, out: np.ndarray) -> None:
    """Blocks ``ids`` (ascending) of the flat ``raw`` into the first rows of ``out``; the short last
    block padded with +0."""
    k = ids.size
    if k == 0:
        return
    n = raw.size
    full = n // B
    if ids[-1] == full and n % B:
        out[k - 1, : n - full * B] = raw[full * B:]
        out[k - 1, n - full * B:] = 0
        k -= 1
    if k:
        np.take(raw[: full * B].reshape(full, B), ids[:k], axis=0, out=out[:k], mode="clip")


def _unpack(packed: np.ndarray, nb: int) -> np.ndarray:
    """Bitmap bytes (last axis) as ``nb`` bool flags."""
    return np.unpackbits(packed, axis=-1, count=nb).view(np.bool_)


def _prefix(packed: np.ndarray) -> np.ndarray:
    """The exclusive prefix sums of the bytes' popcounts, one more than the bytes, int32."""
    out = np.zeros(packed.size + 1, dtype=np.int32)
    np.cumsum(_POPCOUNT[packed], out=out[1:])
    return out


@functools.lru_cache(maxsize=8)
def _owners(nb: int, lanes: int, world: int) -> np.ndarray:
    """Each block's owner, ``(b mod lanes) mod world`` (made once per layout; read-only)."""
    owner = np.arange(nb, dtype=np.int64) % lanes % world
    owner.flags.writeable = False
    return owner


def _widen(raw: np.ndarray, dtype: DType) -> np.ndarray:
    """Storage words to float32 (float16 by torch's conversion: numpy's is element by element)."""
    if dtype is DType.BFLOAT16:
        return bf16_to_f32(raw)
    if dtype is DType.FLOAT16:
        return torch.from_numpy(np.ascontiguousarray(raw)).float().numpy()
    return raw


def _narrow(values: np.ndarray, dtype: DType) -> np.ndarray:
    """float32 to the storage type, to nearest even (float16 by torch's conversion, a NaN made
    ``sign | 0x7E00`` whatever its payload: the kernels' host steps')."""
    if dtype is DType.FLOAT32:
        return values
    if dtype is DType.BFLOAT16:
        return f32_to_bf16(values)
    out = torch.from_numpy(np.ascontiguousarray(values)).half().numpy()
    nan = np.isnan(values)
    if nan.any():
        sign = (values.view(np.uint32)[nan] >> 16).astype(np.uint16) & np.uint16(0x8000)
        out.view(np.uint16)[nan] = sign | np.uint16(0x7E00)
    return out
