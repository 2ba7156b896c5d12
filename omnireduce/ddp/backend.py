"""What the hook needs to know of a process group's backend, asked in one place.

Two questions only: whether the group's collectives take host tensors (Gloo and MPI do; NCCL and
the like take device tensors only), and its name, which decides whether ``engine="auto"`` measures
the collective engine (on Gloo; see :func:`omnireduce.ddp.binding.sparse_paths`).
"""

from __future__ import annotations

import torch.distributed as dist


def backend_name(group: dist.ProcessGroup | None) -> str:
    """The group's backend in lower case (``"gloo"``, ``"nccl"``, ...); ``""`` when it cannot be told."""
    try:
        return str(dist.get_backend(group)).lower()
    except (RuntimeError, ValueError):
        return ""


def takes_host_tensors(group: dist.ProcessGroup | None) -> bool:
    """Whether the group's collectives take host tensors (Gloo and MPI; also when the backend is unknown)."""
    name = backend_name(group)
    return not name or "gloo" in name or "mpi" in name
