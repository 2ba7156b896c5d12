"""A sparse COO tensor's rows through the collective engine's group: who owns a block, and the rows' exchange.

A sparse gradient's rows are its blocks (:mod:`omnireduce.sources.sparse`: nothing of the table's
size is read). Block ``b`` is in lane ``b mod T`` and owned by rank ``lane mod W`` (:func:`owners`):
each rank sends its rows to their owners, which sum them in rank order in float32 from -0.0 and round
once (the aggregators' bits), then every owner's sums go to every rank. Every array here grows with the
rows touched, none with the table.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
import torch

from omnireduce.blocks import Layout
from omnireduce.dtypes import DType, narrow
from omnireduce.engines.waits import Wire
from omnireduce.sources.sparse import SparseSource, check_sparse
from omnireduce.sums import rank_order_sum


class Rows(NamedTuple):
    """What a rows' exchange moved (this rank's bytes) and counted (blocks in all, here, in the union)."""

    sent: int
    received: int
    total: int
    nonzero: int
    union: int


def owners(layout: Layout, world_size: int) -> np.ndarray:
    """The rank owning each block: block ``b`` is in lane ``b mod T``, owned by rank ``lane mod W``.
    (By lane rather than by slot: a small tensor is one slot of many lanes, and by slot one rank
    would sum all of it; by lane every rank owns a share of any tensor of W blocks or more, and a
    hot region of consecutive blocks is spread over every rank. Who sums a block does not change
    its sum.)"""
    return owner_of(np.arange(layout.num_blocks, dtype=np.int64), layout, world_size)


def owner_of(ids: Any, layout: Layout, world_size: int) -> Any:
    """The owners of blocks ``ids`` (a numpy array or a torch tensor), as :func:`owners` says."""
    return (ids % layout.total_lanes) % world_size


def owned_sums(mine: np.ndarray, parts: list[tuple[np.ndarray, np.ndarray]], B: int, dtype: DType) -> np.ndarray:
    """The sums of the blocks (or rows) ``mine`` (ascending ids) from ``parts``, each rank's
    ``(ids, rows of B in storage form)`` in rank order: :func:`omnireduce.sums.rank_order_sum`
    (float32, from -0.0), rounded once to ``dtype``'s storage (the aggregators' bits)."""
    positioned = [(None if ids.size == mine.size else np.searchsorted(mine, ids), rows.reshape(-1, B))
                  for ids, rows in parts if ids.size]
    return narrow(rank_order_sum(mine.size, B, positioned, dtype), dtype)


def reduce_rows(tensor: torch.Tensor, average: bool, wire: Wire, me: int, W: int, lanes: int, slots: int
                ) -> tuple[torch.Tensor, Rows]:
    """A sparse COO tensor over ``wire`` (rank ``me`` of ``W``; ``lanes`` and ``slots`` lay out its rows):
    each rank's coalesced rows go to their owners, which sum them in rank order; every owner's union
    rows and sums go to every rank. Returns the new coalesced COO tensor, as the aggregators give it
    (averaged with ``average``), and what the exchange moved and counted."""
    dtype, rows, dim = check_sparse(tensor)
    src = SparseSource(tensor, dtype, rows, dim, lanes, slots)
    ids = src.block_ids()
    lay = src.layout
    B = lay.block_size
    storage = np.dtype(dtype.storage)
    owner = owner_of(ids, lay, W)
    order = np.argsort(owner, kind="stable")
    send_ids = ids[order]
    counts = wire.all_gather_ints(np.bincount(owner, minlength=W))  # [W sources, W owners]
    recv_counts = [int(counts[s][me]) for s in range(W)]
    send_counts = [int(c) for c in counts[me]]
    got_ids = wire.exchange(_split(send_ids, send_counts), recv_counts, np.dtype(np.int64))
    got_rows = wire.exchange(_split(src.gather(send_ids).reshape(-1, B), send_counts), [n * B for n in recv_counts],
                             storage)
    mine = np.unique(np.concatenate(got_ids)) if got_ids else np.zeros(0, np.int64)
    sums = owned_sums(mine, list(zip(got_ids, got_rows, strict=True)), B, dtype)
    unions = [int(u) for u in wire.all_gather_ints(np.array([mine.size]))[:, 0]]
    all_ids = wire.exchange([mine] * W, unions, np.dtype(np.int64))
    all_sums = wire.exchange([sums.reshape(-1)] * W, [u * B for u in unions], storage)
    item = storage.itemsize
    sent = 8 * W * W + sum((8 + B * item) * c for o, c in enumerate(send_counts) if o != me) \
        + (W - 1) * mine.size * (8 + B * item)
    got = 8 * W * W + sum((8 + B * item) * c for s, c in enumerate(recv_counts) if s != me) \
        + sum((8 + B * item) * u for o, u in enumerate(unions) if o != me)
    staged = [(i, d) for i, d in zip(all_ids, all_sums, strict=True) if i.size]
    return src.result(staged, W if average else 1), Rows(sent, got, lay.num_blocks, int(ids.size), sum(unions))



def _split(values: np.ndarray, counts: list[int]) -> list[np.ndarray]:
    """``values`` cut into consecutive parts of ``counts`` (first-axis) elements."""
    return np.split(values, np.cumsum(counts)[:-1]) if counts else []


