"""Sparse COO tensors (embedding gradients): blocks from the indices, no pass over the table.

``nn.Embedding(..., sparse=True)`` and ``nn.EmbeddingBag(..., sparse=True)`` give gradients as COO
tensors of shape ``(rows, dim)`` with one sparse and one dense dimension: ``indices`` (1 x nnz) name
the rows a batch touched and ``values`` (nnz x dim) hold them, duplicates allowed. Their non-zero
blocks are known without reading any value, so they are reduced here without the one detection pass
the dense path makes (:mod:`omnireduce.sources.host`, :mod:`omnireduce.sources.device`), and without
allocating or scanning anything of the table's size:

- Geometry (:func:`sparse_layout`): the block size is the row width, so a row is a block and the
  block ids are the row ids (a row wider than the protocol's largest block, 2^20 elements, is cut
  into the fewest equal blocks that fit). The lanes per slot are capped so that one round of a
  slot stays under 30 MiB whatever the row width. The worker gives a sparse tensor one slot per
  aggregator (its configured slots, at most the number of aggregators): a few thousand rows gain
  nothing from several pipelines per aggregator, and every slot costs each rank messages (with 26
  tables per step, 4 slots instead of 1 tripled the aggregator's CPU per step on the recommender).
- :class:`SparseSource` coalesces the rank's rows (sums its duplicates) and offers them as blocks;
  the lane index is built from the sorted ids (:meth:`omnireduce.blocks.LaneIndex.from_ids`), so
  work and memory grow with the touched rows, never with the table. Every row present in the input
  travels, even one whose values are zero (a row's presence is what optimizers such as
  ``torch.optim.SparseAdam`` act on, and what the process group's sparse all-reduce keeps); the
  worker's lossy ``threshold`` does not apply.
- The result is a new coalesced COO tensor of the input's shape, dtype and device: the union of the
  rows present on some rank, ascending, with their sums (divided by the world size when averaging,
  as the dense path does: the float32 product with ``1/world_size``, rounded once). The input is
  never written.

Determinism. A rank's duplicates of a row are summed in float32 in the order they appear in its
input (float16 and bfloat16 widened exactly), and rounded once to the dtype; the aggregator then
sums the ranks' rows in rank order in float32 and rounds once (docs/reference/protocol.md). So the result is
the same bits on every run and every rank, whatever order the ranks coalesced or sent in. A row
present on one rank only comes back bit for bit as that rank coalesced it.

Bad input. What the caller's thread can see (not a COO tensor of two dimensions with one dense
dimension, an unsupported dtype or device, a table past the protocol's 2^40 elements) raises
TypeError/ValueError from ``allreduce_async`` at once; the tensor's sequence number is still used
and the aggregators are told (:func:`rejection`), so the other ranks fail at once, naming the cause,
instead of waiting for this rank until their deadline. Row ids out of range are found where the
indices are read (on the I/O thread, after a device's copy): the future fails with
:class:`SparseInputError` and the other ranks likewise. Ranks whose shapes or dtypes differ are
told apart by the aggregator (the element count is rows x width, the block size is the width); the
error says so (:meth:`omnireduce.worker.sparse.SparseOp.fail`, the reduction of such a source). The
input is untouched in every case.
"""

from __future__ import annotations

import math
import sys
from typing import Any

import numpy as np

from omnireduce.blocks import Layout
from omnireduce.dtypes import DType, dtype_from_name, narrow, widen
from omnireduce.errors import OmniReduceError
from omnireduce.sources.base import Staged
from omnireduce.sums import accumulator, add_repeats_in_order
from omnireduce.wire import MAX_BLOCK_SIZE, MAX_NUMEL


class SparseInputError(OmniReduceError, ValueError):
    """A sparse tensor this rank was given cannot be reduced (e.g. a row id out of range)."""


