"""The collective engine: omnireduce's block-sparse all-reduce with the ranks as aggregators and the
process group's collectives as the wire.

Design. The same blocks and the same lanes-to-slots layout (:class:`omnireduce.blocks.Layout`) as
the aggregators use; only who sums and how the bytes travel change. A dense tensor's reduction
(:mod:`omnireduce.engines.exchange_device` in torch ops, or :mod:`omnireduce.engines.exchange_kernels`
in a few fused calls: see "Host and device") is one all-gather of every rank's block bitmap, one
copy of a few counts to the host, and one of three exchanges that :mod:`omnireduce.engines.plan`
chooses from those counts, the same on every rank:

- ``gather``: one all-gather of every rank's non-zero blocks; every rank sums the union itself;
- ``union``: the union's blocks, compacted, summed by the backend's own all-reduce;
- ``owners``: each rank's blocks to the rank owning their lane (lane ``l``: rank ``l mod W``,
  :func:`omnireduce.engines.sparse_rows.owners`), summed there, and every owner's sums to every rank (two all-to-alls).

A bucket whose dense all-reduce costs no more than one collective's fixed cost (``latency_bytes``)
takes that all-reduce whole, with no bitmap (``dense``; its info then counts every block).

A bucket shape whose last reduction went ``gather`` sends its bitmap and its first blocks in one
all-gather of a fixed capacity (a second one carries the rest when a rank has more), so a sparse
bucket usually costs one collective. Sums: ``gather`` and ``owners`` add in rank order in float32
from -0.0 and round once to the tensor's dtype, the aggregators' bits; ``union`` sums as the
backend's dense all-reduce does (its order, its precision), and is left out with
``order="rank"``. Averaging writes ``sum * float32(1/W)``, rounded once. In lossy mode
(``threshold > 0``) a rank's blocks under the threshold that no rank sent read 0 afterwards.

Threads and order. The collectives of every reduction must be issued in the same order on every
rank, and none may interleave with DDP's own collectives. So the engine owns a process group
(made by the caller, collectively, at binding) and one thread that runs the reductions in the
order they were asked for, one after the other: the order DDP hands over its buckets, the same on
every rank. A caller that waits for a reduction not begun yet, with none before it and none
running, runs it on its own thread instead (``Reduction.wait``): the same reduction in the same
place in the order, without the hand-over to the engine's thread (a synchronous call's, a
benchmark's). A reduction that cannot finish fails with the group's timeout, and every later one
fails at once without a collective (after a failure the ranks may stand at different collectives).

Host and device. A tensor stays where it is. Its steps between the collectives are the kernel
exchange's four calls, in numpy on a CPU tensor's memory (:mod:`omnireduce.engines.numpy_kernels`)
and, with ``OMNIREDUCE_ENGINE_KERNELS=1``, as CUDA kernels on a CUDA tensor; otherwise torch ops on
its device (:func:`omnireduce.engines.exchange_kernels.enabled`). A lossy threshold takes the torch
ops everywhere. Every way gives the same bits. The collectives
move that memory (NCCL moves GPU memory directly). The host learns the counts once per reduction,
on the engine's thread, never on the training thread; every later size follows from them, so
nothing else waits for the device. On CUDA the engine's thread
works on omnireduce's side stream after an event recorded where the tensor was produced, and the
future completes on that stream (CUDA-aware), so the caller's stream waits for the result on the
device. (``OMNIREDUCE_DEVICE_PATH=1`` sends CPU tensors through the torch ops, as a device runs
them, and counts them as device reductions in :meth:`CollectiveEngine.stats`.) With
``OMNIREDUCE_CUDA_GRAPHS=1`` a CUDA bucket's steady-state reduction is a CUDA graph's replay
(:mod:`omnireduce.engines.graphs`).

No aggregator process takes part, so there is nothing to
restart and nothing to survive: a rank that dies fails the other ranks' reductions at the group's
timeout, as with DDP's own all-reduce. The engine's thread never waits on the device without that
deadline: it polls the device (:mod:`omnireduce.engines.waits`) for the counts, so a collective
stuck on a dead peer fails the reduction with a clear error even where the backend's own watchdog
is late or off.

Sparse COO tensors. A sparse gradient's rows are found and summed on the host
(:mod:`omnireduce.sources.sparse`); over a group without host collectives (NCCL) its arrays travel
through the tensor's device (:class:`omnireduce.engines.waits.Wire`), so NCCL's sparse gradients
need no Gloo group of their own.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
import weakref
from typing import Any, cast

import torch
import torch.distributed as dist

from omnireduce import default_group
from omnireduce.blocks import Layout
from omnireduce.cuda import runtime
from omnireduce.engines import exchange_device, exchange_kernels, graphs, own_groups, plan
from omnireduce.engines.exchange_device import Outcome
from omnireduce.engines.host_exchange import HostExchange
from omnireduce.engines.plan import (
    LOCAL_WEIGHT_DEVICE,
    LOCAL_WEIGHT_HOST,
    Counts,
    Exchange,
    History,
    Order,
    Shape,
    choose,
)
from omnireduce.engines.reducer import EngineStats, Reduction, ReductionInfo
from omnireduce.engines.sparse_rows import reduce_rows
from omnireduce.engines.turns import Turns
from omnireduce.engines.waits import Wire
from omnireduce.engines.workspace import Workspace
from omnireduce.errors import OmniReduceError
from omnireduce.exits import RELEASE, at_exit
from omnireduce.sources.adapt import device_path_for_cpu
from omnireduce.sources.sparse import check_sparse

log = logging.getLogger("omnireduce.collective")
default_group.guard()  # (imported before the program's init_process_group: torch's defaults then hold no group)


_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_HOST = "host"  # a shape's way: the host exchange (:mod:`omnireduce.engines.host_exchange`)


class CollectiveStats(EngineStats, total=False):
    """:meth:`CollectiveEngine.stats` (see there)."""

    bytes_sent: int
    bytes_received: int
    device_reductions: int
    collectives: int
    host_waits: int
    host_s: float
    host_wait_s: float
    fused: int
    overflows: int
    workspace_bytes: int
    graph_captures: int
    graph_replays: int
    graph_fallbacks: int
    graph_failures: int
    graphs: int
    waited_here: int


class _Job:
    def __init__(self, tensor: torch.Tensor, average: bool, block_size: int, fut: Reduction) -> None:
        self.tensor, self.average, self.block_size, self.fut = tensor, average, block_size, fut
        self.result: Any = tensor  # (a sparse tensor's: a new one)
        self.ready: Any = None  # CUDA: an event on the stream that produced the tensor
        if tensor.is_cuda:
            self.ready = torch.cuda.Event()
            self.ready.record(torch.cuda.current_stream(tensor.device))
        self.info = ReductionInfo()  # (what the reduction did: its blocks and bytes, once counted)
        self.lent: dict[Any, torch.Tensor] | None = None  # host buffers for the spell it starts (Workspace.lend)


class CollectiveEngine:
    """Block-sparse all-reduces over ``group`` (a process group of the engine's own; see the module).

    Args:
        group: the process group the engine's collectives run on (no other collective may use it).
        block_size, lanes, slots: the layout (as :class:`omnireduce.Worker`'s; ``slots`` at least
            the world size spreads the slots over every rank).
        threshold: lossy mode, as the worker's (0: exact).
        timeout: seconds the engine's thread waits for the device's results of a collective before
            the reduction fails (None: for ever; :meth:`for_group` gives the group's timeout).
        exchange: ``"auto"`` (chosen per bucket), or always ``"gather"``, ``"union"`` or ``"owners"``.
        order: ``"any"`` (the union's all-reduce where it is cheapest) or ``"rank"`` (rank-order sums only).
        latency_bytes: what one collective's fixed cost is worth in bytes, in the choice, and the dense
            all-reduce's bytes under which a bucket takes it whole (None: ``OMNIREDUCE_LATENCY_BYTES``,
            default 256 KiB; 0: a bucket never goes whole).
        fuse: a shape that went ``gather`` sends its bitmap with its blocks next time.
    """

    def __init__(self, group: Any, block_size: int, lanes: int, slots: int, threshold: float = 0.0,
                 timeout: float | None = None, exchange: Exchange | str = Exchange.AUTO,
                 order: Order | str = Order.ANY, latency_bytes: int | None = None, fuse: bool = True) -> None:
        self.group = group
        self.timeout = timeout
        self._wire = Wire(group, timeout)
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        self.block_size, self.lanes, self.threshold = block_size, lanes, threshold
        self.slots = max(slots, self.world_size)
        self.exchange, self.order = Exchange(exchange), Order(order)
        self.latency_bytes = plan.latency_bytes() if latency_bytes is None else latency_bytes
        self.fuse = fuse and self.exchange in (Exchange.AUTO, Exchange.GATHER)
        if self.order is Order.RANK and self.exchange is Exchange.UNION:
            raise ValueError("exchange='union' sums in the backend's order, not in rank order (order='rank')")
        self._history = History()
        self._workspace = Workspace(lending=True)  # (only the reduction running touches it)
        self._host = HostExchange(group, self.rank, self.world_size, self._workspace)
        # (CUDA graphs of the steady state, OMNIREDUCE_CUDA_GRAPHS=1: omnireduce/engines/graphs.py)
        self._graphs = graphs.Graphs(group, self.rank, self.world_size, timeout, self._workspace, threshold) \
            if graphs.enabled() else None
        self._shapes: dict[Shape, tuple[int, int, bool, Any]] = {}  # (:meth:`_shape_of`)
        self._chosen: dict[tuple[Any, ...], Exchange] = {}  # the exchange of counts seen before (:meth:`_choose`)
        self._device_path = device_path_for_cpu()  # (read once: a CPU tensor's reductions count as the device's)
        self._broken: OmniReduceError | None = None  # the failure that ends every later reduction
        self._lock = threading.Lock()
        self._asked = 0  # reductions asked for and not yet done: 0 between spells (the workspace's lending)
        self._demand: dict[Any, int] = {}  # what a spell's host buffers are lent with (Workspace.demand)
        self._counts: dict[str, Any] = {"bytes_sent": 0, "bytes_received": 0, "reductions": 0, "device_reductions": 0,
                                        "collectives": 0, "host_waits": 0, "host_s": 0.0, "host_wait_s": 0.0,
                                        "fused": 0, "overflows": 0, "kernel_reductions": 0,
                                        "workspace_bytes": 0, "waited_here": 0,
                                        "exchanges": {**{e.value: 0 for e in Exchange if e is not Exchange.AUTO},
                                                      "whole": 0}}
        self._closed = False
        # the reductions in order, on the engine's thread or a waiting caller's (the graphs go with the thread)
        self._turns: Turns[_Job] = Turns(self._run, "omnireduce-collective", self._thread_ends)
        self._thread = self._turns.thread
        # a script that never closes its state: the thread ends and the group is let go before the
        # interpreter shuts down (the handler holds the engine weakly)
        at_exit(RELEASE, _release_at_exit, weakref.ref(self))

    @classmethod
    def for_group(cls, group: Any, timeout: float, block_size: int, lanes: int, slots: int,
                  threshold: float = 0.0, **options: Any) -> CollectiveEngine:
        """An engine on a new group of ``group``'s ranks and backend (collective over the default group; a Gloo
        one destroyed as the engine closes), giving up after ``timeout`` s; ``options``: the constructor's."""
        own = own_groups.new_group(dist.get_process_group_ranks(group), dist.get_backend(group), timeout)
        return cls(own, block_size, lanes, slots, threshold, timeout, **options)

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
        elif tensor.dtype not in _DTYPES:
            raise TypeError(f"the collective engine reduces float32, float16 and bfloat16 tensors, got {tensor.dtype}")
        # (a sparse result is complete on the host's side: see SparseSource)
        fut = Reduction(tensor if tensor.is_cuda and not sparse else None)
        job = _Job(tensor, average, block_size or self.block_size, fut)
        with self._lock:
            self._asked += 1
            demand = self._demand if self._asked == 1 else None
        if demand:  # a spell starts: its host buffers come from this thread's heap (Workspace's "lent")
            job.lent = {key: torch.empty(n, dtype=torch.uint8) for key, n in demand.items()}
        if self._graphs is None:  # (with CUDA graphs on, every reduction on the engine's thread: the graphs' own)
            fut.run_here = functools.partial(self._run_waited, job)
        self._turns.put(job)
        return fut

    def takes_whole(self, tensor: torch.Tensor) -> bool:
        """Whether the engine would carry ``tensor`` by the backend's dense all-reduce whole, with no
        bitmap (a dense tensor small enough: :func:`omnireduce.engines.plan.goes_dense`), from its size
        and dtype alone (a :class:`~omnireduce.engines.reducer.TakesWhole`)."""
        return (tensor.layout == torch.strided and tensor.dtype in _DTYPES and self.exchange is Exchange.AUTO
                and plan.goes_dense(tensor.numel(), tensor.element_size(), self.world_size, order=self.order,
                                    latency_bytes=self.latency_bytes))

    def stats(self) -> CollectiveStats:
        """Bytes this rank sent and received through the engine's collectives, reductions done, how
        many took the device path, and for the dense ones: collectives issued, host waits for the
        device, seconds of the engine thread's CPU (``host_s``) and how many of them it spent in those
        waits (``host_wait_s``: on CUDA, polling), fused all-gathers and their overflows, how many
        reductions each exchange carried, how many went through the kernel exchange
        (``kernel_reductions``: a CUDA tensor's kernels, a host tensor's numpy calls), and the bytes
        its reused buffers hold; with ``OMNIREDUCE_CUDA_GRAPHS=1`` its CUDA graphs' captures, replays,
        fallbacks (a replay whose capacity was short, finished uncaptured), failed captures and graphs
        held (:meth:`omnireduce.engines.graphs.Graphs.counters`), and how many reductions ran on the
        thread that waited for them (``waited_here``: ``wait()`` on a reduction not begun, with none
        before it, runs it there instead of waking the engine's thread)."""
        with self._lock:
            out = dict(self._counts, exchanges=dict(self._counts["exchanges"]))
        out.update(graphs.counters(self._graphs))
        return cast(CollectiveStats, out)

    def close(self, wait: float = 5.0) -> None:
        """Stop the thread once the reductions asked for are done, wait for it (``wait`` seconds at
        most) and let go of the process group, destroyed first where made for the engine alone (Gloo:
        :mod:`~omnireduce.engines.own_groups`). Idempotent; done at interpreter exit if not before.

        The wait makes the caller, not the engine's thread, hold the engine's last reference. A thread
        that ends on its own drops its reference to the engine last thing; where that is the last one
        (the caller's gone, ``destroy_process_group()`` done) the group is freed on that thread, which
        lets go of the GIL to do it, and if the interpreter has begun to shut down meanwhile, the
        thread cannot take the GIL back: the process aborts ("terminate called without an active
        exception")."""
        self._closed = True
        self._turns.close()
        if self._thread is threading.current_thread():  # (a continuation on the thread: it ends next)
            return
        self._thread.join(wait)
        if self._thread.is_alive():
            log.warning("the collective engine's thread did not end within %g s of close(): it still holds "
                        "its process group", wait)
        else:  # (nothing runs on the group any more)
            group, self.group, self._wire.group, self._host.group = self.group, None, None, None
            own_groups.release(group)

    def release(self, wait: float = 5.0) -> None:
        """:meth:`close`, so no group of the engine's lives into the interpreter's shutdown (see own_groups)."""
        self.close(wait)

    # -- the engine's thread ----------------------------------------------------------------------

    def _thread_ends(self) -> None:
        if self._graphs is not None:  # (the graphs go with the thread that made them)
            self._graphs.close()

    def _run_waited(self, job: _Job) -> None:
        """A caller waits for ``job`` (:meth:`Reduction.wait`): where it is next in line and nothing runs,
        it runs here, on the caller's thread, instead of waking the engine's (:class:`Turns`)."""
        if self._turns.run_waited(job):
            with self._lock:
                self._counts["waited_here"] += 1

    def _run(self, job: _Job) -> None:
        """One reduction (on the engine's thread, or a waiting caller's: :class:`Turns`)."""
        job.fut.run_here = None
        if job.lent is not None:
            self._workspace.lend(job.lent)
            job.lent = None
        if self._broken is not None:  # the ranks may now be at different collectives: none is issued any more
            self._job_done()
            job.fut.fail(OmniReduceError(f"the collective engine failed earlier: {self._broken}"))
            return
        try:
            stream = None
            if job.tensor.layout != torch.strided:
                job.result = self._reduce_sparse(job)
            else:
                stream = self._reduce_on_device(job)
        except BaseException as e:
            self._broken = e if isinstance(e, OmniReduceError) else OmniReduceError(
                f"collective engine: {type(e).__name__}: {e}")
            log.error("%s", self._broken)
            self._job_done()
            job.fut.fail(self._broken)
            return
        self._job_done()  # (before the future completes: its waiter finds the spell's buffers let go)
        # (on CUDA completed on the stream that wrote the result: the caller's stream waits for it there)
        job.fut.complete(job.result, job.info, stream)

    def _job_done(self) -> None:
        """One reduction asked for is done; the last of a spell ends the spell: the host buffers lent
        or mapped for it are let go (:meth:`Workspace.end_spell`), and the next spell is lent what
        this one held."""
        with self._lock:
            self._asked -= 1
            if self._asked:
                return
            spent = self._workspace.end_spell()
            if spent:
                self._host.forget()  # (its views of the spent buffers)
                self._demand = self._workspace.demand()
        del spent  # (let go of outside the lock: a mapped buffer is unmapped here)

    def _reduce_sparse(self, job: _Job) -> Any:
        """A sparse COO tensor through the engine's group (:func:`omnireduce.engines.sparse_rows.reduce_rows`):
        a new coalesced COO tensor, as the aggregators give it."""
        result, rows = reduce_rows(job.tensor, job.average, self._wire.on(job.tensor.device), self.rank,
                                   self.world_size, self.lanes, self.slots)
        self._count(job, rows.sent, rows.received, blocks_total=rows.total, blocks_nonzero=rows.nonzero,
                    blocks_union=rows.union)
        return result

    def _reduce_on_device(self, job: _Job) -> Any:
        """The device path (see the module); returns the CUDA stream the result was written on (None
        off CUDA)."""
        t = job.tensor
        if not t.is_cuda:  # (the host: no device, no stream)
            flat = t.reshape(-1) if t.is_contiguous() else t.contiguous().reshape(-1)
            self._device_steps(job, flat)
            if not t.is_contiguous():  # (a contiguous tensor was reduced in place through its view)
                t.copy_(flat.view(t.shape))
            return None
        stream = runtime.side_stream(torch, t.device)
        if stream is None:
            raise OmniReduceError(f"a CUDA tensor, but no side stream for {t.device}")
        t.record_stream(stream)
        with torch.cuda.device(t.device), torch.cuda.stream(stream):
            if job.ready is not None:
                stream.wait_event(job.ready)
            flat = t.reshape(-1) if t.is_contiguous() else t.contiguous().reshape(-1)
            self._device_steps(job, flat)
            if not t.is_contiguous():  # (a contiguous tensor was reduced in place through its view)
                t.copy_(flat.view(t.shape))
        return stream

    def _device_steps(self, job: _Job, flat: torch.Tensor) -> None:
        W, B = self.world_size, job.block_size
        t0 = time.thread_time()
        shape = Shape(flat.numel(), flat.dtype, B)
        known = self._shapes.get(shape)
        if known is None:
            known = self._shapes[shape] = self._shape_of(shape, flat)
        nb, total_lanes, whole, way = known
        if nb == 0:
            return
        if whole:
            out = exchange_device.dense(flat, B, group=self.group, world=W, average=job.average)
            self._done(job, out, t0, nb, nb, nb, dense=True)
            return
        step = self._history.next_step(shape, nb, fuse=self.fuse)
        fixed = self.exchange is not Exchange.AUTO
        decide = (lambda c: self.exchange) if fixed else functools.partial(self._choose, flat=flat, block_size=B,
                                                                           num_blocks=nb)
        pairs = self.exchange is Exchange.OWNERS or (W > 2 and not fixed)
        graphed = None if self._graphs is None else self._graphs.reduce(  # (None: no CUDA graph carries it)
            flat, B, kernels=way, step=step, average=job.average, total_lanes=total_lanes, pairs=pairs)
        if graphed is not None:
            out = graphed
        elif way is _HOST:
            out = self._host.reduce(flat, B, average=job.average, step=step, decide=decide, total_lanes=total_lanes,
                                    pairs=pairs)
        elif way is not None:
            out = exchange_kernels.reduce(flat, B, kernels=way, group=self.group, rank=self.rank, world=W,
                                          average=job.average, step=step, decide=decide, total_lanes=total_lanes,
                                          pairs=pairs, timeout=self.timeout, workspace=self._workspace)
        else:
            out = exchange_device.reduce(flat, B, group=self.group, rank=self.rank, world=W, threshold=self.threshold,
                                         average=job.average, step=step, decide=decide, total_lanes=total_lanes,
                                         pairs=pairs, timeout=self.timeout, workspace=self._workspace)
        # (a fused reduction went "gather" whatever the counts say: what they say decides the next one)
        self._history.record(shape, decide(out.counts) if out.fused else out.exchange, out.counts)
        self._done(job, out, t0, nb, out.counts.nonzero[self.rank], out.counts.union, kernels=way is not None)

    def _shape_of(self, shape: Shape, flat: torch.Tensor) -> tuple[int, int, bool, Any]:
        """What a bucket shape's reductions share (made once a shape): its blocks and lanes, whether it
        goes whole (:func:`omnireduce.engines.plan.goes_dense`), and which way its steps take: the host's
        (:mod:`omnireduce.engines.host_exchange`), a kernel exchange's kernels, or None (torch ops)."""
        lay = Layout.for_tensor(shape.numel, shape.block_size, self.lanes, self.slots, flat.element_size())
        whole = self.exchange is Exchange.AUTO and plan.goes_dense(
            shape.numel, flat.element_size(), self.world_size, order=self.order, latency_bytes=self.latency_bytes)
        kernels = exchange_kernels.kernels_for(flat, self.threshold, self.world_size)
        way = _HOST if kernels is exchange_kernels.NUMPY else kernels
        if len(self._shapes) >= 256:  # (bounded: the oldest shapes go first)
            self._shapes.pop(next(iter(self._shapes)))
        return lay.num_blocks, lay.total_lanes, whole, way

    def _choose(self, counts: Counts, *, flat: torch.Tensor, block_size: int, num_blocks: int) -> Exchange:
        """The exchange for ``counts`` (:func:`omnireduce.engines.plan.choose`): the dense all-reduce
        among the options only without a threshold (with one, blocks under it must read 0), a block
        copied priced for the tensor's memory."""
        if self.exchange is not Exchange.AUTO:
            return self.exchange
        key = (counts, block_size * flat.element_size(), num_blocks, flat.is_cuda)
        chosen = self._chosen.get(key)
        if chosen is None:
            allowed = (Exchange.GATHER, Exchange.UNION, Exchange.OWNERS) + \
                (() if self.threshold > 0 else (Exchange.DENSE,))
            chosen = choose(counts, key[1], order=self.order, latency_bytes=self.latency_bytes, allowed=allowed,
                            num_blocks=num_blocks, fused=self.fuse,
                            local_weight=LOCAL_WEIGHT_DEVICE if key[3] else LOCAL_WEIGHT_HOST)
            if len(self._chosen) >= 1024:  # (the counts that recur, kept: a bucket's steady state)
                self._chosen.clear()
            self._chosen[key] = chosen
        return chosen

    def _done(self, job: _Job, out: Outcome, t0: float, blocks_total: int, blocks_nonzero: int, blocks_union: int,
              *, dense: bool = False, kernels: bool = False) -> None:
        """One dense reduction done: the engine's counters (one lock), and the job's ``info`` (its bytes and
        blocks; ``dense``: taken whole by the dense all-reduce, its blocks not counted)."""
        device = self._device_path or job.tensor.is_cuda
        whole = out.exchange is Exchange.DENSE and out.waits == 0  # (taken whole: no bitmaps)
        with self._lock:
            c = self._counts
            c["bytes_sent"] += out.sent
            c["bytes_received"] += out.received
            c["reductions"] += 1
            c["device_reductions"] += device
            c["kernel_reductions"] += kernels
            c["collectives"] += out.collectives
            c["host_waits"] += out.waits
            c["host_s"] += time.thread_time() - t0
            c["host_wait_s"] += out.wait_s
            c["fused"] += out.fused
            c["overflows"] += out.overflow
            c["exchanges"]["whole" if whole else out.exchange.value] += 1
            c["workspace_bytes"] = self._workspace.nbytes
        job.info = ReductionInfo(blocks_total, blocks_nonzero, blocks_union, out.sent, out.received, dense=dense)

    def _count(self, job: _Job, sent: int, got: int, *, device: bool = False, blocks_total: int,
               blocks_nonzero: int, blocks_union: int, dense: bool = False) -> None:
        """One sparse COO reduction done: the engine's counters, and the job's ``info``."""
        with self._lock:
            self._counts["bytes_sent"] += sent
            self._counts["bytes_received"] += got
            self._counts["reductions"] += 1
            self._counts["device_reductions"] += int(device)
        job.info = ReductionInfo(blocks_total, blocks_nonzero, blocks_union, sent, got, dense=dense)


def _release_at_exit(ref: weakref.ref[CollectiveEngine]) -> None:
    """At interpreter exit: release the engine if it still lives (:meth:`CollectiveEngine.release`)."""
    engine = ref()
    if engine is not None:
        with contextlib.suppress(Exception):
            engine.release()
