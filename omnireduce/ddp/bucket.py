"""One DDP gradient bucket as the hook's layers see it: its key, its buffer, its iteration, its blocks.

DDP hands the hook a ``GradBucket``; the hook turns it into a :class:`Bucket` once, and everything
below the hook (the router, the paths, the path choice) takes that value. A bucket is identified by
its :data:`BucketKey`, ``(index, numel)``: DDP rebuilds its buckets after the first iteration, and a
rebuilt bucket is a new one. A bucket that goes compressed (``OmniReduceState(compression=...)``) is
a new one too, ``(index, numel, 1)``: its ways are timed again, on its compacted blocks (the
*payload*, which :meth:`Bucket.payload` wraps with the key and dense bytes of the bucket it came
from). The block size of a bucket is aligned to the rows of its dominant table when the state asks
for it (:func:`omnireduce.ddp.alignment.aligned_block_size`); the alignment reads only the
parameters' shapes, so every rank makes the same choice.
"""

from __future__ import annotations

import dataclasses
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
    source: torch.Tensor | None = None  # a payload's DDP buffer (the compacted blocks were taken from it)

    @property
    def key(self) -> BucketKey:
        numel = (self.source if self.source is not None else self.buffer).numel()
        return (self.index, numel, 1) if self.compressed else (self.index, numel)

    @property
    def nbytes(self) -> int:
        """Bytes of what is reduced (a payload's: its compacted blocks)."""
        return self.buffer.numel() * self.buffer.element_size()

    @property
    def dense_nbytes(self) -> int:
        """Bytes of DDP's bucket (what its dense all-reduce would reduce)."""
        full = self.source if self.source is not None else self.buffer
        return full.numel() * full.element_size()

    def as_compressed(self) -> Bucket:
        """This bucket, going compressed (a key of its own)."""
        return dataclasses.replace(self, compressed=True)

    def payload(self, values: torch.Tensor, block_size: int) -> Bucket:
        """The compacted ``values`` of this (compressed) bucket, reduced in its place: same key and dense
        bytes, blocks of ``block_size``."""
        return dataclasses.replace(self, buffer=values, source=self.buffer, block_size=block_size, compressed=True)

    @property
    def coo(self) -> bool:
        """A sparse COO gradient (``nn.Embedding(sparse=True)`` and the like)."""
        return self.buffer.layout != torch.strided

    @classmethod
    def of(cls, grad_bucket: Any, iteration: int, block_size: int, align: bool) -> Bucket:
        """The hook's view of DDP's ``grad_bucket``; ``block_size``: the configured one, aligned to the
        bucket's dominant row width when ``align``."""
        buffer = grad_bucket.buffer()
        if align and buffer.layout == torch.strided:
            block_size = aligned_block_size([tuple(p.shape) for p in grad_bucket.parameters()], block_size)
        return cls(buffer, grad_bucket.index(), iteration, grad_bucket.is_last(), block_size)
