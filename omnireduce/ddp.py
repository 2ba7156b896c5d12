"""PyTorch DDP communication hook: all-reduce gradient buckets through omnireduce.

    state = OmniReduceState()                              # before or after init_process_group
    ddp_model.register_comm_hook(state, omnireduce_hook)   # averages, like DDP's default

Aggregators: ``aggregators=[...]`` or ``$OMNIREDUCE_AGGREGATORS``; with neither, the job starts its
own, one per node (:mod:`omnireduce.colocate`), when the state binds (see ``OmniReduceState``).

The hook hands each bucket to the worker's background I/O thread and returns a
``torch.futures.Future`` at once, so communication overlaps the rest of the backward pass; the I/O
thread writes the averaged gradient into ``bucket.buffer()`` in place and completes the future with
that buffer. Only the blocks that are non-zero on some rank travel.

Dense fallback. A bucket whose gradient is mostly non-zero is cheaper to all-reduce densely
through the process group. Which path a bucket takes must be the same on every rank, or ranks wait
for each other forever; so the decision is made from information every rank shares bit for bit:
the union density of the same bucket's previous reduction (the reduced result is identical on
every rank, and so is the fraction of its blocks that are non-zero). No rank's local view enters.

Streams. On CUDA the worker writes the result on its side stream and, asked with
``synchronize=False``, completes its future as soon as the writes are queued; the hook completes
its CUDA-aware torch future on that stream (``ReduceFuture.stream``), so DDP's stream waits for the
writes on the device, and no thread waits for them on the host.

``fuse_optimizer(hook, optimizer)`` (from :mod:`omnireduce.fusion`, re-exported here) wraps a hook
so that the optimizer step of a bucket's parameters runs as soon as that bucket's reduced gradient
arrives.
"""

# No `from __future__ import annotations` here: DDP checks the hook's annotations against the real
# dist.GradBucket and torch.futures.Future[torch.Tensor] objects.
import atexit
import contextlib
import logging
import os
import threading
import uuid
import weakref
from typing import Any

import torch
import torch.distributed as dist

from omnireduce.alignment import aligned_block_size
from omnireduce.colocate import Colocated, exiting_on_error
from omnireduce.config import DEFAULT_TIMEOUT, WorkerConfig, _env_number
from omnireduce.errors import OmniReduceError
from omnireduce.fusion import HookType, fuse_optimizer
from omnireduce.membership import Agreement
from omnireduce.worker import Worker
from omnireduce.worker.sparse import concat_rows, split_rows
from omnireduce.worker.tensors import adapt

__all__ = ["HookType", "OmniReduceState", "fuse_optimizer", "omnireduce_hook"]

log = logging.getLogger("omnireduce.ddp")

_SUPPORTED = (torch.float32, torch.float16, torch.bfloat16)