def is_sparse(x: Any) -> bool:
    """Whether ``x`` is a torch tensor of a sparse layout (COO, CSR, CSC, BSR, BSC)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor) and x.layout != torch.strided


def describe_sparse(x: Any) -> str:
    return (f"a {str(x.layout).removeprefix('torch.')} tensor of shape {tuple(x.shape)}, dtype "
            f"{str(x.dtype).removeprefix('torch.')}" + (f", {x.sparse_dim()} sparse and {x.dense_dim()} dense "
                                                         "dimensions" if _is_coo(x) else ""))


def _is_coo(x: Any) -> bool:
    import torch

    return x.layout == torch.sparse_coo


def blocks_per_row(dim: int) -> int:
    """Blocks a row of ``dim`` elements is cut into: 1, unless it is wider than the largest block."""
    if dim <= MAX_BLOCK_SIZE:
        return 1
    return next(m for m in range(2, dim + 1) if dim % m == 0 and dim // m <= MAX_BLOCK_SIZE)


def sparse_layout(rows: int, dim: int, dtype: DType, max_lanes: int, max_slots: int) -> tuple[Layout, int]:
    """The geometry of a ``rows x dim`` sparse tensor and the blocks per row: one row per block (the
    block size is the row width), lanes capped so a slot's round fits in
    :data:`~omnireduce.blocks.MAX_FRAME_BYTES`."""
    per_row = blocks_per_row(dim) if dim else 1
    block = max(1, dim // per_row)
    return Layout.for_tensor(rows * dim, block, max_lanes, max_slots, dtype.itemsize), per_row


def check_sparse(x: Any) -> tuple[DType, int, int]:
    """``(dtype, rows, dim)`` of a sparse tensor omnireduce can reduce; TypeError/ValueError naming
    what is wrong otherwise. Looks at the tensor's metadata only (no data, no device sync)."""
    import torch

    what = describe_sparse(x)
    wanted = ("omnireduce reduces sparse COO tensors of shape (rows, dim) with one sparse and one dense "
              "dimension, as nn.Embedding(sparse=True) and nn.EmbeddingBag(sparse=True) give")
    rows_hint = "give its rows: torch.sparse_coo_tensor(row_ids[None], row_values, (rows, dim))"
    if x.layout != torch.sparse_coo:
        raise TypeError(f"{wanted}; got {what}: {rows_hint}, or reduce a dense tensor")
    if x.dim() != 2:
        raise TypeError(f"{wanted}; got {x.dim()} dimensions ({what})")
    if x.sparse_dim() != 1 or x.dense_dim() != 1:
        raise TypeError(f"{wanted}; got {what}: {rows_hint}")
    try:
        dtype = dtype_from_name(str(x.dtype))
    except TypeError as e:
        raise TypeError(f"{e} ({what})") from None
    if x.device.type not in ("cpu", "cuda"):
        raise TypeError(f"sparse tensors on device {x.device} are not supported ({what})")
    rows, dim = int(x.shape[0]), int(x.shape[1])
    if rows * dim > MAX_NUMEL:
        raise ValueError(f"{what}: {rows} x {dim} = {rows * dim} elements, the protocol's limit is 2^40")
    return dtype, rows, dim


class SparseSource:
    """The rows of a sparse COO tensor as blocks (see the module docstring).

    Made on the caller's thread (metadata only; on CUDA it records an event on the stream that
    produced the tensor). :meth:`block_ids` reads the indices and values (after a device's copy to
    the host), checks the row ids and coalesces: the protocol's one preparation step. On CUDA the
    I/O thread waits there for that event and the copies of the nnz entries (never of the table),
    and :meth:`result` copies the reduced rows back and waits for that copy, so the future completes
    with a tensor that any stream may read.
    """

    defer = None  # the rows are read on the I/O thread (a CUDA tensor's nnz entries: a small copy)

    def __init__(self, x: Any, dtype: DType, rows: int, dim: int, max_lanes: int, max_slots: int) -> None:
        import torch

        self.torch, self.tensor, self.dtype, self.rows, self.dim = torch, x.detach(), dtype, rows, dim
        self.layout, self.per_row = sparse_layout(rows, dim, dtype, max_lanes, max_slots)
        self.device = x.device
        self.ready = None
        if x.is_cuda:
            self.ready = torch.cuda.Event()
            self.ready.record(torch.cuda.current_stream(x.device))
        self._ids: np.ndarray | None = None  # sorted block ids of this rank's rows
        self._blocks: np.ndarray | None = None  # (ids, block size), storage dtype

    def describe(self) -> str:
        return f"{self.rows} x {self.dim} {self.dtype.name.lower()} sparse COO tensor on {self.device}"

    # -- the block source interface --------------------------------------------------------------

    def block_ids(self) -> np.ndarray:
        """This rank's non-zero blocks (ascending): its rows present in the input, duplicates summed."""
        torch = self.torch
        if self.ready is not None:
            self.ready.synchronize()  # the stream that produced the tensor has written it
        x = self.tensor
        idx = x._indices()[0].to("cpu").numpy()
        values = x._values().to("cpu").contiguous()
        if self.dtype is DType.BFLOAT16:
            vals = values.view(torch.int16).numpy().view(np.uint16)
        else:
            vals = values.numpy()
        vals = vals.reshape(idx.size, self.dim)
        if idx.size:
            lo, hi = int(idx.min()), int(idx.max())
            if lo < 0 or hi >= self.rows:
                bad = lo if lo < 0 else hi
                raise SparseInputError(f"row id {bad} is out of range for a sparse tensor of {self.rows} rows "
                                       f"(ids must be in 0..{self.rows - 1}; {self.describe()})")
        rows, vals = coalesce_rows(idx, vals, self.dtype, presorted=bool(x.is_coalesced()))
        m, B = self.per_row, self.layout.block_size
        if m == 1:
            self._ids, self._blocks = rows, vals.reshape(rows.size, B)
        else:
            self._ids = (rows[:, None] * m + np.arange(m, dtype=np.int64)).reshape(-1)
            self._blocks = vals.reshape(rows.size * m, B)
        if self.dim == 0:
            self._ids = np.zeros(0, np.int64)
            self._blocks = np.zeros((0, B), self.dtype.storage)
        return self._ids

    def nonzero(self, threshold: float) -> np.ndarray:  # pragma: no cover - SparseOp never asks
        raise AssertionError("a sparse source gives block ids (block_ids), not flags of every block")

    def gather(self, ids: np.ndarray) -> np.ndarray:
        assert self._ids is not None and self._blocks is not None
        return self._blocks[np.searchsorted(self._ids, ids)].reshape(-1)

    def finish(self, staged: Staged, divisor: int) -> None:
        """Nothing to write: the result is a new tensor (:meth:`result`)."""
        return None

    def release(self) -> None:
        self.tensor = None
        self._ids = self._blocks = None

    def result(self, staged: Staged, divisor: int) -> Any:
        """The reduced tensor: a new coalesced COO tensor of the input's shape, dtype and device
        holding the union of the rows present on some rank (ascending) and their sums, divided by
        ``divisor``."""
        torch, B, m = self.torch, self.layout.block_size, self.per_row
        count = sum(int(ids.size) for ids, _ in staged)
        ids = np.concatenate([i for i, _ in staged]) if staged else np.zeros(0, np.int64)
        data = (np.concatenate([d.reshape(-1) for _, d in staged]) if staged
                else np.zeros(0, self.dtype.storage)).reshape(count, B)
        order = np.argsort(ids, kind="stable")
        ids = ids[order]
        blocks = data[order]
        if divisor > 1:  # as the dense path scales: the float32 product with 1/divisor, rounded once
            blocks = narrow(widen(blocks, self.dtype) * np.float32(1.0 / divisor), self.dtype)
        rows = ids[::m] // m
        values = blocks.reshape(rows.size, self.dim)
        if self.dtype is DType.BFLOAT16:
            tvalues = torch.from_numpy(values.view(np.int16)).view(torch.bfloat16)
        else:
            tvalues = torch.from_numpy(values)
        out = torch.sparse_coo_tensor(torch.from_numpy(rows.reshape(1, -1)), tvalues, (self.rows, self.dim),
                                      is_coalesced=True)
        if self.device.type == "cpu":
            return out
        out = out.to(self.device)
        torch.cuda.current_stream(self.device).synchronize()  # complete on the device for any stream's reader
        return out


