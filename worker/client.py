"""The public worker: ``Worker(...).allreduce(x)`` sums ``x`` over every rank of the job, in place.

Construction connects to every aggregator and waits (up to ``timeout``) for each to welcome this
rank. Each reduction is numbered in call order (every rank must reduce the same tensors in the same
order, as DDP does) and handed to the background I/O thread; ``allreduce_async`` returns a
``concurrent.futures.Future`` at once, so several tensors can be in flight.

Per call, the caller's thread only validates the input and picks its block source (host or device,
:func:`omnireduce.sources.adapt.adapt`), wraps it in a :class:`~omnireduce.worker.op.TensorOp` and
queues it; everything else happens on the I/O thread (:mod:`omnireduce.worker.io_loop`). The first
tensor on each device also builds or loads the CUDA kernels there
(:func:`omnireduce.cuda.build.prepare`), on the caller's thread and before the tensor's deadline
starts: a first build takes about a minute.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import uuid
from typing import Any

# pyzmq's collector of zero-copy frames stops at exit through an exit handler of its own, registered
# when it is first imported; imported here, before ours (_close_all) is registered, it runs after ours
# (handlers run last-registered first), so workers close while it still releases their frames.
import zmq.utils.garbage  # noqa: F401

from omnireduce._malloc import keep_freed_memory, malloc_tune
from omnireduce.config import WorkerConfig
from omnireduce.errors import OmniReduceTimeout
from omnireduce.exits import LEAVE, at_exit
from omnireduce.sources.adapt import adapt
from omnireduce.sources.device import DeviceSource
from omnireduce.sources.sparse import SparseSource, is_sparse, rejection
from omnireduce.wire import MAX_BLOCK_SIZE
from omnireduce.worker.io_loop import IOLoop
from omnireduce.worker.op import ReduceFuture, TensorOp
from omnireduce.worker.sparse import SparseOp

log = logging.getLogger("omnireduce.worker")
_CLOSE_SECONDS = 30.0
# Every open worker, held strongly: one whose owner dropped it without close() (a DDP hook's state goes
# with its model) still has its I/O thread running, which must end before the interpreter shuts down
# (a daemon thread that wakes up in a shutting-down interpreter can abort the process).
_live: set[Worker] = set()


class Worker:
    """A rank's connection to the aggregators of a job.

    Args:
        aggregators: addresses (``tcp://host:port``), a list or a comma-separated string;
            default ``$OMNIREDUCE_AGGREGATORS``.
        rank, world_size: default ``$RANK``/``$WORLD_SIZE``, else MPI's ``COMM_WORLD``, else 0 of 1.
        job: name shared by the ranks of one training run; default ``$OMNIREDUCE_JOB`` or "default".
        block_size: elements per block; default ``$OMNIREDUCE_BLOCK_SIZE`` or 256.
        timeout: seconds for first contact and for each tensor; default ``$OMNIREDUCE_TIMEOUT`` or 60.
        token: shared secret the aggregators check; default ``$OMNIREDUCE_TOKEN``.
        lanes: most lanes per slot (blocks a slot aggregates per round); default 32768, capped so that
            a round carries at most 30 MiB of blocks.
        slots: most slots per tensor (independent pipelines; slot s goes to aggregator s mod A);
            default 4, or the number of aggregators if that is larger.
        threshold: treat blocks whose elements all have ``|x| <= threshold`` as zero (lossy); 0 = exact.
    """

    def __init__(self, aggregators: str | list[str] | None = None, rank: int | None = None,
                 world_size: int | None = None, job: str | None = None, block_size: int | None = None,
                 timeout: float | None = None, token: str | None = None, *, lanes: int | None = None,
                 slots: int | None = None, threshold: float = 0.0) -> None:
        if malloc_tune():
            keep_freed_memory()
        self.config = WorkerConfig.resolve(aggregators, rank, world_size, job, block_size, timeout, token,
                                           lanes, slots, threshold)
        self.client = uuid.uuid4().hex[:12]
        self._seq = 0
        self._seq_lock = threading.Lock()
        # the aggregators the caller lets new tensors use, and the number of that agreement
        self._agreed: frozenset[int] = frozenset(range(len(self.config.aggregators)))
        self._generation = 0
        self._closed = False
        self._kernels_ready: set[str] = set()  # devices whose block operations are prepared
        self._io = IOLoop(self.config, self.client)
        self._io.start()
        try:
            _wait(self._io.hello, self.config.timeout + 5.0, "first contact")
        except BaseException:
            self.close()
            raise
        _live.add(self)
        log.debug("rank %d of %d joined job %r at %s", self.config.rank, self.config.world_size,
                  self.config.job, ", ".join(self.config.aggregators))

    @property
    def rank(self) -> int:
        return self.config.rank

    @property
    def world_size(self) -> int:
        return self.config.world_size

    def allreduce_async(self, x: Any, *, average: bool = False, synchronize: bool = True,
                        block_size: int | None = None) -> ReduceFuture:
        """Start summing ``x`` (numpy array or torch tensor) over all ranks, in place.

        Returns a :class:`~omnireduce.worker.op.ReduceFuture` (a ``concurrent.futures.Future``)
        whose result is ``x`` once it holds the sum (divided by the world size if ``average``), and
        whose ``info`` then counts the blocks and bytes of this reduction. ``x`` must not be touched
        until then; it is left unchanged if the future fails. Raises TypeError/ValueError at once for
        an input omnireduce cannot reduce.

        CUDA tensors: the result is written on a side stream, ``future.stream``. With ``synchronize``
        (the default) the future completes once the writes are done, so ``x`` can be read from any
        stream. ``synchronize=False`` is for stream-aware callers (the DDP hook): the future
        completes as soon as the writes are queued, and the caller must make the stream that reads
        ``x`` wait for ``future.stream`` first. On the host path both are the same. The first CUDA
        tensor on a device builds or loads the CUDA kernels for it here, before the tensor's deadline
        starts (about a minute the first time in a build cache); with
        ``OMNIREDUCE_CUDA_KERNELS=require``, a RuntimeError saying why they cannot be built is raised
        here (and for every later CUDA tensor).

        Sparse COO tensors of shape (rows, dim) (embedding gradients, :mod:`omnireduce.sources.sparse`)
        are not reduced in place: the result is a new coalesced COO tensor of the same shape, dtype
        and device, the rows present on some rank and their sums; only the rows present travel, one
        block per row, and nothing of the table's size is allocated or read. A sparse input that
        cannot be reduced still uses its place in the sequence, and the other ranks' reductions of
        it fail at once with the reason.

        ``block_size``: elements per block for this tensor (default: the worker's); every rank must
        use the same for the same tensor. Sparse tensors ignore it (their rows are their blocks).
        """
        if self._closed:
            raise RuntimeError("this omnireduce Worker is closed")
        cfg = self.config
        if block_size is not None and not 1 <= block_size <= MAX_BLOCK_SIZE:
            raise ValueError(f"block_size must be in 1..{MAX_BLOCK_SIZE}, got {block_size}")
        # a sparse tensor: one slot per aggregator (its few rows gain nothing from more pipelines)
        slots = min(cfg.slots, len(cfg.aggregators)) if is_sparse(x) else cfg.slots
        try:
            source = adapt(x, block_size or cfg.block_size, cfg.lanes, slots)
        except (TypeError, ValueError) as e:
            if is_sparse(x):  # the other ranks may be reducing theirs: take its number, tell them why
                self._reject(e)
            raise
        if isinstance(source, DeviceSource):
            self._prepare_kernels(source.device)
        future = ReduceFuture()
        future.set_running_or_notify_cancel()
        with self._seq_lock:
            seq = self._seq
            self._seq += 1
            agreed, generation = self._agreed, self._generation
        op_type = SparseOp if isinstance(source, SparseSource) else TensorOp
        op = op_type(seq, x, source, rank=cfg.rank, world_size=cfg.world_size,
                     num_aggregators=len(cfg.aggregators), average=average, threshold=cfg.threshold,
                     future=future, synchronize=synchronize)
        op.agreed, op.generation = agreed, generation
        self._io.submit(op)
        return future

    def _reject(self, error: BaseException) -> None:
        """Use the next sequence number for a tensor this rank cannot reduce: the I/O thread aborts
        it at every aggregator with ``error`` as the reason (see :func:`omnireduce.sources.sparse.rejection`)."""
        cfg = self.config
        future = ReduceFuture()
        future.set_running_or_notify_cancel()
        with self._seq_lock:
            seq = self._seq
            self._seq += 1
            agreed, generation = self._agreed, self._generation
        op = TensorOp(seq, None, rejection(error, len(cfg.aggregators)), rank=cfg.rank, world_size=cfg.world_size,
                      num_aggregators=len(cfg.aggregators), average=False, threshold=0.0, future=future)
        op.agreed, op.generation = agreed, generation
        self._io.submit(op)

    # -- lost aggregators (omnireduce.worker.routing) ----------------------------------------------

    def reachable(self) -> list[bool]:
        """Per aggregator (in ``config.aggregators`` order), whether this rank reaches it: False for one
        whose connection has been down for ``lost_after`` seconds (``$OMNIREDUCE_LOST_AFTER``) and
        has not come back. The input of the ranks' agreement for :meth:`use_aggregators`."""
        return self._io.reachable()

    def use_aggregators(self, indices: Any) -> None:
        """Let the tensors submitted from now on use only these aggregators (indices into
        ``config.aggregators``). Every rank must call it with the same set before the same tensor,
        e.g. the set every rank reaches (:meth:`reachable`, MIN over the ranks); the DDP hook does so
        once per iteration. The worker routes around an aggregator it finds lost by itself; this is
        how a lost one is taken back once every rank reaches it again."""
        agreed = frozenset(int(i) for i in indices)
        if not agreed <= set(range(len(self.config.aggregators))):
            raise ValueError(f"aggregator indices must be in 0..{len(self.config.aggregators) - 1}, "
                             f"got {sorted(agreed)}")
        with self._seq_lock:
            if agreed != self._agreed:
                self._agreed, self._generation = agreed, self._generation + 1
                log.info("rank %d: tensors from %d on use aggregator(s) %s", self.config.rank, self._seq,
                         ", ".join(self.config.aggregators[i] for i in sorted(agreed)) or "none")

    def finished_below(self) -> int:
        """A sequence number: every tensor this worker was handed before the one it numbers has finished
        here (its future completed or failed). Tensors are numbered in the order they are handed over,
        from 0, the same on every rank of the job. The input of the ranks' agreement for
        :meth:`release_kept` (MIN over the ranks)."""
        return self._io.finished_below()

    def release_kept(self, below: int) -> None:
        """Every rank of the job has finished the tensors numbered below ``below`` (e.g. the MIN of
        :meth:`finished_below` over the ranks): the sums this worker keeps of them for replays after an
        aggregator restart are not needed again, and those it holds in arrays of its own (copied out of
        the buffers they arrived in, as far as the blocks it sent took buffers of their own) go now.
        The others, and every kept sum without this call, go when an aggregator next reports the
        job's progress (with the next tensor's results, which then take their memory again in the
        heap they lie in: let go earlier, a large tensor's would leave that heap to the training's
        temporaries and the next results to fresh memory), or after twice the timeout. The DDP hook
        calls it once per iteration."""
        self._io.release_kept(int(below))

    def aggregators_in_use(self) -> list[str]:
        """The addresses a tensor submitted now would use: those agreed on, less those found lost."""
        with self._seq_lock:
            agreed, generation = self._agreed, self._generation
        return [self.config.aggregators[i] for i in self._io.in_use(agreed, generation)]

    def _prepare_kernels(self, device: Any) -> None:
        """Build or load the block operations' kernels for ``device`` on this (the caller's) thread,
        once per device; raises what :func:`omnireduce.cuda.build.prepare` raises."""
        if str(device) in self._kernels_ready:
            return
        from omnireduce.cuda import build

        backend = build.prepare(device)
        self._kernels_ready.add(str(device))
        log.debug("block operations on %s: %s", device, backend)

    def allreduce(self, x: Any, *, average: bool = False) -> Any:
        """Sum ``x`` over all ranks in place and return it (a sparse COO ``x``: return the sum as a new
        tensor; see :meth:`allreduce_async`)."""
        return _wait(self.allreduce_async(x, average=average), self.config.timeout + 30.0, "a tensor")

    def stats(self) -> dict[str, int]:
        """Counters since construction.

        bytes_sent / bytes_received: every byte of every message (headers included);
        messages_sent / messages_received; tensors / tensors_failed; blocks_total: blocks of all
        reduced tensors; blocks_nonzero: those non-zero on this rank; blocks_sent: blocks this rank
        sent; blocks_received: summed blocks it received; dense_bytes: the bytes of the tensors
        themselves (what each rank would send at least once in a dense all-reduce); retries: tensors
        started again because an aggregator restarted; aggregators_lost: times this rank found an
        aggregator lost and routed around it; slots_rerouted: slots it moved to another aggregator
        then; aggregators_in_use: how many aggregators a tensor submitted now would use.
        """
        keys = ("bytes_sent", "bytes_received", "messages_sent", "messages_received", "tensors",
                "tensors_failed", "blocks_total", "blocks_nonzero", "blocks_sent", "blocks_received",
                "dense_bytes", "retries", "aggregators_lost", "slots_rerouted")
        snap = self._io.snapshot()
        out = {k: int(snap.get(k, 0)) for k in keys}
        out["aggregators_in_use"] = len(self.aggregators_in_use())
        return out

    def close(self) -> None:
        """Leave the job (GOODBYE to every aggregator) and stop the I/O thread. Idempotent.

        Returns once the I/O thread has ended (it lingers at most a second for its GOODBYEs to leave),
        so that none of its threads is left running when the interpreter shuts down."""
        if self._closed:
            return
        self._closed = True
        self._io.submit("close")
        self._io.join(_CLOSE_SECONDS)
        if self._io.alive:
            log.warning("omnireduce: the I/O thread of rank %d did not end within %g s of close()",
                        self.config.rank, _CLOSE_SECONDS)
        _live.discard(self)

    def __enter__(self) -> Worker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _wait(future: concurrent.futures.Future, timeout: float, what: str) -> Any:
    """The future's result; a safety net (the I/O thread enforces the real deadlines) in case it never
    completes. (OmniReduceTimeout is a TimeoutError, so it must not be caught around ``result()``.)"""
    done, _ = concurrent.futures.wait([future], timeout)
    if not done:
        raise OmniReduceTimeout(f"the omnireduce I/O thread did not finish {what} within {timeout:g} s")
    return future.result()


def _close_all() -> None:
    for w in list(_live):
        w.close()


at_exit(LEAVE, _close_all)  # (every worker still open says goodbye before the job's aggregators stop)