class OmniReduceState:
    """State of :func:`omnireduce_hook` for one DDP model.

    Make it anywhere: before or after ``torch.distributed`` is initialised, before or after the DDP
    model exists (PyTorch Lightning builds ``DDPStrategy(ddp_comm_state=OmniReduceState(), ...)``
    before it initialises the process group), then ``ddp_model.register_comm_hook(state,
    omnireduce_hook)``. The state binds to the job once: it resolves the process group, this rank and
    the world size, the job name (rank 0 makes one up and broadcasts it) and the aggregators, and
    connects its :class:`omnireduce.Worker`. Binding is collective over the process group. Made
    after ``init_process_group``, the state binds at once, as it is made (so make it on every rank,
    in the same order); made before, it binds in the first hook call, which DDP makes in the same
    order on every rank. :meth:`bind` binds it explicitly.

    Aggregators. With addresses (``aggregators=`` or ``$OMNIREDUCE_AGGREGATORS``) the state
    connects to those. Without any, the job runs its own (:func:`omnireduce.colocate.start_colocated`):
    ``$OMNIREDUCE_AGGREGATORS_PER_NODE`` (default 1) aggregator processes per node, started by the
    node's lowest rank as its children, on the node's address the other nodes reach
    (``$OMNIREDUCE_IFNAME`` to choose the interface), on free ports, with a fresh token rank 0 makes
    and shares through the process group. They stop with :meth:`close`, at interpreter exit, or
    when the process that started them dies (SIGKILL included). If some node cannot start its
    aggregator, binding fails on every rank with an :class:`~omnireduce.OmniReduceError` naming the
    node and the cause (from the hook: ``backward()`` raises it).

    Args:
        process_group: the group DDP reduces over (None: the default group). Its rank and size
            are this worker's rank and world size; the dense fallback all-reduces through it.
        aggregators: aggregator addresses, a list or a comma-separated string
            (None: ``$OMNIREDUCE_AGGREGATORS``; neither: colocated aggregators, see above).
        job: name shared by the ranks of this training run at the aggregators (None:
            ``$OMNIREDUCE_JOB``, else a random name that rank 0 broadcasts). Two runs must not
            share a name on the same aggregators.
        block_size: elements per block (None: ``$OMNIREDUCE_BLOCK_SIZE`` or 256). Smaller blocks
            find more zeros (an embedding row of 64 floats is a quarter of a 256-block) but cost
            more per block.
        timeout: seconds each bucket may take before backward() fails with
            :class:`~omnireduce.OmniReduceTimeout`, and colocated aggregators may take to start
            (None: ``$OMNIREDUCE_TIMEOUT`` or 60).
        token: the aggregators' shared secret (None: ``$OMNIREDUCE_TOKEN``; colocated aggregators
            use the job's own).
        threshold: treat blocks whose elements all satisfy ``|x| <= threshold`` as zero. Lossy;
            0 (exact) by default.
        dense_fallback: let buckets whose last union density reached ``dense_threshold`` go
            through the process group's dense all-reduce instead. On by default. A host bucket seen
            for the first time (the first iteration, and after DDP rebuilds its buckets) has no
            union density yet: the ranks all-reduce their local densities (MAX, one number; the
            union is at least the largest), so that a dense bucket goes dense from its first
            iteration instead of being staged whole through omnireduce once.
        dense_threshold: the union density (fraction of a bucket's blocks non-zero on some rank)
            at and above which a bucket is reduced densely. Where omnireduce and Gloo cost the
            same depends on the network and the aggregators (docs/BENCHMARKS.md, 4 ranks, 100 MiB):
            a union density of about 0.75 on loopback, 0.35 with one aggregator and 0.85 with four
            on 1 Gbit/s links. The default 0.6 sits between; measure and tune it for your cluster.
        lanes, slots: protocol geometry (see :class:`omnireduce.Worker`).
        worker: an existing :class:`omnireduce.Worker` to use instead of creating one (the state
            does not close it).
        align_blocks: per dense bucket, align the blocks to the rows of its dominant table: the
            block size becomes the largest multiple of their width up to ``block_size`` (a 200-wide
            embedding gets blocks of 200, not 256, so a touched row is one block, not two;
            ``block_size=16`` with 16-wide rows: one row per block; :mod:`omnireduce.alignment`).
            On by default (measured: docs/BENCHMARKS.md).

    Sparse gradients (``nn.Embedding(sparse=True)``, ``nn.EmbeddingBag(sparse=True)``) are reduced
    through omnireduce whatever the process group's backend (NCCL has none for them): one block per
    touched row, known from the gradient's indices, nothing of the table's size read or allocated
    (:mod:`omnireduce.worker.sparse`); ``stats()["buckets_coo"]`` counts them.

    Attributes:
        iteration: completed iterations (the hook counts the last bucket of each).
        rank, world_size, job: this rank, the world size and the job name (None until bound).
        worker: the :class:`omnireduce.Worker` (None until bound).
        colocated: the job's :class:`omnireduce.colocate.Colocated` aggregators when it runs its
            own (None otherwise, or until bound).

    The state can be pickled (e.g. inside a checkpoint, or by a launcher that spawns processes);
    its sockets, aggregator processes, token and process group are not. An unpickled state binds
    again on first use, in the default process group (starting colocated aggregators again if it
    was given no addresses).
    """

    def __init__(self, process_group: dist.ProcessGroup | None = None, aggregators: str | list[str] | None = None,
                 *, job: str | None = None, block_size: int | None = None, timeout: float | None = None,
                 token: str | None = None, threshold: float = 0.0, dense_fallback: bool = True,
                 dense_threshold: float = 0.6, lanes: int | None = None, slots: int | None = None,
                 worker: Worker | None = None, align_blocks: bool = True) -> None:
        if not 0.0 < dense_threshold <= 1.0:
            raise ValueError(f"dense_threshold must be in (0, 1], got {dense_threshold}")
        self.process_group = process_group
        self.rank: int | None = None
        self.world_size: int | None = None
        self.job: str | None = job or None
        self.worker_options: dict[str, Any] = {
            "aggregators": aggregators, "block_size": block_size, "timeout": timeout, "token": token,
            "threshold": threshold, "lanes": lanes, "slots": slots}
        self.dense_fallback = dense_fallback
        self.dense_threshold = dense_threshold
        self.align_blocks = align_blocks
        self.iteration = 0
        self._lock = threading.Lock()
        # (bucket index, numel) -> union density; a CUDA count stays a device tensor until it is read
        self._density: dict[tuple[int, int], float | torch.Tensor] = {}
        self._seen: set[tuple[int, int]] = set()  # buckets asked about (probed or not) before
        self._latest: dict[int, float | torch.Tensor] = {}  # bucket index -> latest union density (stats)
        self._counters: dict[str, int] = {"buckets_sparse": 0, "buckets_dense": 0, "buckets_failed": 0,
                                          "buckets_probed": 0,
                                          "buckets_coo": 0, "bytes_sent": 0, "bytes_received": 0,
                                          "dense_equivalent_bytes": 0}
        self._warned: set[str] = set()
        self.worker = worker
        self._owns_worker = worker is None
        self._init_binding()
        if dist.is_available() and dist.is_initialized():
            self.bind()

    # -- binding to the job --------------------------------------------------------------------

    def _init_binding(self) -> None:
        """The unpicklable part of the binding state (also after unpickling)."""
        self.colocated: Colocated | None = None
        self._bound = False
        self._closed = False
        self._bind_error: BaseException | None = None
        self._bind_lock = threading.RLock()
        self._agreement = Agreement()  # which aggregators the ranks use (omnireduce.membership)

    @property
    def bound(self) -> bool:
        """Whether the state has bound to the job (process group, rank, job name, worker)."""
        return self._bound

    def bind(self) -> None:
        """Bind to the job now, if not yet bound: resolve the process group, rank, world size and
        job name, start or find the aggregators, and connect the worker.

        Collective over the process group: every rank calls it, in the same order (the hook calls
        it on its first call; the constructor, when torch.distributed is initialised). If it fails,
        the state stays failed: later calls raise the same error at once, without any collective
        (so ranks never wait for each other's retries)."""
        with self._bind_lock:
            if self._bound:
                return
            if self._closed:
                raise OmniReduceError("this OmniReduceState is closed")
            if self._bind_error is not None:
                raise OmniReduceError(f"omnireduce could not start: {self._bind_error}") from self._bind_error
            try:
                self._bind()
            except BaseException as e:
                self._bind_error = e
                raise

    def _bind(self) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("omnireduce_hook needs torch.distributed to be initialised (dist.init_process_group) "
                               "before its first call")
        group = self.process_group if self.process_group is not None else dist.group.WORLD
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        if not self.job:
            self.job = os.environ.get("OMNIREDUCE_JOB") or _agree_on_job_name(group)
        if self.worker is None:
            self.worker = self._connect(group)
            self._owns_worker = True
        self._bound = True

    def _connect(self, group: Any = None) -> Worker:
        """A worker for this rank: at the given aggregators, or at colocated ones started now."""
        opts = {k: v for k, v in self.worker_options.items() if v is not None}
        if "aggregators" in opts or os.environ.get("OMNIREDUCE_AGGREGATORS"):
            return Worker(rank=self.rank, world_size=self.world_size, job=self.job, **opts)
        from omnireduce.colocate import start_colocated

        timeout = opts.get("timeout", _env_number("OMNIREDUCE_TIMEOUT", float, DEFAULT_TIMEOUT))
        colocated = start_colocated(group, timeout=float(timeout))
        try:
            opts.update(aggregators=colocated.addresses, token=colocated.token)
            worker = Worker(rank=self.rank, world_size=self.world_size, job=self.job, **opts)
        except BaseException:
            colocated.close(drain=False)
            raise
        self.colocated = colocated
        # Registered after the colocated aggregators' own exit handler, so it runs first (handlers run
        # last-registered first): the worker says goodbye while its aggregators still listen. It holds
        # the worker and the aggregators, not the state, which DDP may have dropped by then.
        atexit.register(_close_at_exit, worker, colocated)
        return worker

    def _reconnect(self) -> None:
        """After unpickling: bind again (this process's rank in the default group, a new worker)."""
        self.bind()

    def close(self, *, drain: bool = True) -> None:
        """Leave the job (the worker says goodbye) and stop the colocated aggregators this process
        started, once the other ranks' workers have left them too (``drain``; at most a few seconds).
        Idempotent; runs at interpreter exit for a state with colocated aggregators (without the
        wait when the script ends with an exception). A worker passed in as ``worker=`` is left
        open."""
        with self._bind_lock:
            self._closed = True
            worker, colocated = self.worker, self.colocated
            self.colocated = None
            if worker is not None and self._owns_worker:
                worker.close()
            if colocated is not None:
                colocated.close(drain=drain)

    # -- the collective dense/sparse decision ----------------------------------------------------

    def use_dense(self, key: tuple[int, int]) -> bool:
        """Whether the bucket ``key`` = (index, numel) goes through the dense all-reduce this time.

        Decided from the bucket's last union density, which is identical on every rank. It is read
        from host memory: a density counted on a CUDA device was copied there when it was counted
        (:class:`_DeviceDensity`), an iteration ago, so deciding does not wait for the device."""
        if not self.dense_fallback:
            return False
        with self._lock:
            density = self._density.get(key)
        return density is not None and _as_float(density) >= self.dense_threshold

    def first_sight(self, key: tuple[int, int]) -> bool:
        """True the first time bucket ``key`` is asked about (it has no density yet), then False."""
        with self._lock:
            if key in self._density or key in self._seen:
                return False
            self._seen.add(key)
            return True

    def record(self, key: tuple[int, int], density: "float | _DeviceDensity | None", dense: bool, sent: int,
               received: int, nbytes: int) -> None:
        """Count a reduced bucket; ``density`` None: not measured (it does not steer the decision)."""
        with self._lock:
            if density is not None:
                self._density[key] = density
                self._latest[key[0]] = density
            c = self._counters
            c["buckets_dense" if dense else "buckets_sparse"] += 1
            c["bytes_sent"] += sent
            c["bytes_received"] += received
            c["dense_equivalent_bytes"] += _ring_bytes(nbytes, self.world_size)

    # -- reporting -----------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """What the hook has done since the state was made.

        ``bytes_sent`` / ``bytes_received``: this rank's bytes for all buckets (dense-fallback
        buckets counted at the ring all-reduce's ``2 (W-1)/W`` times the bucket size);
        ``dense_equivalent_bytes``: what a ring all-reduce of every bucket would have sent;
        ``sent_fraction``: their ratio; ``buckets_sparse`` / ``buckets_dense`` / ``buckets_failed``;
        ``buckets_coo``: those of ``buckets_sparse`` that were sparse COO gradients;
        ``buckets_probed``: buckets seen for the first time whose ranks' largest density was
        all-reduced to pick their path (see ``dense_fallback``);
        ``density``: the last union density of each bucket, keyed by bucket index;
        ``aggregators_in_use``: the addresses a bucket reduced now would use (an aggregator found lost
        leaves it, and comes back once every rank reaches it again: :mod:`omnireduce.membership`).
        """
        with self._lock:
            out: dict[str, Any] = dict(self._counters)
            out["density"] = {k: _as_float(v) for k, v in sorted(self._latest.items())}
        out["iteration"] = self.iteration
        worker = self.worker
        out["aggregators_in_use"] = worker.aggregators_in_use() if worker is not None else []
        dense = out["dense_equivalent_bytes"]
        out["sent_fraction"] = out["bytes_sent"] / dense if dense else 0.0
        return out

    def warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning("%s", message)

    # -- pickling ------------------------------------------------------------------------------

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        for unpicklable in ("process_group", "worker", "_lock", "colocated", "_bind_lock", "_bind_error", "_bound",
                            "_closed", "_owns_worker", "_agreement"):
            state.pop(unpicklable, None)
        # No secret in checkpoints: after unpickling the token comes from the environment again.
        state["worker_options"] = {**self.worker_options, "token": None}
        state["_density"] = {k: _as_float(v) for k, v in self._density.items()}
        state["_latest"] = {k: _as_float(v) for k, v in self._latest.items()}
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.__dict__.setdefault("_seen", set())  # (pickled by an older version)
        self.process_group = None
        self.worker = None
        self._owns_worker = True
        self._lock = threading.Lock()
        self._init_binding()


def _close_at_exit(worker: Worker, colocated: Colocated) -> None:
    """Leave the job, then stop this rank's colocated aggregators once every rank has left them."""
    with contextlib.suppress(Exception):
        worker.close()
    colocated.close(drain=not exiting_on_error())


