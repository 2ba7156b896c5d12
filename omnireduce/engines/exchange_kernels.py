"""The collective engine's reduction in four fused calls: CUDA kernels (``csrc/exchange.cu``) for CUDA
tensors, numpy's (:mod:`omnireduce.engines.numpy_kernels`) for host ones.

Design. The same reduction as :func:`omnireduce.engines.exchange_device.reduce`, the same exchanges,
collectives and bits, with the torch ops between the collectives replaced by four kernel calls, so
that the host issues a handful of launches per bucket instead of about thirty:

1. ``record``: this rank's bitmap (its blocks' flags packed eight to a byte), the prefix sums of its
   bytes' popcounts, and, in a fused reduction, its first ``capacity`` non-zero blocks as rows after
   the bitmap: the record the all-gather carries;
2. ``counts``, after the all-gather: every rank's bitmap and their union in one ``[W + 1, nbytes]``
   array, the prefix sums over it (a block's row among a rank's is found from them, no index list
   is made), and the counts vector the host reads: the one wait of a reduction;
3. ``rows``: the blocks a bitmap has whose places fall in a range, as rows (the overflow of a fused
   all-gather, or the union's blocks for its all-reduce);
4. ``sum_blocks``: every union block summed from the rows that have it, in rank order in float32
   from -0.0, rounded once (then times ``1/W`` when averaging), written into the tensor.

``owners`` keeps the torch ops (its bitmaps unpacked from the counted ones), and a lossy threshold
keeps :mod:`omnireduce.engines.exchange_device` whole. ``kernels`` is any object with those four
calls: the CUDA extension (:mod:`omnireduce.cuda.build`), numpy's for a host tensor, or, in the
tests, a host build of the kernels' per-item steps (``csrc/exchange_steps.h``) on CPU tensors.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from omnireduce.cuda import build
from omnireduce.engines import bitmaps
from omnireduce.engines.exchange_device import (
    _SEND,
    Outcome,
    Parts,
    Workspace,
    _all_gather,
    _all_reduce_whole,
    _Bucket,
    _record,
    _Reduction,
    _rows_of,
    owners,
)
from omnireduce.engines.numpy_kernels import NumpyKernels
from omnireduce.engines.plan import Counts, Exchange, Step, capacity
from omnireduce.engines.waits import read_counts
from omnireduce.envvars import env
from omnireduce.sources.adapt import device_path_for_cpu

_MAX_WORLD = 100
"""The largest group whose counts the kernels add in shared memory (``OMR_MAX_COUNTS``)."""
NUMPY = NumpyKernels()
"""The host's kernels (numpy's)."""


def enabled(device: torch.device) -> bool:
    """``OMNIREDUCE_ENGINE_KERNELS``: ``auto`` (the default) sends a host bucket through the kernel
    exchange (numpy's calls) and a CUDA bucket through torch ops, until a GPU run has timed and
    checked the CUDA kernels; ``1`` sends both through the kernel exchange; ``0`` neither."""
    raw = (env("OMNIREDUCE_ENGINE_KERNELS") or "auto").strip()
    if raw not in ("0", "1", "auto"):
        raise ValueError(f"OMNIREDUCE_ENGINE_KERNELS must be auto, 0 or 1, got {raw!r}")
    return raw == "1" or (raw == "auto" and device.type == "cpu")


def kernels_for(flat: torch.Tensor, threshold: float, world: int) -> Any:
    """The kernels that reduce ``flat``, or None where torch ops do: none with the setting off for its
    device (:func:`enabled`) or a lossy threshold; a host tensor's numpy ones
    (:mod:`omnireduce.engines.numpy_kernels`; with ``OMNIREDUCE_DEVICE_PATH=1`` the torch ops, as a
    device runs them); a CUDA tensor's extension (not for a group too large, or an extension built
    without these kernels)."""
    if threshold > 0.0 or not enabled(flat.device):
        return None
    if flat.device.type == "cpu":
        return None if device_path_for_cpu() else NUMPY
    if not flat.is_cuda or world > _MAX_WORLD:
        return None
    ext = build.extension_for(flat)
    return ext if ext is not None and hasattr(ext, "sum_blocks") else None


def reduce(flat: torch.Tensor, block_size: int, *, kernels: Any, group: Any, rank: int, world: int, average: bool,
           step: Step, decide: Callable[[Counts], Exchange], total_lanes: int, pairs: bool, timeout: float | None,
           workspace: Workspace) -> Outcome:
    """Reduce ``flat`` in place over ``group`` with ``kernels`` (see the module; the arguments are
    :func:`omnireduce.engines.exchange_device.reduce`'s, without a threshold)."""
    b = _Bucket(flat, block_size)
    B, W = b.B, world
    r = _Reduction(b, group, rank, world, 0.0, workspace)
    nbytes = -(-b.nb // 8)
    cap = step.capacity if step.fused else 0
    head, size = _record(nbytes, cap, b)
    if not cap and not getattr(kernels, "pads_bitmaps", True):
        size = nbytes  # (a bitmap alone, unpadded: exchange_device's bytes)
    own: list[torch.Tensor] = []  # (this rank's prefix sums, which the record's call returns)

    def fill(record: torch.Tensor) -> None:
        own.append(kernels.record(flat, B, 0.0, record.view(-1), head, cap))

    parts = _all_gather(workspace, "gathered" if step.fused else "bitmaps", (size,), torch.uint8, fill, r,
                        slack=not step.fused)
    gathered = _rows(parts, kernels)
    bits, prefix, flat_counts = kernels.counts(gathered, b.nb, total_lanes, pairs)
    values, wait_s = read_counts(flat_counts, timeout, "the blocks' counts")
    counts = Counts.from_flat(values, W)
    exchange = Exchange.GATHER if step.fused else decide(counts)
    scale = 1.0 / W if average and W > 1 else 1.0
    finish(kernels, r, exchange, counts, gathered, bits, prefix, own[0], head, cap, scale, total_lanes, average)
    overflow = step.fused and counts.most > step.capacity
    return Outcome(exchange, counts, step.fused, overflow, r.sent, r.received, r.collectives, 1, wait_s)


def finish(kernels: Any, r: _Reduction, exchange: Exchange, counts: Counts, gathered: Parts, bits: torch.Tensor,
           prefix: torch.Tensor, own_prefix: torch.Tensor, head: int, cap: int, scale: float, total_lanes: int,
           average: bool) -> None:
    """The exchange chosen, after the bitmaps (``gathered``: every rank's record, ``bits``, ``prefix``: the
    counts call's), into the tensor of ``r``: ``gather`` (the rest of every rank's blocks where a fused
    record's ``cap`` did not carry them, then the union's sums), ``union`` (its rows all-reduced),
    ``dense`` (the whole tensor all-reduced) or ``owners`` (the torch ops, from the bitmaps unpacked)."""
    b, W, group, workspace = r.b, r.W, r.group, r.ws
    flat, B = b.flat, b.B
    nbytes = -(-b.nb // 8)
    if counts.union == 0:
        pass  # (nothing non-zero anywhere: the tensor stays as it is)
    elif exchange is Exchange.GATHER:
        _gather(kernels, r, counts, gathered, bits, prefix, own_prefix, head, cap, scale)
    elif exchange is Exchange.UNION:
        U = counts.union
        rows = workspace.take(_SEND, (U, B), flat.dtype, b.dev)
        kernels.rows(flat, B, bits[W], prefix[W * nbytes:], None, 0, U, rows)
        dist.all_reduce(rows, group=group)
        r._moved(2 * (W - 1) * U * B * b.item // W)
        kernels.sum_blocks(flat, B, bits, prefix, W, W, 1, rows.unsqueeze(0), None, scale)
    elif exchange is Exchange.DENSE:
        _all_reduce_whole(flat, group, W, average)
        r._moved(2 * (W - 1) * flat.numel() * flat.element_size() // W)
    else:  # owners: the torch ops, from the bitmaps unpacked
        r.every = bitmaps.unpack(bits[:W], b.nb)
        r.union = bitmaps.unpack(bits[W:], b.nb)[0]
        r.flags = r.every[r.me]
        owner = owners(b.nb, total_lanes, W, b.dev)
        r.owners(counts, owner, scale, (b.nb - 1) % total_lanes % W)


def _gather(kernels: Any, r: _Reduction, counts: Counts, gathered: Parts, bits: torch.Tensor,
            prefix: torch.Tensor, own_prefix: torch.Tensor, head: int, cap: int, scale: float) -> None:
    """Every rank's blocks at every rank: those past a fused all-gather's ``cap`` in one more
    all-gather, then the union's sums in rank order (``sum_blocks``)."""
    b, W, me = r.b, r.W, r.me
    first: Parts | None = None
    if cap:
        first = [_rows_of(p, head, cap, b.B, b.flat.dtype) for p in gathered] if isinstance(gathered, list) else \
            _rows_of(gathered, head, cap, b.B, b.flat.dtype)
    rest = None
    m = counts.most
    if m > cap:
        mine = counts.nonzero[me] - cap
        reserve = 0 if cap else _record(-(-b.nb // 8), capacity(m, b.nb), b)[1]

        def fill_rest(row: torch.Tensor) -> None:
            if mine > 0:
                kernels.rows(b.flat, b.B, bits[me], own_prefix, None, cap, cap + mine, row[:mine])

        got = _all_gather(r.ws, "rest" if cap else "gathered", (m - cap, b.B), b.flat.dtype, fill_rest, r,
                          reserve=reserve, send_name="rest-send" if cap else _SEND)
        rest = _rows(got, kernels)
    kernels.sum_blocks(b.flat, b.B, bits, prefix, W, 0, W, first, rest, scale)


def _rows(parts: Parts, kernels: Any) -> Parts:
    """Every rank's part of an all-gather as ``kernels`` take them: one ``[W, ...]`` tensor (a device's
    all-gather gives one; the host's parts are stacked), or the host's parts as they are where the
    kernels take a list (``takes_parts``: numpy's, which then copy none of the blocks)."""
    if isinstance(parts, torch.Tensor) or getattr(kernels, "takes_parts", False):
        return parts
    return parts[0].unsqueeze(0) if len(parts) == 1 else torch.stack(parts)  # (one rank's: a view, no copy)
