"""One group's calls, in the order they were made, on a thread of omnireduce's.

Design. The caller's thread makes the call (:mod:`omnireduce.distributed.call`), numbers it and queues
it; every rank numbers its calls on a group in the same order, as torch requires of collectives. The
group's thread takes them one at a time:

1. the ranks all-gather the call's header on the group's private copy
   (:mod:`omnireduce.distributed.header`); where they disagree, every rank fails the call with the same
   :class:`~omnireduce.errors.OmniReduceMismatchError` and goes on with the next one;
2. the reducer takes the buffer (:mod:`omnireduce.distributed.reducers`); its future completes the
   call. The collective engine's collectives run on the same private group, so the next call's header
   waits until this reduction is done: one collective at a time on the group, in the same order on
   every rank. (The aggregators' reductions travel elsewhere: the next header goes at once.)

On CUDA the thread works on a stream of its own per device, which first waits (on the device) for the
event the caller recorded; the reducer records its own start on that stream.

Deadlines. The header's all-gather fails after the private group's timeout (``OMNIREDUCE_TIMEOUT``);
the reducer fails a reduction at the same timeout; a rank that dies fails the others' calls within it.
After such a failure the ranks may stand at different collectives of the group: every later call on
the group fails at once with the first error, without a collective, until
:func:`omnireduce.distributed.shutdown` closes the group's runtime (its next call builds a new one).
A mismatch is not such a failure: no block was sent.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from omnireduce.distributed import header
from omnireduce.distributed.call import Call
from omnireduce.distributed.reducers import Made
from omnireduce.engines.waits import Wire
from omnireduce.errors import OmniReduceError, OmniReduceMismatchError, OmniReduceTimeout

log = logging.getLogger("omnireduce.distributed")
_SLACK = 30.0  # seconds past the timeout the thread waits for a reducer that has its own deadline


class GroupRuntime:
    """The calls on one process group (see the module): ``group`` the user's, ``own`` its private copy,
    ``made`` the reducer, ``timeout`` seconds."""

    def __init__(self, group: Any, own: Any, made: Made, timeout: float) -> None:
        self.group, self.own, self.made, self.timeout = group, own, made, timeout
        self.ranks = list(dist.get_process_group_ranks(group))
        self.world = len(self.ranks)
        self._wire = Wire(own, timeout)
        self._seq = 0
        self._lock = threading.Lock()
        self._calls: queue.SimpleQueue[Call | None] = queue.SimpleQueue()
        self._broken: BaseException | None = None
        self._streams: dict[torch.device, Any] = {}
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="omnireduce-distributed", daemon=True)
        self._thread.start()

    @property
    def way(self) -> str:
        return self.made.way

    def submit(self, make: Any) -> Call:
        """Number and queue the call ``make(seq)`` makes; returns it."""
        with self._lock:
            if self._closed:
                raise OmniReduceError("omnireduce.distributed: this group's runtime is shut down")
            call = make(self._seq)
            self._seq += 1
            self._calls.put(call)
        return call

    def close(self, wait: float = 10.0) -> None:
        """Stop the thread once the calls queued are done (``wait`` seconds at most), then close the
        reducer (idempotent)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._calls.put(None)
        self._thread.join(wait)
        try:
            self.made.close()
        except Exception as e:  # (closing goes on: a failed reducer still lets go of the rest)
            log.warning("omnireduce.distributed: closing the %s reducer: %s", self.way, e)

    # -- the group's thread ----------------------------------------------------------------------

    def _loop(self) -> None:
        while (call := self._calls.get()) is not None:
            if self._broken is not None:
                call.fail(OmniReduceError(f"omnireduce.distributed.{call.name}: an earlier call on this group "
                                          f"(global ranks {self.ranks}) failed: {self._broken}"))
                continue
            try:
                self._run(call)
            except OmniReduceMismatchError as e:
                call.fail(e)
            except BaseException as e:
                self._broken = _named(e, call, self.ranks, self.timeout)
                log.error("%s", self._broken)
                call.fail(self._broken)
            del call

    def _run(self, call: Call) -> None:
        with self._on_device(call):
            rows = self._wire.on(call.device).all_gather_ints(call.header)
            problem = header.disagreement(rows, self.ranks, f"omnireduce.distributed.{call.name}")
            if problem is not None:
                raise OmniReduceMismatchError(problem)
            reduction = self.made.reducer.allreduce_async(call.buffer, average=call.average)
        done = threading.Event()
        reduction.add_done_callback(lambda _f: done.set())
        reduction.add_done_callback(call.finished)
        if not self.made.on_group:
            return
        run_here = getattr(reduction, "run_here", None)
        if run_here is not None:  # (the engine's next reduction: run on this thread, not handed to the engine's)
            run_here()
        if not done.wait(self.timeout + _SLACK):
            raise OmniReduceTimeout(f"the {self.way} reducer did not finish within {self.timeout + _SLACK:g} s")
        failure = _failure(reduction)
        if failure is not None:  # (the call failed with it; the group's collectives may be out of step now)
            self._broken = _named(failure, call, self.ranks, self.timeout)

    @contextlib.contextmanager
    def _on_device(self, call: Call) -> Iterator[None]:
        """On CUDA: the call's device, and this thread's stream there, after the caller's event."""
        if call.ready is None:
            yield
            return
        dev = call.device
        stream = self._streams.get(dev)
        if stream is None:
            stream = self._streams[dev] = torch.cuda.Stream(dev)
        with torch.cuda.device(dev), torch.cuda.stream(stream):
            stream.wait_event(call.ready)
            yield


def _failure(fut: torch.futures.Future[Any]) -> BaseException | None:
    try:
        fut.value()
    except BaseException as e:
        return e
    return None


def _named(error: BaseException, call: Call, ranks: list[int], timeout: float) -> OmniReduceError:
    """``error`` as an :class:`OmniReduceError` naming the call and the group (a timeout as
    :class:`OmniReduceTimeout`)."""
    if isinstance(error, OmniReduceError) and "omnireduce.distributed" in str(error):
        return error
    where = f"omnireduce.distributed.{call.name}: call {int(call.header[1])} on the group of global ranks {ranks}"
    text = f"{type(error).__name__}: {error}"
    kind = OmniReduceTimeout if isinstance(error, TimeoutError) or "timed out" in text.lower() or \
        "timeout" in text.lower() else OmniReduceError
    out = kind(f"{where} failed: {text} (a rank died, or stopped calling, within the {timeout:g} s timeout?)")
    out.__cause__ = error
    return out