def coalesce_rows(idx: np.ndarray, vals: np.ndarray, dtype: DType, *, presorted: bool = False
                  ) -> tuple[np.ndarray, np.ndarray]:
    """Rows ``idx`` (any order, duplicates allowed) with values ``vals`` (storage dtype, one row each)
    as ascending unique rows and their values: duplicates summed in float32 in input order, rounded
    once to ``dtype``. Rows that appear once keep their bits (no arithmetic touches them)."""
    idx = np.asarray(idx, dtype=np.int64)
    if idx.size == 0 or (presorted and bool(np.all(idx[1:] > idx[:-1]))):
        return idx, vals
    rows, first, inverse = np.unique(idx, return_index=True, return_inverse=True)
    if rows.size == idx.size:  # no duplicates: only reorder
        return rows, vals[first]
    # Unbuffered, in index order: each row is ((-0.0 + d0) + d1) + ..., its entries in input order
    # (-0.0 is the exact additive identity: a lone entry keeps its bits): the rank-order sum's arithmetic.
    acc = add_repeats_in_order(accumulator(rows.size, vals.shape[1]), inverse.reshape(-1), widen(vals, dtype))
    return rows, narrow(acc, dtype)


class _Rejected:
    """The source of a tensor this rank refused: preparing it raises why, which the I/O thread
    sends to the aggregators as the tensor's ABORT. One slot per aggregator, so that every
    aggregator hears of it."""

    device = "cpu"
    defer = None

    def __init__(self, error: BaseException, num_aggregators: int) -> None:
        self.error = error
        self.dtype = DType.FLOAT32
        self.layout = Layout(0, 1, 1, max(1, num_aggregators))

    def nonzero(self, threshold: float) -> np.ndarray:
        raise SparseInputError(f"{type(self.error).__name__}: {self.error}")

    def gather(self, ids: np.ndarray) -> np.ndarray:  # pragma: no cover - never prepared
        raise AssertionError

    def finish(self, staged: Staged, divisor: int) -> None:  # pragma: no cover - never prepared
        raise AssertionError

    def release(self) -> None:
        pass


def rejection(error: BaseException, num_aggregators: int) -> _Rejected:
    """The source of a rejected tensor (see the module docstring: its sequence number is used and
    the aggregators abort it, naming ``error``, for the other ranks)."""
    return _Rejected(error, num_aggregators)


def table_bytes(rows: int, dim: int, dtype: DType) -> int:
    """Bytes of the dense table a ``rows x dim`` sparse tensor stands for."""
    return int(math.prod((rows, dim, dtype.itemsize)))
