"""What bench_allreduce.py and bench_train.py share: the machine description and SIGTERM/SIGHUP -> exit.

``scripts/`` is not a package: the benchmarks import this as ``benchutil`` (their own directory is
on ``sys.path`` when they run as scripts; tests add it).
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
import platform
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def _version(pkg: str) -> str | None:
    with contextlib.suppress(importlib.metadata.PackageNotFoundError):
        return importlib.metadata.version(pkg)
    return None


def _git_commit() -> str | None:
    with contextlib.suppress(Exception):
        return subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    return None


def machine_info() -> dict[str, Any]:
    """Host, CPU model and count, memory, kernel and OS, the versions of python, numpy, torch and
    omnireduce, and the git commit (read without importing torch)."""
    cpu = None
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), None)
    mem = None
    with contextlib.suppress(OSError, ValueError):
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return {"host": platform.node(), "cpu_model": cpu, "cpus": os.cpu_count(), "memory_gib": mem,
            "kernel": platform.release(), "os": platform.platform(), "python": platform.python_version(),
            "numpy": _version("numpy"), "torch": _version("torch"), "omnireduce": _version("omnireduce"),
            "git_commit": _git_commit()}


def exit_on_signals(prog: str) -> None:
    """Turn SIGTERM and SIGHUP into ``SystemExit(128 + signum)`` so that ``finally`` blocks and context
    managers stop the benchmark's processes and networks. Signals whose disposition is not the
    default (an application's handler, or SIG_IGN from nohup) are left alone."""

    def handler(signum: int, _frame: object) -> None:
        print(f"{prog}: {signal.Signals(signum).name}: stopping the workers, aggregators and network",
              file=sys.stderr)
        raise SystemExit(128 + signum)

    for sig in (signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(sig) is signal.SIG_DFL:
            signal.signal(sig, handler)
