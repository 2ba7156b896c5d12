"""Sparse COO gradient buckets (``nn.Embedding(sparse=True)``, ``nn.EmbeddingBag(sparse=True)``),
gathered during a backward pass and reduced together through omnireduce.

Design. A sparse COO gradient goes through omnireduce whatever the process group's backend (NCCL
has no sparse all-reduce): its rows are its blocks, known from its indices, so nothing of the
table's size is read (:mod:`omnireduce.worker.sparse`). Each bucket's future gets the averaged sum
as a new coalesced COO tensor, which DDP copies into the parameter's gradient.

DDP gives every sparse parameter a bucket of its own and hands them over one after another
(tables are looked up first in the forward pass, so their gradients come last, together). The
state's :class:`CooBatch` (``state._pending_coo``) gathers them and :meth:`CooBatch.flush` reduces
them together when a dense bucket or the last one comes, which is the same moment on every rank:
one reduction of the stacked tables per row width, dtype and device instead of one per table, the
same bits (rows are summed independently). For the recommender's 26 tables (4 ranks, loopback)
that took the reduction from 280-520 ms to 33-100 ms per step, the workers' CPU from ~50 to ~9 ms
and the aggregator's from ~70 to 11-18 ms (docs/BENCHMARKS.md). The batch lives only on the
autograd thread, during one backward pass; it is not pickled. With the hierarchy
(:mod:`omnireduce.hook_hierarchy`) the stacked rows go through it instead: gathered in the node, split
over the rails by row, reduced across the nodes rail by rail, gathered back.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from omnireduce.hook_decisions import BucketKey
from omnireduce.hook_paths import fail, hook_future
from omnireduce.worker.sparse import concat_rows, split_rows

if TYPE_CHECKING:
    from omnireduce.hook_state import OmniReduceState


class _Pending(NamedTuple):
    buffer: torch.Tensor
    key: BucketKey
    fut: torch.futures.Future[Any]
    iteration: int


class CooBatch:
    """The sparse COO buckets of the backward pass in progress, waiting to be reduced together."""

    def __init__(self) -> None:
        self._pending: list[_Pending] = []

    def __len__(self) -> int:
        return len(self._pending)

    def add(self, state: OmniReduceState, buffer: torch.Tensor, key: BucketKey, iteration: int,
            last: bool) -> torch.futures.Future[Any]:
        """Gather a sparse bucket; the last bucket of the backward pass flushes the batch. Returns
        the future its averaged gradient will complete."""
        fut = hook_future(buffer)
        self._pending.append(_Pending(buffer, key, fut, iteration))
        if last:
            self.flush(state)
        return fut

    def flush(self, state: OmniReduceState) -> None:
        """Reduce the sparse buckets gathered so far: one reduction per row width, dtype and device
        (their tables stacked, :func:`omnireduce.worker.sparse.concat_rows`); never raises."""
        pending, self._pending = self._pending, []
        groups: dict[tuple[Any, ...], list[_Pending]] = {}
        for item in pending:
            b = item.buffer
            groups.setdefault((b.dim(), int(b.shape[-1]) if b.dim() else 0, b.dtype, b.device), []).append(item)
        for group in groups.values():
            _reduce(state, group)


def _reduce(state: OmniReduceState, group: list[_Pending]) -> None:
    try:
        first = group[0].buffer
        stacked, offsets = concat_rows([item.buffer for item in group]) if first.dim() == 2 else (first, [])
        if state._hierarchy is not None and stacked.dim() == 2:
            _reduce_hierarchical(state, group, stacked, offsets)
            return
        engine = state._engine if state.engine == "collective" else None  # (the ranks sum the rows, or the aggregators)
        reduction = (engine or state.worker).allreduce_async(stacked, average=True)
    except BaseException as e:
        for item in group:
            fail(state, item.fut, e, item.iteration, item.key[0])
        return

    def done(f: Any) -> None:
        info = reduction.info  # (empty if the reduction failed: _complete raises its error then)
        result = f.result if hasattr(f, "result") else f.value  # (a worker's future, or a torch one)
        _complete(state, group, offsets, result, info.get("bytes_sent", 0), info.get("bytes_received", 0))

    reduction.add_done_callback(done)


def _reduce_hierarchical(state: OmniReduceState, group: list[_Pending], stacked: torch.Tensor,
                         offsets: list[int]) -> None:
    """The batch's stacked rows through the hierarchy (:meth:`omnireduce.hook_hierarchy.HierarchicalPath.reduce_rows`):
    the node's rows gathered and split over the rails, reduced across the nodes by rail, gathered back."""
    assert state._hierarchy is not None
    first = group[0]
    fut = state._hierarchy.reduce_rows(state, stacked, first.iteration, first.key[0])

    def done(f: torch.futures.Future[torch.Tensor]) -> None:
        _complete(state, group, offsets, f.value, 0, 0)  # (bytes: counted by the rail)

    fut.add_done_callback(done)


def _complete(state: OmniReduceState, group: list[_Pending], offsets: list[int], result: Any, sent: int,
              received: int) -> None:
    """Cut the reduced stack (``result()``, which raises if the reduction failed) back into the
    batch's buckets and complete their futures; the bytes are counted once, with the first."""
    try:
        parts = split_rows(result(), offsets)
        for i, (item, part) in enumerate(zip(group, parts, strict=True)):
            nbytes = item.buffer.numel() * item.buffer.element_size()
            state.record(item.key, None, False, sent if i == 0 else 0, received if i == 0 else 0, nbytes, coo=True)
            item.fut.set_result(part)
    except BaseException as e:
        for item in group:
            if not item.fut.done():
                fail(state, item.fut, e, item.iteration, item.key[0])
