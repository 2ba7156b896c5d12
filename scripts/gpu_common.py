"""What the GPU check's Python helpers share: the skip rule, a process group, and a small DDP model.

Design. Each helper of ``scripts/gpu_check.sh`` is a script of its own, run in its own process
under its own timeout; what they have in common is here and nothing else: :func:`require_cuda`
(exit status 77 and a ``RESULT:`` line with the reason when there is no GPU: the shell reports the
step skipped), :func:`init_group` (a Gloo process group on 127.0.0.1, the backend the hook is
tested with, or NCCL with several ranks on one GPU: :func:`nccl_rank_env`), and :class:`Net`, a
model whose backward pass has both kinds of bucket omnireduce
meets: an embedding table whose gradient is mostly zero rows (the sparse path) and a stack of dense
layers (whose buckets go dense after their first reduction, unless the dense fallback is off), in
several DDP buckets, so that communication can overlap the rest of the backward pass.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
from torch import nn

SKIP_STATUS = 77  # gpu_check.sh reports a helper that exits with this as skipped

ROWS, DIM, WIDTH, DEPTH, IDS_PER_ROW = 100_000, 64, 1024, 6, 8


def require_cuda(what: str) -> None:
    """Exit with :data:`SKIP_STATUS` and the reason unless a CUDA device is visible."""
    if not torch.cuda.is_available():
        print(f"RESULT: no CUDA device: torch.cuda.is_available() is False (torch {torch.__version__}, "
              f"CUDA build {torch.version.cuda}); {what} needs a GPU", flush=True)
        sys.exit(SKIP_STATUS)


def nccl_rank_env(rank: int) -> dict[str, str]:
    """What lets several ranks share one GPU through NCCL: each rank claims a host of its own
    (``NCCL_HOSTID``), so NCCL neither refuses two ranks on one device nor looks for shared memory
    or peer access between them, and moves the bytes with its socket transport on loopback (no
    InfiniBand). Variables already set (e.g. ``NCCL_P2P_DISABLE`` from the check's first step) stay."""
    env = {"NCCL_HOSTID": f"host{rank}"}
    for key, value in (("NCCL_SOCKET_IFNAME", "lo"), ("NCCL_IB_DISABLE", "1"), ("NCCL_DEBUG", "WARN")):
        env[key] = os.environ.get(key, value)
    return env


def init_group(rank: int, world_size: int, port: int, backend: str = "gloo") -> None:
    """The default process group over 127.0.0.1:``port``: Gloo, or NCCL with every rank on
    ``cuda:0`` (:func:`nccl_rank_env`)."""
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    if backend == "nccl":
        os.environ.update(nccl_rank_env(rank))
        torch.cuda.set_device(0)
        dist.init_process_group("nccl", rank=rank, world_size=world_size, device_id=torch.device("cuda", 0))
        return
    dist.init_process_group(backend, rank=rank, world_size=world_size)


class Net(nn.Module):
    """An embedding bag (sparse gradient rows) into ``DEPTH`` dense layers: several DDP buckets."""

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.EmbeddingBag(ROWS, DIM, mode="sum")
        layers: list[nn.Module] = [nn.Linear(DIM, WIDTH), nn.ReLU()]
        for _ in range(DEPTH - 1):
            layers += [nn.Linear(WIDTH, WIDTH), nn.ReLU()]
        self.body = nn.Sequential(*layers, nn.Linear(WIDTH, 1))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.body(self.table(ids)).squeeze(1)


def batches(rank: int, steps: int, batch: int, device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``steps`` batches of (ids, targets), made on the device up front (no copy inside a checked step)."""
    gen = torch.Generator(device=device).manual_seed(1000 + rank)
    out = []
    for _ in range(steps):
        ids = torch.randint(0, ROWS, (batch, IDS_PER_ROW), device=device, generator=gen)
        out.append((ids, torch.rand(batch, device=device, generator=gen)))
    return out
