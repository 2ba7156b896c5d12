"""Where this process runs: its node, and its rank and world size under an MPI launcher.

One answer for every layer: the hierarchy's topology and the colocated aggregators both name nodes
with :func:`node_name`; the worker's configuration (rank and world size when torchrun's variables
are unset) and ``init_distributed`` (torch's variables from MPI) both ask MPI through
:func:`mpi_world`, :func:`mpi_rank_size` and :func:`rank_size`. mpi4py is imported only when
asked, and only if installed.
"""

from __future__ import annotations

import os
import socket
from typing import Any

#: Variables that MPI launchers (MPICH/Hydra, Open MPI, PMIx, Intel MPI) set for the processes they start.
MPI_LAUNCHER_VARS = ("PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "MPI_LOCALRANKID",
                     "HYDI_CONTROL_FD")


def node_name() -> str:
    """This process's node: its host, and torchrun's node rank when there is one."""
    group_rank = os.environ.get("GROUP_RANK")
    host = socket.gethostname()
    return f"{host}#{group_rank}" if group_rank is not None else host


def started_by_mpi() -> bool:
    """Whether an MPI launcher (``mpiexec``, ``srun --mpi``) started this process."""
    return any(k in os.environ for k in MPI_LAUNCHER_VARS)


def mpi_world() -> Any:
    """mpi4py's ``COMM_WORLD``, or None when mpi4py is not installed."""
    try:
        from mpi4py import MPI
    except ImportError:
        return None
    return MPI.COMM_WORLD


def mpi_rank_size() -> tuple[int, int] | None:
    """(rank, size) in MPI's ``COMM_WORLD`` if an MPI launcher started this process and mpi4py is
    installed, else None."""
    if not started_by_mpi():
        return None
    comm = mpi_world()
    return None if comm is None else rank_size(comm)


def rank_size(comm: Any) -> tuple[int, int]:
    """(rank, size) of this process in the MPI communicator ``comm``."""
    return comm.Get_rank(), comm.Get_size()
