"""One gradient bucket as the hook's layers see it: its key, its buffer, its iteration, its blocks.

DDP hands the hook a ``GradBucket``; the hook turns it into a :class:`Bucket` once
(:meth:`Bucket.of`), and everything below the hook (the router, the path choice, the reducers'
callers) takes that value. A bucket is identified by its :data:`BucketKey`, ``(index, numel)``: DDP
rebuilds its buckets after the first iteration, and a rebuilt bucket is a new one. A bucket that
goes compressed (``OmniReduceState(compression=...)``) is a new one too, ``(index, numel, 1)``: its
ways are timed again, on its compacted blocks. The block size of a bucket is aligned to the rows of
its dominant table when the state asks for it (:func:`omnireduce.ddp.alignment.aligned_block_size`);
the alignment reads only the parameters' shapes, so every rank makes the same choice.

Any tensor the ranks reduce in the same order with a stable index can be a bucket
(:meth:`Bucket.of_tensor`: an FSDP reduce-scatter's output, say): the router then routes it and hands
it a reducer as it does a DDP bucket's. A DDP bucket is averaged over the ranks; such a tensor may
ask to be summed instead (``average=False``: FSDP2 with a gradient divide factor).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch

from omnireduce.ddp.alignment import aligned_block_size

BucketKey = tuple[int, ...]  # (bucket index, numel), or (bucket index, numel, 1) compressed


def is_compressed(key: BucketKey) -> bool:
    """Whether ``key`` is a compressed bucket's (see the module)."""
    return len(key) > 2


@dataclasses.dataclass(frozen=True)
class Bucket:
    """A gradient bucket on its way through the hook."""

    buffer: torch.Tensor
    index: int
    iteration: int
    last: bool  # DDP's last bucket of the backward pass
    block_size: int  # blocks of this bucket (aligned to its table's rows, or the configured size)
    compressed: bool = False  # it goes compressed (its key says so)
    params: Sequence[torch.Tensor] = ()  # the parameters whose gradients it holds, back to back
    average: bool = True  # averaged over the ranks (False: summed)

    @property
    def key(self) -> BucketKey:
        numel = self.buffer.numel()
        return (self.index, numel, 1) if self.compressed else (self.index, numel)

    @property
    def nbytes(self) -> int:
        """Bytes of the buffer (what a dense all-reduce would reduce)."""
        return self.buffer.numel() * self.buffer.element_size()

    def as_compressed(self) -> Bucket:
        """This bucket, going compressed (a key of its own)."""
        return dataclasses.replace(self, compressed=True)

    @property
    def coo(self) -> bool:
        """A sparse COO gradient (``nn.Embedding(sparse=True)`` and the like)."""
        return self.buffer.layout != torch.strided

    @classmethod
    def of(cls, grad_bucket: Any, iteration: int, block_size: int, align: bool) -> Bucket:
        """The hook's view of DDP's ``grad_bucket``; ``block_size``: the configured one, aligned to the
        bucket's dominant row width when ``align``."""
        buffer, params = grad_bucket.buffer(), grad_bucket.parameters()
        if align and buffer.layout == torch.strided:
            block_size = aligned_block_size([tuple(p.shape) for p in params], block_size)
        return cls(buffer, grad_bucket.index(), iteration, grad_bucket.is_last(), block_size, params=params)

    @classmethod
    def of_tensor(cls, tensor: torch.Tensor, index: int, iteration: int, block_size: int, *, last: bool = False,
                  params: Sequence[torch.Tensor] = (), average: bool = True) -> Bucket:
        """Any tensor as a bucket: ``index`` its stable place in the order every rank reduces them in
        (its key is ``(index, numel)``), ``last`` the last of an iteration, ``average`` False to sum it
        over the ranks instead of averaging it."""
        return cls(tensor, index, iteration, last, block_size, params=params, average=average)
