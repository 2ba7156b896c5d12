"""Block bitmaps: flags packed eight to a byte, unpacked, and the counts a reduction's host learns
from them (:mod:`omnireduce.engines.exchange_device`).

On the host numpy packs, unpacks and counts (it makes nothing but its result); a device takes
torch ops and the flags' sums (fewer kernels). The two give the same bytes and counts (tested on
CPU tensors).
"""

from __future__ import annotations

import functools

import numpy as np
import torch

_BITS = (128, 64, 32, 16, 8, 4, 2, 1)  # np.packbits' order: the first flag in the high bit


def counts_host(e: np.ndarray, u: np.ndarray, owner: torch.Tensor | None, W: int) -> torch.Tensor:
    """:func:`counts_device`'s vector from host flags (``[W, nb]`` and their union), in numpy (no
    temporary of more than the flags' size)."""
    parts = [np.array([np.count_nonzero(row) for row in e] + [np.count_nonzero(u), u[-1]])]
    if owner is not None:
        o = owner.numpy()
        parts += [np.bincount(o[e[s]], minlength=W) for s in range(W)] + [np.bincount(o[u], minlength=W)]
    return torch.from_numpy(np.concatenate(parts).astype(np.int64, copy=False))


def counts_device(every: torch.Tensor, union: torch.Tensor, owner: torch.Tensor | None, W: int) -> torch.Tensor:
    """Each rank's non-zero blocks, the union's, whether the last block is in it, and with ``owner``
    the (source, owner) pairs and each owner's union blocks: one int64 vector
    (:meth:`omnireduce.engines.plan.Counts.from_flat`), made in torch ops on the flags' device for
    the one copy the host waits for (on the host :func:`counts_host` makes it in numpy)."""
    parts = [every.sum(dim=1), union.sum().view(1), union[-1:].long()]
    if owner is not None:
        pairs = torch.zeros((W, W), dtype=torch.int64, device=every.device)
        pairs.scatter_add_(1, owner.expand(W, -1), every.long())
        owned = torch.zeros(W, dtype=torch.int64, device=every.device)
        owned.scatter_add_(0, owner, union.long())
        parts += [pairs.view(-1), owned]
    return torch.cat(parts)


def pack(flags: torch.Tensor) -> torch.Tensor:
    """Bool flags as bytes, eight to a byte, the first flag in the high bit (on their device; on the
    host numpy's ``packbits``, which makes nothing but its result)."""
    if flags.device.type == "cpu":
        return torch.from_numpy(np.packbits(flags.numpy()))
    return pack_torch(flags)


def unpack(packed: torch.Tensor, n: int) -> torch.Tensor:
    """``[W, ceil(n / 8)]`` bytes back to ``[W, n]`` bool flags (on the host numpy's ``unpackbits``)."""
    if packed.device.type == "cpu":
        return torch.from_numpy(np.unpackbits(packed.numpy(), axis=1, count=n).view(np.bool_))
    return unpack_torch(packed, n)


def pack_torch(flags: torch.Tensor) -> torch.Tensor:
    """:func:`pack` in torch ops (a device's; on the host a few temporaries of the flags' size)."""
    pad = (-flags.numel()) % 8
    f = flags.view(torch.uint8)
    if pad:
        f = torch.cat([f, f.new_zeros(pad)])
    return (f.view(-1, 8) * _weights(flags.device)).sum(dim=1, dtype=torch.uint8)


def unpack_host(packed: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """:func:`unpack` of host bytes in numpy, and the flags' union (``[n]``): numpy arrays."""
    every = np.unpackbits(packed, axis=1, count=n).view(np.bool_)
    return every, every[0] if every.shape[0] == 1 else np.logical_or.reduce(every, axis=0)


def unpack_torch(packed: torch.Tensor, n: int) -> torch.Tensor:
    """:func:`unpack` in torch ops."""
    return (packed.unsqueeze(-1) & _weights(packed.device)).ne(0).view(packed.shape[0], -1)[:, :n]


@functools.lru_cache(maxsize=8)
def _weights(device: torch.device) -> torch.Tensor:
    """Each bit's weight in a byte, on ``device``: made once (a tensor from a list is a copy the host
    would wait for)."""
    return torch.tensor(_BITS, dtype=torch.uint8, device=device)
