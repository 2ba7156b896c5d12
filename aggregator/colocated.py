"""``python -m omnireduce.aggregator.colocated [--drain S] [omnireduce-agg options]``: the entry point of
a job's own aggregator, which dies with the training process that started it.

A colocated aggregator (:mod:`omnireduce.launch.colocate`) is a child of a training process. It must not
outlive it, even when the training process is SIGKILLed and has no chance to stop it. So it runs
``omnireduce-agg`` with one addition: a thread reads standard input, a pipe from the parent, until
end-of-file (the parent closed it, or is gone: the kernel closes a dead process's pipes); that
thread is :func:`omnireduce.lifetime.watch_parent`, the library's one policy for children. If the
parent closed it (the job's normal end), the aggregator stops as soon as no worker is connected to it
any more, and ``--drain`` seconds (default 10) after end-of-file at the latest; if the parent died
(killed: the job is failing anyway), it stops at once. At the normal end of a job every rank says
GOODBYE within moments, so the aggregator of one node outlives none of the other nodes' workers
(which would otherwise see it vanish); a rank that never leaves holds it ``--drain`` seconds.
Unlike ``PR_SET_PDEATHSIG``, this does not depend on which thread of the parent started it, and works
on any POSIX system. The benchmarks in ``scripts/`` run their aggregators this way too.

Like the rest of the aggregator package, it imports neither torch nor the worker.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from omnireduce.lifetime import DEFAULT_DRAIN, watch_parent


def main(argv: list[str] | None = None) -> int:
    from omnireduce.aggregator.cli import main as agg_main

    parent = os.getppid()
    args = list(sys.argv[1:] if argv is None else argv)
    drain = DEFAULT_DRAIN
    if args[:1] == ["--drain"]:
        drain = float(args[1])
        del args[:2]

    def watch(agg: Any) -> None:
        watch_parent(lambda: agg.stop_when_idle(drain), agg.request_stop, parent=parent)

    return agg_main(args, on_serving=watch)


if __name__ == "__main__":
    sys.exit(main())
