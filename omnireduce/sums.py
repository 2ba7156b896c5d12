"""The rank-order sum: how every summer of omnireduce adds blocks, so that all give the same bits.

Every sum omnireduce makes (an aggregator's slot, the collective engine's owners on the host and on
a device, a rank coalescing a sparse tensor's duplicate rows) is the same arithmetic: row ``p`` is
``((-0.0 + v0[p]) + v1[p]) + ...`` in float32, over the contributions that hold ``p`` in their
order (ranks ascending; a rank's duplicates in input order), each widened exactly from its dtype,
and the result is rounded once to the dtype afterwards (:func:`omnireduce.dtypes.narrow`, or
:func:`omnireduce.cuda.ops.narrow` on a device). -0.0 is the exact additive identity, so a row
only one contribution holds keeps its bits.

- :func:`add_in_order` is that definition, for numpy arrays and torch tensors alike (it only
  indexes and adds), which the device path uses as it is;
- :func:`rank_order_sum` gives the same bits for numpy contributions in storage form, faster: when
  every contribution holds every row it adds chunk by chunk (in cache) into the first one's buffer,
  and otherwise the first contribution to a row is assigned rather than added to -0.0 (IEEE
  addition is commutative, and -0.0 + x == x);
- :func:`add_repeats_in_order` adds contributions whose rows repeat (unbuffered, in order).

numpy only; no torch import.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from omnireduce.dtypes import DType, widen

#: One contribution: (positions of its rows among the sums, distinct; or None: every row, in order), rows.
Part = tuple[Any, Any]

_CHUNK_BYTES = 256 << 10  # float32 bytes of the sums added per pass of the dense case (stays in cache)


def accumulator(k: int, block_size: int) -> np.ndarray:
    """``k`` rows of ``block_size`` float32 zeros, negative (the identity every sum starts from)."""
    return np.full((k, block_size), -0.0, dtype=np.float32)


def add_in_order(acc: Any, parts: Sequence[Part]) -> Any:
    """Add each part's float32 rows into ``acc`` (rows from -0.0) at its positions, the parts in
    order; returns ``acc``. numpy arrays or torch tensors: only indexing and ``+=`` are used."""
    for pos, rows in parts:
        if pos is None:
            acc += rows
        else:
            acc[pos] += rows
    return acc


def add_repeats_in_order(acc: np.ndarray, positions: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """Add float32 ``rows`` into ``acc`` at ``positions``, which may repeat, one after the other in
    their order (unbuffered): a rank's duplicates of a row summed as the rank-order sum would."""
    np.add.at(acc, positions, rows)
    return acc


def rank_order_sum(k: int, block_size: int, parts: Sequence[Part], dtype: DType) -> np.ndarray:
    """The float32 sums of ``k`` rows from ``parts`` (in rank order; rows in ``dtype``'s storage form),
    bit for bit :func:`add_in_order` from -0.0; not yet rounded to ``dtype``. May sum into a part's
    buffer (a writable float32 one that holds every row); rows no part holds read -0.0."""
    acc = _sum_dense(k, parts, dtype)
    if acc is None:
        acc = _sum_sparse(k, block_size, parts, dtype)
    return acc


def _sum_dense(k: int, parts: Sequence[Part], dtype: DType) -> np.ndarray | None:
    """The sums when every part holds every row (a dense region): one pass over memory, in chunks
    that stay in cache, adding every other part's chunk (widened chunk by chunk) into the first
    part's buffer in order (the same bits as one whole-array add per part, with a third of the
    memory traffic for four ranks). None if some part holds fewer rows, or the first part's buffer
    cannot be summed into."""
    if len(parts) < 2 or any(pos is not None for pos, _ in parts):
        return None
    acc = widen(parts[0][1], dtype)
    if not acc.flags.writeable:
        return None
    others = [rows for _, rows in parts[1:]]
    step = max(1, _CHUNK_BYTES // max(1, acc.shape[1] * 4))
    for lo in range(0, k, step):
        chunk = acc[lo: lo + step]
        for rows in others:
            chunk += widen(rows[lo: lo + step], dtype)
    return acc


def _sum_sparse(k: int, block_size: int, parts: Sequence[Part], dtype: DType) -> np.ndarray:
    """The sums when parts hold different rows. A part's rows are written once: assigned to rows no
    earlier part held; where one did, the partial sum is added into the part's own (writable) rows
    first, which gives the same bits because IEEE addition is commutative. No Python loop over rows."""
    acc: np.ndarray | None = None
    seen = np.zeros(k, dtype=bool)
    for pos, rows in parts:
        values = widen(rows, dtype)
        if acc is None and pos is None and values.flags.writeable and values.dtype == np.float32:
            acc = values  # the first part holds every row: sum into its buffer in place
            seen[:] = True
            continue
        if acc is None:
            acc = np.empty((k, block_size), dtype=np.float32)
        if pos is None:  # every row: plain slices, no fancy indexing
            _add_all(acc, values, seen)
            continue
        again = np.flatnonzero(seen[pos])
        if again.size == pos.size:
            acc[pos] += values
        else:
            if again.size:
                if not values.flags.writeable:
                    values = values.copy()
                values[again] += acc[pos[again]]
            acc[pos] = values
        seen[pos] = True
    if acc is None:
        return accumulator(k, block_size)
    if not seen.all():
        acc[~seen] = -0.0
    return acc


def _add_all(acc: np.ndarray, values: np.ndarray, seen: np.ndarray) -> None:
    """Add ``values`` (every row) into ``acc``: assigned where no earlier part held the row."""
    if seen.all():
        acc += values
    elif not seen.any():
        acc[...] = values
    else:
        np.add(acc, values, out=acc, where=seen[:, None])
        np.copyto(acc, values, where=~seen[:, None])
    seen[:] = True
