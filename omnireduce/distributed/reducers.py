"""The reducer a group's calls go through: the aggregators where the user configured them, the collective
engine otherwise.

- ``OMNIREDUCE_AGGREGATORS`` set: an :class:`omnireduce.Worker` of a job of the group's own (its name made
  by the group's first rank and shared with the others) at those aggregators, as this rank of the group,
  wrapped as a reducer (:class:`~omnireduce.engines.aggregators.WorkerReducer`);
- otherwise :class:`~omnireduce.engines.collective.CollectiveEngine` on the group's private copy: the
  ranks sum each other's blocks through the group's own collectives (Gloo's, NCCL's). Its sums follow
  ``OMNIREDUCE_SUM_ORDER``: ``any`` (the default: the union's blocks may go through the backend's own
  all-reduce where that is cheapest, summed in the backend's order) or ``rank`` (always float32 in rank
  order, rounded once).

Both take the block size, timeout, lanes and slots from the environment (``OMNIREDUCE_BLOCK_SIZE``,
``OMNIREDUCE_TIMEOUT``, ...), as the DDP hook does.
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Callable, Mapping
from typing import Any

import torch.distributed as dist

from omnireduce.config import WorkerConfig, env_aggregators, env_job
from omnireduce.engines.reducer import Reducer
from omnireduce.envvars import env

SUM_ORDERS = ("any", "rank")


@dataclasses.dataclass
class Made:
    """A group's reducer: ``reducer``, what closes it, its way's name (``collective`` or ``aggregators``),
    whether its collectives run on the private group (then a call's header waits for the previous call),
    and its counters."""

    reducer: Reducer
    close: Callable[[], None]
    way: str
    on_group: bool
    stats: Callable[[], Mapping[str, Any]]


def env_sum_order() -> str:
    """``OMNIREDUCE_SUM_ORDER``: ``any`` (default) or ``rank``."""
    order = (env("OMNIREDUCE_SUM_ORDER") or "any").strip().lower()
    if order not in SUM_ORDERS:
        raise ValueError(f"OMNIREDUCE_SUM_ORDER must be any or rank, got {order!r}")
    return order


def make(own: Any, timeout: float) -> Made:
    """The reducer of a group whose private copy is ``own`` (collective over it)."""
    rank, world = dist.get_rank(own), dist.get_world_size(own)
    if env_aggregators():
        return _worker(own, rank, world, timeout)
    from omnireduce.engines.collective import CollectiveEngine

    cfg = WorkerConfig.resolve(rank=rank, world_size=world, timeout=timeout, without_aggregators=True)
    engine = CollectiveEngine(own, cfg.block_size, cfg.lanes, cfg.slots, 0.0, timeout, order=env_sum_order())
    return Made(engine, engine.release, "collective", True, engine.stats)


def _worker(own: Any, rank: int, world: int, timeout: float) -> Made:
    from omnireduce.engines.aggregators import WorkerReducer
    from omnireduce.worker import Worker

    name: list[Any] = [f"{env_job() or 'distributed'}-{uuid.uuid4().hex[:12]}" if rank == 0 else None]
    dist.broadcast_object_list(name, src=dist.get_global_rank(own, 0), group=own)
    worker = Worker(rank=rank, world_size=world, job=str(name[0]), timeout=timeout)
    return Made(WorkerReducer(worker), worker.close, "aggregators", False, worker.stats)
