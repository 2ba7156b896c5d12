"""The collective engine's exchanges on torch tensors: CUDA, or the CPU with ``OMNIREDUCE_DEVICE_PATH=1``.

Design. One reduction of a flat tensor (:func:`reduce`) is:

1. the block flags (:func:`omnireduce.cuda.ops.block_flags`) packed into a bitmap, eight blocks a
   byte (:mod:`omnireduce.engines.bitmaps`), and all-gathered; where the shape's last reduction chose ``gather``
   (:class:`omnireduce.engines.plan.History`) the bitmap travels in the same all-gather as this
   rank's first ``capacity`` blocks (``fused``);
2. every count the host needs (each rank's blocks, the union's, the owners' pairs, in one small
   tensor) copied to the host: the one synchronisation of a reduction, on the engine's thread,
   waited for with the group's deadline (:func:`omnireduce.engines.waits.read_counts`);
3. the exchange :mod:`omnireduce.engines.plan` chose: ``gather`` (one all-gather; a second one
   only where a fused capacity overflowed), ``union`` (one all-reduce) or ``owners`` (two
   all-to-alls);
4. the sums written into the tensor (:func:`omnireduce.cuda.ops.scatter`), times
   ``float32(1/W)`` when averaging, rounded once (a float32 host tensor's ``gather`` sums are made
   in the tensor itself: no buffer of the union's size, the same bits).

Every size after step 2 is known on the host, so nothing else waits for the device: block ids are
compacted with ``nonzero_static`` (or a cumulative sum where it is missing), never ``nonzero`` or
a boolean index, and a tensor's short last block is handled by a mask, not a branch on the device's
data. The same code runs on CPU tensors (no device to wait for), which is how it is tested here;
where the host takes its own way (memory: packing, counts, all-gathers, the in-place sums) the
device's torch ops are tested equal to it. (By default the collective engine sends a host tensor
through :mod:`omnireduce.engines.numpy_kernels` instead, unless ``OMNIREDUCE_DEVICE_PATH=1`` or
``OMNIREDUCE_ENGINE_KERNELS=0``.)

Memory. The buffers a reduction's blocks pass through are kept from one reduction to the next
(:class:`Workspace`) and sized once for the fused reductions that follow the first; on the host an
all-gather holds this rank's part once and the others' once (about 2.5 times its non-zero bytes at
two ranks).

Sums. ``gather`` and ``owners`` sum in rank order in float32 from -0.0 and round once (the
aggregators' bits); ``union`` is summed by the backend's all-reduce in the tensor's dtype, in the
backend's order, as the dense all-reduce sums it.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from omnireduce.cuda import build, ops
from omnireduce.engines import bitmaps
from omnireduce.engines.numpy_kernels import sums_in_place
from omnireduce.engines.plan import Counts, Exchange, Step, capacity
from omnireduce.engines.waits import read_counts
from omnireduce.engines.workspace import Workspace

_ALIGN = 16  # bytes: where a fused record's blocks start after its bitmap
Parts = list[torch.Tensor] | torch.Tensor
"""Every rank's part of an all-gather, in rank order (:func:`_all_gather`)."""
_SEND = "send"
"""The workspace buffer of what a rank sends (an all-gather's part, the union's rows) and, once the
collectives that read it are done, of its float32 sums: roles of a reduction that never overlap."""


@dataclasses.dataclass(frozen=True)
class Outcome:
    """What one reduction did: the exchange, the counts, whether the bitmap rode with the blocks and
    whether their capacity overflowed, this rank's bytes, the collectives and host waits it took, and
    the CPU seconds its thread spent in those waits (on CUDA polling the device: :mod:`.waits`)."""

    exchange: Exchange
    counts: Counts
    fused: bool
    overflow: bool
    sent: int
    received: int
    collectives: int
    waits: int
    wait_s: float = 0.0


