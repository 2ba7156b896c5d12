"""``python -m omnireduce._colocated [--drain S] [omnireduce-agg options]``: the entry point of a job's
own aggregator, which dies with the training process that started it.

A colocated aggregator (:mod:`omnireduce.colocate`) is a child of a training process. It must not
outlive it, even when the training process is SIGKILLed and has no chance to stop it. So it runs
``omnireduce-agg`` with one addition: a thread reads standard input, a pipe from the parent, and
when that reaches end-of-file (the parent closed it, or is gone: the kernel closes a dead process's
pipes). If the parent closed it (the job's normal end), the aggregator stops as soon as no worker
is connected to it any more, and ``--drain`` seconds (default 10) after end-of-file at the latest;
if the parent died (killed: the job is failing anyway), it stops at once. At the normal end of a job every rank says
GOODBYE within moments, so the aggregator of one node outlives none of the other nodes' workers
(which would otherwise see it vanish); a rank that never leaves holds it ``--drain`` seconds.
Unlike ``PR_SET_PDEATHSIG``, this does not depend on which thread of the parent started it, and works
on any POSIX system.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Any

DEFAULT_DRAIN = 10.0


def _stop_after_parent(agg: Any, drain: float, parent: int) -> None:
    # The file descriptor, not sys.stdin: a daemon thread blocked inside a buffered reader holds its
    # lock, which the interpreter's shutdown may then wait for (a fatal error at exit).
    try:
        while os.read(0, 4096):
            pass
    except OSError:
        pass
    agg.stop_when_idle(drain)
    # A dying parent's pipes close before it is reaped and this process reparented: watch a moment.
    for _ in range(40):
        if os.getppid() != parent:  # orphaned: the parent died without closing the pipe itself
            agg.request_stop()
            return
        time.sleep(0.05)


def main(argv: list[str] | None = None) -> int:
    from omnireduce.aggregator.cli import main as agg_main

    parent = os.getppid()
    args = list(sys.argv[1:] if argv is None else argv)
    drain = DEFAULT_DRAIN
    if args[:1] == ["--drain"]:
        drain = float(args[1])
        del args[:2]

    def watch(agg: Any) -> None:
        threading.Thread(target=_stop_after_parent, args=(agg, drain, parent), name="omnireduce-parent-watch",
                         daemon=True).start()

    return agg_main(args, on_serving=watch)


if __name__ == "__main__":
    sys.exit(main())
