"""Timed runs that take turns repeat by repeat, and their medians.

Per repeat, each run in turn: its input copied in (untimed), the ranks meet and their devices go idle
(:func:`omnireduce.bench.launch.barrier`), then the run is timed on each rank from its start until its
result is in memory (the device synchronised); the repeat's time is the slowest rank's. A run's time is
the median over the repeats after the warm-up ones. Taking turns, what drifts on a shared machine drifts
for every run alike; only numbers of one run are compared.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from omnireduce.bench.launch import barrier, slowest, sync


@dataclasses.dataclass
class Run:
    """``run(work)`` on a fresh copy of ``source`` each repeat, after ``prepare()`` (untimed); ``work`` holds
    the last result. ``clock``: where the run times itself (a part of what it does), the seconds of its
    last repeat. ``times``: the slowest rank's seconds per timed repeat; ``cpu``: this process's CPU
    seconds (every thread's) per timed repeat."""

    run: Callable[[torch.Tensor], Any]
    source: torch.Tensor
    clock: Callable[[], float] | None = None
    prepare: Callable[[], None] | None = None
    result: Callable[[], torch.Tensor] | None = None  # where the run leaves its result, if not in ``work``
    work: torch.Tensor = dataclasses.field(init=False)
    times: list[float] = dataclasses.field(default_factory=list)
    cpu: list[float] = dataclasses.field(default_factory=list)

    def __post_init__(self) -> None:
        self.work = torch.empty_like(self.source)

    def output(self) -> torch.Tensor:
        """The last repeat's result."""
        return self.result() if self.result is not None else self.work

    @property
    def median(self) -> float:
        return statistics.median(self.times) if self.times else float("nan")

    @property
    def cpu_median(self) -> float:
        return statistics.median(self.cpu) if self.cpu else float("nan")


def interleaved(runs: dict[str, Run], warmup: int, repeats: int, device: torch.device) -> dict[str, float]:
    """Median seconds per run (see the module)."""
    for i in range(warmup + repeats):
        for r in runs.values():
            r.work.copy_(r.source)
            if r.prepare is not None:
                r.prepare()
            barrier(device)
            c0, t0 = time.process_time(), time.perf_counter()
            r.run(r.work)
            sync(device)
            took, cpu = time.perf_counter() - t0, time.process_time() - c0
            took = slowest(took if r.clock is None else r.clock(), device)
            if i >= warmup:
                r.times.append(took)
                r.cpu.append(cpu)
    return {name: r.median for name, r in runs.items()}
