"""From a user tensor (numpy array or torch tensor) to the block source a reduction runs against.

:func:`adapt` is the one place that decides whether a tensor is reduced on the host or on its
device, and returns the matching source of :mod:`omnireduce.sources`:

- numpy arrays and CPU torch tensors: a :class:`~omnireduce.sources.host.HostSource` over a
  flat, contiguous numpy array of the storage type (float32, float16, or uint16 words for bfloat16)
  that shares memory with the user's tensor, so a reduction is in place and costs no copy;
- CUDA tensors: a :class:`~omnireduce.sources.device.DeviceSource` over the flat torch tensor.
  ``OMNIREDUCE_DEVICE_PATH=1`` sends CPU torch tensors down the device path too (for testing it
  without a GPU; read here, by :func:`device_path_for_cpu`).

- sparse COO torch tensors (embedding gradients): a :class:`~omnireduce.sources.sparse.SparseSource`
  whose blocks are the rows the indices name (:mod:`omnireduce.sources.sparse`); the result is a
  new tensor.

Non-contiguous inputs are reduced through a contiguous copy that is written back at the end. The
source's geometry (:class:`~omnireduce.blocks.Layout`) follows from the tensor's size and the
worker's block size and lane/slot limits. torch is imported only if the input is a torch tensor.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import numpy as np

from omnireduce.blocks import Layout
from omnireduce.config import DEFAULT_BLOCK_SIZE, DEFAULT_LANES, DEFAULT_SLOTS
from omnireduce.dtypes import DType, dtype_from_name
from omnireduce.envvars import env
from omnireduce.sources.base import Source
from omnireduce.sources.device import DeviceSource
from omnireduce.sources.host import HostSource, raw_numpy
from omnireduce.sources.sparse import SparseSource, check_sparse, is_sparse

Geometry = Callable[[int, DType], Layout]  # element count, dtype -> layout


def device_path_for_cpu() -> bool:
    """``OMNIREDUCE_DEVICE_PATH=1``: CPU torch tensors take the device path (with torch ops)."""
    return env("OMNIREDUCE_DEVICE_PATH") == "1"


def is_torch_tensor(x: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)


def describe(x: Any) -> str:
    if is_torch_tensor(x) or isinstance(x, np.ndarray):
        return f"{type(x).__module__}.{type(x).__name__} of shape {tuple(x.shape)} and dtype {x.dtype}"
    return f"{type(x).__module__}.{type(x).__name__}"


def adapt(x: Any, block_size: int = DEFAULT_BLOCK_SIZE, lanes: int = DEFAULT_LANES,
          slots: int = DEFAULT_SLOTS) -> Source:
    """The block source of ``x``, cut into blocks of ``block_size`` elements over at most ``lanes``
    lanes per slot and ``slots`` slots; TypeError/ValueError saying what is wrong with ``x`` otherwise.
    A sparse COO torch tensor gets a :class:`~omnireduce.sources.sparse.SparseSource` (its rows are
    its blocks, whatever ``block_size``)."""

    def geometry(numel: int, dtype: DType) -> Layout:
        return Layout.for_tensor(numel, block_size, lanes, slots, dtype.itemsize)

    if isinstance(x, np.ndarray):
        return _numpy_source(x, geometry)
    if is_torch_tensor(x):
        if is_sparse(x):  # the rows of a sparse COO tensor are its blocks (block size = row width)
            dtype, rows, dim = check_sparse(x)
            return SparseSource(x, dtype, rows, dim, lanes, slots)
        return _torch_source(x, geometry)
    raise TypeError(f"omnireduce reduces numpy arrays and torch tensors; got {describe(x)}")


def _numpy_source(x: np.ndarray, geometry: Geometry) -> HostSource:
    dtype = dtype_from_name(x.dtype.name)  # raises TypeError for unsupported dtypes
    if not x.flags.writeable:
        raise ValueError(f"cannot reduce in place: the array is read-only ({describe(x)})")
    if x.dtype.byteorder == ">":
        raise TypeError(f"big-endian arrays are not supported ({describe(x)})")
    storage = dtype.storage
    if x.flags.c_contiguous:
        return HostSource(x.reshape(-1).view(storage), dtype, geometry(x.size, dtype), None)
    tmp = np.ascontiguousarray(x)

    def writeback() -> None:
        x[...] = tmp

    return HostSource(tmp.reshape(-1).view(storage), dtype, geometry(x.size, dtype), writeback)


def _torch_source(x: Any, geometry: Geometry) -> Source:
    import torch

    try:
        dtype = dtype_from_name(str(x.dtype))
    except TypeError as e:  # its message says what to do with a float64
        raise TypeError(f"{e} ({describe(x)})") from None
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
    layout = geometry(flat.numel(), dtype)
    if x.device.type == "cuda" or device_path_for_cpu():
        return DeviceSource(flat, dtype, layout, writeback)
    return HostSource(raw_numpy(torch, flat, dtype), dtype, layout, writeback)
