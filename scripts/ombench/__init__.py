"""What the benchmarks in scripts/ share, as an importable package (``ombench``).

It lives beside the scripts and is not installed with omnireduce (no library module imports it):
``python scripts/x.py`` puts ``scripts/`` on ``sys.path``, so the scripts import it by name; the
tests add ``scripts/`` to ``sys.path`` (``tests/conftest.py``), and a ``python -c``/``-m`` process
that needs it gets ``scripts/`` in ``PYTHONPATH`` (:func:`child_env`).

* :mod:`~ombench.network`: where the ranks and aggregators run, this machine's loopback or
  an emulated network, and stopping them on the way out.
* :mod:`~ombench.netem`: the emulated network itself (network namespaces on a bridge,
  links shaped with tbf).
* :mod:`~ombench.mpi`: starting ranks with ``mpiexec``, on loopback or into the namespaces.
* :mod:`~ombench.collectives`: the all-reduce methods of bench_allreduce.py, one table
  from name to setup, step and wire floor.
* :mod:`~ombench.hooks`: the DDP communication hooks of bench_train.py, one table from
  name to registration and bytes per step.
* :mod:`~ombench.nodemethods`: the methods of bench_hierarchy.py on nodes of several ranks
  (Gloo ring, the hierarchy dense or with omnireduce, flat omnireduce), DDP-free;
  :mod:`~ombench.linkbytes`: the bytes that crossed a node's link, from its interface counters;
  :mod:`~ombench.nodereport`: bench_hierarchy.py's tables and plot.
* :mod:`~ombench.traffic`: the bytes each scheme moves (ring, PowerSGD, omnireduce per link, the
  collective engine per rank).
* :mod:`~ombench.collcost`: PREDICTION of the collective engine on GPUs over NCCL against NCCL's
  ring (cost_model.py collective).
* :mod:`~ombench.tables` and :mod:`~ombench.plots`: the output.
* :mod:`~ombench.machine`: the machine description recorded with the results.
* :mod:`~ombench.rankjobs`: jobs of rank processes on this machine (the GPU check's and bench_engine.py's);
  :mod:`~ombench.rankside`: a rank's context in those jobs, and omnireduce's internal names they use.

The inputs and the timed turns of the benchmarks that time an all-reduce in ranks of their own are
omnireduce-bench's (:mod:`omnireduce.bench.inputs`, :mod:`omnireduce.bench.timing`): one implementation.

Importing the package imports none of them; torch, matplotlib and mpi4py are only imported inside
the functions that need them.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parent.parent
"""The ``scripts/`` directory this package lives in (what ``PYTHONPATH`` needs to import it)."""


def child_env(env: Mapping[str, str] | None = None, **extra: str) -> dict[str, str]:
    """``env`` (default: this process's environment) and ``extra``, with :data:`SCRIPTS` first in
    ``PYTHONPATH``: for a ``python -c``/``python -m`` child that imports ``ombench``."""
    out = dict(os.environ if env is None else env, **extra)
    out["PYTHONPATH"] = os.pathsep.join(p for p in (str(SCRIPTS), out.get("PYTHONPATH", "")) if p)
    return out
