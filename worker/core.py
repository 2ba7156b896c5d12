"""The worker without its sockets: every decision about the aggregators and the tensors in flight.

Design. :class:`WorkerCore` is what the I/O thread (:mod:`omnireduce.worker.io_loop`) does
between a socket event and the messages it sends, with no socket and no clock, in the manner of
the aggregator's core: its inputs are a message from aggregator ``i`` (:meth:`~WorkerCore.receive`:
its header, and its body, which the loop decodes when the core asks: a RESULT's against its tensor's
layout), a connection that went down or came up (:meth:`~WorkerCore.disconnected`,
:meth:`~WorkerCore.connected`), a submitted tensor (:meth:`~WorkerCore.start`, or
:meth:`~WorkerCore.preparing` and :meth:`~WorkerCore.prepared` when its device prepares it) and the
clock (:meth:`~WorkerCore.tick`). Every call that needs the time is given it (``now``:
``time.monotonic()`` in the loop, anything in tests). Messages leave through ``send(aggregator,
message)``, which returns the bytes sent (the loop encodes and sends them; tests queue them); the
core fills in the connection's job handle and, in a BOOTSTRAP, this rank's watermark. Futures are
completed or failed here. One thread calls the core; :meth:`~WorkerCore.reachable`,
:meth:`~WorkerCore.in_use`, :meth:`~WorkerCore.snapshot` and :meth:`~WorkerCore.flight` (which
only makes a record) may be called from any thread.

Per tensor in flight the core keeps two things: the tensor's protocol state
(:class:`~omnireduce.worker.op.TensorOp`, which decides every message about the tensor) and a
:class:`Flight`, the core's own record of it: when it started, its deadline, the STATUS replies to
a QUERY, how often it was retried and the bytes it moved.

Deadlines. First contact (HELLO -> WELCOME from every aggregator) and every tensor have a deadline
of ``timeout`` seconds. When a tensor's deadline passes, the core asks the aggregators of its
unfinished slots what they are waiting for (QUERY -> STATUS) and, after a short grace period, fails
the tensor with :class:`OmniReduceTimeout` naming the aggregator, job, tensor, slot, round and the
ranks that had not contributed (or that the aggregator did not answer). It then sends ABORT so the
aggregators free the tensor and the other ranks fail at once instead of at their own deadline.

Aggregator restarts. When the connection to an aggregator drops and comes back, or it answers that
it does not know this job, the core says HELLO again. If the WELCOME comes from a new aggregator
instance (or the old one had said it lost the job), every tensor with slots there is recovered: a
slot this rank has not finished starts over from its bootstrap (the input is untouched until the
whole tensor is done); a slot it has finished is sent as FINAL (its summed blocks), which the
aggregator replays to ranks that lost them: finished tensors keep their sums for that
(:mod:`omnireduce.worker.retention`: until the watermark passes them or the caller says every
rank has finished them, for at most twice the timeout, within ``retain_bytes``; not at all in a job
of one rank). Each tensor is retried at most
``MAX_RETRIES`` times, each retry is logged, and its deadline restarts with each retry; past the
bound it fails as a timeout. Each BOOTSTRAP carries this rank's own watermark (every tensor below
it has finished or failed here), from which the aggregators compute the job's.

Lost aggregators. A connection that stays down for ``lost_after`` seconds (the aggregator's process
died and nothing listens there, or, through zmq heartbeats, its host went silent) makes this rank
route around that aggregator (:mod:`omnireduce.worker.routing`), provided another one is reachable:
the slots it served, of the tensors in flight and of the finished ones kept for replays, go to the
next usable aggregator, where they start over or are replayed exactly as after a restart; new
tensors go there from the start. Every rank finds a dead aggregator lost and moves the same slots to
the same place. Taking an aggregator back is a decision all ranks must take for the same tensor, so
the worker never takes one back by itself: its caller agrees on the set (the DDP hook does, once per
iteration, through the process group) and hands it over with ``use_aggregators``.

Device tensors. A tensor being prepared on its device's thread is held here (its deadline runs: a
stuck device fails it as a timeout) until the loop hands it back. A CUDA result that must be
complete on the device before its future completes (``synchronize=True``) is held as an event
that :meth:`~WorkerCore.tick` polls; :meth:`~WorkerCore.next_wakeup` says so (poll at once).
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import logging
import threading
from collections.abc import Callable

from omnireduce.config import WorkerConfig
from omnireduce.errors import (
    OmniReduceError,
    OmniReduceTimeout,
    WireError,
)
from omnireduce.wire import (
    SEQ_ALL,
    Abort,
    Bare,
    Error,
    ErrorCode,
    Header,
    Hello,
    Message,
    MsgType,
    Status,
    Welcome,
)
from omnireduce.worker.flight import (
    ERROR_TYPES,
    MAX_RETRIES,
    Body,
    Flight,
    Link,
    Send,
    Settling,
    settle,
    waiting_for,
)
from omnireduce.worker.op import TensorOp
from omnireduce.worker.rerouting import Rerouting
from omnireduce.worker.retention import KeptSums
from omnireduce.worker.routing import route, usable_for

log = logging.getLogger("omnireduce.worker")

class WorkerCore(Rerouting):
    """One worker's protocol with its aggregators (see the module docstring). ``now``: the time of
    construction, from which first contact has ``cfg.timeout`` seconds."""

    def __init__(self, cfg: WorkerConfig, client: str, send: Send, now: float) -> None:
        self.cfg = cfg
        self.client = client
        self.send = send
        self.links = [Link(address) for address in cfg.aggregators]
        self.hello: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._hello_deadline = now + cfg.timeout
        #: the job refused this worker: every new tensor fails with it (the loop sets it on closing)
        self.fatal: BaseException | None = None
        self._flights: dict[int, Flight] = {}  # seq -> tensor in flight
        self._preparing: dict[int, Flight] = {}  # seq -> tensor being prepared on its device's thread
        self._settling: list[Settling] = []
        self.kept = KeptSums(cfg.retain_bytes, 2 * cfg.timeout)  # finished tensors' sums, for replays
        self._done_below = 0  # every tensor with a smaller seq has finished (or failed) here
        self._done_above: set[int] = set()
        self._lost: dict[int, int] = {}  # aggregator found lost -> the newest agreement number then
        self._generation = 0  # the newest agreement of a tensor launched here: its number and set
        self._agreed: frozenset[int] = frozenset(range(len(self.links)))
        self._stats_lock = threading.Lock()
        self.stats: collections.Counter[str] = collections.Counter()

    # -- read from any thread ----------------------------------------------------------------------

    def reachable(self, now: float) -> list[bool]:
        """Per aggregator, whether this rank reaches it: False only for one unreachable for
        ``lost_after`` seconds and not joined again since."""
        limit = self.cfg.lost_seconds
        return [not (lk.dropped and lk.down_since is not None and now - lk.down_since >= limit)
                for lk in self.links]

    @property
    def finished_below(self) -> int:
        """Every tensor with a smaller sequence number has finished (or failed) here (read from any thread)."""
        return self._done_below

    def release_kept(self, below: int) -> None:
        """Every rank has finished the tensors below ``below``: the sums kept of them for replays in
        arrays of their own go (:meth:`omnireduce.Worker.release_kept` says why only those)."""
        self.kept.release(below, owned_only=True)

    def in_use(self, agreed: frozenset[int], generation: int) -> list[int]:
        """The aggregators a tensor submitted now under ``agreed`` (agreement ``generation``) would
        use, as far as the core knows now."""
        return sorted(usable_for(agreed, generation, dict(self._lost)))

    def snapshot(self) -> dict[str, int]:
        with self._stats_lock:
            return dict(self.stats)

    def count(self, **increments: int) -> None:
        stats = self.stats
        with self._stats_lock:
            for name, n in increments.items():  # (Counter.update is several times slower, per message)
                stats[name] += n

    # -- connections -------------------------------------------------------------------------------

    def greet(self) -> None:
        """Say HELLO to every aggregator (once, when the connections are first made)."""
        for i in range(len(self.links)):
            self._say_hello(i)

    def disconnected(self, i: int, now: float) -> None:
        """The connection to aggregator ``i`` went down."""
        link = self.links[i]
        if not link.dropped:
            link.down_since = now
            # A warning only when it stalls a tensor: an idle connection that drops (the job
            # ending, an aggregator restarted between steps) is redone at once, and a tensor
            # that meets the loss says so itself (retry, timeout).
            busy = any(f.op.slots_on(i) for f in (*self._flights.values(), *self._preparing.values()))
            log.log(logging.WARNING if busy else logging.INFO,
                    "lost the connection to aggregator %s; reconnecting", link.address)
        link.dropped = True

    def connected(self, i: int, now: float) -> None:
        """The connection to aggregator ``i`` is up (again): after a drop, say HELLO again."""
        link = self.links[i]
        if link.dropped:
            log.info("reconnected to aggregator %s", link.address)
            self._say_hello(i)

    def _say_hello(self, i: int) -> None:
        link = self.links[i]
        link.hello_pending = True
        cfg = self.cfg
        self._send(i, Hello(Header(MsgType.HELLO, rank=cfg.rank), cfg.job, cfg.rank, cfg.world_size, cfg.block_size,
                            cfg.token, self.client, cfg.timeout))

    # -- tensors -------------------------------------------------------------------------------------

    def flight(self, op: TensorOp, now: float) -> Flight:
        """The record of ``op``, submitted at ``now``: its deadline starts then."""
        return Flight(op, started=now, deadline=now + self.cfg.timeout)

    def start(self, flight: Flight, now: float) -> None:
        """Find the tensor's non-zero blocks here, then launch it."""
        try:
            flight.op.prepare()
        except Exception as e:  # (bad input found here, e.g. a sparse row id out of range): the
            self._fail(flight.op, e, abort=True)  # aggregators abort the tensor, so the other ranks fail at once
            return
        self._launch(flight, now)

    def preparing(self, flight: Flight) -> None:
        """The tensor is being prepared elsewhere (its device's thread); :meth:`prepared` follows,
        unless its deadline passes first."""
        self._preparing[flight.op.seq] = flight

    def prepared(self, flight: Flight, error: BaseException | None, now: float) -> None:
        """The tensor's preparation ended (``error``: it failed): launch it."""
        op = flight.op
        if self._preparing.pop(op.seq, None) is None:
            return  # failed meanwhile (its deadline passed)
        if error is not None:
            err = error if isinstance(error, OmniReduceError) else OmniReduceError(
                f"tensor {op.seq}: finding its non-zero blocks on {op.source.device} "
                f"failed: {type(error).__name__}: {error}")
            self._fail(op, err, abort=True)
            return
        self._launch(flight, now)

    def _launch(self, flight: Flight, now: float) -> None:
        """The tensor is prepared: route its slots and send every slot's bootstrap."""
        op = flight.op
        if op.generation > self._generation:
            self._generation, self._agreed = op.generation, op.agreed
        slots_route = route(op.num_aggregators, usable_for(op.agreed, op.generation, self._lost))
        if slots_route is None:
            self._fail(op, OmniReduceError(
                f"tensor {op.seq} of job {self.cfg.job!r}: no aggregator may be used (agreed: "
                f"{sorted(op.agreed) or 'none'}; found lost here: {sorted(self._lost) or 'none'})"), abort=False)
            return
        op.route = slots_route
        self._flights[op.seq] = flight
        self.count(blocks_total=op.layout.num_blocks, blocks_nonzero=op.blocks_nonzero,
                   dense_bytes=op.layout.numel * op.dtype.itemsize)
        for agg, msg in op.bootstraps():
            flight.bytes_sent += self._send(agg, msg)

    # -- messages ------------------------------------------------------------------------------------

    def receive(self, i: int, hdr: Header, body: Body, nbytes: int, now: float) -> None:
        """One message from aggregator ``i``: its header, its ``body`` (see :data:`Body`) and its
        size in bytes, header included."""
        handler = self._HANDLERS.get(hdr.mtype)
        if handler is None:
            log.warning("dropped a %s message from %s", hdr.mtype.name, self.links[i].address)
            return
        if hdr.mtype in (MsgType.RESULT, MsgType.REPLAY):  # tensor data: decoded against the tensor
            self._on_tensor_message(i, hdr, body, nbytes, now)
            return
        try:
            msg = body(None, None)
        except WireError as e:
            log.warning("dropped a bad %s message from %s: %s", hdr.mtype.name, self.links[i].address, e)
            return
        handler(self, i, msg, now)

    def _on_welcome(self, i: int, msg: Welcome, now: float) -> None:
        link, hdr, instance = self.links[i], msg.header, msg.instance
        restarted = link.lost_job or (link.instance is not None and instance != link.instance)
        link.handle, link.instance, link.dropped, link.hello_pending = hdr.job, instance, False, False
        link.lost_job, link.down_since = False, None
        if i in self._lost:
            log.info("aggregator %s is reachable again; it is used again once every rank reaches it",
                     link.address)
        if all(lk.handle is not None for lk in self.links) and not self.hello.done():
            self.hello.set_result(None)
        if restarted:
            self._recover(i, now)

    def _recover(self, i: int, now: float) -> None:
        """Aggregator ``i`` is a new instance: start its slots again, or replay finished ones."""
        for flight in list(self._flights.values()):
            op = flight.op
            if not op.slots_on(i):
                continue
            flight.retries += 1
            if flight.retries > MAX_RETRIES:
                self._fail(op, OmniReduceTimeout(
                    f"tensor {op.seq} of job {self.cfg.job!r}: aggregator {self.links[i].address} lost it "
                    f"{flight.retries} times; giving up after {MAX_RETRIES} retries"), abort=True)
                continue
            log.warning("aggregator %s restarted: retrying tensor %d of job %r (retry %d of %d)",
                        self.links[i].address, op.seq, self.cfg.job, flight.retries, MAX_RETRIES)
            self.count(retries=1)
            flight.rearm(now + self.cfg.timeout)
            for msg in op.recover(i):
                flight.bytes_sent += self._send(i, msg)
        for op in self.kept.tensors.values():
            for msg in op.recover(i):
                self._send(i, msg)

    def _on_tensor_message(self, i: int, hdr: Header, body: Body, nbytes: int, now: float) -> None:
        """A RESULT or REPLAY: decoded against the tensor in flight it is about, and fed to it."""
        if hdr.mtype is MsgType.RESULT:
            self.kept.release(hdr.watermark)
        flight = self._flights.get(hdr.seq)
        if flight is None:
            log.debug("%s for tensor %d, which is not in flight", hdr.mtype.name, hdr.seq)
            return
        op = flight.op
        try:
            flight.bytes_received += nbytes
            reply = op.receive(body(op.layout, op.dtype))  # type: ignore[arg-type]
            if reply is not None:
                flight.bytes_sent += self._send(i, reply)
            self._maybe_finish(flight, now)
        except Exception as e:
            where = (f"tensor {op.seq} slot {hdr.slot} round {hdr.round} from {self.links[i].address}"
                     if hdr.mtype is MsgType.RESULT
                     else f"tensor {op.seq} slot {hdr.slot}: bad replay from {self.links[i].address}")
            err = e if isinstance(e, OmniReduceError) else OmniReduceError(f"{type(e).__name__}: {e}")
            self._fail(op, type(err)(f"{where}: {err}"), abort=True)

    def _on_error(self, i: int, msg: Error, now: float) -> None:
        link, hdr, code = self.links[i], msg.header, msg.code
        text = f"aggregator {link.address}: {msg.message}"
        if code is ErrorCode.UNKNOWN_JOB:
            # The aggregator lost our job (it restarted). Errors about an older handle are stale.
            if link.handle is not None and hdr.job == link.handle and not link.hello_pending:
                log.warning("%s; saying HELLO again", text)
                link.lost_job = True
                self._say_hello(i)
            return
        err = ERROR_TYPES.get(code, OmniReduceError)(text)
        if msg.cause is not None:  # an ABORTED about a tensor aborted earlier: why it was
            err.cause = msg.cause.name
        if not self.hello.done():
            self.hello.set_exception(err)
            return
        if hdr.seq == SEQ_ALL or code in (ErrorCode.REPLACED, ErrorCode.REFUSED):
            # Fatal to this worker's place in the job: refused or replaced, or the ranks disagree
            # about the job itself (a rank of another world size tried to join): every tensor fails.
            if code in (ErrorCode.REPLACED, ErrorCode.REFUSED, ErrorCode.MISMATCH):
                self.fatal = err
            log.debug("%s", text)  # the callers get it through their futures: said once, not twice
            for each in list(self._flights.values()):
                self._fail(each.op, err, abort=code is not ErrorCode.REPLACED)
            return
        flight = self._flights.get(hdr.seq)
        if flight is not None:
            self._fail(flight.op, err, abort=code not in (ErrorCode.ABORTED, ErrorCode.MISMATCH, ErrorCode.TIMEOUT))

    def _on_status(self, i: int, msg: Status, now: float) -> None:
        flight = self._flights.get(msg.header.seq)
        if flight is None or flight.query_deadline is None:
            return
        flight.status[i] = msg.info
        if all(a in flight.status for a in self._queried(flight.op)):
            self._time_out(flight, now)

    _HANDLERS: dict[MsgType, Callable[..., None]] = {
        MsgType.WELCOME: _on_welcome, MsgType.RESULT: _on_tensor_message, MsgType.ERROR: _on_error,
        MsgType.STATUS: _on_status, MsgType.REPLAY: _on_tensor_message}

    # -- finished tensors --------------------------------------------------------------------------------

    def _maybe_finish(self, flight: Flight, now: float) -> None:
        op = flight.op
        if not op.done:
            return
        del self._flights[op.seq]
        pending = op.finish(bytes_sent=flight.bytes_sent, bytes_received=flight.bytes_received)
        if pending is not None:  # its future completes once the device has run the writes
            self._settling.append(Settling(op, pending, now + self.cfg.timeout))
        self._mark_done(op.seq)
        self.count(tensors=1, blocks_sent=op.blocks_sent, blocks_received=op.blocks_received)
        if self.cfg.world_size > 1:  # (one rank: nobody else could need them)
            if op.retained_bytes() <= self.kept.max_bytes:
                op.own_sums()
            self.kept.keep(op, now)

    def _mark_done(self, seq: int) -> None:
        self._done_above.add(seq)
        while self._done_below in self._done_above:
            self._done_above.discard(self._done_below)
            self._done_below += 1


    # -- the clock -----------------------------------------------------------------------------------

    def next_wakeup(self, now: float) -> float:
        """When :meth:`tick` must run next (at the latest; ``now`` while a device's writes are polled)."""
        if self._settling:
            return now  # poll the device's events
        soonest = now + 0.2
        if not self.hello.done():
            soonest = min(soonest, self._hello_deadline)
        for flight in self._flights.values():
            soonest = min(soonest, flight.wakeup)
        for flight in self._preparing.values():
            soonest = min(soonest, flight.deadline)
        for i, link in enumerate(self.links):  # when a dropped connection makes its aggregator lost
            if link.dropped and link.down_since is not None and self._may_lose(i):
                due = link.down_since + self.cfg.lost_seconds
                if due > now:  # (past due and still not lost: no other aggregator to go to)
                    soonest = min(soonest, due)
        return soonest

    def tick(self, now: float) -> None:
        """Complete settled device writes, act on passed deadlines, route around lost aggregators."""
        self._check_settling(now)
        self._check_deadlines(now)
        self._check_links(now)

    def _check_settling(self, now: float) -> None:
        """Complete the futures of finished CUDA tensors whose writes have run on the device."""
        if self._settling:
            self._settling = settle(self._settling, now, self.cfg.job, self.cfg.timeout)

    def _check_deadlines(self, now: float) -> None:
        self.kept.expire(now)
        for flight in [f for f in self._preparing.values() if now >= f.deadline]:
            op = flight.op
            device = op.source.device
            self._fail(op, OmniReduceTimeout(
                f"tensor {op.seq} of job {self.cfg.job!r} (rank {op.rank} of {op.world_size}, "
                f"{op.layout.numel} x {op.dtype.name.lower()}) timed out after {now - flight.started:.1f} s "
                f"before it was sent: finding its non-zero blocks on {device} did not finish (is a kernel, or "
                "the stream that produced the tensor, stuck?)"), abort=True)
        if not self.hello.done() and now >= self._hello_deadline:
            missing = [lk.address for lk in self.links if lk.handle is None]
            self.hello.set_exception(OmniReduceTimeout(
                f"no answer from aggregator(s) {', '.join(missing)} within {self.cfg.timeout:g} s "
                f"(job {self.cfg.job!r}, rank {self.cfg.rank}): is omnireduce-agg running there and "
                "reachable from this host?"))
        for flight in list(self._flights.values()):
            if flight.query_deadline is not None:
                if now >= flight.query_deadline:
                    self._time_out(flight, now)
            elif now >= flight.deadline:
                flight.query_deadline = now + min(1.0, self.cfg.timeout / 2)
                for agg in self._queried(flight.op):
                    self._send(agg, Bare(flight.op.header(MsgType.QUERY)))

    def _queried(self, op: TensorOp) -> set[int]:
        return {op.aggregator_of(s) for s, _ in op.waiting_on()}

    def _time_out(self, flight: Flight, now: float) -> None:
        op = flight.op
        parts = waiting_for(flight, [lk.address for lk in self.links])
        self._fail(op, OmniReduceTimeout(
            f"tensor {op.seq} of job {self.cfg.job!r} (rank {op.rank} of {op.world_size}, "
            f"{op.layout.numel} x {op.dtype.name.lower()}) timed out after {now - flight.started:.1f} s: "
            + "; ".join(parts)), abort=True)

    # -- failures and the end ------------------------------------------------------------------------

    def _fail(self, op: TensorOp, error: BaseException, *, abort: bool) -> None:
        self._flights.pop(op.seq, None)
        self._preparing.pop(op.seq, None)
        self._mark_done(op.seq)
        self.count(tensors_failed=1)
        if abort:
            abort_msg = Abort(op.header(MsgType.ABORT), str(error)[:1000], isinstance(error, OmniReduceTimeout))
            for agg in {op.aggregator_of(s) for s in range(op.layout.slots)}:
                self._send(agg, abort_msg)
        log.debug("%s", error)  # raised to the caller through its future: said once, not twice
        op.fail(error)

    def close(self, error: BaseException, pending: list[Flight]) -> None:
        """The worker ends: every tensor in flight, being prepared, settling or ``pending`` (queued,
        not started) fails with ``error``, and every aggregator that welcomed this rank is told
        GOODBYE. (Nothing is aborted: the GOODBYE tells the aggregators.)"""
        for flight in [*self._flights.values(), *self._preparing.values(), *pending]:
            flight.op.fail(error)
        for item in self._settling:
            item.op.complete(error)
        self._flights.clear()
        self._preparing.clear()
        self._settling.clear()
        self.kept.clear()
        if not self.hello.done():
            self.hello.set_exception(error)
        for i, link in enumerate(self.links):
            if link.handle is not None:
                self._send(i, Bare(Header(MsgType.GOODBYE, rank=self.cfg.rank)))

    def _send(self, i: int, msg: Message) -> int:
        """Send to aggregator ``i`` (under this connection's job handle); returns the bytes sent."""
        hdr = msg.header._replace(job=self.links[i].handle or 0)
        if hdr.mtype is MsgType.BOOTSTRAP:
            hdr = hdr._replace(watermark=self._done_below)
        n = self.send(i, dataclasses.replace(msg, header=hdr))
        self.count(messages_sent=1, bytes_sent=n)
        return n
