"""The aggregator service: one ROUTER socket, one thread, a thin receive-dispatch-send loop.

Design. :class:`Aggregator` owns the socket and its lifecycle (bind, serve from a thread or the
caller's, stop) and nothing of the protocol. Its loop receives messages and hands each to the
:class:`~omnireduce.aggregator.core.Core` (sender identity and frames), calls the core's sweep a few
times a second (deadlines, idle jobs) and the telemetry's log line; the core answers through its
``send`` hook, which is the socket's send here. A single thread owns the socket and all state, so
nothing is locked (the metrics thread only reads counters and gauges).

The parts, each in a module of its own: ``core.py`` (dispatch: checks, handlers, aborts, error
replies), ``registry.py`` (jobs and connections: HELLO, takeover, GOODBYE, forgetting jobs),
``job.py`` (one job's slots, aborts and watermarks), ``slot.py`` (one slot's rounds and its recovery
after a restart, sans-I/O), ``budget.py`` (memory limits over what the slots hold), ``throttle.py``
(error replies per connection), ``limits.py`` (:class:`AggregatorLimits`), ``telemetry.py``
(counters, log line, metrics).

Protocol in brief (docs/reference/protocol.md has it all). Workers connect with a DEALER socket and say HELLO;
the aggregator checks the token, rank and world size and answers WELCOME with a job *handle* and its
*instance* id (random per process: a worker that sees a new one knows the aggregator restarted and
recovers). Tensors are tracked per ``(job, seq, slot)``; results are broadcast to every rank of the
job with zero-copy sends of one buffer, with the job's *watermark* (the lowest tensor some rank has
not finished) so workers can drop sums kept for replays. After a restart, a rank that had finished a
slot sends FINAL with its sums, which are replayed to the ranks that start the slot again. Nothing a
client sends can stop the loop, and every kind of state is capped (:class:`AggregatorLimits`).

Telemetry of the I/O itself (messages and bytes in and out, failed sends) is counted here; the core
counts what the protocol does.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from typing import Any

import zmq

from omnireduce.aggregator.core import Core
from omnireduce.aggregator.limits import AggregatorLimits
from omnireduce.aggregator.telemetry import Telemetry
from omnireduce.credentials import env_secret
from omnireduce.transport import recv_frames, send_frames
from omnireduce.wire import frame_bytes

log = logging.getLogger("omnireduce.aggregator")

_LOOPBACK_HOSTS = {"127.0.0.1", "localhost", "::1", "[::1]"}
_SWEEP_SECONDS = 0.25
_BATCH = 256  # messages received per poll before the clock is looked at again

__all__ = ["Aggregator", "AggregatorLimits", "is_loopback"]


def is_loopback(address: str) -> bool:
    host = address.partition("://")[2].rpartition(":")[0]
    return address.startswith(("ipc://", "inproc://")) or host in _LOOPBACK_HOSTS


#: libzmq I/O threads of an aggregator (measured: at 100% density, W = 4 on loopback, the one I/O thread
#: spent more CPU per all-reduce than the aggregator's loop and bounded its time; see docs/BENCHMARKS.md).
DEFAULT_IO_THREADS = 2


class Aggregator:
    """An omnireduce aggregator.

    ``Aggregator(listen="tcp://127.0.0.1:0", token=None)``; ``start()`` binds and serves from a
    background thread (``address`` is then the real address, port included), ``stop()`` ends it.
    It is also a context manager. ``serve_forever()`` serves from the calling thread instead (the
    CLI does this). A token is required to listen on anything but loopback unless ``insecure``.
    ``curve_secret_key`` (Z85) encrypts every connection with zmq CURVE; ``log_interval`` seconds
    between status log lines (0: none); ``socket_buffer`` bytes of TCP send/receive buffer per
    connection (0: the kernel's autotuning); ``io_threads``: libzmq I/O threads, over which the
    workers' connections are spread (the kernel's TCP copies run on them: with one, a dense tensor's
    traffic from every worker goes through one core).

    ``core`` is the protocol behind the socket; ``core.send(identity, frames)`` is how every message
    leaves (the socket's send): wrap or replace it to watch or lose messages.
    """

    def __init__(self, listen: str = "tcp://127.0.0.1:0", token: str | None = None, *,
                 insecure: bool = False, limits: AggregatorLimits | None = None,
                 curve_secret_key: str | None = None, log_interval: float = 60.0, socket_buffer: int = 0,
                 io_threads: int = DEFAULT_IO_THREADS) -> None:
        scheme = listen.partition("://")[0] if "://" in listen else ""
        if scheme not in ("tcp", "ipc", "inproc"):
            raise ValueError(f"listen address {listen!r} needs a transport: tcp://HOST:PORT (for example "
                             f"tcp://{listen if not scheme else '127.0.0.1:5555'}; PORT 0 picks a free port)")
        if token is None:
            token = env_secret("OMNIREDUCE_TOKEN")
        if not is_loopback(listen) and token is None and not insecure:
            raise ValueError(f"refusing to listen on {listen} without a token: anyone who can reach it "
                             "could join jobs. Set a token (--token-file / OMNIREDUCE_TOKEN) or pass "
                             "insecure=True (--insecure)")
        self.listen = listen
        self._curve_secret = curve_secret_key
        self._socket_buffer = socket_buffer
        if io_threads < 1:
            raise ValueError(f"io_threads must be >= 1, got {io_threads}")
        self._io_threads = io_threads
        self.limits = limits or AggregatorLimits()
        self.instance = uuid.uuid4().hex[:16]
        self.telemetry = Telemetry(log_interval)
        self.core = Core(self._send, limits=self.limits, token=token, instance=self.instance,
                         telemetry=self.telemetry)
        self._ctx: zmq.Context | None = None
        self._sock: zmq.Socket | None = None
        self._address: str | None = None
        self._thread: threading.Thread | None = None
        # Plain attributes, not a threading.Event: request_stop() is called from signal handlers, which
        # run on the main thread between any two bytecodes, possibly inside an Event's own lock (two
        # SIGTERMs in a row deadlocked an aggregator in Event.set for good).
        self._stopping = False
        self._drain_until: float | None = None
        self._next_sweep = 0.0

    @property
    def counters(self) -> dict[str, int]:
        return self.telemetry.snapshot()

    def gauges(self) -> dict[str, int]:
        return self.core.gauges()

    # -- lifecycle -----------------------------------------------------------------------------

    @property
    def address(self) -> str:
        if self._address is None:
            raise RuntimeError("the aggregator is not bound yet: call start() first")
        return self._address

    def bind(self) -> str:
        """Create and bind the socket (idempotent); returns the real address."""
        if self._sock is None:
            self._ctx = zmq.Context(io_threads=self._io_threads)
            sock = self._ctx.socket(zmq.ROUTER)
            # SNDHWM: a peer that never reads cannot make the aggregator queue more than this for it.
            # ROUTER_HANDOVER: a worker that reconnects after a blip (same routing id) keeps its place.
            for opt, value in ((zmq.ROUTER_MANDATORY, 1), (zmq.ROUTER_HANDOVER, 1), (zmq.SNDHWM, 100_000),
                               (zmq.RCVHWM, 0), (zmq.LINGER, 0), (zmq.MAXMSGSIZE, self.limits.max_message_bytes)):
                sock.setsockopt(opt, value)
            if self._socket_buffer > 0:
                sock.setsockopt(zmq.SNDBUF, self._socket_buffer)
                sock.setsockopt(zmq.RCVBUF, self._socket_buffer)
            if self._curve_secret is not None:
                sock.curve_server = True
                sock.curve_secretkey = self._curve_secret.encode()
                sock.curve_publickey = zmq.curve_public(self._curve_secret.encode())
            sock.bind(self.listen)
            self._sock = sock
            self._address = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        return self.address

    def start(self) -> Aggregator:
        """Bind and serve from a daemon thread."""
        self.bind()
        self._stopping, self._drain_until = False, None
        self._thread = threading.Thread(target=self.serve_forever, name="omnireduce-agg", daemon=True)
        self._thread.start()
        return self

    def request_stop(self) -> None:
        """Ask the loop to stop; it does within a sweep period (0.25 s). Safe in a signal handler: it
        sets a flag and takes no lock."""
        self._stopping = True

    def stop_when_idle(self, grace: float) -> None:
        """Stop once no worker is connected to a job (every rank said GOODBYE), or after ``grace``
        seconds at the latest. A job's own aggregator is told so when the job ends: the ranks leave
        first, so that none of them sees its aggregator vanish. Safe in a signal handler."""
        self._drain_until = time.monotonic() + max(0.0, grace)

    def stop(self, timeout: float = 5.0) -> None:
        """Stop serving and close the socket."""
        self._stopping = True
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
        self._close()

    def __enter__(self) -> Aggregator:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _close(self) -> None:
        if self._sock is not None:
            self._sock.close(0)
            self._sock = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    # -- the loop: receive, dispatch, send ----------------------------------------------------------

    def serve_forever(self) -> None:
        """Serve until :meth:`stop` is called."""
        if self._sock is None:
            self.bind()
        sock = self._sock
        assert sock is not None
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        log.info("serving on %s (instance %s)", self._address, self.instance)
        try:
            while not self._stopping and not self._drained():
                if poller.poll(int(_SWEEP_SECONDS * 1000)):
                    for _ in range(_BATCH):
                        frames = recv_frames(sock)
                        if frames is None:
                            break
                        self.telemetry.count(messages_in=1, bytes_in=frame_bytes(frames))
                        self.core.handle(frames[0].bytes, [f.buffer for f in frames[1:]])
                now = time.monotonic()
                if now >= self._next_sweep:
                    self._next_sweep = now + _SWEEP_SECONDS
                    self.core.sweep(now)
                    self.telemetry.maybe_log(now, self.gauges)
        finally:
            if self._thread is None:
                self._close()

    def _drained(self) -> bool:
        """Asked to stop when idle (:meth:`stop_when_idle`), and idle or out of time."""
        if self._drain_until is None:
            return False
        peers = self.core.registry.peers
        if peers and time.monotonic() < self._drain_until:
            return False
        if peers:
            log.info("stopping with %d worker connection(s) still registered", peers)
        return True

    def _send(self, identity: bytes, frames: list[Any]) -> None:
        """The socket's send (the core's ``send`` hook): a peer that is gone or full is counted and skipped."""
        assert self._sock is not None
        try:
            send_frames(self._sock, [identity, *frames])
        except zmq.ZMQError as e:  # peer gone (ROUTER_MANDATORY) or queue full
            self.telemetry.count(send_failures=1)
            log.debug("could not send to %r: %s", identity, e)
            return
        self.telemetry.count(messages_out=1, bytes_out=frame_bytes(frames))
