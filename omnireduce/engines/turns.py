"""Jobs run one at a time, in the order they were handed over, by a thread of their own or by a caller
that waits for the next one.

The collective engine's reductions must run in the order they were asked for, one after the other
(every rank issues their collectives in that order). :class:`Turns` runs them on a daemon thread; but
a caller that waits for a job not begun yet, with none before it and none running, runs it itself on
its own thread (:meth:`Turns.run_waited`): the same job in the same place in the order, without the
hand-over to the other thread and back (a synchronous call's, a benchmark's).

The thread sleeps on a lock that is locked while it has nothing to do, blocked in C: handing a job over
releases it; a waiting caller that takes the job first locks it again, so the thread, if it has not
woken yet, is not woken for nothing.

Dozing. Woken all the same, the thread takes the interpreter lock from the caller that runs the job
(at its first call that lets go of it) only to find the job taken: two hand-overs of that lock a job.
So once :data:`SETTLE` jobs in a row were run by their waiting callers, handing a job over no longer
wakes the thread: it dozes instead, waking every ``doze_s`` seconds. A job still not begun at two
wake-ups in a row (its caller did not wait for it) is run by the thread, which then wakes for every
job again; so is a job handed over after a whole doze in which no job began (the callers went quiet).
A job whose caller never waits is therefore begun within two dozes at most, and only the first such
job after a run of waiting callers waits at all.
"""

from __future__ import annotations

import collections
import contextlib
import threading
from collections.abc import Callable
from typing import Generic, TypeVar

Job = TypeVar("Job")

SETTLE = 4
"""Jobs in a row run by their waiting callers after which handing a job over stops waking the thread."""
DOZE_S = 0.002
"""Seconds between a dozing thread's wake-ups (a job nobody waits for begins within two)."""


class Turns(Generic[Job]):
    """Runs ``run(job)`` for each job handed over (:meth:`put`), one at a time, in order (see the
    module); ``run`` must not raise. ``at_end`` runs on the thread once it ends (after :meth:`close`,
    every job handed over done); ``doze_s``: seconds between a dozing thread's wake-ups."""

    def __init__(self, run: Callable[[Job], None], name: str, at_end: Callable[[], None] | None = None,
                 doze_s: float = DOZE_S) -> None:
        self._do, self._at_end, self._doze_s = run, at_end, doze_s
        self._pending: collections.deque[Job] = collections.deque()  # handed over, not begun, in order
        self._lock = threading.Lock()  # (guards everything below but _wake)
        self._busy = False  # a job is running (on the thread, or on a waiting caller's)
        self._closed = False
        self._handed = 0  # jobs handed over so far
        self._begun = 0  # jobs begun so far (the next pending job is number _begun)
        self._waited = 0  # jobs in a row run by their waiting callers
        self._dozing = False  # handing a job over does not wake the thread (see the module)
        self._wake = threading.Lock()  # (locked: the thread has nothing to do; see the module)
        self._wake.acquire()
        self.thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self.thread.start()

    @property
    def dozing(self) -> bool:
        """Whether handing a job over leaves the thread dozing (see the module)."""
        return self._dozing

    def put(self, job: Job) -> None:
        """Hand ``job`` over: it runs after every job handed over before it."""
        with self._lock:
            self._pending.append(job)
            self._handed += 1
            dozing = self._dozing
        if not dozing:
            self._rouse()

    def run_waited(self, job: Job) -> bool:
        """Run ``job`` here, on the caller's thread, where it is the next and nothing runs (a caller about to
        wait for it); False where it is not (the thread runs it in its turn, or has)."""
        with self._lock:
            if self._busy or not self._pending or self._pending[0] is not job:
                return False
            self._pending.popleft()
            self._busy = True
            self._begun += 1
            self._waited += 1
            was_dozing = self._dozing
            dozing = self._dozing = was_dozing or self._waited >= SETTLE
        if dozing and not was_dozing:  # (the thread may sleep until woken: woken once, it dozes from now on)
            self._rouse()
        elif not was_dozing:  # (woken by put: the thread, if not awake yet, stays asleep)
            self._wake.acquire(blocking=False)
        self._run(job)
        return True

    def close(self) -> None:
        """Let the thread end once every job handed over is done (it does not wait: join :attr:`thread`)."""
        with self._lock:
            self._closed = True
        self._rouse()

    def _loop(self) -> None:
        begun = handed = 0  # (dozing: how many jobs had begun, and been handed over, at the last wake-up)
        while True:
            with self._lock:
                if self._closed and not self._pending and not self._busy:  # every job handed over done
                    break
                job = None
                if self._pending and not self._busy:
                    stray = self._dozing and self._begun < handed  # (handed over before the last wake-up: no one waits)
                    if not self._dozing or stray or self._closed:
                        job = self._pending.popleft()
                        self._busy, self._begun, self._waited, self._dozing = True, self._begun + 1, 0, False
                elif self._dozing and not self._busy and self._begun == begun:  # a whole doze with no job begun
                    self._dozing = False
                dozing, begun, handed = self._dozing, self._begun, self._handed
            if job is None:
                if dozing:
                    self._wake.acquire(timeout=self._doze_s)
                else:
                    self._wake.acquire()  # (until there is something to do)
                continue
            self._run(job)
            del job  # (a job's tensors are not kept while the thread waits for the next)
        if self._at_end is not None:
            self._at_end()

    def _run(self, job: Job) -> None:
        """One job, then the turn handed on (``_busy`` set by whoever took ``job``)."""
        try:
            self._do(job)
        finally:
            with self._lock:
                self._busy = False
                rouse = (bool(self._pending) and not self._dozing) or self._closed
            if rouse:  # (the thread waits for nothing else: not woken in vain)
                self._rouse()

    def _rouse(self) -> None:
        """Wake the thread (woken already: nothing more)."""
        with contextlib.suppress(RuntimeError):  # (released already)
            self._wake.release()
