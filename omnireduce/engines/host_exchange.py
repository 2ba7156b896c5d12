"""A host bucket's reduction through the collective engine in as few calls as its exchange needs.

Design. The kernel exchange (:mod:`omnireduce.engines.exchange_kernels`) drives any tensor through
four general calls; on the host each of them is a dozen numpy or torch calls, and a call costs a
few microseconds whatever its size, so a bucket with one non-zero block paid hundreds of
microseconds for what its one read (the scan) does in tens. :class:`HostExchange` runs the same
reduction for a host tensor, with the same collectives, the same records on the wire and the same
bits, in the calls its steps need:

1. the scan (:func:`omnireduce.blocks.block_nonzero`) and this rank's non-zero blocks;
2. the record (the bitmap, and in a fused reduction its first ``capacity`` blocks after it) written
   where the all-gather sends it from, and the all-gather (an all-to-all on the host, as
   :func:`omnireduce.engines.exchange_device._all_gather` says why);
3. the counts from the bitmaps: this rank's from its own blocks, the others' and their union from
   their bitmaps unpacked at once;
4. ``gather``: the rest of every rank's blocks where a fused record did not carry them, then the
   union's sums in rank order in float32 from -0.0, rounded once, in the tensor itself
   (:func:`omnireduce.engines.numpy_kernels._sum_in_place`) for float32; a half type's, and every
   other exchange, take the kernel exchange's own steps from the same bitmaps
   (:func:`omnireduce.engines.exchange_kernels.finish`).

A float32 ``gather`` whose blocks would fill more than :data:`PARTS_FROM` of buffer goes in
:data:`PARTS` parts, unfused: the bitmaps first, then a part of the union's blocks at a time, each
rank sending its own blocks among them in one all-to-all, then their sums. A part holds every rank's
rows of its blocks, so each block is summed in rank order as before (the same bits), and the buffers
hold a part instead of every rank's blocks at once: lent for each spell, the whole gather's came and
went in the training thread's heap beside the training's own temporaries, and the heap grew with the
holes they left. What the fused record saves, one collective's latency, is small beside the transfer
of such a gather's blocks; each part's collective is not, on a slow group: hence few parts.

A lossy threshold, and ``OMNIREDUCE_DEVICE_PATH=1``, keep the other ways (the engine decides).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from omnireduce.blocks import block_nonzero
from omnireduce.dtypes import DType
from omnireduce.engines.exchange_device import _ALIGN, Outcome, _Bucket, _bytes, _Reduction
from omnireduce.engines.exchange_kernels import finish
from omnireduce.engines.numpy_kernels import (
    CHUNK_BLOCKS,
    NUMPY_ROWS,
    NumpyKernels,
    _owners,
    _prefix,
    _raw,
    _take,
    sums_in_place,
)
from omnireduce.engines.plan import Counts, Exchange, Step, capacity
from omnireduce.engines.workspace import Workspace

_NUMPY = NumpyKernels()
_CPU = torch.device("cpu")
PARTS_FROM = 4 << 20
"""A float32 ``gather`` goes in parts where the blocks the other ranks send would fill more than this
many bytes of buffer (see the module)."""
PARTS = 4
"""How many parts such a ``gather`` goes in (each one more collective)."""


class HostExchange:
    """The host reductions of one engine's group (see the module); ``workspace``: the engine's buffers."""

    def __init__(self, group: Any, rank: int, world: int, workspace: Workspace) -> None:
        self.group, self.me, self.W, self.ws = group, rank, world, workspace
        self._views: dict[tuple[str, str], tuple[Any, ...]] = {}  # the numpy views of the workspace's buffers
        self._send: torch.Tensor | None = None  # the last all-gather's buffers (:meth:`_all_gather`)
        self._recv: torch.Tensor | None = None

    def reduce(self, flat: torch.Tensor, B: int, *, average: bool, step: Step, decide: Callable[[Counts], Exchange],
               total_lanes: int, pairs: bool) -> Outcome:
        """Reduce the contiguous CPU tensor ``flat`` in place (the arguments are
        :func:`omnireduce.engines.exchange_kernels.reduce`'s)."""
        W, me = self.W, self.me
        raw, dtype = _raw(flat)
        nb = -(-raw.size // B)
        if step.fused and _in_parts(W, step.capacity, B, dtype):
            step = Step(False)  # (its blocks go in parts: see the module)
        flags = block_nonzero(raw, dtype, B)
        own = np.flatnonzero(flags)
        nbytes = -(-nb // 8)
        cap = step.capacity if step.fused else 0
        head = -(-nbytes // _ALIGN) * _ALIGN
        b = _Bucket(flat, B)
        r = _Reduction(b, self.group, me, W, 0.0, self.ws)
        size = head + cap * B * dtype.itemsize if cap else nbytes
        mine, others = self._all_gather("gathered" if cap else "bitmaps", size, r, slack=not cap)
        mine[:nbytes] = np.packbits(flags)
        if cap:
            _take(raw, B, own[:cap], _rows(mine, head, cap, B, dtype))
        self._exchange(r, slack=not cap)
        counts, every, union = self._counts(flags, own, others, nb, nbytes, total_lanes, pairs)
        exchange = Exchange.GATHER if step.fused else decide(counts)
        scale = 1.0 / W if average and W > 1 else 1.0
        if counts.union and exchange is Exchange.GATHER and dtype is DType.FLOAT32 and b.full:
            self._gather_sums(r, raw, dtype, own, mine, others, every, union, counts, head, cap, scale)
        elif counts.union:
            packed = [others[q - (q > me)][:nbytes] if q != me else mine[:nbytes] for q in range(W)]
            gathered = [torch.from_numpy(others[q - (q > me)]) if q != me else torch.from_numpy(mine)
                        for q in range(W)]
            bits, prefix, _ = _NUMPY.counts([torch.from_numpy(p) for p in packed], nb, total_lanes, False)
            finish(_NUMPY, r, exchange, counts, gathered, bits, prefix, torch.from_numpy(_prefix(packed[me])), head,
                   cap, scale, total_lanes, average)
        overflow = step.fused and counts.most > step.capacity
        return Outcome(exchange, counts, step.fused, overflow, r.sent, r.received, r.collectives, 1, 0.0)

    def forget(self) -> None:
        """Let go of the views of the workspace's buffers (the buffers a spell was lent go with it)."""
        self._views.clear()
        self._send = self._recv = None

    # -- the steps --------------------------------------------------------------------------------

    def _all_gather(self, name: str, size: int, r: _Reduction, *, slack: bool, reserve: int = 0,
                    send_name: str = "send", dtype: torch.dtype = torch.uint8,
                    shape: tuple[int, ...] = ()) -> tuple[np.ndarray, list[np.ndarray]]:
        """Where this rank's part of an all-gather goes (numpy, written by the caller before
        :meth:`_exchange`) and where the others' arrive (in rank order without this one), buffers
        ``send_name`` and ``name`` of the workspace (their tensors kept for :meth:`_exchange`)."""
        W, dev = self.W, _CPU
        part = shape or (size,)
        send = self.ws.take(send_name, (max(W - 1, 1), *part), dtype, dev, slack=slack,
                            reserve=max(W - 1, 1) * reserve)
        recv = self.ws.take(name, (W - 1, *part), dtype, dev, slack=slack, reserve=(W - 1) * reserve) \
            if W > 1 else None
        self._send, self._recv = send, recv
        key = (name, send_name)
        views = self._views.get(key)
        if views is None or views[0] is not send or views[1] is not recv:  # (the workspace's views: made again)
            arrived = recv.numpy() if recv is not None else None
            views = self._views[key] = (send, recv, send[0].numpy(), [arrived[i] for i in range(W - 1)]
                                        if arrived is not None else [])
        return views[2], views[3]

    def _exchange(self, r: _Reduction, *, slack: bool) -> None:
        """The all-gather :meth:`_all_gather` laid out: this rank's part copied once for each other rank and
        an all-to-all that sends none of it to itself (one collective; none alone)."""
        W, send, recv = self.W, self._send, self._recv
        if recv is None:
            return
        assert send is not None  # (taken with recv)
        if W > 2:
            send[1:].copy_(send[:1].expand_as(send[1:]))
        part = recv[0].numel() * recv.element_size()
        splits = [0 if q == self.me else part for q in range(W)]
        dist.all_to_all_single(_bytes(recv), _bytes(send), splits, splits, group=self.group)
        r._moved((W - 1) * part)

    def _counts(self, flags: np.ndarray, own: np.ndarray, others: list[np.ndarray], nb: int, nbytes: int,
                total_lanes: int, pairs: bool) -> tuple[Counts, np.ndarray, np.ndarray]:
        """The counts every rank computes alike, every rank's block flags (``[W, nb]``, rank order) and
        their union."""
        W, me = self.W, self.me
        if W == 1:
            every, union = flags[None], flags
            nonzero: tuple[int, ...] = (int(own.size),)
        else:
            theirs = np.unpackbits(np.stack([o[:nbytes] for o in others]), axis=1, count=nb).view(np.bool_)
            every = np.insert(theirs, me, flags, axis=0)
            union = np.logical_or.reduce(every, axis=0)
            nonzero = tuple(int(c) for c in every.sum(axis=1))
        U = int(np.count_nonzero(union))
        last = bool(union[-1]) if nb else False
        if not pairs:
            return Counts(nonzero, U, last), every, union
        owner = _owners(nb, total_lanes, W)
        table = tuple(tuple(int(c) for c in np.bincount(owner[every[s]], minlength=W)) for s in range(W))
        owned = tuple(int(c) for c in np.bincount(owner[union], minlength=W))
        return Counts(nonzero, U, last, table, owned), every, union

    def _gather_sums(self, r: _Reduction, raw: np.ndarray, dtype: DType, own: np.ndarray, mine: np.ndarray,
                     others: list[np.ndarray], every: np.ndarray, union: np.ndarray, counts: Counts, head: int,
                     cap: int, scale: float) -> None:
        """``gather`` for a float32 tensor of a whole block or more: what a fused record did not carry in
        one more all-gather (the next fused record's room reserved where this one was not fused), then
        the union's sums in rank order, in the tensor itself."""
        W, me, B, item = self.W, self.me, r.b.B, dtype.itemsize
        m = counts.most
        heads = [_rows(others[q - (q > me)] if q != me else mine, head, cap, B, dtype) for q in range(W)] if cap else []
        tails: list[np.ndarray] = []
        if m > cap:
            nbytes = -(-r.b.nb // 8)
            reserve = 0 if cap else (-(-nbytes // _ALIGN) * _ALIGN + capacity(m, r.b.nb) * B * item)
            if not cap and _in_parts(W, m, B, dtype):
                self._sums_in_parts(r, raw, own, every, union, scale)
                return
            rest, arrived = self._all_gather("rest" if cap else "gathered", 0, r, slack=True, reserve=reserve,
                                             send_name="rest-send" if cap else "send", dtype=r.b.flat.dtype,
                                             shape=(m - cap, B))
            extra = own[cap: cap + counts.nonzero[me] - cap]
            if extra.size:
                _take(raw, B, extra, rest.view(dtype.storage))
            self._exchange(r, slack=True)
            tails = [arrived[q - (q > me)] if q != me else rest for q in range(W)]
        targets = np.flatnonzero(union)
        scratch = None
        if scale != 1.0 and targets.size > NUMPY_ROWS:  # (the scaling's rows: the send buffer, spent by then)
            scratch = self._spent_rows(min(CHUNK_BLOCKS, targets.size), B)
        sums_in_place(raw, B, every, targets, cap, heads, tails, np.float32(scale), scratch)

    def _sums_in_parts(self, r: _Reduction, raw: np.ndarray, own: np.ndarray, every: np.ndarray, union: np.ndarray,
                       scale: float) -> None:
        """An unfused ``gather`` of a float32 tensor in parts (see the module): each part's blocks every
        rank has, in one all-to-all (this rank's copied once for each other rank), then their sums in
        rank order in the part of the tensor they cover."""
        W, me, B, nb = self.W, self.me, r.b.B, r.b.nb
        targets = np.flatnonzero(union)
        per = -(-targets.size // PARTS)  # (the union's blocks a part: no rank has more of them)
        ids = [own if s == me else np.flatnonzero(every[s]) for s in range(W)]
        send_t = self.ws.take("parts-send", ((W - 1) * per, B), torch.float32, _CPU, slack=False)
        recv_t = self.ws.take("parts", ((W - 1) * per, B), torch.float32, _CPU, slack=False)
        self._send, self._recv = send_t, recv_t
        send, recv, row = send_t.numpy(), recv_t.numpy(), B * 4
        for k in range(0, targets.size, per):
            lo, hi = int(targets[k]), int(targets[k + per]) if k + per < targets.size else nb
            at = [np.searchsorted(i, (lo, hi)) for i in ids]
            rows = [int(b - a) for a, b in at]
            mine = rows[me]
            _take(raw, B, own[at[me][0]: at[me][1]], send)
            for j in range(1, W - 1):
                send[j * mine: (j + 1) * mine] = send[:mine]
            into = [0 if q == me else mine * row for q in range(W)]
            out = [0 if q == me else rows[q] * row for q in range(W)]
            dist.all_to_all_single(_bytes(recv_t)[: sum(out)], _bytes(send_t)[: sum(into)], out, into,
                                   group=self.group)
            r.sent, r.received, r.collectives = r.sent + sum(into), r.received + sum(out), r.collectives + 1
            tails, start = [], 0
            for q in range(W):
                tails.append(send[:mine] if q == me else recv[start: start + rows[q]])
                start += 0 if q == me else rows[q]
            part = targets[k: k + per]
            scratch = None
            if scale != 1.0 and part.size > NUMPY_ROWS:
                scratch = self._spent_rows(min(CHUNK_BLOCKS, part.size), B)
            sums_in_place(raw[lo * B: hi * B], B, every[:, lo:hi], part - lo, 0, [], tails, np.float32(scale), scratch)

    def _spent_rows(self, rows: int, B: int) -> torch.Tensor:
        """A float32 ``[rows or fewer, B]`` buffer for the scaling of the sums: the buffer this rank's
        blocks were sent from (its rows are added by the time the sums are scaled), else the workspace's
        own buffer."""
        send = self._send
        if send is not None:
            spare = send.reshape(-1).view(torch.uint8)
            fit = min(rows, spare.numel() // (B * 4))
            if fit:
                return spare[: fit * B * 4].view(torch.float32).view(fit, B)
        return self.ws.take("scaled", (rows, B), torch.float32, _CPU, slack=False)


def _in_parts(W: int, blocks: int, B: int, dtype: DType) -> bool:
    """Whether a ``gather`` of ``blocks`` a rank at most goes in parts (see the module)."""
    return W > 1 and dtype is DType.FLOAT32 and (W - 1) * blocks * B * 4 > PARTS_FROM


def _rows(record: np.ndarray, head: int, cap: int, B: int, dtype: DType) -> np.ndarray:
    """The ``cap`` rows of ``B`` elements of a record's bytes, from byte ``head`` on."""
    return record[head: head + cap * B * dtype.itemsize].view(dtype.storage).reshape(cap, B)