class _Bucket:
    """The flat tensor and its block geometry."""

    __slots__ = ("B", "dev", "flat", "full", "item", "nb", "tail")

    def __init__(self, flat: torch.Tensor, B: int) -> None:
        n = flat.numel()
        self.flat, self.B = flat, B
        self.nb, self.full, self.tail = -(-n // B), n // B, n % B
        self.item = flat.element_size()
        self.dev = flat.device


def reduce(flat: torch.Tensor, block_size: int, *, group: Any, rank: int, world: int, threshold: float,
           average: bool, step: Step, decide: Callable[[Counts], Exchange], total_lanes: int, pairs: bool,
           timeout: float | None, workspace: Workspace | None = None) -> Outcome:
    """Reduce ``flat`` (contiguous, on its device's current stream) in place over ``group`` (see the
    module). ``decide`` picks the exchange from the counts; block ``b`` is owned by rank
    ``(b mod total_lanes) mod world``; ``pairs``: count what the owners' exchange needs;
    ``workspace``: where the blocks pass (None: buffers of this reduction's own)."""
    r = _Reduction(_Bucket(flat, block_size), group, rank, world, threshold, workspace or Workspace())
    r.bitmaps(step)
    owner = owners(r.b.nb, total_lanes, world, r.b.dev) if pairs else None
    flat_counts = bitmaps.counts_host(*r.on_host, owner, world) if r.on_host is not None else \
        bitmaps.counts_device(r.every, r.union, owner, world)
    values, wait_s = read_counts(flat_counts, timeout, "the blocks' counts")
    counts = Counts.from_flat(values, world)
    exchange = Exchange.GATHER if step.fused else decide(counts)
    scale = 1.0 / world if average and world > 1 else 1.0
    if counts.union == 0:
        pass  # (nothing non-zero anywhere: the tensor stays as it is)
    elif exchange is Exchange.UNION:
        r.union_all_reduce(counts, scale)
    elif exchange is Exchange.GATHER:
        r.gather(counts, scale)
    elif exchange is Exchange.DENSE:  # (never with a threshold: the decider does not offer it then)
        _all_reduce_whole(flat, group, world, average)
        ring = 2 * (world - 1) * flat.numel() * flat.element_size() // world
        r._moved(ring)
    else:
        assert owner is not None
        r.owners(counts, owner, scale, (r.b.nb - 1) % total_lanes % world)
    if threshold > 0.0:  # blocks under the threshold that no rank sent read 0
        ops.zero_blocks(flat, block_size, ops.block_flags(flat, block_size) & ~r.union)
    overflow = step.fused and counts.most > step.capacity
    return Outcome(exchange, counts, step.fused, overflow, r.sent, r.received, r.collectives, 1, wait_s)


def dense(flat: torch.Tensor, block_size: int, *, group: Any, world: int, average: bool) -> Outcome:
    """The backend's all-reduce of the whole of ``flat``, then ``float32(1/W)`` when averaging, rounded
    once (a bucket :func:`omnireduce.engines.plan.goes_dense` keeps whole: no bitmap, no wait)."""
    _all_reduce_whole(flat, group, world, average)
    nb = -(-flat.numel() // block_size)
    ring = 2 * (world - 1) * flat.numel() * flat.element_size() // world
    return Outcome(Exchange.DENSE, Counts((nb,) * world, nb, True), False, False, ring, ring, 1, 0)


def _all_reduce_whole(flat: torch.Tensor, group: Any, world: int, average: bool) -> None:
    """The backend's all-reduce of ``flat`` in place, then ``float32(1/W)`` when averaging, rounded once."""
    dist.all_reduce(flat, group=group)
    if average and world > 1:
        s = float(np.float32(1.0 / world))
        if flat.dtype == torch.float32:
            flat.mul_(s)
        else:
            flat.copy_(flat.float().mul_(s))


class _Reduction:
    """One reduction's arrays and tallies, step by step (see :func:`reduce`)."""

    def __init__(self, b: _Bucket, group: Any, rank: int, world: int, threshold: float, ws: Workspace) -> None:
        self.b, self.group, self.me, self.W, self.threshold, self.ws = b, group, rank, world, threshold, ws
        self.sent = self.received = self.collectives = 0
        self.first: Parts | None = None  # a fused all-gather's blocks, [cap, B] of each rank
        self.on_host: tuple[np.ndarray, np.ndarray] | None = None  # a host tensor's ``every`` and ``union`` in numpy
        self.cap = 0

    def _moved(self, nbytes: int, collectives: int = 1) -> None:
        self.sent, self.received = self.sent + nbytes, self.received + nbytes
        self.collectives += collectives

    def bitmaps(self, step: Step) -> None:
        """Every rank's block flags (``every``, ``[W, nb]``) and their union, here; ``fused``: with this
        rank's first ``capacity`` blocks in the same all-gather (``first``)."""
        b = self.b
        self.flags = ops.flags_of(b.flat, b.B, self.threshold)
        bitmap = bitmaps.pack(self.flags)
        nbytes = bitmap.numel()
        if step.fused:
            self.cap = cap = step.capacity
            head, size = _record(nbytes, cap, b)

            def fill(record: torch.Tensor) -> None:
                record[:nbytes] = bitmap
                _gather(b, _compact(self.flags, cap), out=_rows_of(record, head, cap, b.B, b.flat.dtype))

            parts = _all_gather(self.ws, "gathered", (size,), torch.uint8, fill, self, slack=False)
            self.first = [_rows_of(p, head, cap, b.B, b.flat.dtype) for p in parts]
        else:
            parts = _all_gather(self.ws, "bitmaps", (nbytes,), torch.uint8, lambda row: row.copy_(bitmap), self)
        # [W, nbytes]: a device's parts are one tensor's rows; the host's are copied (small), their buffers free
        if isinstance(parts, torch.Tensor):
            self.packed = parts[:, :nbytes]
            self.every = bitmaps.unpack(self.packed, b.nb)
            self.union = self.every.any(dim=0)
            return
        self.packed = parts[0][:nbytes].unsqueeze(0) if len(parts) == 1 else torch.stack([p[:nbytes] for p in parts])
        every, union = self.on_host = bitmaps.unpack_host(self.packed.numpy(), b.nb)
        self.every, self.union = torch.from_numpy(every), torch.from_numpy(union)

    def union_all_reduce(self, counts: Counts, scale: float) -> None:
        """The union's blocks, compacted, summed by the backend's all-reduce."""
        b, U = self.b, counts.union
        ids = _compact(self.union, U)
        rows = _gather(b, ids, out=self.ws.take(_SEND, (U, b.B), b.flat.dtype, b.dev))
        if self.threshold > 0.0:  # (a block under the threshold here is not this rank's to add)
            rows = torch.where(self.flags[ids].unsqueeze(1), rows, torch.zeros((), dtype=rows.dtype, device=b.dev))
        dist.all_reduce(rows, group=self.group)
        self._moved(2 * (self.W - 1) * U * b.B * b.item // self.W)
        _scatter(b, ids, rows, scale, _short_at(b, counts), owned=True)

    def gather(self, counts: Counts, scale: float) -> None:
        """Every rank's blocks at every rank (what a fused all-gather did not carry, in one more), the
        union summed here in rank order."""
        b, cap, m = self.b, self.cap, counts.most
        rest = None
        if m > cap:
            mine = counts.nonzero[self.me] - cap
            # (unfused, the buffers the next reduction's fused all-gather takes: growing them then
            # would leave these behind as holes in the heap)
            reserve = 0 if cap else _record(self.packed.shape[1], capacity(m, b.nb), b)[1]

            def fill(row: torch.Tensor) -> None:
                if mine > 0:
                    _gather(b, _compact(self.flags, cap + mine)[cap:], out=row[:mine])

            rest = _all_gather(self.ws, "rest" if cap else "gathered", (m - cap, b.B), b.flat.dtype, fill, self,
                               reserve=reserve, send_name="rest-send" if cap else _SEND)  # (first[me] is in _SEND)
        if IN_PLACE_ON_HOST and self.on_host is not None and b.flat.dtype == torch.float32 and b.full:
            _sums_in_place(b, *self.on_host, counts, self.first, cap, rest, scale)
            return
        ids = _compact(self.union, counts.union)
        acc = self.ws.take("acc", (counts.union, b.B), torch.float32, b.dev)  # (this rank's part is in _SEND)
        sums = ops.narrow(_rank_order_sums(acc, self.every, ids, counts, self.first, cap, rest), b.flat.dtype)
        _scatter(b, ids, sums, scale, _short_at(b, counts), owned=True)

    def owners(self, counts: Counts, owner: torch.Tensor, scale: float, owner_of_last: int) -> None:
        """Each rank's blocks to their owners (all-to-all), summed there in rank order; every owner's
        sums to every rank (all-to-all)."""
        b, W, me, dt = self.b, self.W, self.me, self.b.flat.dtype
        B, item, pairs, owned = b.B, b.item, counts.pairs, counts.owned
        own = _compact(self.flags, counts.nonzero[me])
        send = _gather(b, own)[torch.sort(owner[own], stable=True).indices]  # by owner, each ascending
        recv = self.ws.take("recv", (sum(pairs[s][me] for s in range(W)), B), dt, b.dev)
        dist.all_to_all_single(_bytes(recv), _bytes(send), [pairs[s][me] * B * item for s in range(W)],
                               [pairs[me][o] * B * item for o in range(W)], group=self.group)
        acc = self.ws.take(_SEND, (owned[me], B), torch.float32, b.dev)
        sums = _owned_sums(acc, self.every, self.union, owner, counts, me, recv)
        results = self.ws.take("results", (sum(owned), B), dt, b.dev)
        dist.all_to_all_single(_bytes(results), _bytes(ops.narrow(sums, dt).repeat(W, 1)),
                               [n * B * item for n in owned], [owned[me] * B * item] * W, group=self.group)
        sent = sum(pairs[me][o] for o in range(W) if o != me) + (W - 1) * owned[me]
        got = sum(pairs[s][me] for s in range(W) if s != me) + sum(n for o, n in enumerate(owned) if o != me)
        self.sent, self.received = self.sent + sent * B * item, self.received + got * B * item
        self.collectives += 2
        ids = _compact(self.union, counts.union)
        by_owner = ids[torch.sort(owner[ids], stable=True).indices]  # the order the owners' sums came in
        short_at = sum(owned[: owner_of_last + 1]) - 1 if b.tail and counts.last_in_union else None
        _scatter(b, by_owner, results, scale, short_at, owned=True)


def _owned_sums(acc: torch.Tensor, every: torch.Tensor, union: torch.Tensor, owner: torch.Tensor, counts: Counts,
                me: int, recv: torch.Tensor) -> torch.Tensor:
    """This owner's union blocks' float32 sums in rank order into ``acc``, from what each rank sent
    it (``recv``: ``counts.pairs[s][me]`` rows from each rank ``s`` in turn, ascending ids)."""
    mine = owner == me
    ids = _compact(union & mine, counts.owned[me])  # this owner's sums, a row each, ascending
    acc.fill_(-0.0)
    start = 0
    for s in range(counts.world):
        n = counts.pairs[s][me]
        if n:
            rows = torch.searchsorted(ids, _compact(every[s] & mine, n))
            acc.index_add_(0, rows, recv[start: start + n].float())
        start += n
    return acc


def _short_at(b: _Bucket, counts: Counts) -> int | None:
    """Where the short last block is among the union's ascending ids (None: not there, or no short block)."""
    return counts.union - 1 if b.tail and counts.last_in_union else None


# --- helpers ----------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=8)
def owners(nb: int, total_lanes: int, world: int, device: torch.device) -> torch.Tensor:
    """Each block's owner, ``(b mod total_lanes) mod world``, on ``device``: made once per layout (the
    last few kept: 8 bytes a block)."""
    return torch.arange(nb, device=device) % total_lanes % world


def _rank_order_sums(acc: torch.Tensor, every: torch.Tensor, union_ids: torch.Tensor, counts: Counts,
                     first: Parts | None, cap: int, rest: Parts | None) -> torch.Tensor:
    """The union's float32 sums in rank order, from -0.0, into ``acc``: rank r's blocks are
    ``first[r][:cap]`` then ``rest[r]`` (either may be None), its ids the flags ``every[r]`` in
    ascending order; a block's row is its place among ``union_ids`` (ascending)."""
    acc.fill_(-0.0)
    for r in range(counts.world):
        d = counts.nonzero[r]
        if not d:
            continue
        rows = torch.searchsorted(union_ids, _compact(every[r], d))
        k = min(d, cap) if first is not None else 0
        if k:
            acc.index_add_(0, rows[:k], first[r][:k].float())  # type: ignore[index]
        if d > k:
            acc.index_add_(0, rows[k:], rest[r][: d - k].float())  # type: ignore[index]
    return acc


def _sums_in_place(b: _Bucket, every: np.ndarray, union: np.ndarray, counts: Counts,
                   first: Parts | None, cap: int, rest: Parts | None, scale: float) -> None:
    """:func:`_rank_order_sums` and :func:`_scatter` in one, for a float32 host bucket with a whole
    block or more: the union's blocks summed in the bucket itself, in rank order from -0.0, then
    times ``scale`` (:func:`omnireduce.engines.numpy_kernels.sums_in_place`, the host exchange's):
    the same bits, and no buffer of the union's size."""
    heads = [] if first is None else [first[r].numpy() for r in range(counts.world)]
    tails = [] if rest is None else [rest[r].numpy() for r in range(counts.world)]
    sums_in_place(b.flat.numpy(), b.B, every, np.flatnonzero(union), cap, heads, tails, np.float32(scale))


IN_PLACE_ON_HOST = True
"""Whether a float32 host bucket's ``gather`` sums are made in place (:func:`_sums_in_place`); False
takes the device's way (a float32 buffer, then :func:`_scatter`), which the tests compare it with."""


def _compact(mask: torch.Tensor, k: int) -> torch.Tensor:
    """The first ``k`` indices where ``mask`` is set, ascending (0 past its last set one), without
    the host learning anything from the device."""
    if k == 0:
        return torch.zeros(0, dtype=torch.int64, device=mask.device)
    if _STATIC:
        return torch.nonzero_static(mask, size=k, fill_value=0).view(-1)
    out = torch.zeros(k + 1, dtype=torch.int64, device=mask.device)
    pos = torch.cumsum(mask, 0) - 1
    target = torch.where(mask & (pos < k), pos, k)
    out.scatter_(0, target, torch.arange(mask.numel(), device=mask.device))
    return out[:k]


_STATIC = hasattr(torch, "nonzero_static") and tuple(int(v) for v in torch.__version__.split(".")[:2]) >= (2, 6)
"""``nonzero_static`` exists and runs on CUDA without a synchronisation (torch 2.6 and later)."""


def _gather(b: _Bucket, ids: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Blocks ``ids`` of the tensor as ``(k, B)`` rows (into ``out`` if given); the short last block
    padded with +0. Nothing of the bucket's size or the rows' is made besides the rows themselves."""
    B, flat = b.B, b.flat
    if b.tail == 0:
        return torch.index_select(flat.view(b.nb, B), 0, ids, out=out) if out is not None else \
            flat.view(b.nb, B).index_select(0, ids)
    tail_row = torch.zeros(B, dtype=flat.dtype, device=b.dev)
    tail_row[: b.tail] = flat[b.full * B:]
    if b.full == 0:
        rows = tail_row.expand(ids.numel(), B)
        return rows.clone() if out is None else out.copy_(rows)
    full = flat[: b.full * B].view(b.full, B)
    rows = torch.index_select(full, 0, ids.clamp(max=b.full - 1), out=out) if out is not None else \
        full.index_select(0, ids.clamp(max=b.full - 1))
    return torch.where((ids == b.full).unsqueeze(1), tail_row, rows, out=rows)  # (in place: no second copy)


def _scatter(b: _Bucket, ids: torch.Tensor, rows: torch.Tensor, scale: float, short_at: int | None,
             owned: bool = False) -> None:
    """Write ``rows * scale`` into blocks ``ids`` (distinct), of the short last block (at position
    ``short_at`` of ``ids``, known on the host) its real elements only: the CUDA kernel where it is
    built, else torch ops (``owned``: ``rows`` may be scaled in place)."""
    if ids.numel() == 0:
        return
    if build.extension_for(b.flat) is not None:
        ops.scatter(b.flat, ids, rows, scale)
        return
    B, flat = b.B, b.flat
    if scale != 1.0:  # one float32 product, rounded once
        s = float(np.float32(scale))
        rows = rows.mul_(s) if owned and rows.dtype == torch.float32 else (rows.float() * s).to(flat.dtype)
    view = flat[: b.full * B].view(b.full, B)
    if short_at is None:
        view.index_copy_(0, ids, rows)
        return
    for lo, hi in ((0, short_at), (short_at + 1, ids.numel())):
        if hi > lo:
            view.index_copy_(0, ids[lo:hi], rows[lo:hi])
    flat[b.full * B:] = rows[short_at, : b.tail]


def _rows_of(buf: torch.Tensor, head: int, cap: int, B: int, dtype: torch.dtype) -> torch.Tensor:
    """The ``cap`` rows of ``B`` elements that start ``head`` bytes into the last dimension of ``buf``."""
    body = buf[..., head: head + cap * B * dtype.itemsize].view(dtype)
    return body.view(*body.shape[:-1], cap, B)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def _all_gather(ws: Workspace, name: str, shape: tuple[int, ...], dtype: torch.dtype,
                fill: Callable[[torch.Tensor], Any], r: _Reduction, slack: bool = True,
                reserve: int = 0, send_name: str = _SEND) -> list[torch.Tensor] | torch.Tensor:
    """Every rank's part of ``shape`` (this rank's written by ``fill``), in rank order: one collective
    (none for one rank on the host).
    This rank's part is in buffer ``send_name``, the others' in buffer ``name`` (``slack``, and
    ``reserve`` bytes a part: as :meth:`Workspace.take`'s). On the host an all-to-all carries it,
    this rank's part copied once for each other rank and none of it sent to itself: Gloo's
    all-gather takes fresh buffers of the output's size at every call, and a process's heap grew
    by about seven outputs' worth (seen here, torch 2.13). On a device the parts are the rows of the
    all-gather's output, returned as that ``[W, ...]`` tensor."""
    W, me, dev = r.W, r.me, r.b.dev
    if dev.type != "cpu":
        send = ws.take(send_name, shape, dtype, dev, slack=slack, reserve=reserve)
        fill(send)
        out = ws.take(name, (W, *shape), dtype, dev, slack=slack, reserve=W * reserve)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        gather(out.view(-1), send.reshape(-1), group=r.group)
        r._moved((W - 1) * send.numel() * send.element_size())
        return out
    send = ws.take(send_name, (max(W - 1, 1), *shape), dtype, dev, slack=slack, reserve=max(W - 1, 1) * reserve)
    fill(send[0])
    if W == 1:
        return [send[0]]
    if W > 2:
        send[1:].copy_(send[:1].expand_as(send[1:]))
    out = ws.take(name, (W - 1, *shape), dtype, dev, slack=slack, reserve=(W - 1) * reserve)
    part = out[0].numel() * out.element_size()
    splits = [0 if q == me else part for q in range(W)]
    dist.all_to_all_single(_bytes(out), _bytes(send), splits, splits, group=r.group)
    r._moved((W - 1) * part)
    return [send[0] if q == me else out[q - (q > me)] for q in range(W)]


def _record(nbytes: int, cap: int, b: _Bucket) -> tuple[int, int]:
    """A fused all-gather's record for a bitmap of ``nbytes`` and ``cap`` blocks: where its blocks
    start and its bytes."""
    head = -(-nbytes // _ALIGN) * _ALIGN
    return head, head + cap * b.B * b.item
