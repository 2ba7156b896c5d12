"""The whole-step check of a path plan: are training steps faster with it than with every bucket dense?

Design. The path choice (:mod:`omnireduce.ddp.routing.path_choice`) times each bucket's reduction on its own,
from the hook's call to the future's completion. That misses what omnireduce costs the rest of
the step: its scans, copies and I/O thread take CPU (or device) time the backward pass and the
other buckets' all-reduces would have used. Where cores are few that cost can outweigh a faster
bucket: a bucket timed faster through omnireduce can still make the whole step slower
(docs/bench/training.md has the measurement that showed it).

So once every bucket is decided and the plan sends some bucket through omnireduce that it did not
before, a :class:`StepCheck` runs whole steps both ways on alternate iterations: the plan, then
the same steps with the plan's omnireduce buckets dense, ``trials`` iterations of each. A step is
timed from the first bucket of one iteration to the first bucket of the next (:class:`Mark`: the
host clock, or on CUDA an event recorded on the producing stream, read later and never waited
for); the period holds everything a step does once (the rest of the backward pass, every
bucket's reduction, the optimizer step, the next forward pass). The ranks agree on the slowest
rank's medians of both through the same all-reduce as the buckets' timings, and the plan is kept
only if its steps are faster; otherwise its omnireduce buckets go dense (DDP's own choice wins
ties and missing timings).

Where the hierarchy runs beside the flat path and is left to the measurement (``hierarchical``
left to ``auto``), the check runs three ways in turn: every bucket of the plan through the
hierarchy (its way across the nodes), the plan flat, and the plan dense; the fastest steps win
(ties go to the later way: flat before the hierarchy, dense before both). So the hierarchy's
in-node steps are taken only where whole steps are faster with them. This module holds the
check's schedule and timings; the path choice decides what follows from them.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from omnireduce.ddp.bucket import BucketKey
from omnireduce.ddp.routing.path import DENSE, Path
from omnireduce.ddp.routing.timing import Mark, negated_median_us


class StepCheck:
    """One check of a plan (see the module): ``n`` ways in turn, iterations ``start + j``,
    ``start + j + n``, ... running way ``j`` (``variants[j]``: the way of each bucket there; a bucket
    it does not name takes its planned way), ``trials`` of each. Without ``variants``: the plan
    (``{}``), then ``buckets`` dense."""

    def __init__(self, start: int, buckets: frozenset[BucketKey], trials: int,
                 clock: Callable[[], float] = time.perf_counter,
                 variants: list[dict[BucketKey, Path]] | None = None) -> None:
        self.start, self.buckets, self.trials = start, buckets, trials
        self.variants = variants if variants is not None else [{}, dict.fromkeys(buckets, DENSE)]
        self.ways = len(self.variants)
        self.end = start + self.ways * trials  # the first iteration after the check (its mark ends the last step)
        self.proposed = False
        self._clock = clock
        self._marks: dict[int, Mark] = {}

    def running(self, iteration: int) -> bool:
        return self.start <= iteration < self.end

    def variant_at(self, iteration: int) -> int:
        """Which way runs at ``iteration`` (0 before and after the check)."""
        return (iteration - self.start) % self.ways if self.running(iteration) else 0

    def dense_at(self, iteration: int) -> bool:
        """Whether another way than the first runs at ``iteration`` (without ``variants``: the plan's
        omnireduce buckets dense)."""
        return self.variant_at(iteration) != 0

    def way_at(self, iteration: int, key: BucketKey) -> Path | None:
        """The way bucket ``key`` takes at ``iteration`` (None: its planned way)."""
        return self.variants[self.variant_at(iteration)].get(key) if self.running(iteration) else None

    def mark(self, iteration: int, buffer: torch.Tensor) -> None:
        if self.start <= iteration <= self.end and iteration not in self._marks:
            self._marks[iteration] = Mark(buffer, self._clock)

    def ready(self, iteration: int) -> bool:
        """Whether this rank proposes the check's medians at the last bucket of ``iteration``
        (the same answer on every rank: it reads iterations only)."""
        return not self.proposed and iteration >= self.end

    def proposal(self) -> list[int]:
        """The medians of each way's steps, in negated microseconds (0: no step timed)."""
        self.proposed = True
        return [negated_median_us([s for i in range(self.start, self.end) if self.variant_at(i) == v
                                   and (s := self._seconds(i)) is not None]) for v in range(self.ways)]

    def _seconds(self, iteration: int) -> float | None:
        a, b = self._marks.get(iteration), self._marks.get(iteration + 1)
        return None if a is None or b is None else a.until(b)

    @staticmethod
    def keeps(plan_ms: float | None, dense_ms: float | None) -> bool:
        """Whether the plan stays: its steps timed and faster than the dense ones (a tie, or no
        timing of the plan, goes dense)."""
        return StepCheck.winner([plan_ms, dense_ms]) == 0

    @staticmethod
    def winner(medians_ms: list[float | None]) -> int:
        """The way whose steps were fastest; a tie goes to the later way, and where the first way's
        steps were not timed, the last way (dense) wins."""
        if medians_ms[0] is None:
            return len(medians_ms) - 1
        return min((t, -i) for i, t in enumerate(medians_ms) if t is not None)[1] * -1
