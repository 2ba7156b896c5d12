"""How a child process ends with its parent, even when the parent is SIGKILLed: the child's half of
the package's one policy for child processes (the parent's half, starting and stopping them, is
:mod:`omnireduce.launch.procs`).

Not ``PR_SET_PDEATHSIG`` (which fires when the *thread* that forked the child ends, and is Linux
only): a child that must not outlive its parent is started with ``stdin=subprocess.PIPE`` and
watches that pipe (:func:`watch_parent`): the kernel closes a dead process's pipes, so end-of-file
means the parent closed it or is gone, and a parent pid that changed afterwards tells the two apart.
``python -m omnireduce.aggregator.colocated`` is such an aggregator (it drains for
:data:`DEFAULT_DRAIN` seconds at most); a child of our own (a benchmark's rank) calls
:func:`exit_with_parent`. A ground-floor module: the aggregator imports it.
"""

from __future__ import annotations

import os
import signal
import stat
import threading
import time
from collections.abc import Callable

DEFAULT_DRAIN = 10.0
"""Seconds a colocated aggregator (``python -m omnireduce.aggregator.colocated``) waits for its
workers to leave after its parent closed its standard input (its ``--drain`` default)."""


def watch_parent(on_eof: Callable[[], None], on_orphaned: Callable[[], None] | None = None, *,
                 parent: int | None = None, settle: float = 2.0) -> threading.Thread:
    """The child's half of the policy (see the module docstring): a daemon thread that reads standard
    input (a pipe from the parent) until end-of-file, then calls ``on_eof()``; then, if the parent
    pid changes within ``settle`` seconds (the parent died: its pipes close before it is reaped and
    this process reparented), calls ``on_orphaned()``. ``parent``: the parent's pid as this process
    first saw it (default: now). Returns the thread, started."""
    parent = os.getppid() if parent is None else parent

    def watch() -> None:
        # The file descriptor, not sys.stdin: a daemon thread blocked inside a buffered reader holds its
        # lock, which the interpreter's shutdown may then wait for (a fatal error at exit).
        try:
            while os.read(0, 4096):
                pass
        except OSError:
            pass
        on_eof()
        if on_orphaned is None:
            return
        deadline = time.monotonic() + settle
        while time.monotonic() < deadline:
            if os.getppid() != parent:  # orphaned: the parent died without closing the pipe itself
                on_orphaned()
                return
            time.sleep(0.05)

    t = threading.Thread(target=watch, name="omnireduce-parent-watch", daemon=True)
    t.start()
    return t


def exit_with_parent(sig: int = signal.SIGTERM) -> threading.Thread | None:
    """For a child started with ``stdin=subprocess.PIPE`` that reads nothing from it: send ``sig`` to
    this process once standard input ends, i.e. when the parent closes it or dies (even by SIGKILL).
    When standard input is not a pipe (the process was not started so), watches nothing and returns
    None; else returns the watching thread."""
    try:
        if not stat.S_ISFIFO(os.fstat(0).st_mode):
            return None
    except OSError:  # no standard input at all
        return None
    return watch_parent(lambda: os.kill(os.getpid(), sig))
