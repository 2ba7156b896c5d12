"""The collective engine: omnireduce's block-sparse all-reduce with the ranks as aggregators and the
process group's collectives as the wire.

Design. The same blocks, the same lanes-to-slots layout (:class:`omnireduce.blocks.Layout`) and
the same sums as the aggregators give, bit for bit; only who sums and how the bytes travel
change. Lane ``l`` of a tensor is owned by rank ``l mod W`` instead of its slot's aggregator
process (:func:`owners`), and one reduction is four collectives on a process group of its own:

1. every rank's non-zero block bitmap goes to every rank (an all-gather of ``ceil(nb / 8)``
   bytes), so every rank knows what each rank sends and receives, and the union;
2. one ``all_to_all_single`` moves each rank's non-zero blocks to the owners of their slots
   (split sizes from the bitmaps; blocks in wire form, the short last block trimmed);
3. each owner sums its blocks in rank order in float32, starting from -0.0, and rounds the
   sums once to the tensor's dtype: what an aggregator computes;
4. one more ``all_to_all_single`` hands every rank every owner's sums (an owner sends the same
   sums to each rank), and each rank writes them into its tensor, times ``float32(1/W)`` when
   averaging, rounded once: what the worker does with an aggregator's sums. In lossy mode
   (``threshold > 0``) a rank's blocks under the threshold that no rank sent read 0 afterwards.

Threads and order. The collectives of every reduction must be issued in the same order on every
rank, and none may interleave with DDP's own collectives. So the engine owns a process group
(made by the caller, collectively, at binding) and one thread that runs the reductions in the
order they were asked for, one after the other: the order DDP hands over its buckets, the same on
every rank. A reduction that cannot finish fails with the group's timeout, and every later one
fails at once without a collective (after a failure the ranks may stand at different collectives).

Two paths, the same collectives and the same bits. Host tensors (numpy views) use the worker's
own block operations. Device tensors (CUDA, or CPU tensors with ``OMNIREDUCE_DEVICE_PATH=1``,
which is how that path is tested without a GPU) stay on their device: flags, compaction and the
scatter are :mod:`omnireduce.cuda.ops`' operations, the bitmaps are packed and the sums made
with torch ops, and the collectives move device memory (NCCL moves GPU memory directly). The split
sizes of the all-to-alls must be known on the host: that is the one synchronisation, on the
engine's thread, never on the training thread. On CUDA the engine's thread works on omnireduce's
side stream after an event recorded where the tensor was produced, and the future completes on that
stream (CUDA-aware), so the caller's stream waits for the result on the device.

No aggregator process takes part, so there is nothing to
restart and nothing to survive: a rank that dies fails the other ranks' reductions at the group's
timeout, as with DDP's own all-reduce. The engine's thread never waits on the device without that
deadline: it polls the device (:mod:`omnireduce.engines.waits`) after each collective whose results
the host reads, so a collective stuck on a dead peer fails the reduction with a clear error even
where the backend's own watchdog is late or off.

Backends without host collectives (NCCL). A sparse COO gradient's rows are found and summed on
the host (:mod:`omnireduce.sources.sparse`); over such a group its arrays travel through the
tensor's device (:class:`omnireduce.engines.waits.Wire`), so NCCL's sparse gradients need no Gloo
group of their own.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import weakref
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from omnireduce.blocks import Layout
from omnireduce.cuda import runtime
from omnireduce.dtypes import DType, narrow
from omnireduce.engines.reducer import Reduction, ReductionInfo
from omnireduce.engines.waits import Wire, settle, to_host
from omnireduce.errors import OmniReduceError
from omnireduce.exits import RELEASE, at_exit
from omnireduce.sources.adapt import adapt, device_path_for_cpu
from omnireduce.sources.host import HostSource
from omnireduce.sources.sparse import SparseSource, check_sparse
from omnireduce.sums import add_in_order, rank_order_sum
from omnireduce.wire import to_wire, unwire

log = logging.getLogger("omnireduce.collective")


def owners(layout: Layout, world_size: int) -> np.ndarray:
    """The rank owning each block: block ``b`` is in lane ``b mod T``, owned by rank ``lane mod W``.
    (By lane rather than by slot: a small tensor is one slot of many lanes, and by slot one rank
    would sum all of it; by lane every rank owns a share of any tensor of W blocks or more, and a
    hot region of consecutive blocks is spread over every rank. Who sums a block does not change
    its sum.)"""
    return owner_of(np.arange(layout.num_blocks, dtype=np.int64), layout, world_size)


def owner_of(ids: Any, layout: Layout, world_size: int) -> Any:
    """The owners of blocks ``ids`` (a numpy array or a torch tensor), as :func:`owners` says."""
    return (ids % layout.total_lanes) % world_size


def by_owner(ids: np.ndarray, layout: Layout, world_size: int) -> list[np.ndarray]:
    """Blocks ``ids`` (ascending) split by their owner, each part still ascending."""
    of = owner_of(ids, layout, world_size)
    return np.split(ids[np.argsort(of, kind="stable")], np.cumsum(np.bincount(of, minlength=world_size))[:-1])


def owned_by(ids: np.ndarray, rank: int, layout: Layout, world_size: int) -> np.ndarray:
    """The blocks of ``ids`` that ``rank`` owns (in their order)."""
    return ids[owner_of(ids, layout, world_size) == rank]


def wire_len(layout: Layout, ids: np.ndarray) -> int:
    """Elements of the blocks ``ids`` on the wire (the short last block trimmed)."""
    n = ids.size * layout.block_size
    if layout.short_index(ids) is not None:
        n -= layout.block_size - layout.tail
    return n


def owner_sums(layout: Layout, dtype: Any, mine: np.ndarray, sent: list[tuple[np.ndarray, np.ndarray]]) -> np.ndarray:
    """The sums of the blocks ``mine`` (ascending ids, this owner's union) from each rank's
    ``(ids, wire data)`` in rank order: float32, from -0.0, rounded once to ``dtype``'s storage;
    in wire form."""
    B = layout.block_size
    rows = [(ids, unwire(data, ids.size, B, layout.short_index(ids), layout.tail)) for ids, data in sent if ids.size]
    return to_wire(owned_sums(mine, rows, B, dtype), layout.short_index(mine), layout.tail)


def owned_sums(mine: np.ndarray, parts: list[tuple[np.ndarray, np.ndarray]], B: int, dtype: DType) -> np.ndarray:
    """The sums of the blocks (or rows) ``mine`` (ascending ids) from ``parts``, each rank's
    ``(ids, rows of B in storage form)`` in rank order: :func:`omnireduce.sums.rank_order_sum`
    (float32, from -0.0), rounded once to ``dtype``'s storage (the aggregators' bits)."""
    positioned = [(None if ids.size == mine.size else np.searchsorted(mine, ids), rows.reshape(-1, B))
                  for ids, rows in parts if ids.size]
    return narrow(rank_order_sum(mine.size, B, positioned, dtype), dtype)


class _Job:
    def __init__(self, tensor: torch.Tensor, average: bool, block_size: int, fut: Reduction) -> None:
        self.tensor, self.average, self.block_size, self.fut = tensor, average, block_size, fut
        self.result: Any = tensor  # (a sparse tensor's: a new one)
        self.ready: Any = None  # CUDA: an event on the stream that produced the tensor
        if tensor.is_cuda:
            self.ready = torch.cuda.Event()
            self.ready.record(torch.cuda.current_stream(tensor.device))
        self.info = ReductionInfo()  # (what the reduction did: its blocks and bytes, once counted)


class CollectiveEngine:
    """Block-sparse all-reduces over ``group`` (a process group of the engine's own; see the module).

    Args:
        group: the process group the engine's collectives run on (no other collective may use it).
        block_size, lanes, slots: the layout (as :class:`omnireduce.Worker`'s; ``slots`` at least
            the world size spreads the slots over every rank).
        threshold: lossy mode, as the worker's (0: exact).
        timeout: seconds the engine's thread waits for the device's results of a collective before
            the reduction fails (None: for ever; :meth:`for_group` gives the group's timeout).
    """

    def __init__(self, group: Any, block_size: int, lanes: int, slots: int, threshold: float = 0.0,
                 timeout: float | None = None) -> None:
        self.group = group
        self.timeout = timeout
        self._wire = Wire(group, timeout)
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        self.block_size, self.lanes, self.threshold = block_size, lanes, threshold
        self.slots = max(slots, self.world_size)
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._counts = {"bytes_sent": 0, "bytes_received": 0, "reductions": 0, "device_reductions": 0}
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="omnireduce-collective", daemon=True)
        self._thread.start()
        # a script that never closes its state: the thread ends and the group is let go before the
        # interpreter shuts down (the handler holds the engine weakly)
        at_exit(RELEASE, _release_at_exit, weakref.ref(self))

    @classmethod
    def for_group(cls, group: Any, timeout: float, block_size: int, lanes: int, slots: int,
                  threshold: float = 0.0) -> CollectiveEngine:
        """An engine on a new process group of ``group``'s ranks and backend, whose collectives give up
        after ``timeout`` seconds. Collective over the default group (``dist.new_group``)."""
        import datetime

        own = dist.new_group(ranks=dist.get_process_group_ranks(group), backend=dist.get_backend(group),
                             timeout=datetime.timedelta(seconds=timeout))
        return cls(own, block_size, lanes, slots, threshold, timeout)

    def allreduce_async(self, tensor: torch.Tensor, *, average: bool = False,
                        block_size: int | None = None) -> Reduction:
        """Reduce ``tensor`` on the engine's thread, as :meth:`omnireduce.Worker.allreduce_async`
        does: a dense tensor in place (the future's value is the tensor), a sparse COO one (rows as
        blocks) into a new coalesced COO tensor (the future's value); a
        :class:`~omnireduce.engines.reducer.Reducer`. The future's ``info`` (a
        :class:`~omnireduce.engines.reducer.ReductionInfo`) holds its blocks and bytes once it
        completes. Raises at once for what the engine cannot take. ``block_size``: this dense
        tensor's (None: the engine's)."""
        if self._closed:
            raise OmniReduceError("the collective engine is closed")
        sparse = tensor.layout != torch.strided
        if sparse:
            check_sparse(tensor)  # raises TypeError/ValueError saying what is wrong
        # (a sparse result is complete on the host's side: see SparseSource)
        fut = Reduction(tensor if tensor.is_cuda and not sparse else None)
        self._jobs.put(_Job(tensor, average, block_size or self.block_size, fut))
        return fut

    def stats(self) -> dict[str, int]:
        """Bytes this rank sent and received through the engine's collectives, reductions done, and
        how many of them took the device path."""
        with self._lock:
            return dict(self._counts)

    def close(self) -> None:
        """Stop the thread once the reductions asked for are done (idempotent; at interpreter exit
        the engine is released whether or not this was called: :meth:`release`)."""
        if not self._closed:
            self._closed = True
            self._jobs.put(None)

    def release(self, wait: float = 5.0) -> None:
        """Close, wait for the thread (``wait`` seconds at most) and let go of the process group, so
        that nothing of the engine's holds a group or its work when the interpreter shuts down
        (a Gloo group destroyed during the shutdown can abort the process)."""
        self.close()
        self._thread.join(wait)
        if not self._thread.is_alive():
            self.group = None

    # -- the engine's thread ----------------------------------------------------------------------

    def _loop(self) -> None:
        broken: OmniReduceError | None = None
        while (job := self._jobs.get()) is not None:
            if broken is not None:  # the ranks may now be at different collectives: none is issued any more
                job.fut.fail(OmniReduceError(f"the collective engine failed earlier: {broken}"))
                del job
                continue
            try:
                stream = None
                if job.tensor.layout != torch.strided:
                    job.result = self._reduce_sparse(job)
                elif job.tensor.is_cuda or device_path_for_cpu():
                    stream = self._reduce_on_device(job)
                else:
                    self._reduce(job)
            except BaseException as e:
                broken = e if isinstance(e, OmniReduceError) else OmniReduceError(
                    f"collective engine: {type(e).__name__}: {e}")
                log.error("%s", broken)
                job.fut.fail(broken)
                del job
                continue
            # (on CUDA completed on the stream that wrote the result: the caller's stream waits for it there)
            job.fut.complete(job.result, job.info, stream)
            del job  # its tensor (a DDP bucket, rebuilt after DDP's first step) is not kept while waiting

    def _reduce(self, job: _Job) -> None:
        """The host path (numpy views of the tensor's memory)."""
        source = adapt(job.tensor, job.block_size, self.lanes, self.slots)
        if not isinstance(source, HostSource):
            raise OmniReduceError(f"the collective engine takes dense host tensors, got {type(source).__name__}")
        lay, W, me = source.layout, self.world_size, self.rank
        nb = lay.num_blocks
        if nb == 0:
            return
        flags = source.nonzero(self.threshold)
        # 1. bitmaps: every rank's non-zero blocks, known to every rank
        bitmap = torch.from_numpy(np.packbits(flags))
        gathered = [torch.empty_like(bitmap) for _ in range(W)]
        dist.all_gather(gathered, bitmap, group=self.group)
        every = np.unpackbits(torch.stack(gathered).numpy(), axis=1, count=nb).view(bool)  # [W, nb]
        # (the owners of non-zero blocks only: no int64 array per block of the tensor, which this
        # thread's heap would keep once freed)
        item = source.raw.dtype.itemsize
        # 2. each rank's blocks to their owners
        send_ids = by_owner(np.flatnonzero(flags), lay, W)
        send = [source.gather(ids) for ids in send_ids]
        recv_ids = [owned_by(np.flatnonzero(every[s]), me, lay, W) for s in range(W)]
        recv_len = [wire_len(lay, ids) for ids in recv_ids]
        received = self._wire.exchange(send, recv_len, source.raw.dtype)
        sent_elems = sum(x.size for o, x in enumerate(send) if o != me)
        del send  # (each copy of the blocks goes once it has been used)
        # 3. this rank's slots summed in rank order
        union = np.flatnonzero(every.any(axis=0))  # (the union's block ids)
        mine = owned_by(union, me, lay, W)
        sums = owner_sums(lay, source.dtype, mine, list(zip(recv_ids, received, strict=True)))
        del received
        # 4. every owner's sums to every rank
        union_ids = by_owner(union, lay, W)
        results = self._wire.exchange([sums] * W, [wire_len(lay, ids) for ids in union_ids], source.raw.dtype)
        source.finish([(ids, data) for ids, data in zip(union_ids, results, strict=True) if ids.size],
                      W if job.average else 1)
        sent = (W - 1) * bitmap.numel() + item * (sent_elems + (W - 1) * sums.size)
        got = (W - 1) * bitmap.numel() + item * (sum(n for s, n in enumerate(recv_len) if s != me)
                                                  + sum(x.size for o, x in enumerate(results) if o != me))
        self._count(job, sent, got, blocks_total=nb, blocks_nonzero=int(flags.sum()), blocks_union=int(union.size))

    def _reduce_sparse(self, job: _Job) -> Any:
        """A sparse COO tensor, its rows the blocks (:mod:`omnireduce.sources.sparse`): each rank's
        coalesced rows go to their slots' owners, which sum them in rank order; every owner's union
        rows and sums go to every rank; the result is a new coalesced COO tensor, as the aggregators
        give it. Every array here grows with the rows touched, none with the table."""
        W, me = self.world_size, self.rank
        dtype, rows, dim = check_sparse(job.tensor)
        src = SparseSource(job.tensor, dtype, rows, dim, self.lanes, self.slots)
        ids = src.block_ids()
        lay = src.layout
        B = lay.block_size
        storage = np.dtype(dtype.storage)
        owner = owner_of(ids, lay, W)
        order = np.argsort(owner, kind="stable")
        send_ids = ids[order]
        wire = self._wire.on(job.tensor.device)
        counts = wire.all_gather_ints(np.bincount(owner, minlength=W))  # [W sources, W owners]
        recv_counts = [int(counts[s][me]) for s in range(W)]
        send_counts = [int(c) for c in counts[me]]
        got_ids = wire.exchange(_split(send_ids, send_counts), recv_counts, np.dtype(np.int64))
        got_rows = wire.exchange(_split(src.gather(send_ids).reshape(-1, B), send_counts), [n * B for n in recv_counts],
                                 storage)
        mine = np.unique(np.concatenate(got_ids)) if got_ids else np.zeros(0, np.int64)
        sums = owned_sums(mine, list(zip(got_ids, got_rows, strict=True)), B, dtype)
        unions = [int(u) for u in wire.all_gather_ints(np.array([mine.size]))[:, 0]]
        all_ids = wire.exchange([mine] * W, unions, np.dtype(np.int64))
        all_sums = wire.exchange([sums.reshape(-1)] * W, [u * B for u in unions], storage)
        item = storage.itemsize
        sent = 8 * W * W + sum((8 + B * item) * c for o, c in enumerate(send_counts) if o != me) \
            + (W - 1) * mine.size * (8 + B * item)
        got = 8 * W * W + sum((8 + B * item) * c for s, c in enumerate(recv_counts) if s != me) \
            + sum((8 + B * item) * u for o, u in enumerate(unions) if o != me)
        self._count(job, sent, got, blocks_total=lay.num_blocks, blocks_nonzero=int(ids.size),
                    blocks_union=sum(unions))
        staged = [(i, d) for i, d in zip(all_ids, all_sums, strict=True) if i.size]
        return src.result(staged, W if job.average else 1)

    def _reduce_on_device(self, job: _Job) -> Any:
        """The device path (see the module); returns the CUDA stream the result was written on (None
        off CUDA)."""
        t = job.tensor
        stream = None
        if t.is_cuda:
            stream = runtime.side_stream(torch, t.device)
            t.record_stream(stream)
        with (torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()), \
                (torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()):
            if job.ready is not None:
                if stream is None:
                    raise OmniReduceError(f"a CUDA event on the producer's stream, but no side stream for {t.device}")
                stream.wait_event(job.ready)
            flat = t.reshape(-1) if t.is_contiguous() else t.contiguous().reshape(-1)
            self._device_steps(job, flat)
            if not t.is_contiguous():  # (a contiguous tensor was reduced in place through its view)
                t.copy_(flat.view(t.shape))
        return stream

    def _device_steps(self, job: _Job, flat: torch.Tensor) -> None:
        from omnireduce.cuda import ops

        W, me, dev, B = self.world_size, self.rank, flat.device, job.block_size
        lay = Layout.for_tensor(flat.numel(), B, self.lanes, self.slots, flat.element_size())
        nb = lay.num_blocks
        if nb == 0:
            return
        flags = ops.block_flags(flat, B, self.threshold)
        # 1. bitmaps
        bitmap = _pack(flags)
        gathered = [torch.empty_like(bitmap) for _ in range(W)]
        dist.all_gather(gathered, bitmap, group=self.group)
        settle(dev, self.timeout, "the bitmaps' all-gather")  # (the host reads what follows: never blocked)
        every = _unpack(torch.stack(gathered), nb)  # [W, nb] bool
        owner = owner_of(torch.arange(nb, device=dev), lay, W)  # (made on the device: no copy of nb owners)
        owned = torch.nonzero(owner == me).view(-1)
        union = every.any(dim=0)
        per_pair, per_owner = _device_counts(every, owner, union, W, self.timeout)  # on the host: the one sync
        item = flat.element_size()
        # 2. this rank's non-zero blocks (padded to whole blocks), grouped by owner, to their owners
        ids, rows = ops.compact(flat, B, self.threshold)
        send = rows[torch.sort(owner[ids], stable=True).indices].contiguous()
        recv = torch.empty((sum(per_pair[s][me] for s in range(W)), B), dtype=flat.dtype, device=dev)
        dist.all_to_all_single(recv.view(-1).view(torch.uint8), send.view(-1).view(torch.uint8),
                               [per_pair[s][me] * B * item for s in range(W)],
                               [per_pair[me][o] * B * item for o in range(W)], group=self.group)
        settle(dev, self.timeout, "the blocks' all-to-all")
        # 3. this rank's slots, summed in rank order in float32 from -0.0, rounded once
        mine = owned[union[owned]]
        sums = ops.narrow(_device_sums(recv, [per_pair[s][me] for s in range(W)], every, owned, mine), flat.dtype)
        # 4. every owner's sums to every rank, written into the tensor
        results = torch.empty((sum(per_owner), B), dtype=flat.dtype, device=dev)
        dist.all_to_all_single(results.view(-1).view(torch.uint8), sums.repeat(W, 1).view(-1).view(torch.uint8),
                               [n * B * item for n in per_owner], [mine.numel() * B * item] * W, group=self.group)
        in_union = torch.nonzero(union).view(-1)
        union_ids = in_union[torch.sort(owner[in_union], stable=True).indices]  # by owner, each ascending
        if self.threshold > 0.0:  # blocks under the threshold that no rank sent read 0
            ops.zero_blocks(flat, B, ops.block_flags(flat, B) & ~union)
        ops.scatter(flat, union_ids, results, 1.0 / W if job.average and W > 1 else 1.0)
        sent = (W - 1) * bitmap.numel() + item * B * (sum(per_pair[me][o] for o in range(W) if o != me)
                                                       + (W - 1) * mine.numel())
        got = (W - 1) * bitmap.numel() + item * B * (sum(per_pair[s][me] for s in range(W) if s != me)
                                                      + sum(n for o, n in enumerate(per_owner) if o != me))
        self._count(job, sent, got, device=True, blocks_total=nb, blocks_nonzero=int(ids.numel()),
                    blocks_union=sum(per_owner))

    def _count(self, job: _Job, sent: int, got: int, *, device: bool = False, blocks_total: int,
               blocks_nonzero: int, blocks_union: int) -> None:
        """One reduction done: the engine's counters, and the job's ``info`` (its bytes and blocks)."""
        with self._lock:
            self._counts["bytes_sent"] += sent
            self._counts["bytes_received"] += got
            self._counts["reductions"] += 1
            self._counts["device_reductions"] += int(device)
        job.info = ReductionInfo(blocks_total, blocks_nonzero, blocks_union, sent, got)


_BITS = (7, 6, 5, 4, 3, 2, 1, 0)  # np.packbits' order: the first flag in the high bit


def _release_at_exit(ref: weakref.ref[CollectiveEngine]) -> None:
    """At interpreter exit: release the engine if it still lives (:meth:`CollectiveEngine.release`)."""
    engine = ref()
    if engine is not None:
        with contextlib.suppress(Exception):
            engine.release()


def _pack(flags: torch.Tensor) -> torch.Tensor:
    """Bool flags as bytes, eight to a byte (on their device)."""
    pad = (-flags.numel()) % 8
    f = torch.cat([flags, flags.new_zeros(pad)]).view(-1, 8).to(torch.int32)
    shifts = torch.tensor(_BITS, dtype=torch.int32, device=flags.device)
    return (f << shifts).sum(dim=1).to(torch.uint8)


def _unpack(packed: torch.Tensor, n: int) -> torch.Tensor:
    """[W, ceil(n / 8)] bytes back to [W, n] bool flags."""
    shifts = torch.tensor(_BITS, dtype=torch.int32, device=packed.device)
    bits = (packed.to(torch.int32).unsqueeze(-1) >> shifts) & 1
    return bits.reshape(packed.shape[0], -1)[:, :n].bool()


def _device_counts(every: torch.Tensor, owner: torch.Tensor, union: torch.Tensor,
                   W: int, timeout: float | None = None) -> tuple[list[list[int]], list[int]]:
    """Every (source, owner) count of non-zero blocks, and each owner's union, on the host."""
    nb = owner.numel()
    counts = torch.zeros(W + 1, W, dtype=torch.int64, device=owner.device)
    counts[:W].scatter_add_(1, owner.expand(W, nb), every.long())
    counts[W].scatter_add_(0, owner, union.long())
    host = to_host(counts, timeout, "the blocks' counts").tolist()
    return host[:W], host[W]


def _device_sums(recv: torch.Tensor, from_each: list[int], every: torch.Tensor, owned: torch.Tensor,
                 mine: torch.Tensor) -> torch.Tensor:
    """The float32 sums of this owner's blocks ``mine`` from ``recv`` (``from_each[s]`` rows from rank
    ``s``, in rank order): :func:`omnireduce.sums.add_in_order`, on the device."""
    acc = torch.full((mine.numel(), recv.shape[1]), -0.0, dtype=torch.float32, device=recv.device)
    parts, at = [], 0
    for s, n in enumerate(from_each):
        if n:
            parts.append((torch.searchsorted(mine, owned[every[s, owned]]), recv[at: at + n].float()))
        at += n
    return add_in_order(acc, parts)


def _split(values: np.ndarray, counts: list[int]) -> list[np.ndarray]:
    """``values`` cut into consecutive parts of ``counts`` (first-axis) elements."""
    return np.split(values, np.cumsum(counts)[:-1]) if counts else []


