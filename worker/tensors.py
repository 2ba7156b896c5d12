"""Adapters from user tensors (numpy arrays, torch tensors) to the flat raw numpy view the protocol uses.

The worker reads and writes a host tensor through a flat, contiguous numpy array of its storage type
(float32, float16, or uint16 words for bfloat16) that shares memory with the user's tensor, so a
reduction is in place and costs no copy. A CUDA tensor stays a flat torch tensor (the device path
of :mod:`omnireduce.worker.sources`), with an event recorded on the stream that produced it.
``OMNIREDUCE_DEVICE_PATH=1`` sends CPU torch tensors down the device path too (for testing it
without a GPU). Non-contiguous inputs are reduced through a contiguous copy that is written back at
the end. torch is imported only if the input is a torch tensor.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Callable
from typing import Any

import numpy as np

from omnireduce.dtypes import SUPPORTED, DType, dtype_from_name


@dataclasses.dataclass
class Adapted:
    """A user tensor seen as a flat raw host array, or as a flat device tensor, and how to finish
    writing into it."""

    raw: np.ndarray | None  # host: flat, contiguous, storage dtype; the memory that receives the result
    dtype: DType
    writeback: Callable[[], None] | None  # copies the result back when it is not the tensor's memory
    tensor: Any = None  # device path: the flat torch tensor
    ready: Any = None  # device path, CUDA: an event recorded on the stream that produced the tensor

    @property
    def numel(self) -> int:
        return int(self.raw.size) if self.raw is not None else int(self.tensor.numel())


def is_torch_tensor(x: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)


def describe(x: Any) -> str:
    if is_torch_tensor(x) or isinstance(x, np.ndarray):
        return f"{type(x).__module__}.{type(x).__name__} of shape {tuple(x.shape)} and dtype {x.dtype}"
    return f"{type(x).__module__}.{type(x).__name__}"


def adapt(x: Any) -> Adapted:
    """The flat raw view of ``x``; TypeError/ValueError saying what is wrong with ``x`` otherwise."""
    if isinstance(x, np.ndarray):
        return _adapt_numpy(x)
    if is_torch_tensor(x):
        return _adapt_torch(x)
    raise TypeError(f"omnireduce reduces numpy arrays and torch tensors; got {describe(x)}")


def _adapt_numpy(x: np.ndarray) -> Adapted:
    dtype = dtype_from_name(x.dtype.name)  # raises TypeError for unsupported dtypes
    if not x.flags.writeable:
        raise ValueError(f"cannot reduce in place: the array is read-only ({describe(x)})")
    if x.dtype.byteorder == ">":
        raise TypeError(f"big-endian arrays are not supported ({describe(x)})")
    storage = dtype.storage
    if x.flags.c_contiguous:
        return Adapted(x.reshape(-1).view(storage), dtype, None)
    tmp = np.ascontiguousarray(x)

    def writeback() -> None:
        x[...] = tmp

    return Adapted(tmp.reshape(-1).view(storage), dtype, writeback)


def _adapt_torch(x: Any) -> Adapted:
    import torch

    try:
        dtype = dtype_from_name(str(x.dtype))
    except TypeError:
        raise TypeError(f"omnireduce reduces {SUPPORTED} tensors; got {describe(x)}") from None
    if x.is_sparse or x.layout != torch.strided:
        raise TypeError(f"sparse tensors are not supported; reduce a dense tensor ({describe(x)})")
    if x.device.type not in ("cpu", "cuda"):
        raise TypeError(f"tensors on device {x.device} are not supported ({describe(x)})")
    t = x.detach()
    writeback = None
    if not t.is_contiguous():
        src = t
        t = t.contiguous()

        def writeback() -> None:
            src.copy_(t)

    flat = t.view(-1)
    if x.device.type == "cuda" or os.environ.get("OMNIREDUCE_DEVICE_PATH") == "1":
        ready = None
        if x.device.type == "cuda":  # what the I/O thread's side stream will wait for
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(x.device))
        return Adapted(None, dtype, writeback, tensor=flat, ready=ready)
    if dtype is DType.BFLOAT16:
        raw = flat.view(torch.int16).numpy().view(np.uint16)
    else:
        raw = flat.numpy()
    return Adapted(raw, dtype, writeback)
