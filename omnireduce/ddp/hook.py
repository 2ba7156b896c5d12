"""The DDP communication hook: a dispatcher from DDP's buckets to the state's runtime.

    state = OmniReduceState()                              # before or after init_process_group
    ddp_model.register_comm_hook(state, omnireduce_hook)   # averages, like DDP's default

One bucket's way runs in one direction: hook -> runtime -> router (a route and its reducer) ->
reducer -> future, and on the way back only the state's recorder is written. The hook counts the
iteration (and checks that the state serves one model), binds the state on its first call, hands the
bucket to the runtime (:meth:`omnireduce.ddp.runtime.Runtime.reduce`) and, once the last bucket is on
its way, starts the ranks' agreement for the next iteration (:mod:`omnireduce.ddp.agreement`). It
returns a ``torch.futures.Future`` at once, so communication overlaps the rest of the backward pass,
and never raises: a failure completes the future with an :class:`~omnireduce.OmniReduceError` naming
the iteration, the bucket and the cause, which DDP raises from ``backward()`` as it is
(:func:`omnireduce.engines.reducer.fail`).
"""

# No `from __future__ import annotations` here: DDP checks the hook's annotations against the real
# dist.GradBucket and torch.futures.Future[torch.Tensor] objects.
import logging

import torch
import torch.distributed as dist

from omnireduce.ddp.state import OmniReduceState

log = logging.getLogger("omnireduce.ddp")


def omnireduce_hook(state: OmniReduceState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average a DDP gradient bucket over all ranks through omnireduce (see the module); never raises."""
    iteration, index, runtime = state.iteration, -1, None
    try:
        index = bucket.index()
        iteration = state.count(bucket)
        runtime = state.bind()
        return runtime.reduce(bucket, iteration)
    except BaseException as e:
        return state.recorder.failed(e, iteration, index)
    finally:  # after the last bucket is on its way, so that its all-reduce does not queue behind this one
        if runtime is not None and bucket.is_last():
            try:
                runtime.after_last_bucket(iteration, bucket.buffer().device)
            except BaseException as e:  # (DDP raises the bucket's error, if any; this one is logged)
                log.error("omnireduce: the agreement of iteration %d could not start: %s", iteration, e)
