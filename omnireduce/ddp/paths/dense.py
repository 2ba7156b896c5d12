"""The dense path: the process group's own all-reduce of a bucket, averaged as torch's ``allreduce_hook``.

A strided buffer is divided by the world size before the all-reduce, on the calling thread, as
torch's ``allreduce_hook`` does: the division then overlaps the reductions of the buckets before
it instead of delaying the bucket's completion after its all-reduce. A sparse COO tensor's average
is a new tensor. With ``measure`` (the threshold rule) the result's union density is recorded, so
the bucket can come back to omnireduce.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from omnireduce.config import WorkerConfig
from omnireduce.ddp.bucket import Bucket
from omnireduce.ddp.densities import union_density
from omnireduce.ddp.recorder import Recorder, ring_bytes


def dense_allreduce(bucket: Bucket, group: Any, world_size: int, recorder: Recorder,
                    measure: WorkerConfig | None = None) -> torch.futures.Future[torch.Tensor]:
    """Average ``bucket`` over the ranks of ``group`` (in place when strided); ``measure``: the
    layout to count the result's union density with (None: not counted)."""
    buffer = bucket.buffer
    strided = not bucket.coo
    if strided:
        buffer.div_(world_size)
    work = dist.all_reduce(buffer, group=group, async_op=True)
    nbytes, dense_nbytes = (bucket.nbytes, bucket.dense_nbytes) if strided else (0, 0)

    def average(f: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
        try:
            result = f.value()[0]
            if not strided:  # sparse: DDP expects the averaged tensor back
                result = result / world_size
            density = union_density(result, measure) if measure is not None else None
            ring = ring_bytes(nbytes, world_size)
            recorder.reduced(bucket.key, density, dense=True, sent=ring, received=ring, nbytes=dense_nbytes,
                             world_size=world_size)
            return result
        except BaseException as e:
            raise recorder.failure(e, bucket.iteration, bucket.index) from e

    return work.get_future().then(average)
