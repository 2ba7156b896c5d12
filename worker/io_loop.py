"""The worker's background I/O thread: owns the sockets and drives every tensor in flight.

One DEALER socket per aggregator, plus an inproc PULL socket through which caller threads wake the
loop when they submit a tensor. The loop alone touches the sockets and the tensor states, so
nothing is locked but the submission queue and the statistics.

Deadlines. First contact (HELLO -> WELCOME from every aggregator) and every tensor have a deadline
of ``timeout`` seconds. When a tensor's deadline passes, the loop asks the aggregators of its
unfinished slots what they are waiting for (QUERY -> STATUS) and, after a short grace period, fails
the tensor with :class:`OmniReduceTimeout` naming the aggregator, job, tensor, slot, round and the
ranks that had not contributed (or that the aggregator did not answer). It then sends ABORT so the
aggregators free the tensor and the other ranks fail at once instead of at their own deadline.
"""

from __future__ import annotations

import collections
import concurrent.futures
import itertools
import logging
import threading
import time
from typing import Any

import zmq

from omnireduce.config import WorkerConfig
from omnireduce.errors import (
    OmniReduceError,
    OmniReduceMismatchError,
    OmniReduceRefused,
    OmniReduceTimeout,
    WireError,
)
from omnireduce.wire import (
    HEADER,
    SEQ_ALL,
    ErrorCode,
    Header,
    MsgType,
    frame_bytes,
    pack_json,
    unpack_header,
    unpack_json,
)
from omnireduce.worker.op import TensorOp

log = logging.getLogger("omnireduce.worker")

_ERROR_TYPES: dict[ErrorCode, type[OmniReduceError]] = {
    ErrorCode.MISMATCH: OmniReduceMismatchError,
    ErrorCode.REFUSED: OmniReduceRefused,
    ErrorCode.REPLACED: OmniReduceRefused,
    ErrorCode.TIMEOUT: OmniReduceTimeout,
}
_wake_ids = itertools.count()


