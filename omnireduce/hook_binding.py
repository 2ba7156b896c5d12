"""Binding a DDP hook's state to its job: the job name, the aggregators and this rank's worker.

Design. :meth:`omnireduce.ddp.OmniReduceState.bind` holds the binding's lock and outcome (a failed
binding stays failed, so ranks never wait for each other's retries); the steps that talk to the
process group and the aggregators are here. Both are collective over the process group, so every
rank runs them in the same order:

- :func:`job_name`: ``$OMNIREDUCE_JOB``, else a random name rank 0 makes up and broadcasts;
- :func:`connect`: a :class:`omnireduce.Worker` at the given aggregators (``aggregators=`` or
  ``$OMNIREDUCE_AGGREGATORS``), or else at aggregators the job starts for itself
  (:func:`omnireduce.colocate.start_colocated`), which the state then holds and which stop at
  interpreter exit after the worker has left them (:func:`_close_at_exit`).
"""

from __future__ import annotations

import atexit
import contextlib
import uuid
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from omnireduce.colocate import Colocated, exiting_on_error
from omnireduce.config import env_aggregators, env_job, env_timeout
from omnireduce.worker import Worker

if TYPE_CHECKING:
    from omnireduce.hook_state import OmniReduceState


def job_name(group: dist.ProcessGroup) -> str:
    """The job's name at the aggregators when the user gave none (collective)."""
    return env_job() or _agree_on_job_name(group)


def connect(state: OmniReduceState, group: Any = None) -> Worker:
    """A worker for this rank: at the given aggregators, or at colocated ones started now (then held
    in ``state.colocated``)."""
    opts = {k: v for k, v in state.worker_options.items() if v is not None}
    if "aggregators" in opts or env_aggregators():
        return Worker(rank=state.rank, world_size=state.world_size, job=state.job, **opts)
    from omnireduce.colocate import start_colocated

    timeout = opts.get("timeout", env_timeout())
    colocated = start_colocated(group, timeout=float(timeout))
    try:
        opts.update(aggregators=colocated.addresses, token=colocated.token)
        worker = Worker(rank=state.rank, world_size=state.world_size, job=state.job, **opts)
    except BaseException:
        colocated.close(drain=False)
        raise
    state.colocated = colocated
    # Registered after the colocated aggregators' own exit handler, so it runs first (handlers run
    # last-registered first): the worker says goodbye while its aggregators still listen. It holds
    # the worker and the aggregators, not the state, which DDP may have dropped by then.
    atexit.register(_close_at_exit, worker, colocated)
    return worker


def _close_at_exit(worker: Worker, colocated: Colocated) -> None:
    """Leave the job, then stop this rank's colocated aggregators once every rank has left them."""
    with contextlib.suppress(Exception):
        worker.close()
    colocated.close(drain=not exiting_on_error())


def _agree_on_job_name(group: dist.ProcessGroup) -> str:
    name = [f"ddp-{uuid.uuid4().hex[:16]}" if dist.get_rank(group) == 0 else None]
    dist.broadcast_object_list(name, src=dist.get_global_rank(group, 0), group=group)
    return str(name[0])
