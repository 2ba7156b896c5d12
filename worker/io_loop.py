"""The worker's background I/O thread: owns the sockets and drives every tensor in flight.

One DEALER socket per aggregator, plus an inproc PULL socket through which caller threads wake the
loop when they submit a tensor, and one zmq monitor socket per aggregator connection. The loop
alone touches the sockets and the tensor states, so nothing is locked but the submission queue and
the statistics.

Per tensor in flight the loop keeps two things: the tensor's protocol state
(:class:`~omnireduce.worker.op.TensorOp`, which decides every message about the tensor) and a
:class:`Flight`, the loop's own record of it: when it started, its deadline, the STATUS replies to
a QUERY, how often it was retried and the bytes it moved. Only the loop writes a Flight.

Deadlines. First contact (HELLO -> WELCOME from every aggregator) and every tensor have a deadline
of ``timeout`` seconds. When a tensor's deadline passes, the loop asks the aggregators of its
unfinished slots what they are waiting for (QUERY -> STATUS) and, after a short grace period, fails
the tensor with :class:`OmniReduceTimeout` naming the aggregator, job, tensor, slot, round and the
ranks that had not contributed (or that the aggregator did not answer). It then sends ABORT so the
aggregators free the tensor and the other ranks fail at once instead of at their own deadline.

Aggregator restarts. When the connection to an aggregator drops and comes back, or it answers that
it does not know this job, the loop says HELLO again. If the WELCOME comes from a new aggregator
instance (or the old one had said it lost the job), every tensor with slots there is recovered: a
slot this rank has not finished starts over from its bootstrap (the input is untouched until the
whole tensor is done); a slot it has finished is sent as FINAL (its summed blocks), which the
aggregator replays to ranks that lost them. Finished tensors keep their sums (the received buffers,
no copy) until every rank of the job has finished them (the *watermark* the aggregators report),
so that a rank whose last result was lost with the aggregator can still be given it, or for at most
twice the timeout (a rank that still needs the sums had sent its bootstrap before this rank could
finish, so its own deadline has passed by then; the watermark only moves when tensors follow, and a
job whose buckets all went to the dense all-reduce sends none). Each tensor is
retried at most ``MAX_RETRIES`` times, each retry is logged, and its deadline restarts with each
retry; past the bound it fails as a timeout.

Lost aggregators. A connection that stays down for ``lost_after`` seconds (the aggregator's process
died and nothing listens there, or, through zmq heartbeats, its host went silent) makes this rank
route around that aggregator (:mod:`omnireduce.worker.routing`), provided another one is reachable:
the slots it served, of the tensors in flight and of the finished ones kept for replays, go to the
next usable aggregator, where they start over or are replayed exactly as after a restart; new
tensors go there from the start. Every rank finds a dead aggregator lost and moves the same slots to
the same place. Taking an aggregator back is a decision all ranks must take for the same tensor, so
the worker never takes one back by itself: its caller agrees on the set (the DDP hook does, once per
iteration, through the process group) and hands it over with ``use_aggregators``.

Device tensors. The loop never waits for a device. A tensor on a device (a
:class:`~omnireduce.worker.sources.DeviceSource`) is *prepared* (its non-zero blocks compacted and
copied to the host, which blocks on the device) on that device's own thread; meanwhile the loop
keeps serving the other tensors, and the tensor's deadline runs (a stuck device fails it as a
timeout). The device thread hands the prepared tensor back through the command queue, which wakes
the loop. A CUDA result that must be complete on the device before its future completes
(``synchronize=True``) is held as an event that the loop polls between socket events (every
millisecond while there is one), under its own deadline.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import itertools
import logging
import threading
import time
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from omnireduce.config import WorkerConfig
from omnireduce.errors import (
    OmniReduceError,
    OmniReduceMismatchError,
    OmniReduceRefused,
    OmniReduceTimeout,
    WireError,
)
from omnireduce.transport import recv_frames, send_frames
from omnireduce.wire import (
    HEADER,
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
    decode,
    frame_bytes,
    unpack_header,
)
from omnireduce.worker.op import TensorOp
from omnireduce.worker.routing import route, usable_for

log = logging.getLogger("omnireduce.worker")

MAX_RETRIES = 5

_ERROR_TYPES: dict[ErrorCode, type[OmniReduceError]] = {
    ErrorCode.MISMATCH: OmniReduceMismatchError,
    ErrorCode.REFUSED: OmniReduceRefused,
    ErrorCode.REPLACED: OmniReduceRefused,
    ErrorCode.TIMEOUT: OmniReduceTimeout,
}
_wake_ids = itertools.count()
_MONITOR_EVENTS = zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED


@dataclasses.dataclass
class _Prepared:
    """From a device's thread: ``flight``'s tensor is prepared (``error``: or failed to be)."""

    flight: Flight
    error: BaseException | None


@dataclasses.dataclass
class _Settling:
    """A finished CUDA tensor whose future waits for its writes to run on the device."""

    op: TensorOp
    completion: Any  # omnireduce.worker.sources.Completion
    deadline: float


@dataclasses.dataclass
class Flight:
    """The I/O thread's record of one tensor in flight (its protocol state is ``op``)."""

    op: TensorOp
    started: float  # time.monotonic() when the tensor was submitted
    deadline: float  # when to ask the aggregators what the tensor waits for (QUERY)
    query_deadline: float | None = None  # QUERY sent: when to give up waiting for STATUS
    status: dict[int, dict[str, Any]] = dataclasses.field(default_factory=dict)  # aggregator -> STATUS
    retries: int = 0  # times an aggregator restart started (some of) the tensor again
    bytes_sent: int = 0  # every byte of this tensor's messages, headers included
    bytes_received: int = 0

    def rearm(self, deadline: float) -> None:
        """A new deadline (after a retry): any QUERY in progress is forgotten."""
        self.deadline, self.query_deadline, self.status = deadline, None, {}

    @property
    def wakeup(self) -> float:
        """When the loop must look at this tensor again."""
        return self.query_deadline or self.deadline