def _agree_on_job_name(group: dist.ProcessGroup) -> str:
    name = [f"ddp-{uuid.uuid4().hex[:16]}" if dist.get_rank(group) == 0 else None]
    dist.broadcast_object_list(name, src=dist.get_global_rank(group, 0), group=group)
    return str(name[0])


def _ring_bytes(nbytes: int, world_size: int) -> int:
    """Bytes each rank sends in a ring all-reduce of ``nbytes``."""
    return 2 * (world_size - 1) * nbytes // world_size if world_size > 1 else 0


def _union_density(t: torch.Tensor, cfg: WorkerConfig) -> "float | _DeviceDensity":
    """Fraction of the reduced tensor's blocks that are non-zero, counted by the block source the
    sparse path would use (identical on every rank). Counted on a CUDA device, it is a
    :class:`_DeviceDensity`, so that nothing waits for the device here."""
    if t.numel() == 0:
        return 0.0
    source = adapt(t, cfg.block_size, cfg.lanes, cfg.slots)
    count = source.count_nonzero(cfg.threshold)
    if isinstance(count, torch.Tensor):
        if count.is_cuda:
            return _DeviceDensity(count, source.layout.num_blocks)
        count = int(count)  # the device path on a CPU tensor: nothing to wait for
    return count / source.layout.num_blocks


