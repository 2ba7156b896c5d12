"""``python -m omnireduce._colocated [omnireduce-agg options]``: an aggregator that dies with its starter.

A colocated aggregator (:mod:`omnireduce.colocate`) is a child of a training process. It must not
outlive it, even when the training process is SIGKILLed and has no chance to stop it. So it runs
``omnireduce-agg`` with one addition: a thread reads standard input, a pipe from the parent, and
when that reaches end-of-file (the parent closed it or is gone: the kernel closes a dead process's
pipes) it stops the aggregator the way SIGTERM does. Unlike ``PR_SET_PDEATHSIG``, this does not
depend on which thread of the parent started it, and works on any POSIX system.
"""

from __future__ import annotations

import os
import signal
import sys
import threading


def _exit_with_parent() -> None:
    try:
        while sys.stdin.buffer.read(4096):
            pass
    except (OSError, ValueError):
        pass
    os.kill(os.getpid(), signal.SIGTERM)


def main() -> int:
    from omnireduce.aggregator.cli import main as agg_main

    threading.Thread(target=_exit_with_parent, name="omnireduce-parent-watch", daemon=True).start()
    return agg_main(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
