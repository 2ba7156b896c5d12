"""How the path choice times things: one reduction (:class:`Trial`), the start of a step (:class:`Mark`), and a
median as the ranks' agreement carries it (:func:`negated_median_us`).

On the host with a clock; on CUDA with events recorded on the stream that produced the gradient and on
the one its result is ready on, read later and never waited for (a timing whose events have not
completed yet counts as missing).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from omnireduce.ddp.routing.path import Path

_MAX_US = 2**31 - 1  # (~36 minutes: more than any trial takes; the agreement carries int64)


def negated_median_us(times: list[float]) -> int:
    """The median of ``times`` (seconds) as the agreement carries it: negated microseconds, at least
    1 and capped at ~36 minutes, so that MIN gives the slowest rank's; 0 when none."""
    return -min(_MAX_US, max(1, round(median(times) * 1e6))) if times else 0


def median(values: list[float]) -> float:
    """``statistics.median``'s value (the middle one, or the mean of the two middle ones), without
    importing ``statistics``, which brings ``decimal`` and ``fractions`` along: 0.4 MiB of memory in
    every process that imports the hook."""
    s = sorted(values)
    m = len(s) // 2
    return s[m] if len(s) % 2 else (s[m - 1] + s[m]) / 2


class Mark:
    """When an iteration's first bucket reached the hook: the host clock, or on CUDA an event on the
    current (producing) stream."""

    def __init__(self, buffer: torch.Tensor, clock: Callable[[], float] = time.perf_counter) -> None:
        self.t = clock()
        self.event: torch.cuda.Event | None = None
        if buffer.is_cuda:
            with torch.cuda.device(buffer.device):
                self.event = torch.cuda.Event(enable_timing=True)
                self.event.record()

    def until(self, later: Mark) -> float | None:
        """Seconds from this mark to ``later`` (on CUDA: None until both events completed)."""
        if self.event is None or later.event is None:
            return later.t - self.t
        if not (self.event.query() and later.event.query()):
            return None
        return self.event.elapsed_time(later.event) / 1e3


class Trial:
    """One timed reduction of a bucket: started at the hook's call, stopped when its future
    completes (:meth:`watch`); :meth:`seconds` is None until both ends are known (on CUDA: until
    both events have completed on the device; nothing waits for them)."""

    def __init__(self, path: Path, buffer: torch.Tensor, clock: Callable[[], float] = time.perf_counter) -> None:
        self.path = path
        self._cuda = buffer.is_cuda
        self._device = buffer.device
        self._clock = clock
        self._t0 = clock()
        self._t1: float | None = None
        self._start: torch.cuda.Event | None = None
        self._end: torch.cuda.Event | None = None
        self._failed = False
        if self._cuda:
            with torch.cuda.device(self._device):
                self._start = torch.cuda.Event(enable_timing=True)
                self._start.record()  # on the stream that produced the gradient

    def watch(self, fut: torch.futures.Future[torch.Tensor]) -> torch.futures.Future[torch.Tensor]:
        """Stop the clock when ``fut`` completes (on CUDA: an event on the stream its value is
        ready on, which the callback runs under); returns ``fut`` itself."""

        def done(f: torch.futures.Future[torch.Tensor]) -> None:
            try:
                f.value()
            except BaseException:
                self._failed = True
                return
            if self._cuda:
                with torch.cuda.device(self._device):
                    end = torch.cuda.Event(enable_timing=True)
                    end.record()
                self._end = end
            else:
                self._t1 = self._clock()

        fut.add_done_callback(done)
        return fut

    def seconds(self) -> float | None:
        if self._failed:
            return None
        if not self._cuda:
            return None if self._t1 is None else self._t1 - self._t0
        start, end = self._start, self._end
        if start is None or end is None or not end.query() or not start.query():  # (start: set on CUDA)
            return None
        return start.elapsed_time(end) / 1e3
