"""Launching: ``omnireduce-run`` (:mod:`~omnireduce.launch.run`), its children
(:mod:`~omnireduce.launch.child`), the aggregator processes (:mod:`~omnireduce.launch.procs`), a job's
own aggregators (:mod:`~omnireduce.launch.colocate`), their settings
(:mod:`~omnireduce.launch.settings`), and here, :func:`init_distributed`.

Start torch.distributed the same way under torchrun and under ``mpiexec``.

``init_distributed()`` calls ``torch.distributed.init_process_group`` with the rank and world size of
whichever launcher started the process: torchrun's environment variables (``RANK``,
``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``) when they are set, else MPI's ``COMM_WORLD``
(through mpi4py), in which case rank 0 picks a free port, MPI broadcasts it, and the torch variables
are set for the rest of the process (so ``omnireduce.Worker`` and anything else that reads them
agree). ``mpiexec -n 4 python train.py`` therefore works without any torch launcher.
"""

from __future__ import annotations

import datetime
import logging
import os
import socket

from omnireduce.launch.procs import free_port
from omnireduce.placement import mpi_world, rank_size

log = logging.getLogger("omnireduce.launch")


def launched_by_torch() -> bool:
    """Whether torchrun's variables (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) are all set."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def env_from_mpi() -> tuple[int, int]:
    """Set RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT from MPI's COMM_WORLD."""
    comm = mpi_world()
    if comm is None:
        raise RuntimeError("not started by torchrun (RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT unset) and mpi4py "
                           "is not installed: pip install mpi4py mpich, or launch with torchrun")
    rank, size = rank_size(comm)
    hosts = comm.allgather(socket.gethostname())
    local = hosts.count(hosts[0]) == size  # every rank on one host: loopback will do
    if rank == 0:
        addr = os.environ.get("MASTER_ADDR") or ("127.0.0.1" if local else socket.gethostbyname(hosts[0]))
        master = (addr, int(os.environ.get("MASTER_PORT") or free_port("" if not local else addr)))
    else:
        master = None
    addr, port = comm.bcast(master, root=0)
    local_rank = sum(1 for h in hosts[:rank] if h == hosts[rank])
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(size), LOCAL_RANK=str(local_rank),
                      LOCAL_WORLD_SIZE=str(hosts.count(hosts[rank])), MASTER_ADDR=addr, MASTER_PORT=str(port))
    return rank, size


def init_distributed(backend: str = "gloo", timeout_s: float = 300.0) -> tuple[int, int]:
    """Initialise the default process group under torchrun or MPI; returns (rank, world size)."""
    import torch.distributed as dist

    if not launched_by_torch():
        env_from_mpi()
    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group(backend, rank=rank, world_size=size, timeout=datetime.timedelta(seconds=timeout_s))
    log.debug("rank %d of %d: process group %s at %s:%s", rank, size, backend, os.environ["MASTER_ADDR"],
              os.environ["MASTER_PORT"])
    return rank, size
