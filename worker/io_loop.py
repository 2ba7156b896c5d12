"""The worker's background I/O thread: the sockets, the wake-ups and the clock around the worker core.

Design. :class:`IOLoop` is thin, like the aggregator's service around its core: everything the
protocol decides (handshake, deadlines, retries, recovery after restarts, lost aggregators, kept
sums, statistics) is the :class:`~omnireduce.worker.core.WorkerCore`'s; the loop turns socket
events into calls of the core, with the time, and sends what the core sends (its ``send`` is
:meth:`IOLoop._send`: encode, send the frames, return the bytes).

Sockets. One DEALER socket per aggregator (zmq heartbeats, so that a silent host's connection
drops, and a stable routing id per connection, so that a blip keeps this rank's registration), plus
one zmq monitor socket per connection, whose CONNECTED / DISCONNECTED events become the core's
:meth:`~omnireduce.worker.core.WorkerCore.connected` / ``disconnected``, and an inproc PULL socket
through which other threads wake the loop. The loop alone touches the sockets and the core, so
nothing is locked but the command queue (the core locks its own statistics).

Wake-ups. Caller threads submit a tensor (its deadline starts then: the core's
:meth:`~omnireduce.worker.core.WorkerCore.flight`) or "close" through the command queue; one wake
per empty-to-non-empty change of the queue is enough, since a woken loop takes every queued command.
Between socket events the loop sleeps until the core's next wake-up
(:meth:`~omnireduce.worker.core.WorkerCore.next_wakeup`: a deadline, a connection about to be found
lost, or every millisecond while a CUDA result's writes are polled) and then calls its ``tick``.

Device threads. The loop never waits for a device. A tensor on a device (a
:class:`~omnireduce.sources.device.DeviceSource`) is *prepared* (its non-zero blocks compacted and
copied to the host, which blocks on the device) on that device's own thread (``source.defer``);
meanwhile the loop keeps serving the other tensors, and the core keeps the tensor's deadline (a
stuck device fails it as a timeout). The device thread hands the prepared tensor back through the
command queue, which wakes the loop, and the loop passes it to the core
(:meth:`~omnireduce.worker.core.WorkerCore.prepared`). A host tensor is prepared on the loop's
thread, by the core (:meth:`~omnireduce.worker.core.WorkerCore.start`).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
import logging
import threading
import time

import zmq
from zmq.utils.monitor import recv_monitor_message

from omnireduce.config import WorkerConfig
from omnireduce.errors import OmniReduceError, WireError
from omnireduce.transport import recv_frames, send_frames
from omnireduce.wire import Message, decode, encode, frame_bytes, unpack_header
from omnireduce.worker.core import WorkerCore
from omnireduce.worker.flight import MAX_RETRIES, Flight, Link
from omnireduce.worker.op import TensorOp

log = logging.getLogger("omnireduce.worker")

__all__ = ["MAX_RETRIES", "IOLoop"]

_wake_ids = itertools.count()
_MONITOR_EVENTS = zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED


@dataclasses.dataclass
class _Prepared:
    """From a device's thread: ``flight``'s tensor is prepared (``error``: or failed to be)."""

    flight: Flight
    error: BaseException | None


@dataclasses.dataclass
class _Release:
    """From a user thread: every rank has finished the tensors below ``below`` (their kept sums go)."""

    below: int


class IOLoop:
    """The I/O thread of one :class:`~omnireduce.worker.Worker`."""

    def __init__(self, cfg: WorkerConfig, client: str) -> None:
        self.cfg = cfg
        self.client = client
        self._ctx = zmq.Context()
        self._socks: list[zmq.Socket] = []
        self._monitors: list[zmq.Socket] = []
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
            self._socks.append(sock)
            self._monitors.append(monitor)
        wake = f"inproc://omnireduce-wake-{next(_wake_ids)}"
        self._wake_recv = self._ctx.socket(zmq.PULL)
        self._wake_recv.bind(wake)
        self._wake_send = self._ctx.socket(zmq.PUSH)
        self._wake_send.connect(wake)
        self._wake_lock = threading.Lock()
        self._commands: collections.deque[Flight | _Prepared | _Release | str] = collections.deque()
        self._closed = False  # the loop has ended; the sockets are gone
        self.core = WorkerCore(cfg, client, self._send, time.monotonic())
        self.hello = self.core.hello
        self._thread = threading.Thread(target=self._run, name=f"omnireduce-io-r{cfg.rank}", daemon=True)

    # -- called from user threads ----------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def submit(self, item: TensorOp | str) -> None:
        """Hand a tensor (or the string "close") to the loop; a tensor's deadline starts now."""
        with self._wake_lock:
            fatal = self.core.fatal
            if self._closed or (fatal is not None and isinstance(item, TensorOp)):
                if isinstance(item, TensorOp):
                    item.fail(fatal or OmniReduceError("the worker is closed"))
                return
            if isinstance(item, TensorOp):
                self._enqueue(self.core.flight(item, time.monotonic()))
            else:
                self._enqueue(item)

    def release_kept(self, below: int) -> None:
        """Every rank has finished the tensors below ``below``: the loop drops the sums it keeps of them."""
        with self._wake_lock:
            if not self._closed:
                self._enqueue(_Release(below))

    def finished_below(self) -> int:
        """Every tensor below this sequence number has finished (or failed) here (read from any thread)."""
        return self.core.finished_below

    def _enqueue(self, item: Flight | _Prepared | _Release | str) -> None:
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
        return self.core.reachable(time.monotonic())

    def in_use(self, agreed: frozenset[int], generation: int) -> list[int]:
        """The aggregators a tensor submitted now under ``agreed`` (agreement ``generation``) would
        use, as far as this thread knows now (read from any thread)."""
        return self.core.in_use(agreed, generation)

    def snapshot(self) -> dict[str, int]:
        return self.core.snapshot()

    # (read by tests and tools: the core's connection states and the sums it keeps for replays)
    @property
    def _links(self) -> list[Link]:
        return self.core.links

    @property
    def _retained(self) -> collections.OrderedDict[int, TensorOp]:
        return self.core.kept.tensors

    @property
    def _retained_bytes(self) -> int:
        return self.core.kept.nbytes

    # -- the loop ------------------------------------------------------------------------------

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._wake_recv, zmq.POLLIN)
        for sock, monitor in zip(self._socks, self._monitors, strict=True):
            poller.register(sock, zmq.POLLIN)
            poller.register(monitor, zmq.POLLIN)
        error: BaseException | None = None
        try:
            self.core.greet()
            while True:
                events = dict(poller.poll(self._poll_ms()))
                if self._wake_recv in events and self._drain_commands():
                    break
                for i in range(len(self._socks)):
                    if self._monitors[i] in events:
                        self._drain_monitor(i)
                    if self._socks[i] in events:
                        self._drain_socket(i)
                self.core.tick(time.monotonic())
        except BaseException as e:  # never leave a future pending because the loop died
            log.exception("omnireduce I/O thread failed")
            error = e
        finally:
            self._shutdown(error)

    def _poll_ms(self) -> int:
        now = time.monotonic()
        return max(0, int((self.core.next_wakeup(now) - now) * 1000) + 1)

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
            if isinstance(item, _Release):
                self.core.release_kept(item.below)
            elif isinstance(item, _Prepared):
                self.core.prepared(item.flight, item.error, time.monotonic())
            else:
                self._start(item)

    def _start(self, flight: Flight) -> None:
        op = flight.op
        defer = op.source.defer
        if defer is not None:  # a device tensor: prepared on its device's thread
            self.core.preparing(flight)
            defer(op.prepare, lambda error: self._post(_Prepared(flight, error)))
            return
        self.core.start(flight, time.monotonic())

    def _post(self, item: _Prepared) -> None:
        """(From a device's thread.) Hand ``item`` to the loop and wake it; dropped once the loop
        has ended (it failed every tensor being prepared then)."""
        with self._wake_lock:
            if self._closed:
                return
            self._enqueue(item)

    def _drain_socket(self, i: int) -> None:
        sock, core = self._socks[i], self.core
        while True:
            frames = recv_frames(sock)
            if frames is None:
                return
            n = frame_bytes(frames)
            core.count(messages_received=1, bytes_received=n)
            try:
                hdr = unpack_header(frames[0].buffer)
            except WireError as e:
                log.warning("dropped an undecodable message from %s: %s", core.links[i].address, e)
                continue
            # the body is decoded by the core's call (against the tensor's layout, for tensor data)
            core.receive(i, hdr, functools.partial(decode, hdr, frames[1:]), n, time.monotonic())

    def _drain_monitor(self, i: int) -> None:
        monitor = self._monitors[i]
        while True:
            try:
                event = recv_monitor_message(monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            if event["event"] == zmq.EVENT_DISCONNECTED:
                self.core.disconnected(i, time.monotonic())
            elif event["event"] == zmq.EVENT_CONNECTED:
                self.core.connected(i, time.monotonic())

    def _send(self, i: int, msg: Message) -> int:
        """The core's ``send``: ``msg`` to aggregator ``i``; returns the bytes sent."""
        frames = encode(msg)
        send_frames(self._socks[i], frames)
        return frame_bytes(frames)

    def _shutdown(self, error: BaseException | None) -> None:
        closed = OmniReduceError("the worker was closed") if error is None else OmniReduceError(
            f"the omnireduce I/O thread failed: {error!r}")
        with self._wake_lock:
            self.core.fatal = self.core.fatal or closed
            self._closed = True
            pending = [c for c in self._commands if isinstance(c, Flight)]  # (a _Prepared's is in preparing)
            self._commands.clear()
        self.core.close(closed, pending)  # fails what is left, says GOODBYE
        for sock, monitor in zip(self._socks, self._monitors, strict=True):
            sock.disable_monitor()
            monitor.close(0)
            sock.close()
        self._wake_recv.close(0)
        with self._wake_lock:
            self._wake_send.close(0)
        self._ctx.term()


def _apply_curve(sock: zmq.Socket, cfg: WorkerConfig) -> None:
    """Encrypt with zmq CURVE when the aggregators' public key is configured."""
    if not cfg.curve_server_key:
        return
    public, secret = zmq.curve_keypair()  # this connection's own keys: the token authenticates the rank
    sock.curve_serverkey = cfg.curve_server_key.encode()
    sock.curve_publickey = public
    sock.curve_secretkey = secret
