"""The ways a tensor can be reduced, by name, and the engines of the ranks' own that carry some of them.

:class:`Way` names each way once: in the path choice's timings, in ``stats()``, in
``OmniReduceState(engine=...)``. :data:`ENGINES` holds the ways an engine of the ranks' own carries
(no aggregator process): how one is built on a process group of its own (made for it, collectively,
when the state binds), and whether ``engine="auto"`` measures it among the ways of each bucket. A new
way is a member here and its entry in :data:`ENGINES` (see :mod:`omnireduce.engines.reducer`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from omnireduce.config import WorkerConfig
from omnireduce.engines.collective import CollectiveEngine
from omnireduce.engines.reducer import Engine
from omnireduce.names import StrEnum


class Way(StrEnum):
    """How a tensor is reduced (a ``str``: its value is its name in ``stats()``)."""

    AGGREGATORS = "aggregators"  # the aggregator processes (omnireduce's own protocol)
    COLLECTIVE = "collective"  # the collective engine: the ranks sum each other's blocks
    DENSE = "dense"  # the process group's all-reduce
    # a new engine's way: NAME = "name", and its entry in ENGINES below


@dataclasses.dataclass(frozen=True)
class EngineKind:
    """An engine of the ranks' own: ``build(group, config, sum_order)`` makes it on ``group``, a process
    group no other collective uses, with the blocks' layout, threshold and timeout of ``config``, and
    the summation order asked for (``"any"`` or ``"rank"``); ``auto``: ``engine="auto"`` measures it (on
    the backends it has run on, Gloo and NCCL)."""

    build: Callable[[Any, WorkerConfig, str], Engine]
    auto: bool = True


def _collective(group: Any, config: WorkerConfig, sum_order: str) -> Engine:
    return CollectiveEngine(group, config.block_size, config.lanes, config.slots, config.threshold,
                            float(config.timeout), order=sum_order)


ENGINES: dict[Way, EngineKind] = {
    Way.COLLECTIVE: EngineKind(_collective),
}
