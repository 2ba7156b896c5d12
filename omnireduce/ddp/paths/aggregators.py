"""The aggregators' path: the worker's I/O thread streams a bucket's non-zero blocks to the aggregators.

The hook hands the bucket to the worker (``allreduce_async(average=True, synchronize=False)``) and
returns at once; the I/O thread writes the averaged sums into the buffer in place, and the returned
future completes with it once the bucket's union density and bytes are recorded. On CUDA the worker
writes on its side stream and completes its future as soon as the writes are queued; the hook's
future is completed under that stream (:func:`omnireduce.ddp.futures.hook_future`), so DDP's stream
waits for the writes on the device and no thread waits for them on the host.
"""

from __future__ import annotations

from typing import Any

import torch

from omnireduce.ddp.bucket import Bucket
from omnireduce.ddp.futures import fail, hook_future
from omnireduce.ddp.recorder import Recorder


def aggregators_allreduce(bucket: Bucket, worker: Any, world_size: int,
                          recorder: Recorder) -> torch.futures.Future[torch.Tensor]:
    """Average ``bucket`` through ``worker`` (an :class:`omnireduce.Worker`) and its aggregators."""
    buffer = bucket.buffer
    fut = hook_future(buffer)
    reduction = worker.allreduce_async(buffer, average=True, synchronize=False, block_size=bucket.block_size)

    def done(f: Any) -> None:
        try:
            f.result()
            record(recorder, bucket, f.info, world_size)
            stream = f.stream  # the side stream that wrote the result (None on the host path)
            if stream is None:
                fut.set_result(buffer)
            else:  # (under the buffer's device: leaving the stream context touches no other GPU)
                with torch.cuda.device(buffer.device), torch.cuda.stream(stream):
                    fut.set_result(buffer)
        except BaseException as e:
            fail(recorder, fut, e, bucket.iteration, bucket.index)

    reduction.add_done_callback(done)
    return fut


def record(recorder: Recorder, bucket: Bucket, info: dict[str, Any], world_size: int) -> None:
    """Record a bucket reduced through omnireduce (either engine) from its reduction's ``info``."""
    total = info["blocks_total"]
    recorder.reduced(bucket.key, info["blocks_union"] / total if total else 0.0, dense=False,
                     sent=info["bytes_sent"], received=info["bytes_received"], nbytes=bucket.dense_nbytes,
                     world_size=world_size)
