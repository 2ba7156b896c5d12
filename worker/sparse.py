"""The all-reduce of a sparse COO tensor (embedding gradients): a :class:`~omnireduce.worker.op.TensorOp`
whose source is a :class:`~omnireduce.sources.sparse.SparseSource` (its rows are its blocks; see
:mod:`omnireduce.sources.sparse` for the geometry, the determinism and the bad input it refuses).
"""

from __future__ import annotations

from typing import Any

from omnireduce.blocks import LaneIndex
from omnireduce.errors import OmniReduceMismatchError
from omnireduce.worker.op import TensorOp


class SparseOp(TensorOp):
    """The all-reduce of a sparse COO tensor: a :class:`TensorOp` whose source is a
    :class:`SparseSource`. It indexes the rows by id (no flags of every block), completes its
    future with the new reduced tensor, and says in a mismatch error what the sizes mean."""

    source: Any

    def prepare(self) -> None:
        ids = self.source.block_ids()
        self.blocks_nonzero = int(ids.size)
        self._index = LaneIndex.from_ids(self.layout, ids)

    def finish(self, *, bytes_sent: int, bytes_received: int) -> Any:
        staged = [part for s in range(self.layout.slots) for part in self._staged[s]]
        self.user = self.source.result(staged, self.world_size if self.average else 1)  # the future's result
        return super().finish(bytes_sent=bytes_sent, bytes_received=bytes_received)

    def fail(self, error: BaseException) -> None:
        describe = getattr(self.source, "describe", None)
        # (a rank that bootstraps after the aggregator aborted the tensor for a mismatch is told so as
        # an abort whose cause is the mismatch: the same cause)
        mismatch = isinstance(error, OmniReduceMismatchError) or getattr(error, "cause", None) == "MISMATCH"
        if mismatch and describe is not None:
            wrapped = OmniReduceMismatchError(
                f"{error} (this rank's tensor is a {describe()}; for a sparse tensor the element count is rows x "
                "row width and the block size is the row width: the ranks' shapes or dtypes differ)")
            wrapped.__cause__ = error
            error = wrapped
        super().fail(error)
