"""The benchmark's process group, from whichever launcher started the ranks.

torchrun (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``), an MPI launcher (``mpiexec``,
``srun --mpi``: :func:`omnireduce.launch.init_distributed` asks MPI), or plain ``srun``
(``SLURM_PROCID``, ``SLURM_NTASKS``, ``SLURM_LOCALID``; the first node of the job is the rendezvous,
port ``MASTER_PORT`` or 29500). The device: ``cuda:LOCAL_RANK`` (modulo the devices) on NCCL, the CPU on
Gloo; with ``emulate_hosts`` every rank on ``cuda:0``, each claiming a host of its own
(``NCCL_HOSTID``), so several NCCL ranks share one GPU over NCCL's sockets on loopback (an emulated
network, for testing NCCL's semantics on one GPU).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from typing import Any

import torch
import torch.distributed as dist

from omnireduce.launch import init_distributed, launched_by_torch
from omnireduce.placement import started_by_mpi


def _from_slurm() -> None:
    """torch's variables from Slurm's (plain ``srun``)."""
    env = os.environ
    env.setdefault("RANK", env["SLURM_PROCID"])
    env.setdefault("WORLD_SIZE", env.get("SLURM_NTASKS", "1"))
    env.setdefault("LOCAL_RANK", env.get("SLURM_LOCALID", "0"))
    env.setdefault("MASTER_PORT", "29500")
    if "MASTER_ADDR" not in env:
        nodes = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or ""
        scontrol = shutil.which("scontrol")
        if not scontrol or not nodes:
            raise RuntimeError("under srun: set MASTER_ADDR (the first node of the job), or run where scontrol is")
        hosts = subprocess.run([scontrol, "show", "hostnames", nodes], capture_output=True, text=True, check=True)
        env["MASTER_ADDR"] = hosts.stdout.split()[0]


def start(backend: str, timeout: float, *, emulate_hosts: bool = False) -> tuple[str, torch.device]:
    """Join the job's default process group; returns (backend, this rank's device). ``backend``:
    ``gloo``, ``nccl`` or ``auto`` (NCCL where CUDA is, else Gloo)."""
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if not launched_by_torch() and not started_by_mpi() and "SLURM_PROCID" in os.environ:
        _from_slurm()
    if backend == "nccl" and emulate_hosts:
        rank = os.environ.get("RANK") or os.environ.get("SLURM_PROCID") or os.environ.get("PMI_RANK") or "0"
        os.environ["NCCL_HOSTID"] = f"host{rank}"
        for key, value in (("NCCL_SOCKET_IFNAME", "lo"), ("NCCL_IB_DISABLE", "1")):
            os.environ.setdefault(key, value)
    device = torch.device("cpu")
    if backend == "nccl":
        local = 0 if emulate_hosts else int(os.environ.get("LOCAL_RANK", "0")) % max(1, torch.cuda.device_count())
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
    init_distributed(backend, timeout)
    return backend, device


def barrier(device: torch.device) -> None:
    """Every rank here and its device idle (a one-element all-reduce: NCCL's barrier guesses a device)."""
    sync(device)
    dist.all_reduce(torch.ones(1, device=device))
    sync(device)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def slowest(seconds: float, device: torch.device) -> float:
    """The largest of every rank's ``seconds``."""
    t = torch.tensor([seconds], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def gathered(value: Any) -> list[Any]:
    """Every rank's ``value``, in rank order."""
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out
