"""Jobs run one at a time, in the order they were handed over, by a thread of their own or by a caller
that waits for the next one.

The collective engine's reductions must run in the order they were asked for, one after the other
(every rank issues their collectives in that order). :class:`Turns` runs them on a daemon thread; but
a caller that waits for a job not begun yet, with none before it and none running, runs it itself on
its own thread (:meth:`Turns.run_waited`): the same job in the same place in the order, without the
hand-over to the other thread and back (a synchronous call's, a benchmark's).

The thread sleeps on a lock that is locked while it has nothing to do, blocked in C: handing a job over
releases it; a waiting caller that takes the job first locks it again, so the thread, if it has not
woken yet, is not woken for nothing and never contends with the caller for the interpreter.
"""

from __future__ import annotations

import collections
import contextlib
import threading
from collections.abc import Callable
from typing import Generic, TypeVar

Job = TypeVar("Job")


class Turns(Generic[Job]):
    """Runs ``run(job)`` for each job handed over (:meth:`put`), one at a time, in order (see the
    module); ``run`` must not raise. ``at_end`` runs on the thread once it ends (after :meth:`close`,
    every job handed over done)."""

    def __init__(self, run: Callable[[Job], None], name: str, at_end: Callable[[], None] | None = None) -> None:
        self._do, self._at_end = run, at_end
        self._pending: collections.deque[Job] = collections.deque()  # handed over, not begun, in order
        self._lock = threading.Lock()  # (guards _pending, _busy, _closed)
        self._busy = False  # a job is running (on the thread, or on a waiting caller's)
        self._closed = False
        self._wake = threading.Lock()  # (locked: the thread has nothing to do; see the module)
        self._wake.acquire()
        self.thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self.thread.start()

    def put(self, job: Job) -> None:
        """Hand ``job`` over: it runs after every job handed over before it."""
        with self._lock:
            self._pending.append(job)
        self._rouse()

    def run_waited(self, job: Job) -> bool:
        """Run ``job`` here, on the caller's thread, where it is the next and nothing runs (a caller about to
        wait for it); False where it is not (the thread runs it in its turn, or has)."""
        with self._lock:
            if self._busy or not self._pending or self._pending[0] is not job:
                return False
            self._pending.popleft()
            self._busy = True
        self._wake.acquire(blocking=False)  # (the thread, if not awake yet, stays asleep)
        self._run(job)
        return True

    def close(self) -> None:
        """Let the thread end once every job handed over is done (it does not wait: join :attr:`thread`)."""
        with self._lock:
            self._closed = True
        self._rouse()

    def _loop(self) -> None:
        while True:
            with self._lock:
                if self._closed and not self._pending and not self._busy:  # every job handed over done
                    break
                job = None if self._busy or not self._pending else self._pending.popleft()
                self._busy = self._busy or job is not None
            if job is None:
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
                rouse = bool(self._pending) or self._closed
            if rouse:  # (the thread waits for nothing else: not woken in vain)
                self._rouse()

    def _rouse(self) -> None:
        """Wake the thread (woken already: nothing more)."""
        with contextlib.suppress(RuntimeError):  # (released already)
            self._wake.release()
