"""The DDP communication hook: a dispatcher from DDP's buckets to the state's runtime.

    state = OmniReduceState()                              # before or after init_process_group
    ddp_model.register_comm_hook(state, omnireduce_hook)   # averages, like DDP's default

One bucket's way runs in one direction: hook -> runtime -> router (a route and its reducer) ->
reducer -> future, and on the way back only the state's recorder is written. The hook binds the
state on its first call and hands the bucket to the runtime (:meth:`omnireduce.ddp.runtime.Runtime.reduce`),
which counts the iteration (and checks that the state serves one model), routes and starts its
reduction, and, once the last bucket is on its way, starts the ranks' agreement for the next
iteration. It returns a ``torch.futures.Future`` at once, so communication overlaps the rest of the
backward pass, and never raises: a failure completes the future with an
:class:`~omnireduce.OmniReduceError` naming the iteration, the bucket and the cause, which DDP raises
from ``backward()`` as it is (:func:`omnireduce.engines.reducer.fail`).
"""

# No `from __future__ import annotations` here: DDP checks the hook's annotations against the real
# dist.GradBucket and torch.futures.Future[torch.Tensor] objects.
import contextlib

import torch
import torch.distributed as dist

from omnireduce.ddp.state import OmniReduceState


def omnireduce_hook(state: OmniReduceState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average a DDP gradient bucket over all ranks through omnireduce (see the module); never raises."""
    try:
        return state.bind().reduce(bucket)
    except BaseException as e:
        index = -1
        with contextlib.suppress(Exception):
            index = bucket.index()
        return state.recorder.failed(e, state.iteration, index)
