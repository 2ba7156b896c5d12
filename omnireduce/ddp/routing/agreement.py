"""The ranks' per-iteration agreement: which aggregators a DDP job uses, and what else rides along.

A worker routes around an aggregator it finds lost by itself (:mod:`omnireduce.worker.routing`), and
every rank finds a dead aggregator lost. Taking one back when it returns, or leaving one that only
some ranks cannot reach, must happen at the same tensor on every rank, and only a collective gives
that. So the hook agrees on the set once per iteration: at the last bucket of iteration ``n`` (once
that bucket is on its way) every rank contributes, per aggregator, whether it reaches it
(:meth:`omnireduce.Worker.reachable`), all-reduced with MIN through the DDP process group without
waiting for it; at the first bucket of iteration ``n + 1``, the same point of the tensor sequence on
every rank, the result is handed to the worker (:meth:`omnireduce.Worker.use_aggregators`). An
aggregator comes back into use one iteration after every rank reaches it again. The cost: one
all-reduce of ``A`` integers per iteration, issued as the backward pass ends and read an iteration
later (on a CUDA process group through pinned memory and an event, so nothing waits for the device).
With no aggregator agreed (all lost), every bucket takes the process group's dense all-reduce. The
same all-reduce carries what else the ranks must agree on (a :class:`Rider`: the path choice's
timings), and how far every rank has got: each rank's :meth:`omnireduce.Worker.finished_below` (every
tensor below it has finished there; a tensor of iteration ``n - 1`` has finished by the last bucket of
iteration ``n``), whose MIN the worker is handed at the next iteration's first bucket
(:meth:`omnireduce.Worker.release_kept`): the sums it keeps of those tensors for replays after an
aggregator restart are needed by no rank any more. Without it they would stay until the aggregators
next report the job's progress, with the next tensor that goes through them, which while the path
choice times the ways in turn is three iterations later.
"""

from __future__ import annotations

import logging
import time
from typing import Protocol

import torch
import torch.distributed as dist

from omnireduce.ddp.backend import takes_host_tensors

log = logging.getLogger("omnireduce.ddp")


class Rider(Protocol):
    """What else the ranks agree on in the same all-reduce (MIN), e.g. the path choice's timings
    (:class:`omnireduce.ddp.routing.path_choice.PathChoice`): ``proposal`` at the last bucket of an iteration
    (the same number of values on every rank), ``agreed`` with the result at the next one's first."""

    def proposal(self, iteration: int) -> list[int]: ...

    def agreed(self, values: list[int], iteration: int) -> None: ...


class Aggregators(Protocol):
    """What of :class:`omnireduce.Worker` the agreement uses: which aggregators this rank reaches, and
    which ones to use from the next tensor on; how far this rank has finished, and that every rank has."""

    def reachable(self) -> list[bool]: ...

    def use_aggregators(self, indices: list[int]) -> None: ...

    def finished_below(self) -> int: ...

    def release_kept(self, below: int) -> None: ...


class _Round:
    """One agreement in flight: the all-reduced flags, and how to read them on the host."""

    def __init__(self, iteration: int, flags: torch.Tensor, group: dist.ProcessGroup | None, aggregators: int,
                 finished: bool = False) -> None:
        self.iteration = iteration
        self.aggregators = aggregators  # the flags' first values; then the ranks' progress (``finished``); the rider's
        self.finished = finished
        self.work = dist.all_reduce(flags, op=dist.ReduceOp.MIN, group=group, async_op=True)
        self.flags = flags
        self.host: torch.Tensor | None = None
        self.event: torch.cuda.Event | None = None
        if flags.is_cuda:  # queue the copy to the host now; read it an iteration later
            self.work.wait()  # (on CUDA: the current stream waits for the collective, the host does not)
            with torch.cuda.device(flags.device):
                self.host = torch.empty(flags.shape, dtype=flags.dtype, pin_memory=True)
                self.host.copy_(flags, non_blocking=True)
                self.event = torch.cuda.Event()
                self.event.record()

    def result(self) -> list[int]:
        if self.host is None:
            self.work.wait()
            return [int(v) for v in self.flags.tolist()]
        event = self.event  # (set with host)
        if event is not None and not event.query():
            event.synchronize()
        return [int(v) for v in self.host.tolist()]


