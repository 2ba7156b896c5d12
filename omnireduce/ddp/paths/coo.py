"""Sparse COO gradient buckets (``nn.Embedding(sparse=True)``, ``nn.EmbeddingBag(sparse=True)``),
gathered during a backward pass and reduced together through omnireduce.

Design. A sparse COO gradient goes through omnireduce whatever the process group's backend (NCCL
has no sparse all-reduce): its rows are its blocks, known from its indices, so nothing of the
table's size is read (:mod:`omnireduce.sources.sparse`). Each bucket's future gets the averaged sum
as a new coalesced COO tensor, which DDP copies into the parameter's gradient.

DDP gives every sparse parameter a bucket of its own and hands them over one after another
(tables are looked up first in the forward pass, so their gradients come last, together). A
:class:`CooBatch` gathers them and :meth:`CooBatch.flush` reduces them together when a dense bucket
or the last one comes, which is the same moment on every rank: one reduction of the stacked tables
per row width, dtype and device instead of one per table (:func:`concat_rows`), the same bits (rows
are summed independently). The batch lives only on the autograd thread, during one backward pass;
it is not pickled. Who sums the stacked rows (the aggregators, the collective engine, or the
hierarchy by rail) is the reducer the router gives each bucket (:class:`omnireduce.engines.reducer.Reducer`;
a batch takes its first bucket's).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from omnireduce.ddp.bucket import Bucket
from omnireduce.ddp.recorder import Recorder
from omnireduce.engines.reducer import Reducer, Reduction, ReductionInfo


class _Pending(NamedTuple):
    bucket: Bucket
    fut: Reduction
    reducer: Reducer


class CooBatch:
    """The sparse COO buckets of the backward pass in progress, waiting to be reduced together."""

    def __init__(self, recorder: Recorder, world_size: int) -> None:
        self._recorder = recorder
        self._world_size = world_size
        self._pending: list[_Pending] = []

    def __len__(self) -> int:
        return len(self._pending)

    def add(self, bucket: Bucket, reducer: Reducer) -> Reduction:
        """Gather a sparse bucket, whose rows ``reducer`` sums; the last bucket of the backward pass
        flushes the batch. Returns the future its averaged gradient will complete."""
        fut = Reduction(bucket.buffer)
        self._pending.append(_Pending(bucket, fut, reducer))
        if bucket.last:
            self.flush()
        return fut

    def flush(self) -> None:
        """Reduce the sparse buckets gathered so far: one reduction per row width, dtype and device
        (their tables stacked); never raises."""
        pending, self._pending = self._pending, []
        groups: dict[tuple[int, torch.dtype, torch.device] | tuple[int], list[_Pending]] = {}
        for item in pending:
            b = item.bucket.buffer  # (tables of rows stack; any other sparse tensor is reduced alone)
            key = (int(b.shape[1]), b.dtype, b.device) if b.dim() == 2 else (id(item),)
            groups.setdefault(key, []).append(item)
        for group in groups.values():
            self._reduce(group)

    def _reduce(self, group: list[_Pending]) -> None:
        try:
            stacked, offsets = concat_rows([item.bucket.buffer for item in group])
            reduction = group[0].reducer.allreduce_async(stacked, average=True)
        except BaseException as e:
            for item in group:
                item.fut.fail(self._recorder.failure(e, item.bucket.iteration, item.bucket.index))
            return
        reduction.add_done_callback(lambda f: self._complete(group, offsets, reduction))

    def _complete(self, group: list[_Pending], offsets: list[int], reduction: Reduction) -> None:
        """Cut the reduced stack back into the batch's buckets and complete their futures; the bytes
        are counted once, with the first."""
        try:
            parts = split_rows(reduction.value(), offsets)
            done = reduction.info  # (rows: their bytes only, counted once)
            first = ReductionInfo(bytes_sent=done.bytes_sent, bytes_received=done.bytes_received)
            for i, (item, part) in enumerate(zip(group, parts, strict=True)):
                info = first if i == 0 else ReductionInfo()
                self._recorder.reduced(item.bucket.key, info, nbytes=item.bucket.nbytes, world_size=self._world_size,
                                       coo=True)
                item.fut.complete(part, info)
        except BaseException as e:
            for item in group:
                if not item.fut.done():
                    item.fut.fail(self._recorder.failure(e, item.bucket.iteration, item.bucket.index))


def concat_rows(tensors: list[torch.Tensor]) -> tuple[torch.Tensor, list[int]]:
    """Sparse COO tensors of one row width, dtype and device as one tensor whose rows are theirs
    stacked (tensor j's row r is row ``offsets[j] + r``), and the ``offsets`` (one more than the
    tensors: the last is the total). O(nnz): nothing of the tables' size. One reduction of the
    stack sums every row exactly as reducing each tensor would (rows are summed independently). A
    single tensor is itself (of any number of dimensions)."""
    offsets = [0]
    for t in tensors:
        offsets.append(offsets[-1] + int(t.shape[0]))
    if len(tensors) == 1:
        return tensors[0], offsets
    indices = torch.cat([t._indices() + off for t, off in zip(tensors, offsets, strict=False)], dim=1)
    values = torch.cat([t._values() for t in tensors])
    shape = (offsets[-1], int(tensors[0].shape[1]))
    return torch.sparse_coo_tensor(indices, values, shape, check_invariants=False), offsets


def split_rows(result: torch.Tensor, offsets: list[int]) -> list[torch.Tensor]:
    """The coalesced COO ``result`` of a stack made by :func:`concat_rows`, cut back into one
    coalesced tensor per stacked tensor."""
    if len(offsets) == 2:
        return [result]
    rows, values = result._indices()[0], result._values()
    cuts = torch.searchsorted(rows, torch.tensor(offsets, device=rows.device)).tolist()
    dim = int(result.shape[1])
    return [torch.sparse_coo_tensor((rows[a:b] - lo).reshape(1, -1), values[a:b], (hi - lo, dim), is_coalesced=True,
                                    check_invariants=False)
            for a, b, lo, hi in zip(cuts, cuts[1:], offsets, offsets[1:], strict=False)]

