"""Continuations of a process group's futures, run on a thread of ours instead of the backend's.

Gloo completes a collective's future on one of its own threads, and a Python callback added to that
future runs there. That thread then needs the GIL until the callback has returned, well after the
callback completed the caller's future (DDP's ``backward()`` is already on its way by then). Whoever
drops the last reference to the group while holding the GIL (DDP's C++ reducer, collected at the end of
a training function, joins the group's threads in its destructor) then waits for a thread that waits
for the GIL: the process hangs for ever. So no code of ours runs on a backend's thread.
:class:`Completer` waits for such futures on a daemon thread of its own, in the order they were
handed over, and runs each continuation there; a future complete at once (NCCL's, whose future
completes as the collective is queued) is continued on the caller's thread, with no hand-over.

The thread is started by the first future that needs it and ends after ``idle`` seconds without one,
so a reducer nobody uses holds no thread; :meth:`Completer.close` (and interpreter exit) ends it once
what was handed over has run. Nothing handed over is kept once its continuation has run.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch

from omnireduce import exits

log = logging.getLogger(__name__)

Continuation = Callable[[torch.futures.Future[Any]], None]


class Completer:
    """Runs ``then(future)`` once ``future`` is complete, never on the thread that completes it (see the
    module). ``then`` reads the outcome with ``future.value()`` and must not raise."""

    def __init__(self, name: str, *, idle: float = 2.0) -> None:
        self.name, self.idle = name, idle
        self._lock = threading.Lock()
        self._queue: queue.SimpleQueue[tuple[torch.futures.Future[Any], Continuation] | None] = queue.SimpleQueue()
        self._waiting = 0  # handed over, their continuations not run yet
        self._thread: threading.Thread | None = None
        exits.at_exit(exits.RELEASE, _close_at_exit, weakref.ref(self))

    def submit(self, future: torch.futures.Future[Any], then: Continuation) -> None:
        """Run ``then(future)`` once ``future`` is complete: here and now if it already is and nothing
        handed over before it waits, else on this completer's thread, after those."""
        with self._lock:
            handed = bool(self._waiting) or not future.done()
            if handed:
                self._waiting += 1
                self._queue.put((future, then))
                if self._thread is None:
                    self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
                    self._thread.start()
        if not handed:
            then(future)

    def close(self, wait: float = 5.0) -> None:
        """End the thread once what was handed over has run (``wait`` seconds at most). A future handed
        over later starts another."""
        with self._lock:
            thread = self._thread
            if thread is not None:
                self._queue.put(None)
        if thread is not None:
            thread.join(wait)

    def _run(self) -> None:
        while True:
            try:
                item = self._queue.get(timeout=self.idle)
            except queue.Empty:
                item = None
            with self._lock:
                if item is None and not self._waiting:  # idle for ``idle`` seconds, or closing with nothing left
                    if self._thread is threading.current_thread():
                        self._thread = None
                    return
            if item is None:
                continue  # (closing, or idle, with work still handed over: it comes next)
            future, then = item
            with contextlib.suppress(BaseException):  # (a failure is read, and reported, by ``then``)
                future.wait()  # (the GIL released)
            try:
                then(future)
            except BaseException:  # a continuation that raised: its own future may never complete
                log.exception("%s: a continuation raised", self.name)
            del future, then, item  # (a command's tensors and futures are not kept by this thread)
            with self._lock:
                self._waiting -= 1


def _close_at_exit(ref: weakref.ref[Completer]) -> None:
    """At interpreter exit: end the completer's thread, if the completer still lives."""
    completer = ref()
    if completer is not None:
        completer.close()