class Agreement:
    """The per-iteration agreement of one :class:`omnireduce.ddp.OmniReduceState` (see the module)."""

    def __init__(self, worker: Aggregators | None = None, group: dist.ProcessGroup | None = None) -> None:
        self.worker = worker  # the omnireduce.Worker whose aggregators are agreed on (None: no aggregators)
        self.group = group  # the process group the ranks agree on (None: the default group)
        self._round: _Round | None = None
        self.none_usable = False  # the last agreement left no aggregator: buckets go dense
        self.usable: tuple[int, ...] | None = None  # the aggregators of the last agreement applied
        self.released = 0  # the tensors every rank had finished, as the last agreement said (worker numbers)
        self.rounds = 0

    def at_bucket(self, iteration: int, rider: Rider | None = None) -> None:
        """Called at the first bucket of ``iteration``, before it is reduced (the same bucket on every
        rank): applies the agreement of an earlier iteration, if one is in flight. ``rider``: more to
        agree on in the same all-reduce (see :class:`Rider`)."""
        r = self._round
        if r is not None and r.iteration < iteration:
            self._round = None
            values = r.result()
            flags, extra = values[: r.aggregators], values[r.aggregators + r.finished:]
            if rider is not None:
                rider.agreed(extra, iteration)
            worker = self.worker  # (there whenever aggregators are)
            if not r.aggregators or worker is None:  # (no aggregator in this job: the collective engine sums)
                return
            if r.finished and values[r.aggregators] > self.released:
                self.released = values[r.aggregators]
                worker.release_kept(self.released)
            usable = [i for i, ok in enumerate(flags) if ok]
            if not usable and not self.none_usable:
                log.warning("omnireduce: no aggregator is reachable from every rank: buckets go through the "
                            "process group's all-reduce until one is")
            self.none_usable = not usable
            self.usable = tuple(usable)
            worker.use_aggregators(usable)

    def settle(self, timeout: float) -> None:
        """Wait, at most ``timeout`` seconds, for the agreement in flight, then let it go (when the state
        closes). A rank that destroys its process group with this all-reduce still queued can leave
        it unfinished, and the other ranks' copies then wait for it in their group's teardown. On a
        CUDA group the host never waits for it (NCCL's watchdog bounds it)."""
        r, self._round = self._round, None
        if r is None or r.host is not None:
            return
        deadline = time.monotonic() + timeout  # (polled: Gloo's Work.wait ignores its timeout)
        try:
            while not r.work.is_completed():
                if time.monotonic() > deadline:
                    log.warning("omnireduce: the last agreement's all-reduce did not finish within %.1f s of "
                                "closing; left behind", timeout)
                    return
                time.sleep(0.002)
        except Exception as e:  # (a group already destroyed, a rank gone: closing goes on)
            log.warning("omnireduce: the last agreement's all-reduce failed at close: %s", e)

    def release(self) -> None:
        """Let go of the agreement in flight (at interpreter exit: its all-reduce was issued by
        every rank at the last bucket; its work is not left for the interpreter's shutdown)."""
        self._round = None

    def after_last_bucket(self, iteration: int, device: torch.device, rider: Rider | None = None) -> None:
        """Called once the last bucket of ``iteration`` is handed to its reducer: starts
        this iteration's agreement (collective: every rank at the same point). After the bucket,
        so that the bucket's own all-reduce, on the dense path, does not queue behind this one,
        which is read only an iteration later."""
        worker, group = self.worker, self.group
        reachable = [int(ok) for ok in worker.reachable()] if worker is not None else []
        finished = [worker.finished_below()] if reachable and worker is not None else []
        extra = rider.proposal(iteration) if rider is not None else []
        flags = torch.tensor(reachable + finished + extra, dtype=torch.int64)
        if not takes_host_tensors(group) and device.type == "cuda":
            flags = flags.to(device)
        self._round = _Round(iteration, flags, group, len(reachable), bool(finished))
        self.rounds += 1

