"""The aggregator's memory budget: the bytes its slots hold, per job and in all, against the limits.

Design. What a slot holds is defined once, by the slot (``SlotState.footprint``: its per-rank lane
arrays, blocks waiting to be summed, a FINAL's sums kept for replays), and the slot reports every
change of it to the :class:`Tally` it was opened with: its job's, which passes it on to the
aggregator's. So a job's bytes and the aggregator's bytes are, at every moment, the sums of their
slots' footprints, and reading them costs nothing. (Summing the slots at each check instead would
cost a CONTRIB about half a millisecond with a job's 4096 slots in flight, more than handling it.)
Nothing but a slot adds to a tally, and a slot gives all it holds back when it is closed.

:class:`Budget` answers the one question asked before anything new is held: would ``more`` bytes
for this job break the per-job or the total limit, and which?
"""

from __future__ import annotations

from typing import Protocol

from omnireduce.aggregator.limits import AggregatorLimits


class Tally:
    """Bytes held by a group of slots; every change is passed on to the ``parent`` tally too."""

    __slots__ = ("bytes", "parent")

    def __init__(self, parent: Tally | None = None) -> None:
        self.bytes = 0
        self.parent = parent

    def add(self, delta: int) -> None:
        tally: Tally | None = self
        while tally is not None:
            tally.bytes += delta
            tally = tally.parent


class Holder(Protocol):
    """What :meth:`Budget.refuse` reads of a job (:class:`omnireduce.aggregator.job.Job`)."""

    held: Tally

    def label(self) -> str: ...


class Budget:
    """The memory limits of :class:`AggregatorLimits`, checked against what the slots hold."""

    def __init__(self, limits: AggregatorLimits) -> None:
        self.limits = limits
        self.total = Tally()  # every job's slots

    def job_tally(self) -> Tally:
        """A new job's tally (it counts towards the total)."""
        return Tally(self.total)

    def refuse(self, job: Holder, more: int) -> str:
        """Why holding ``more`` bytes for ``job`` would break a memory limit ("" if it would not)."""
        if job.held.bytes + more > self.limits.max_job_bytes:
            return f"{job.label()} would hold more than {self.limits.max_job_bytes} bytes (limit per job)"
        if self.total.bytes + more > self.limits.max_total_bytes:
            return f"the aggregator would hold more than {self.limits.max_total_bytes} bytes (limit for all jobs)"
        return ""