class _Link:
    """What the loop knows about its connection to one aggregator."""

    def __init__(self, address: str, sock: zmq.Socket, monitor: zmq.Socket) -> None:
        self.address, self.sock, self.monitor = address, sock, monitor
        self.handle: int | None = None  # job handle; None until WELCOME
        self.instance: str | None = None  # the aggregator process that gave the handle
        self.dropped = False  # the connection went down since the last WELCOME
        self.hello_pending = True
        self.lost_job = False  # it answered UNKNOWN_JOB: whatever instance it is, our slots there are gone
        self.down_since: float | None = None  # when the connection went down (None: up, or never joined)


class IOLoop:
    """The I/O thread of one :class:`~omnireduce.worker.Worker`."""

    def __init__(self, cfg: WorkerConfig, client: str) -> None:
        self.cfg = cfg
        self.client = client
        self.hello: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._ctx = zmq.Context()
        self._links: list[_Link] = []
        for i, address in enumerate(cfg.aggregators):
            sock = self._ctx.socket(zmq.DEALER)
            # heartbeats: a connection silent for lost_after seconds (a dead host sends no reset) is
            # dropped, so that the aggregator is found lost like one whose process died
            for opt, value in ((zmq.SNDHWM, 0), (zmq.RCVHWM, 0), (zmq.LINGER, 1000), (zmq.RECONNECT_IVL, 100),
                               (zmq.RECONNECT_IVL_MAX, 1000), (zmq.HEARTBEAT_IVL, 1000),
                               (zmq.HEARTBEAT_TIMEOUT, max(2000, int(cfg.lost_seconds * 1000)))):
                sock.setsockopt(opt, value)
            if cfg.socket_buffer > 0:
                sock.setsockopt(zmq.SNDBUF, cfg.socket_buffer)
                sock.setsockopt(zmq.RCVBUF, cfg.socket_buffer)
            # A stable identity per connection: after a network blip the aggregator (ROUTER_HANDOVER)
            # keeps this rank's registration, so messages queued during the blip are accepted.
            sock.setsockopt(zmq.ROUTING_ID, f"omnireduce-{client}-{i}".encode())
            _apply_curve(sock, cfg)
            monitor = sock.get_monitor_socket(_MONITOR_EVENTS, addr=f"inproc://omnireduce-mon-{id(self)}-{i}")
            sock.connect(address)
            self._links.append(_Link(address, sock, monitor))
        wake = f"inproc://omnireduce-wake-{next(_wake_ids)}"
        self._wake_recv = self._ctx.socket(zmq.PULL)
        self._wake_recv.bind(wake)
        self._wake_send = self._ctx.socket(zmq.PUSH)
        self._wake_send.connect(wake)
        self._wake_lock = threading.Lock()
        self._commands: collections.deque[Flight | _Prepared | str] = collections.deque()
        self._flights: dict[int, Flight] = {}  # seq -> tensor in flight
        self._preparing: dict[int, Flight] = {}  # seq -> tensor being prepared on its device's thread
        self._settling: list[_Settling] = []
        self._retained: collections.OrderedDict[int, TensorOp] = collections.OrderedDict()
        self._retained_until: dict[int, float] = {}  # seq -> when its sums are dropped in any case
        self._retained_bytes = 0
        self._done_below = 0  # every tensor with a smaller seq has finished (or failed) here
        self._done_above: set[int] = set()
        self._hello_deadline = time.monotonic() + cfg.timeout
        self._fatal: BaseException | None = None  # the job refused this worker: fail every new tensor
        self._lost: dict[int, int] = {}  # aggregator found lost -> the newest agreement number then
        self._generation = 0  # the newest agreement of a tensor launched here: its number and set
        self._agreed: frozenset[int] = frozenset(range(len(self._links)))
        self._closed = False  # the loop has ended; the sockets are gone
        self._stats_lock = threading.Lock()
        self.stats: collections.Counter[str] = collections.Counter()
        self._thread = threading.Thread(target=self._run, name=f"omnireduce-io-r{cfg.rank}", daemon=True)

    # -- called from user threads ----------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def submit(self, item: TensorOp | str) -> None:
        """Hand a tensor (or the string "close") to the loop; a tensor's deadline starts now."""
        with self._wake_lock:
            if self._closed or (self._fatal is not None and isinstance(item, TensorOp)):
                if isinstance(item, TensorOp):
                    item.fail(self._fatal or OmniReduceError("the worker is closed"))
                return
            if isinstance(item, TensorOp):
                now = time.monotonic()
                self._enqueue(Flight(item, started=now, deadline=now + self.cfg.timeout))
            else:
                self._enqueue(item)

    def _enqueue(self, item: Flight | _Prepared | str) -> None:
        """Queue a command (the wake lock held); wake the loop unless a wake is already due: the loop
        takes every queued command once woken, so one wake per empty-to-non-empty change is enough."""
        if not self._commands:
            self._wake_send.send(b"", copy=True)
        self._commands.append(item)

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def reachable(self) -> list[bool]:
        """Per aggregator, whether this rank reaches it: False only for one unreachable for
        ``lost_after`` seconds and not joined again since. (Read from any thread.)"""
        now, limit = time.monotonic(), self.cfg.lost_seconds
        return [not (lk.dropped and lk.down_since is not None and now - lk.down_since >= limit)
                for lk in self._links]

    def in_use(self, agreed: frozenset[int], generation: int) -> list[int]:
        """The aggregators a tensor submitted now under ``agreed`` (agreement ``generation``) would
        use, as far as this thread knows now (read from any thread)."""
        return sorted(usable_for(agreed, generation, dict(self._lost)))

    def snapshot(self) -> dict[str, int]:
        with self._stats_lock:
            return dict(self.stats)

    def _count(self, **increments: int) -> None:
        stats = self.stats
        with self._stats_lock:
            for name, n in increments.items():  # (Counter.update is several times slower, per message)
                stats[name] += n

    # -- the loop ------------------------------------------------------------------------------

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._wake_recv, zmq.POLLIN)
        for link in self._links:
            poller.register(link.sock, zmq.POLLIN)
            poller.register(link.monitor, zmq.POLLIN)
        error: BaseException | None = None
        try:
            for i in range(len(self._links)):
                self._say_hello(i)
            while True:
                events = dict(poller.poll(self._poll_ms()))
                if self._wake_recv in events and self._drain_commands():
                    break
                for i, link in enumerate(self._links):
                    if link.monitor in events:
                        self._drain_monitor(i)
                    if link.sock in events:
                        self._drain_socket(i)
                now = time.monotonic()
                self._check_settling(now)
                self._check_deadlines(now)
                self._check_links(now)
        except BaseException as e:  # never leave a future pending because the loop died
            log.exception("omnireduce I/O thread failed")
            error = e
        finally:
            self._shutdown(error)

    def _poll_ms(self) -> int:
        if self._settling:
            return 1  # poll the device's events
        now = time.monotonic()
        soonest = now + 0.2
        if not self.hello.done():
            soonest = min(soonest, self._hello_deadline)
        for flight in self._flights.values():
            soonest = min(soonest, flight.wakeup)
        for flight in self._preparing.values():
            soonest = min(soonest, flight.deadline)
        for i, link in enumerate(self._links):  # when a dropped connection makes its aggregator lost
            if link.dropped and link.down_since is not None and self._may_lose(i):
                due = link.down_since + self.cfg.lost_seconds
                if due > now:  # (past due and still not lost: no other aggregator to go to)
                    soonest = min(soonest, due)
        return max(0, int((soonest - now) * 1000) + 1)

    def _drain_commands(self) -> bool:
        """Start submitted tensors; True if the loop should stop."""
        while True:
            try:
                self._wake_recv.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
        while True:
            with self._wake_lock:
                if not self._commands:
                    return False
                item = self._commands.popleft()
            if isinstance(item, str):
                return True
            if isinstance(item, _Prepared):
                self._on_prepared(item)
            else:
                self._start(item)

    def _start(self, flight: Flight) -> None:
        op = flight.op
        defer = getattr(op.source, "defer", None)
        if defer is not None:  # a device tensor: prepared on its device's thread
            self._preparing[op.seq] = flight
            defer(op.prepare, lambda error: self._post(_Prepared(flight, error)))
            return
        try:
            op.prepare()
        except Exception as e:  # (bad input found here, e.g. a sparse row id out of range): the
            self._fail(op, e, abort=True)  # aggregators abort the tensor, so the other ranks fail at once
            return
        self._launch(flight)

    def _post(self, item: _Prepared) -> None:
        """(From a device's thread.) Hand ``item`` to the loop and wake it; dropped once the loop
        has ended (it failed every tensor being prepared then)."""
        with self._wake_lock:
            if self._closed:
                return
            self._enqueue(item)

    def _on_prepared(self, item: _Prepared) -> None:
        flight = item.flight
        op = flight.op
        if self._preparing.pop(op.seq, None) is None:
            return  # failed meanwhile (its deadline passed)
        if item.error is not None:
            e = item.error
            err = e if isinstance(e, OmniReduceError) else OmniReduceError(
                f"tensor {op.seq}: finding its non-zero blocks on {getattr(op.source, 'device', 'the device')} "
                f"failed: {type(e).__name__}: {e}")
            self._fail(op, err, abort=True)
            return
        self._launch(flight)

    def _launch(self, flight: Flight) -> None:
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
        self._count(blocks_total=op.layout.num_blocks, blocks_nonzero=op.blocks_nonzero,
                    dense_bytes=op.layout.numel * op.dtype.itemsize)
        for agg, msg in op.bootstraps():
            flight.bytes_sent += self._send(agg, msg)

    def _drain_socket(self, i: int) -> None:
        sock = self._links[i].sock
        while True:
            frames = recv_frames(sock)
            if frames is None:
                return
            self._count(messages_received=1, bytes_received=frame_bytes(frames))
            try:
                hdr = unpack_header(frames[0].buffer)
            except WireError as e:
                log.warning("dropped an undecodable message from %s: %s", self._links[i].address, e)
                continue
            handler = self._HANDLERS.get(hdr.mtype)
            if handler is None:
                log.warning("dropped a %s message from %s", hdr.mtype.name, self._links[i].address)
                continue
            if hdr.mtype in (MsgType.RESULT, MsgType.REPLAY):  # tensor data: decoded against the tensor
                self._on_tensor_message(i, hdr, frames[1:])
                continue
            try:
                msg = decode(hdr, frames[1:])
            except WireError as e:
                log.warning("dropped a bad %s message from %s: %s", hdr.mtype.name, self._links[i].address, e)
                continue
            handler(self, i, msg)

    def _drain_monitor(self, i: int) -> None:
        link = self._links[i]
        while True:
            try:
                event = recv_monitor_message(link.monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            if event["event"] == zmq.EVENT_DISCONNECTED:
                if not link.dropped:
                    link.down_since = time.monotonic()
                    # A warning only when it stalls a tensor: an idle connection that drops (the job
                    # ending, an aggregator restarted between steps) is redone at once, and a tensor
                    # that meets the loss says so itself (retry, timeout).
                    busy = any(f.op.slots_on(i) for f in (*self._flights.values(), *self._preparing.values()))
                    log.log(logging.WARNING if busy else logging.INFO,
                            "lost the connection to aggregator %s; reconnecting", link.address)
                link.dropped = True
            elif event["event"] == zmq.EVENT_CONNECTED and link.dropped:
                log.info("reconnected to aggregator %s", link.address)
                self._say_hello(i)

    def _say_hello(self, i: int) -> None:
        link = self._links[i]
        link.hello_pending = True
        cfg = self.cfg
        self._send(i, Hello(Header(MsgType.HELLO, rank=cfg.rank), cfg.job, cfg.rank, cfg.world_size, cfg.block_size,
                            cfg.token, self.client, cfg.timeout))

    # -- message handlers ----------------------------------------------------------------------

    def _on_welcome(self, i: int, msg: Welcome) -> None:
        link, hdr, instance = self._links[i], msg.header, msg.instance
        restarted = link.lost_job or (link.instance is not None and instance != link.instance)
        link.handle, link.instance, link.dropped, link.hello_pending = hdr.job, instance, False, False
        link.lost_job, link.down_since = False, None
        if i in self._lost:
            log.info("aggregator %s is reachable again; it is used again once every rank reaches it",
                     link.address)
        if all(lk.handle is not None for lk in self._links) and not self.hello.done():
            self.hello.set_result(None)
        if restarted:
            self._recover(i)

    def _recover(self, i: int) -> None:
        """Aggregator ``i`` is a new instance: start its slots again, or replay finished ones."""
        now = time.monotonic()
        for flight in list(self._flights.values()):
            op = flight.op
            if not op.slots_on(i):
                continue
            flight.retries += 1
            if flight.retries > MAX_RETRIES:
                self._fail(op, OmniReduceTimeout(
                    f"tensor {op.seq} of job {self.cfg.job!r}: aggregator {self._links[i].address} lost it "
                    f"{flight.retries} times; giving up after {MAX_RETRIES} retries"), abort=True)
                continue
            log.warning("aggregator %s restarted: retrying tensor %d of job %r (retry %d of %d)",
                        self._links[i].address, op.seq, self.cfg.job, flight.retries, MAX_RETRIES)
            self._count(retries=1)
            flight.rearm(now + self.cfg.timeout)
            for msg in op.recover(i):
                flight.bytes_sent += self._send(i, msg)
        for op in self._retained.values():
            for msg in op.recover(i):
                self._send(i, msg)

    def _check_links(self, now: float) -> None:
        """Route around every aggregator whose connection has been down for ``lost_after`` seconds,
        as long as another one is reachable (with none, tensors wait for one to come back, or fail
        at their deadline)."""
        limit = self.cfg.lost_seconds
        for i, link in enumerate(self._links):
            if not link.dropped or link.down_since is None or now - link.down_since < limit:
                continue
            if not self._may_lose(i):
                continue  # not in use, or already routed around
            others = [j for j, lk in enumerate(self._links) if j != i and not lk.dropped and self._may_lose(j)]
            if not others:
                continue
            self._lost[i] = self._generation
            self._count(aggregators_lost=1)
            moved = self._reroute(now)
            log.warning("aggregator %s unreachable for %.0f s: routing its slots to the other aggregators "
                        "(%d tensor(s) in flight moved); it is used again once every rank reaches it",
                        link.address, now - link.down_since, moved)

    def _may_lose(self, i: int) -> bool:
        """Whether aggregator ``i`` is in use under the newest agreement (so it can be found lost)."""
        return i in self._agreed and self._lost.get(i, -1) < self._generation

    def _reroute(self, now: float) -> int:
        """Apply the lost set to every tensor in flight or kept for replays; returns how many moved."""
        moved = 0
        ops = [(f.op, f) for f in self._flights.values()] + [(op, None) for op in self._retained.values()]
        for op, flight in ops:
            new = route(op.num_aggregators, usable_for(op.agreed, op.generation, self._lost))
            if new is None or new == op.route:
                continue
            messages = op.reroute(new)
            self._count(slots_rerouted=len(messages))
            if flight is not None:
                moved += 1
                flight.rearm(now + self.cfg.timeout)
            for agg, msg in messages:
                n = self._send(agg, msg)
                if flight is not None:
                    flight.bytes_sent += n
        return moved

    def _on_tensor_message(self, i: int, hdr: Header, frames: list[Any]) -> None:
        """A RESULT or REPLAY: decoded against the tensor in flight it is about, and fed to it."""
        if hdr.mtype is MsgType.RESULT:
            self._release(hdr.watermark)
        flight = self._flights.get(hdr.seq)
        if flight is None:
            log.debug("%s for tensor %d, which is not in flight", hdr.mtype.name, hdr.seq)
            return
        op = flight.op
        try:
            flight.bytes_received += HEADER.size + frame_bytes(frames)
            reply = op.receive(decode(hdr, frames, op.layout, op.dtype))
            if reply is not None:
                flight.bytes_sent += self._send(i, reply)
            self._maybe_finish(flight)
        except Exception as e:
            where = (f"tensor {op.seq} slot {hdr.slot} round {hdr.round} from {self._links[i].address}"
                     if hdr.mtype is MsgType.RESULT
                     else f"tensor {op.seq} slot {hdr.slot}: bad replay from {self._links[i].address}")
            err = e if isinstance(e, OmniReduceError) else OmniReduceError(f"{type(e).__name__}: {e}")
            self._fail(op, type(err)(f"{where}: {err}"), abort=True)

    def _maybe_finish(self, flight: Flight) -> None:
        op = flight.op
        if not op.done:
            return
        del self._flights[op.seq]
        pending = op.finish(bytes_sent=flight.bytes_sent, bytes_received=flight.bytes_received)
        if pending is not None:  # its future completes once the device has run the writes
            self._settling.append(_Settling(op, pending, time.monotonic() + self.cfg.timeout))
        self._mark_done(op.seq)
        self._count(tensors=1, blocks_sent=op.blocks_sent, blocks_received=op.blocks_received)
        if self.cfg.world_size > 1:
            self._retained[op.seq] = op
            self._retained_until[op.seq] = time.monotonic() + 2 * self.cfg.timeout
            self._retained_bytes += op.retained_bytes()
            while self._retained_bytes > self.cfg.retain_bytes and self._retained:
                self._unretain(next(iter(self._retained)))

    def _unretain(self, seq: int) -> None:
        """Drop the sums of finished tensor ``seq``."""
        self._retained_until.pop(seq, None)
        self._retained_bytes -= self._retained.pop(seq).retained_bytes()

    def _mark_done(self, seq: int) -> None:
        self._done_above.add(seq)
        while self._done_below in self._done_above:
            self._done_above.discard(self._done_below)
            self._done_below += 1

    def _release(self, watermark: int) -> None:
        """Every rank has finished the tensors below ``watermark``: their sums are not needed again."""
        for seq in [s for s in self._retained if s < watermark]:  # kept in completion order, not seq order
            self._unretain(seq)

    def _on_error(self, i: int, msg: Error) -> None:
        link, hdr, code = self._links[i], msg.header, msg.code
        text = f"aggregator {link.address}: {msg.message}"
        if code is ErrorCode.UNKNOWN_JOB:
            # The aggregator lost our job (it restarted). Errors about an older handle are stale.
            if link.handle is not None and hdr.job == link.handle and not link.hello_pending:
                log.warning("%s; saying HELLO again", text)
                link.lost_job = True
                self._say_hello(i)
            return
        err = _ERROR_TYPES.get(code, OmniReduceError)(text)
        if not self.hello.done():
            self.hello.set_exception(err)
            return
        if hdr.seq == SEQ_ALL or code in (ErrorCode.REPLACED, ErrorCode.REFUSED):
            # Fatal to this worker's place in the job: refused or replaced, or the ranks disagree
            # about the job itself (a rank of another world size tried to join): every tensor fails.
            if code in (ErrorCode.REPLACED, ErrorCode.REFUSED, ErrorCode.MISMATCH):
                self._fatal = err
            log.debug("%s", text)  # the callers get it through their futures: said once, not twice
            for flight in list(self._flights.values()):
                self._fail(flight.op, err, abort=code is not ErrorCode.REPLACED)
            return
        flight = self._flights.get(hdr.seq)
        if flight is not None:
            self._fail(flight.op, err, abort=code not in (ErrorCode.ABORTED, ErrorCode.MISMATCH, ErrorCode.TIMEOUT))

    def _on_status(self, i: int, msg: Status) -> None:
        flight = self._flights.get(msg.header.seq)
        if flight is None or flight.query_deadline is None:
            return
        flight.status[i] = msg.info
        if all(a in flight.status for a in self._queried(flight.op)):
            self._time_out(flight)

    _HANDLERS = {MsgType.WELCOME: _on_welcome, MsgType.RESULT: _on_tensor_message, MsgType.ERROR: _on_error,
                 MsgType.STATUS: _on_status, MsgType.REPLAY: _on_tensor_message}

    # -- deadlines and failures ----------------------------------------------------------------

    def _queried(self, op: TensorOp) -> set[int]:
        return {op.aggregator_of(s) for s, _ in op.waiting_on()}

    def _check_settling(self, now: float) -> None:
        """Complete the futures of finished CUDA tensors whose writes have run on the device."""
        if not self._settling:
            return
        still = []
        for item in self._settling:
            op = item.op
            try:
                done = item.completion.done()
            except Exception as e:  # a CUDA error: the writes may not have happened
                op.complete(OmniReduceError(f"tensor {op.seq} of job {self.cfg.job!r}: writing the result on "
                                            f"the device failed: {type(e).__name__}: {e}"))
                continue
            if done:
                op.complete()
            elif now >= item.deadline:
                op.complete(OmniReduceTimeout(
                    f"tensor {op.seq} of job {self.cfg.job!r} (rank {op.rank} of {op.world_size}): the device did "
                    f"not run the writes of its result within {self.cfg.timeout:g} s (a stuck kernel?)"))
            else:
                still.append(item)
        self._settling = still

    def _check_deadlines(self, now: float) -> None:
        while self._retained:  # (in completion order: the oldest first)
            seq = next(iter(self._retained))
            if self._retained_until[seq] > now:
                break
            self._unretain(seq)
        for flight in [f for f in self._preparing.values() if now >= f.deadline]:
            op = flight.op
            device = getattr(op.source, "device", "its device")
            self._fail(op, OmniReduceTimeout(
                f"tensor {op.seq} of job {self.cfg.job!r} (rank {op.rank} of {op.world_size}, "
                f"{op.layout.numel} x {op.dtype.name.lower()}) timed out after {now - flight.started:.1f} s "
                f"before it was sent: finding its non-zero blocks on {device} did not finish (is a kernel, or "
                "the stream that produced the tensor, stuck?)"), abort=True)
        if not self.hello.done() and now >= self._hello_deadline:
            missing = [lk.address for lk in self._links if lk.handle is None]
            self.hello.set_exception(OmniReduceTimeout(
                f"no answer from aggregator(s) {', '.join(missing)} within {self.cfg.timeout:g} s "
                f"(job {self.cfg.job!r}, rank {self.cfg.rank}): is omnireduce-agg running there and "
                "reachable from this host?"))
        for flight in list(self._flights.values()):
            if flight.query_deadline is not None:
                if now >= flight.query_deadline:
                    self._time_out(flight)
            elif now >= flight.deadline:
                flight.query_deadline = now + min(1.0, self.cfg.timeout / 2)
                for agg in self._queried(flight.op):
                    self._send(agg, Bare(flight.op.header(MsgType.QUERY)))

    def _time_out(self, flight: Flight) -> None:
        op = flight.op
        parts = []
        for slot, rnd in op.waiting_on():
            agg = op.aggregator_of(slot)
            address = self._links[agg].address
            status = flight.status.get(agg)
            if status is None:
                parts.append(f"slot {slot} round {rnd} at {address}: the aggregator did not answer "
                             "(down or unreachable?)")
                continue
            info = next((x for x in status.get("slots", []) if x.get("slot") == slot), None)
            if info is None:
                parts.append(f"slot {slot} round {rnd} at {address}: the aggregator has no state for it"
                             + (f" (aborted: {status['aborted']})" if "aborted" in status else ""))
            else:
                parts.append(f"slot {slot} round {rnd} at {address}: waiting for ranks {info['missing']} "
                             f"({info['phase']})")
        elapsed = time.monotonic() - flight.started
        self._fail(op, OmniReduceTimeout(
            f"tensor {op.seq} of job {self.cfg.job!r} (rank {op.rank} of {op.world_size}, "
            f"{op.layout.numel} x {op.dtype.name.lower()}) timed out after {elapsed:.1f} s: "
            + "; ".join(parts)), abort=True)

    def _fail(self, op: TensorOp, error: BaseException, *, abort: bool) -> None:
        self._flights.pop(op.seq, None)
        self._preparing.pop(op.seq, None)
        self._mark_done(op.seq)
        self._count(tensors_failed=1)
        if abort:
            abort_msg = Abort(op.header(MsgType.ABORT), str(error)[:1000], isinstance(error, OmniReduceTimeout))
            for agg in {op.aggregator_of(s) for s in range(op.layout.slots)}:
                self._send(agg, abort_msg)
        log.debug("%s", error)  # raised to the caller through its future: said once, not twice
        op.fail(error)

    def _shutdown(self, error: BaseException | None) -> None:
        closed = OmniReduceError("the worker was closed") if error is None else OmniReduceError(
            f"the omnireduce I/O thread failed: {error!r}")
        with self._wake_lock:
            self._fatal = self._fatal or closed
            self._closed = True
            pending = [c for c in self._commands if isinstance(c, Flight)]  # (a _Prepared's is in _preparing)
            self._commands.clear()
        for flight in [*self._flights.values(), *self._preparing.values(), *pending]:
            flight.op.fail(closed)
        for item in self._settling:
            item.op.complete(closed)
        self._flights.clear()
        self._preparing.clear()
        self._settling.clear()
        self._retained.clear()
        self._retained_until.clear()
        if not self.hello.done():
            self.hello.set_exception(closed)
        for i, link in enumerate(self._links):
            if link.handle is not None:
                self._send(i, Bare(Header(MsgType.GOODBYE, rank=self.cfg.rank)))
        for link in self._links:
            link.sock.disable_monitor()
            link.monitor.close(0)
            link.sock.close()
        self._wake_recv.close(0)
        with self._wake_lock:
            self._wake_send.close(0)
        self._ctx.term()

    def _send(self, i: int, msg: Message) -> int:
        """Send to aggregator ``i`` (under this connection's job handle); returns the bytes sent."""
        hdr = msg.header._replace(job=self._links[i].handle or 0)
        if hdr.mtype is MsgType.BOOTSTRAP:
            hdr = hdr._replace(watermark=self._done_below)
        frames = [hdr.pack(), *msg.payload()]
        send_frames(self._links[i].sock, frames)
        n = frame_bytes(frames)
        self._count(messages_sent=1, bytes_sent=n)
        return n


def _apply_curve(sock: zmq.Socket, cfg: WorkerConfig) -> None:
    """Encrypt with zmq CURVE when the aggregators' public key is configured."""
    if not cfg.curve_server_key:
        return
    public, secret = zmq.curve_keypair()  # this connection's own keys: the token authenticates the rank
    sock.curve_serverkey = cfg.curve_server_key.encode()
    sock.curve_publickey = public
    sock.curve_secretkey = secret
