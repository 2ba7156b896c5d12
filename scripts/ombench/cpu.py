"""CPU time of a process's threads, read from /proc, for the benchmarks' CPU columns.

``/proc/PID/task/TID/schedstat`` gives each thread's time on a CPU in nanoseconds (user and system);
``/proc/PID/stat`` counts clock ticks of 10 ms, too coarse for one all-reduce, and is only the
fallback where the kernel has no schedstat. Threads that ended are not counted: the ranks' and the
aggregators' threads live as long as a run.
"""

from __future__ import annotations

import os


def thread_cpu(pid: int | str = "self") -> dict[str, int]:
    """CPU nanoseconds of each thread of process ``pid`` so far, keyed by ``name:tid``."""
    out = {}
    base = f"/proc/{pid}/task"
    for tid in os.listdir(base):
        try:
            with open(f"{base}/{tid}/comm") as f:
                name = f.read().strip()
            try:
                with open(f"{base}/{tid}/schedstat") as f:
                    ns = int(f.read().split()[0])
            except FileNotFoundError:  # no schedstat in this kernel: clock ticks (utime + stime)
                with open(f"{base}/{tid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                ns = (int(fields[11]) + int(fields[12])) * 10**9 // os.sysconf("SC_CLK_TCK")
        except (FileNotFoundError, ProcessLookupError):
            continue  # the thread ended meanwhile
        out[f"{name}:{tid}"] = ns
    return out


def cpu_seconds(pid: int | str = "self") -> float:
    """CPU seconds of process ``pid`` so far, all its threads."""
    return sum(thread_cpu(pid).values()) / 1e9
