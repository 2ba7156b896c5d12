"""``python -m omnireduce``: the version, and what this installation can use.

Prints the omnireduce version, the versions of its dependencies, whether torch is there (the
aggregator does not need it), which backend CUDA tensors get (the CUDA kernels, built or to be
built, or the torch-ops fallback and why), and the launcher helpers (mpi4py, a GPU). Nothing is
built or connected.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import platform
import sys

from omnireduce.version import __version__


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def report() -> list[tuple[str, str]]:
    """(what, value) lines describing this installation."""
    lines = [("omnireduce", __version__), ("python", platform.python_version()), ("numpy", _version("numpy")),
             ("pyzmq", _version("pyzmq"))]
    if importlib.util.find_spec("torch") is None:
        lines.append(("torch", "not installed (the aggregator does not need it; the DDP hook does)"))
        return lines
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    lines.append(("torch", f"{torch.__version__} (CUDA {torch.version.cuda or 'none: a CPU build'}, {gpus} GPU(s))"))
    from omnireduce.cuda import build

    lines.append(("CUDA tensors", build.describe()))
    lines.append(("mpi4py", _version("mpi4py") + " (for mpiexec launches)"))
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m omnireduce", description=__doc__.splitlines()[0])
    p.add_argument("--version", action="version", version=f"omnireduce {__version__}")
    p.parse_args(argv)
    lines = report()
    width = max(len(k) for k, _ in lines)
    for key, value in lines:
        print(f"{key:<{width}}  {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
