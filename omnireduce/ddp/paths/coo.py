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
hierarchy by rail) is the ``reduce_rows`` function the runtime gives the batch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple, cast

import torch

from omnireduce.ddp.bucket import Bucket
from omnireduce.ddp.futures import fail, hook_future
from omnireduce.ddp.recorder import Recorder

# (stacked rows, the first bucket of the group) -> a future of (the averaged sum, bytes sent, bytes received)
RowsReducer = Callable[[torch.Tensor, Bucket], torch.futures.Future[tuple[torch.Tensor, int, int]]]


class _Pending(NamedTuple):
    bucket: Bucket
    fut: torch.futures.Future[Any]


class CooBatch:
    """The sparse COO buckets of the backward pass in progress, waiting to be reduced together."""

    def __init__(self, reduce_rows: RowsReducer, recorder: Recorder, world_size: int) -> None:
        self._reduce_rows = reduce_rows
        self._recorder = recorder
        self._world_size = world_size
        self._pending: list[_Pending] = []

    def __len__(self) -> int:
        return len(self._pending)

    def add(self, bucket: Bucket) -> torch.futures.Future[Any]:
        """Gather a sparse bucket; the last bucket of the backward pass flushes the batch. Returns
        the future its averaged gradient will complete."""
        fut = hook_future(bucket.buffer)
        self._pending.append(_Pending(bucket, fut))
        if bucket.last:
            self.flush()
        return fut

    def flush(self) -> None:
        """Reduce the sparse buckets gathered so far: one reduction per row width, dtype and device
        (their tables stacked); never raises."""
        pending, self._pending = self._pending, []
        groups: dict[tuple[Any, ...], list[_Pending]] = {}
        for item in pending:
            b = item.bucket.buffer  # (tables of rows stack; any other sparse tensor is reduced alone)
            key = (int(b.shape[1]), b.dtype, b.device) if b.dim() == 2 else (id(item),)
            groups.setdefault(key, []).append(item)
        for group in groups.values():
            self._reduce(group)

    def _reduce(self, group: list[_Pending]) -> None:
        first = group[0].bucket
        try:
            stacked, offsets = concat_rows([item.bucket.buffer for item in group])
            fut = self._reduce_rows(stacked, first)
        except BaseException as e:
            for item in group:
                fail(self._recorder, item.fut, e, item.bucket.iteration, item.bucket.index)
            return
        fut.add_done_callback(lambda f: self._complete(group, offsets, f))

    def _complete(self, group: list[_Pending], offsets: list[int],
                  f: torch.futures.Future[tuple[torch.Tensor, int, int]]) -> None:
        """Cut the reduced stack back into the batch's buckets and complete their futures; the bytes
        are counted once, with the first."""
        try:
            result, sent, received = f.value()
            parts = split_rows(result, offsets)
            for i, (item, part) in enumerate(zip(group, parts, strict=True)):
                self._recorder.reduced(item.bucket.key, None, dense=False, sent=sent if i == 0 else 0,
                                       received=received if i == 0 else 0, nbytes=item.bucket.nbytes,
                                       world_size=self._world_size, coo=True)
                item.fut.set_result(part)
        except BaseException as e:
            for item in group:
                if not item.fut.done():
                    fail(self._recorder, item.fut, e, item.bucket.iteration, item.bucket.index)


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


def flat_rows(reducer: Any) -> RowsReducer:
    """A :data:`RowsReducer` through ``reducer``: a worker (the aggregators) or a collective engine,
    averaging over every rank."""

    def reduce_rows(stacked: torch.Tensor, first: Bucket) -> torch.futures.Future[tuple[torch.Tensor, int, int]]:
        out: torch.futures.Future[tuple[torch.Tensor, int, int]] = torch.futures.Future()
        reduction = reducer.allreduce_async(stacked, average=True)

        def done(f: Any) -> None:
            try:
                result = f.result() if hasattr(f, "result") else f.value()  # (a worker's future, or a torch one)
                info = reduction.info
                out.set_result((result, info.get("bytes_sent", 0), info.get("bytes_received", 0)))
            except BaseException as e:
                cast(Any, out).set_exception(e)  # (torch's stub types the exception as the value)

        reduction.add_done_callback(done)
        return out

    return reduce_rows