class IOLoop:
    """The I/O thread of one :class:`~omnireduce.worker.Worker`."""

    def __init__(self, cfg: WorkerConfig, client: str) -> None:
        self.cfg = cfg
        self.client = client
        self.hello: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._ctx = zmq.Context()
        self._socks: list[zmq.Socket] = []
        for address in cfg.aggregators:
            sock = self._ctx.socket(zmq.DEALER)
            for opt, value in ((zmq.SNDHWM, 0), (zmq.RCVHWM, 0), (zmq.LINGER, 1000)):
                sock.setsockopt(opt, value)
            sock.connect(address)
            self._socks.append(sock)
        wake = f"inproc://omnireduce-wake-{next(_wake_ids)}"
        self._wake_recv = self._ctx.socket(zmq.PULL)
        self._wake_recv.bind(wake)
        self._wake_send = self._ctx.socket(zmq.PUSH)
        self._wake_send.connect(wake)
        self._wake_lock = threading.Lock()
        self._commands: collections.deque[TensorOp | str] = collections.deque()
        self._ops: dict[int, TensorOp] = {}
        self._handles: list[int | None] = [None] * len(self._socks)
        self._hello_deadline = time.monotonic() + cfg.timeout
        self._fatal: BaseException | None = None  # the job refused this worker: fail every new tensor
        self._closed = False  # the loop has ended; the sockets are gone
        self._stats_lock = threading.Lock()
        self.stats: collections.Counter[str] = collections.Counter()
        self._thread = threading.Thread(target=self._run, name=f"omnireduce-io-r{cfg.rank}", daemon=True)

    # -- called from user threads ----------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def submit(self, item: TensorOp | str) -> None:
        """Hand a tensor (or the string "close") to the loop."""
        with self._wake_lock:
            if self._closed or (self._fatal is not None and isinstance(item, TensorOp)):
                if isinstance(item, TensorOp):
                    item.fail(self._fatal or OmniReduceError("the worker is closed"))
                return
            self._commands.append(item)
            self._wake_send.send(b"", copy=True)

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def snapshot(self) -> dict[str, int]:
        with self._stats_lock:
            return dict(self.stats)

    # -- the loop ------------------------------------------------------------------------------

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._wake_recv, zmq.POLLIN)
        for sock in self._socks:
            poller.register(sock, zmq.POLLIN)
        error: BaseException | None = None
        try:
            for i in range(len(self._socks)):
                self._send(i, Header(MsgType.HELLO, rank=self.cfg.rank), [pack_json({
                    "job": self.cfg.job, "rank": self.cfg.rank, "world_size": self.cfg.world_size,
                    "block_size": self.cfg.block_size, "token": self.cfg.token, "client": self.client})])
            while True:
                events = dict(poller.poll(self._poll_ms()))
                if self._wake_recv in events and self._drain_commands():
                    break
                for i, sock in enumerate(self._socks):
                    if sock in events:
                        self._drain_socket(i, sock)
                self._check_deadlines(time.monotonic())
        except BaseException as e:  # never leave a future pending because the loop died
            log.exception("omnireduce I/O thread failed")
            error = e
        finally:
            self._shutdown(error)

    def _poll_ms(self) -> int:
        soonest = time.monotonic() + 0.2
        if not self.hello.done():
            soonest = min(soonest, self._hello_deadline)
        for op in self._ops.values():
            soonest = min(soonest, op.query_deadline or op.deadline)
        return max(0, int((soonest - time.monotonic()) * 1000) + 1)

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
            self._start(item)

    def _start(self, op: TensorOp) -> None:
        try:
            op.prepare()
        except Exception as e:
            op.fail(e)
            return
        self._ops[op.seq] = op
        with self._stats_lock:
            self.stats["blocks_total"] += op.layout.num_blocks
            self.stats["blocks_nonzero"] += op.blocks_nonzero
            self.stats["dense_bytes"] += op.layout.numel * op.dtype.itemsize
        for agg, hdr, frames in op.bootstraps():
            op.bytes_sent += self._send(agg, hdr, frames)

    def _drain_socket(self, i: int, sock: zmq.Socket) -> None:
        while True:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            with self._stats_lock:
                self.stats["messages_received"] += 1
                self.stats["bytes_received"] += frame_bytes(frames)
            try:
                hdr = unpack_header(frames[0].buffer)
            except WireError as e:
                log.warning("dropped an undecodable message from %s: %s", self.cfg.aggregators[i], e)
                continue
            handler = self._HANDLERS.get(hdr.mtype)
            if handler is None:
                log.warning("dropped a %s message from %s", hdr.mtype.name, self.cfg.aggregators[i])
                continue
            handler(self, i, hdr, frames[1:])

    # -- message handlers ----------------------------------------------------------------------

    def _on_welcome(self, i: int, hdr: Header, frames: list[Any]) -> None:
        self._handles[i] = hdr.job
        if all(h is not None for h in self._handles) and not self.hello.done():
            self.hello.set_result(None)

    def _on_result(self, i: int, hdr: Header, frames: list[Any]) -> None:
        op = self._ops.get(hdr.seq)
        if op is None:
            log.debug("result for tensor %d, which is not in flight", hdr.seq)
            return
        try:
            op.bytes_received += HEADER.size + frame_bytes(frames)
            reply = op.on_result(hdr, frames)
            if reply is not None:
                op.bytes_sent += self._send(i, *reply)
            if op.done:
                del self._ops[op.seq]
                op.finish()
                with self._stats_lock:
                    self.stats["tensors"] += 1
                    self.stats["blocks_sent"] += op.blocks_sent
                    self.stats["blocks_received"] += op.blocks_received
        except Exception as e:
            where = f"tensor {op.seq} slot {hdr.slot} round {hdr.round} from {self.cfg.aggregators[i]}"
            err = e if isinstance(e, OmniReduceError) else OmniReduceError(f"{type(e).__name__}: {e}")
            self._fail(op, type(err)(f"{where}: {err}"), abort=True)

    def _on_error(self, i: int, hdr: Header, frames: list[Any]) -> None:
        try:
            info = unpack_json(frames[0], "ERROR") if frames else {}
        except WireError:
            info = {}
        try:
            code = ErrorCode(hdr.flags)
        except ValueError:
            code = ErrorCode.PROTOCOL
        text = f"aggregator {self.cfg.aggregators[i]}: {info.get('message', code.name)}"
        err = _ERROR_TYPES.get(code, OmniReduceError)(text)
        if not self.hello.done():
            self.hello.set_exception(err)
            return
        if hdr.seq == SEQ_ALL or code in (ErrorCode.REPLACED, ErrorCode.UNKNOWN_JOB, ErrorCode.REFUSED):
            if code in (ErrorCode.REPLACED, ErrorCode.REFUSED):
                self._fatal = err
            log.error("%s", text)
            for op in list(self._ops.values()):
                self._fail(op, err, abort=code not in (ErrorCode.REPLACED, ErrorCode.UNKNOWN_JOB))
            return
        op = self._ops.get(hdr.seq)
        if op is not None:
            self._fail(op, err, abort=code not in (ErrorCode.ABORTED, ErrorCode.MISMATCH))

    def _on_status(self, i: int, hdr: Header, frames: list[Any]) -> None:
        op = self._ops.get(hdr.seq)
        if op is None or op.query_deadline is None:
            return
        try:
            op.status[i] = unpack_json(frames[0], "STATUS")
        except (WireError, IndexError):
            return
        if all(a in op.status for a in self._queried(op)):
            self._time_out(op)

    _HANDLERS = {MsgType.WELCOME: _on_welcome, MsgType.RESULT: _on_result, MsgType.ERROR: _on_error,
                 MsgType.STATUS: _on_status}

    # -- deadlines and failures ----------------------------------------------------------------

    def _queried(self, op: TensorOp) -> set[int]:
        return {op.aggregator_of(s) for s, _ in op.waiting_on()}

    def _check_deadlines(self, now: float) -> None:
        if not self.hello.done() and now >= self._hello_deadline:
            missing = [a for a, h in zip(self.cfg.aggregators, self._handles, strict=True) if h is None]
            self.hello.set_exception(OmniReduceTimeout(
                f"no answer from aggregator(s) {', '.join(missing)} within {self.cfg.timeout:g} s "
                f"(job {self.cfg.job!r}, rank {self.cfg.rank}): is omnireduce-agg running there and "
                "reachable from this host?"))
        for op in list(self._ops.values()):
            if op.query_deadline is not None:
                if now >= op.query_deadline:
                    self._time_out(op)
            elif now >= op.deadline:
                op.query_deadline = now + min(1.0, self.cfg.timeout / 2)
                for agg in self._queried(op):
                    self._send(agg, op.header(MsgType.QUERY), [])

    def _time_out(self, op: TensorOp) -> None:
        parts = []
        for slot, rnd in op.waiting_on():
            agg = op.aggregator_of(slot)
            address = self.cfg.aggregators[agg]
            status = op.status.get(agg)
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
        elapsed = time.monotonic() - op.started
        self._fail(op, OmniReduceTimeout(
            f"tensor {op.seq} of job {self.cfg.job!r} (rank {op.rank} of {op.world_size}, "
            f"{op.layout.numel} x {op.dtype.name.lower()}) timed out after {elapsed:.1f} s: "
            + "; ".join(parts)), abort=True)

    def _fail(self, op: TensorOp, error: BaseException, *, abort: bool) -> None:
        self._ops.pop(op.seq, None)
        with self._stats_lock:
            self.stats["tensors_failed"] += 1
        if abort:
            reason = pack_json({"reason": str(error)[:1000]})
            for agg in {op.aggregator_of(s) for s in range(op.layout.slots)}:
                self._send(agg, op.header(MsgType.ABORT), [reason])
        log.warning("%s", error)
        op.fail(error)

    def _shutdown(self, error: BaseException | None) -> None:
        closed = OmniReduceError("the worker was closed") if error is None else OmniReduceError(
            f"the omnireduce I/O thread failed: {error!r}")
        with self._wake_lock:
            self._fatal = self._fatal or closed
            self._closed = True
            pending = [c for c in self._commands if isinstance(c, TensorOp)]
            self._commands.clear()
        for op in [*self._ops.values(), *pending]:
            op.fail(closed)
        self._ops.clear()
        if not self.hello.done():
            self.hello.set_exception(closed)
        for i, handle in enumerate(self._handles):
            if handle is not None:
                self._send(i, Header(MsgType.GOODBYE, rank=self.cfg.rank), [])
        for sock in self._socks:
            sock.close()
        self._wake_recv.close(0)
        with self._wake_lock:
            self._wake_send.close(0)
        self._ctx.term()

    def _send(self, i: int, hdr: Header, frames: list[Any]) -> int:
        """Send to aggregator ``i``; returns the bytes sent."""
        msg = [hdr._replace(job=self._handles[i] or 0).pack(), *frames]
        self._socks[i].send_multipart(msg, copy=False)
        n = frame_bytes(msg)
        with self._stats_lock:
            self.stats["messages_sent"] += 1
            self.stats["bytes_sent"] += n
        return n
