"""One DDP gradient bucket as the hook's layers see it: its key, its buffer, its iteration, its blocks.

DDP hands the hook a ``GradBucket``; the hook turns it into a :class:`Bucket` once, and everything
below the hook (the router, the paths, the path choice) takes that value. A bucket is identified by
its :data:`BucketKey`, ``(index, numel)``: DDP rebuilds its buckets after the first iteration, and a
rebuilt bucket is a new one. The block size of a bucket is aligned to the rows of its dominant table
when the state asks for it (:func:`omnireduce.ddp.alignment.aligned_block_size`); the alignment reads
only the parameters' shapes, so every rank makes the same choice.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from omnireduce.ddp.alignment import aligned_block_size

BucketKey = tuple[int, int]  # (bucket index, numel): a bucket DDP rebuilt is a new one


@dataclasses.dataclass(frozen=True)
class Bucket:
    """A gradient bucket on its way through the hook."""

    buffer: torch.Tensor
    index: int
    iteration: int
    last: bool  # DDP's last bucket of the backward pass
    block_size: int  # blocks of this bucket (aligned to its table's rows, or the configured size)

    @property
    def key(self) -> BucketKey:
        return self.index, self.buffer.numel()

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()

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
