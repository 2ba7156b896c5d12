"""The collective engine's path: the ranks sum each other's blocks through the process group.

The bucket goes to the engine's thread (:class:`omnireduce.engines.collective.CollectiveEngine`), which
reduces it in place, averaged, in blocks aligned as the aggregators' would be; the returned future
completes with the buffer once the bucket's union density and bytes are recorded.
"""

from __future__ import annotations

from typing import Any

import torch

from omnireduce.ddp.bucket import Bucket
from omnireduce.ddp.paths.aggregators import record
from omnireduce.ddp.recorder import Recorder


def collective_allreduce(bucket: Bucket, engine: Any, world_size: int,
                         recorder: Recorder) -> torch.futures.Future[torch.Tensor]:
    """Average ``bucket`` through the collective ``engine``."""
    reduction = engine.allreduce_async(bucket.buffer, average=True, block_size=bucket.block_size)

    def done(f: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
        try:
            f.value()  # (raises the reduction's error)
            record(recorder, bucket, reduction.info, world_size)
            return bucket.buffer
        except BaseException as e:
            raise recorder.failure(e, bucket.iteration, bucket.index) from e

    return reduction.then(done)
