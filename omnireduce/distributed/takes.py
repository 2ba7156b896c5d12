"""Which all-reduce calls omnireduce takes, and why it leaves the others to torch.distributed.

omnireduce takes a call whose op is SUM or AVG, whose tensors are float32, float16 or bfloat16 (strided,
or sparse COO of shape ``(rows, dim)`` with one sparse and one dense dimension), on the CPU or a CUDA
device, and whose group is a Gloo or NCCL group this rank belongs to and that moves tensors of that
device. Every other call goes to ``torch.distributed.all_reduce`` as it was made, which then does
whatever torch does with it (reduces it, or raises torch's own error): :func:`declined` says why, for the
log. The decision reads only what the call says (its op, its tensors' metadata, its group), never data.

A rank that declines a call its peers take would leave them waiting: ranks that disagree about a dtype
(an int tensor on one rank, a float one on another) reach different collectives, as they would with
torch's own call. Ranks that disagree among the dtypes omnireduce takes, or about shapes, get an
:class:`~omnireduce.errors.OmniReduceMismatchError` (:mod:`omnireduce.distributed.header`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.overrides import has_torch_function

from omnireduce.distributed.subgroups import is_private
from omnireduce.engines.waits import host_collectives

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
BACKENDS = ("gloo", "nccl")


def average_of(op: Any) -> bool | None:
    """False for SUM, True for AVG, None for any other op (PREMUL_SUM included)."""
    if op == dist.ReduceOp.SUM:
        return False
    if op == dist.ReduceOp.AVG:
        return True
    return None


def declined(tensors: Sequence[torch.Tensor], op: Any, group: Any) -> str | None:
    """Why omnireduce leaves this call to torch.distributed (None: omnireduce takes it)."""
    if not dist.is_available() or not dist.is_initialized():
        return "torch.distributed is not initialised"
    if not tensors:
        return "no tensors"
    if any(not isinstance(t, torch.Tensor) for t in tensors):
        return "not a tensor"
    if has_torch_function(tuple(tensors)):
        return "a tensor subclass with its own __torch_function__"
    if group is dist.GroupMember.NON_GROUP_MEMBER:
        return "this rank is not in the group"
    if is_private(group):
        return "omnireduce's own collective on a group of its own"
    if average_of(op) is None:
        return f"op {op}"
    first = tensors[0]
    for t in tensors:
        why = _tensor_declined(t)
        if why is not None:
            return why
        if t.device != first.device or t.dtype != first.dtype or t.layout != first.layout:
            return "tensors of different devices, dtypes or layouts"
    if first.layout != torch.strided and len(tensors) > 1:
        return "several sparse tensors"
    backend = str(dist.get_backend(group)).lower()
    if not any(b in backend for b in BACKENDS):
        return f"backend {backend}"
    if first.device.type == "cpu" and not host_collectives(group):
        return f"a CPU tensor on backend {backend}"
    return None


def _tensor_declined(t: torch.Tensor) -> str | None:
    if t.dtype not in DTYPES:
        return f"dtype {t.dtype}"
    if t.device.type not in ("cpu", "cuda"):
        return f"device {t.device}"
    if t.layout == torch.strided:
        return None
    if t.layout != torch.sparse_coo or t.dim() != 2 or t.sparse_dim() != 1 or t.dense_dim() != 1:
        return f"a sparse tensor that is not COO of shape (rows, dim) ({t.layout}, {t.dim()} dimensions)"
    return None
