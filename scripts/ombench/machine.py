"""The machine a benchmark ran on, for its JSON: host, CPU, memory, OS, versions and git commit.

Read from /proc, ``platform`` and the installed packages' metadata, without importing torch (the
benchmark drivers never import it; only their ranks do).
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
import platform
import subprocess
from pathlib import Path
from typing import Any


def _version(pkg: str) -> str | None:
    with contextlib.suppress(importlib.metadata.PackageNotFoundError):
        return importlib.metadata.version(pkg)
    return None


def _git_commit(repo: Path) -> str | None:
    with contextlib.suppress(Exception):
        return subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    return None


def machine_info(repo: Path) -> dict[str, Any]:
    """Host, CPU model and count, memory, kernel and OS, the versions of python, numpy, torch and
    omnireduce, and the commit checked out in the git repository ``repo`` (None if it is not one)."""
    cpu = None
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), None)
    mem = None
    with contextlib.suppress(OSError, ValueError):
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return {"host": platform.node(), "cpu_model": cpu, "cpus": os.cpu_count(), "memory_gib": mem,
            "kernel": platform.release(), "os": platform.platform(), "python": platform.python_version(),
            "numpy": _version("numpy"), "torch": _version("torch"), "omnireduce": _version("omnireduce"),
            "git_commit": _git_commit(repo)}