class _DeviceDensity:
    """A union density whose block count was computed on a CUDA device: copied, as it is queued, to
    pinned host memory without blocking, with an event after the copy. Read a bucket's iteration
    later, when the copy has long run; if it has not, reading waits for that one event."""

    def __init__(self, count: torch.Tensor, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.device = count.device
        self._value: float | None = None
        with torch.cuda.device(self.device):
            self.host = torch.empty(1, dtype=count.dtype, pin_memory=True)
            self.host.copy_(count.reshape(1), non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()

    def value(self) -> float:
        if self._value is None:
            with torch.cuda.device(self.device):
                if not self.event.query():
                    self.event.synchronize()
            self._value = int(self.host[0]) / self.num_blocks  # host memory: no device access
        return self._value


def _as_float(density: "float | _DeviceDensity") -> float:
    return density.value() if isinstance(density, _DeviceDensity) else float(density)


def omnireduce_hook(state: OmniReduceState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average a DDP gradient bucket over all ranks through omnireduce; never raises.

    Algorithm, per bucket:

    1. Take the bucket's flat buffer. Count the iteration when DDP hands over its last bucket. At
       the first bucket of an iteration, hand the worker the aggregators the ranks agreed to use;
       at the last, start the next agreement (:mod:`omnireduce.membership`).
    2. Decide the path, identically on every rank: a sparse COO gradient goes through omnireduce by
       its rows (``_sparse``: the future gets the averaged sum as a new tensor, whatever the process
       group's backend); dtypes omnireduce does not carry (float64, ...) go through the process
       group's all-reduce; so does a dense bucket whose last union density reached
       ``state.dense_threshold`` (if ``state.dense_fallback``), and every bucket while the ranks
       agree that no aggregator is reachable (:mod:`omnireduce.membership`). A dense bucket's block
       size is aligned to its largest table's rows (``state.align_blocks``).
    3. Sparse path: hand the buffer to the worker's I/O thread
       (``allreduce_async(average=True, synchronize=False)``) and return at once. The I/O thread
       finds the non-zero blocks, streams them to the aggregators, writes the averaged sums into
       the buffer in place, records the bucket's union density, and completes the returned future
       with the buffer (on CUDA, on the stream that wrote it: see "Streams" in the module docstring).
    4. Dense path: ``all_reduce`` through the process group, divide by the world size in place,
       record the union density of the result (so the bucket can come back to the sparse path).
    5. On any failure, complete the future with an :class:`~omnireduce.OmniReduceError` naming the
       iteration, the bucket and the cause (DDP raises it from ``backward()``), and log it.
    """
    index = iteration = -1
    try:
        buffer = bucket.buffer()
        # A CUDA-aware future: completed with a CUDA tensor, it records an event on the completing
        # thread's current stream, and DDP's stream waits for that event, not for the host.
        fut: torch.futures.Future[torch.Tensor] = torch.futures.Future(
            devices=[buffer.device] if buffer.is_cuda else None)
        index, iteration = bucket.index(), state.iteration
        if bucket.is_last():
            state.iteration += 1
        if not state._bound:  # made before init_process_group, or unpickled: bind now (collective)
            state.bind()
        state._agreement.at_bucket(state.worker, state.process_group, iteration, bucket.is_last(), buffer.device)
        key = (index, buffer.numel())
        if buffer.layout != torch.strided and buffer.dtype in _SUPPORTED and not state._agreement.none_usable:
            return _sparse(state, buffer, key, fut, iteration, bucket.is_last())  # nn.Embedding(sparse=True) & co
        _flush_sparse(state)  # the sparse buckets gathered so far go first (the same order on every rank)
        if buffer.dtype not in _SUPPORTED:
            state.warn_once(str(buffer.dtype), f"omnireduce_hook: {buffer.dtype} buckets go through the process "
                            "group's all-reduce (omnireduce carries float32, float16 and bfloat16)")
            return _dense(state, buffer, key, fut, iteration, measure=False)
        if state._agreement.none_usable or state.use_dense(key) or _probed_dense(state, buffer, key):
            return _dense(state, buffer, key, fut, iteration, measure=True)
        block_size = _bucket_block_size(state, bucket)
        reduction = state.worker.allreduce_async(buffer, average=True, synchronize=False, block_size=block_size)
    except BaseException as e:
        if "fut" not in locals():
            fut = torch.futures.Future()
        _fail(state, fut, e, iteration, index)
        return fut

    def done(f: Any) -> None:
        try:
            f.result()
            info = f.info
            density = info["blocks_union"] / info["blocks_total"] if info["blocks_total"] else 0.0
            state.record(key, density, False, info["bytes_sent"], info["bytes_received"],
                         buffer.numel() * buffer.element_size())
            stream = f.stream  # the side stream that wrote the result (None on the host path)
            if stream is None:
                fut.set_result(buffer)
            else:  # (under the buffer's device: leaving the stream context touches no other GPU)
                with torch.cuda.device(buffer.device), torch.cuda.stream(stream):
                    fut.set_result(buffer)
        except BaseException as e:
            _fail(state, fut, e, iteration, index)

    reduction.add_done_callback(done)
    return fut


def _probed_dense(state: "OmniReduceState", buffer: torch.Tensor, key: tuple[int, int]) -> bool:
    """A host bucket seen for the first time: whether the largest local density of the ranks (one
    number all-reduced, MAX: a lower bound of the union's) reaches the dense threshold. Collective:
    every rank sees the same buckets in the same order. CUDA buckets are not probed (it would wait
    for the device): their first reduction goes through omnireduce."""
    if not state.dense_fallback or buffer.is_cuda or not state.first_sight(key):
        return False
    local = _union_density(buffer, state.worker.config)
    largest = torch.tensor([_as_float(local)], dtype=torch.float64)
    dist.all_reduce(largest, op=dist.ReduceOp.MAX, group=state.process_group)
    with state._lock:
        state._counters["buckets_probed"] += 1
    return float(largest[0]) >= state.dense_threshold


def _bucket_block_size(state: "OmniReduceState", bucket: dist.GradBucket) -> int | None:
    """The bucket's block size with ``state.align_blocks``: aligned to the rows of its largest table
    (:func:`omnireduce.alignment.aligned_block_size`); None (the worker's) otherwise."""
    if not getattr(state, "align_blocks", True):
        return None
    base = state.worker.config.block_size
    return aligned_block_size([tuple(p.shape) for p in bucket.parameters()], base)


# Sparse COO buckets of the backward pass in progress, per state, waiting to be reduced together.
_COO_BATCHES: "weakref.WeakKeyDictionary[OmniReduceState, list[tuple[torch.Tensor, tuple[int, int], Any, int]]]" = (
    weakref.WeakKeyDictionary())


def _sparse(state: "OmniReduceState", buffer: torch.Tensor, key: tuple[int, int], fut: torch.futures.Future,
            iteration: int, last: bool) -> torch.futures.Future:
    """A sparse COO gradient (``nn.Embedding(sparse=True)``, ``nn.EmbeddingBag(sparse=True)``)
    through omnireduce, whatever the process group's backend (NCCL has no sparse all-reduce): its
    rows are its blocks, known from its indices, so nothing of the table's size is read
    (:mod:`omnireduce.worker.sparse`). The future gets the averaged sum as a new coalesced COO
    tensor, which DDP copies into the parameter's gradient.

    DDP gives every sparse parameter a bucket of its own and hands them over one after another
    (tables are looked up first in the forward pass, so their gradients come last, together). They
    are gathered and reduced together (:func:`_flush_sparse`) when a dense bucket or the last one
    comes, which is the same moment on every rank: one reduction of the stacked tables instead of
    one per table, the same bits (rows are summed independently). For the recommender's 26 tables (4
    ranks, loopback) that took the reduction from 280-520 ms to 33-100 ms per step, the workers' CPU
    from ~50 to ~9 ms and the aggregator's from ~70 to 11-18 ms (docs/BENCHMARKS.md)."""
    _COO_BATCHES.setdefault(state, []).append((buffer, key, fut, iteration))
    if last:
        _flush_sparse(state)
    return fut


def _flush_sparse(state: "OmniReduceState") -> None:
    """Reduce the sparse buckets gathered so far: one reduction per row width, dtype and device
    (their tables stacked, :func:`omnireduce.worker.sparse.concat_rows`); never raises."""
    pending = _COO_BATCHES.pop(state, None)
    groups: dict[tuple[Any, ...], list[tuple[torch.Tensor, tuple[int, int], Any, int]]] = {}
    for item in pending or ():
        b = item[0]
        groups.setdefault((b.dim(), int(b.shape[-1]) if b.dim() else 0, b.dtype, b.device), []).append(item)
    for group in groups.values():
        _reduce_coo(state, group)


def _reduce_coo(state: "OmniReduceState", group: list[tuple[torch.Tensor, tuple[int, int], Any, int]]) -> None:
    try:
        stacked, offsets = concat_rows([buffer for buffer, *_ in group]) if group[0][0].dim() == 2 \
            else (group[0][0], [])
        reduction = state.worker.allreduce_async(stacked, average=True)
    except BaseException as e:
        for _, key, fut, iteration in group:
            _fail(state, fut, e, iteration, key[0])
        return

    def done(f: Any) -> None:
        try:
            parts = split_rows(f.result(), offsets)
            info = f.info
            for i, ((buffer, key, fut, _), part) in enumerate(zip(group, parts, strict=True)):
                sent, received = (info["bytes_sent"], info["bytes_received"]) if i == 0 else (0, 0)
                state.record(key, None, False, sent, received, buffer.numel() * buffer.element_size())
                with state._lock:
                    state._counters["buckets_coo"] = state._counters.get("buckets_coo", 0) + 1
                fut.set_result(part)
        except BaseException as e:
            for _, key, fut, iteration in group:
                if not fut.done():
                    _fail(state, fut, e, iteration, key[0])

    reduction.add_done_callback(done)


def _dense(state: "OmniReduceState", buffer: torch.Tensor, key: tuple[int, int], fut: torch.futures.Future,
           iteration: int, *, measure: bool) -> torch.futures.Future:
    """The process group's all-reduce of ``buffer``, averaged in place; with ``measure``, the union
    density of the result is recorded (so the bucket can come back to the sparse path)."""
    group = state.process_group
    work = dist.all_reduce(buffer, group=group, async_op=True)
    nbytes = buffer.numel() * buffer.element_size() if buffer.layout == torch.strided else 0

    def finish(f: torch.futures.Future) -> torch.Tensor:
        result = f.value()[0]
        if result.layout == torch.strided:
            result.div_(state.world_size)
        else:  # sparse: DDP expects the averaged tensor back
            result = result / state.world_size
        density = _union_density(result, state.worker.config) if measure else None
        ring = _ring_bytes(nbytes, state.world_size)
        state.record(key, density, True, ring, ring, nbytes)
        return result

    def chained(f: torch.futures.Future) -> None:
        try:
            fut.set_result(finish(f))
        except BaseException as e:
            _fail(state, fut, e, iteration, key[0])

    work.get_future().add_done_callback(chained)
    return fut


def _fail(state: OmniReduceState, fut: torch.futures.Future, cause: BaseException, iteration: int,
          index: int) -> None:
    kind = type(cause) if isinstance(cause, OmniReduceError) else OmniReduceError
    err = kind(f"omnireduce_hook failed at iteration {iteration}, bucket {index}: {cause}")
    err.__cause__ = cause
    with contextlib.suppress(Exception), state._lock:
        state._counters["buckets_failed"] += 1
    log.error("%s", err)
    if not fut.done():
        fut.set_exception(err)
