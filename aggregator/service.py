"""The aggregator service: one ROUTER socket, one thread, many jobs and tensors.

Design. A single event loop owns the socket and all state, so nothing is locked. Workers connect
with a DEALER socket and say HELLO; the aggregator checks the token (constant-time), the rank and the
world size, and answers WELCOME with a job *handle* (a random 32-bit number, so that handles from
before a restart are not mistaken for new ones). Every later message names the handle and its rank;
both must match what the sending connection registered.

Tensors are tracked per ``(job, seq, slot)`` as :class:`~omnireduce.aggregator.slot.SlotState`; a
slot's state exists from its first bootstrap to its last round, and is freed then. Results are
broadcast to every rank of the job with zero-copy sends of one buffer.

Anything wrong with a message is answered with an ERROR (rate-limited per connection) or dropped;
nothing a client sends can stop the loop. A problem that makes a tensor impossible to finish
(ranks disagree, a rank breaks the protocol) aborts that tensor on every rank of the job at once,
so nobody waits for a deadline.
"""

from __future__ import annotations

import collections
import dataclasses
import hmac
import logging
import os
import threading
import time
from typing import Any

import numpy as np
import zmq

from omnireduce.aggregator.slot import Round, SlotState, SlotViolation, TensorMeta
from omnireduce.blocks import Layout, encode_rows
from omnireduce.dtypes import DType
from omnireduce.errors import WireError
from omnireduce.wire import (
    SEQ_ALL,
    ErrorCode,
    Header,
    MsgType,
    data_array,
    decode_row_frames,
    frame_bytes,
    pack_json,
    unpack_header,
    unpack_json,
)

log = logging.getLogger("omnireduce.aggregator")

_LOOPBACK_HOSTS = {"127.0.0.1", "localhost", "::1", "[::1]"}


@dataclasses.dataclass(frozen=True)
class AggregatorLimits:
    """Caps that bound what clients can make the aggregator hold.

    max_jobs: jobs registered at once.
    max_slots_per_job: slot states (tensor slots in flight) per job.
    max_message_bytes: largest message accepted (zmq drops larger ones at the socket).
    max_world_size: largest world size a job may declare.
    error_replies_per_second: error replies per connection per second (the rest are dropped).
    """

    max_jobs: int = 1024
    max_slots_per_job: int = 4096
    max_message_bytes: int = 1 << 30
    max_world_size: int = 4096
    error_replies_per_second: float = 20.0


@dataclasses.dataclass
class _Job:
    handle: int
    name: str
    world_size: int
    members: dict[int, bytes] = dataclasses.field(default_factory=dict)  # rank -> identity
    slots: dict[tuple[int, int], SlotState] = dataclasses.field(default_factory=dict)
    aborted: collections.OrderedDict[int, str] = dataclasses.field(default_factory=collections.OrderedDict)

    def label(self) -> str:
        return f"job {self.name!r}"


@dataclasses.dataclass
class _Peer:
    job: int
    rank: int
    client: str


class _TokenBucket:
    """At most ``rate`` events per second, with bursts of up to ``rate``."""

    __slots__ = ("rate", "stamp", "tokens")

    def __init__(self, rate: float) -> None:
        self.rate, self.tokens, self.stamp = rate, rate, time.monotonic()

    def take(self) -> bool:
        now = time.monotonic()
        self.tokens = min(self.rate, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now
        if self.tokens < 1:
            return False
        self.tokens -= 1
        return True


def is_loopback(address: str) -> bool:
    host = address.partition("://")[2].rpartition(":")[0]
    return address.startswith(("ipc://", "inproc://")) or host in _LOOPBACK_HOSTS


class Aggregator:
    """An omnireduce aggregator.

    ``Aggregator(listen="tcp://127.0.0.1:0", token=None)``; ``start()`` binds and serves from a
    background thread (``address`` is then the real address, port included), ``stop()`` ends it.
    It is also a context manager. ``serve_forever()`` serves from the calling thread instead (the
    CLI does this). A token is required to listen on anything but loopback unless ``insecure``.
    """

    def __init__(self, listen: str = "tcp://127.0.0.1:0", token: str | None = None, *,
                 insecure: bool = False, limits: AggregatorLimits | None = None) -> None:
        if token is None:
            token = os.environ.get("OMNIREDUCE_TOKEN") or None
        if not is_loopback(listen) and token is None and not insecure:
            raise ValueError(f"refusing to listen on {listen} without a token: anyone who can reach it "
                             "could join jobs. Set a token (--token-file / OMNIREDUCE_TOKEN) or pass "
                             "insecure=True (--insecure)")
        self.listen = listen
        self._token = token.encode() if token is not None else None
        self.limits = limits or AggregatorLimits()
        self._ctx: zmq.Context | None = None
        self._sock: zmq.Socket | None = None
        self._address: str | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._jobs: dict[int, _Job] = {}
        self._jobs_by_name: dict[str, int] = {}
        self._peers: dict[bytes, _Peer] = {}
        self._error_buckets: dict[bytes, _TokenBucket] = {}
        self._rng = np.random.default_rng()
        self.counters: collections.Counter[str] = collections.Counter()

    # -- lifecycle -----------------------------------------------------------------------------

    @property
    def address(self) -> str:
        if self._address is None:
            raise RuntimeError("the aggregator is not bound yet: call start() first")
        return self._address

    def bind(self) -> str:
        """Create and bind the socket (idempotent); returns the real address."""
        if self._sock is None:
            self._ctx = zmq.Context()
            sock = self._ctx.socket(zmq.ROUTER)
            sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
            sock.setsockopt(zmq.SNDHWM, 0)
            sock.setsockopt(zmq.RCVHWM, 0)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.MAXMSGSIZE, self.limits.max_message_bytes)
            sock.bind(self.listen)
            self._sock = sock
            self._address = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        return self._address

    def start(self) -> Aggregator:
        """Bind and serve from a daemon thread."""
        self.bind()
        self._stop.clear()
        self._thread = threading.Thread(target=self.serve_forever, name="omnireduce-agg", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        """Stop serving and close the socket."""
        self._stop.set()
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

    def serve_forever(self) -> None:
        """Serve until :meth:`stop` is called."""
        sock = self._sock if self._sock is not None else None
        if sock is None:
            self.bind()
            sock = self._sock
        assert sock is not None
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        log.info("serving on %s", self._address)
        try:
            while not self._stop.is_set():
                if not poller.poll(100):
                    continue
                for _ in range(256):
                    try:
                        frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    self._handle(frames)
        finally:
            if self._thread is None:
                self._close()

    # -- dispatch ------------------------------------------------------------------------------

    def _handle(self, frames: list[Any]) -> None:
        self.counters["messages_in"] += 1
        self.counters["bytes_in"] += frame_bytes(frames)
        identity = frames[0].bytes
        body = frames[1:]
        if not body:
            self._reply_error(identity, Header(MsgType.ERROR), ErrorCode.BAD_MESSAGE, "empty message")
            return
        try:
            hdr = unpack_header(body[0].buffer)
        except WireError as e:
            self._reply_error(identity, Header(MsgType.ERROR), ErrorCode.BAD_MESSAGE, str(e))
            return
        handler = self._HANDLERS.get(hdr.mtype)
        if handler is None:
            self._reply_error(identity, hdr, ErrorCode.BAD_MESSAGE, f"{hdr.mtype.name} is not sent to an "
                              "aggregator")
            return
        try:
            handler(self, identity, hdr, body[1:])
        except WireError as e:
            self._reply_error(identity, hdr, ErrorCode.BAD_MESSAGE, f"{hdr.mtype.name}: {e}")
        except Exception:  # the loop must survive anything a client sends
            log.exception("internal error handling %s from %r", hdr.mtype.name, identity)
            self._reply_error(identity, hdr, ErrorCode.BAD_MESSAGE, "internal error in the aggregator")

    def _on_hello(self, identity: bytes, hdr: Header, frames: list[Any]) -> None:
        if len(frames) != 1:
            raise WireError(f"expected 1 JSON frame, got {len(frames)}")
        info = unpack_json(frames[0], "HELLO")
        try:
            name = str(info["job"])
            rank = int(info["rank"])
            world_size = int(info["world_size"])
            client = str(info.get("client", ""))[:64]
            token = info.get("token")
        except (KeyError, TypeError, ValueError) as e:
            raise WireError(f"HELLO is missing or has a bad field: {e}") from None
        if self._token is not None:
            given = token.encode() if isinstance(token, str) else b""
            if not hmac.compare_digest(given, self._token):
                log.warning("refused HELLO for job %r rank %d (client %s): %s token", name, rank, client,
                            "missing" if token is None else "wrong")
                self._reply_error(identity, hdr, ErrorCode.REFUSED,
                                  f"{'missing' if token is None else 'wrong'} token for this aggregator")
                return
        if not 1 <= world_size <= self.limits.max_world_size or not 0 <= rank < world_size:
            self._reply_error(identity, hdr, ErrorCode.REFUSED,
                              f"rank {rank} / world size {world_size} out of range "
                              f"(world size at most {self.limits.max_world_size})")
            return
        job = self._job_for(name, world_size, identity, hdr, rank)
        if job is None:
            return
        old = job.members.get(rank)
        if old is not None and old != identity:
            self._takeover(job, rank, old, client)
        prev = self._peers.get(identity)
        if prev is not None and (prev.job != job.handle or prev.rank != rank):
            self._leave(identity)
        job.members[rank] = identity
        self._peers[identity] = _Peer(job.handle, rank, client)
        log.info("%s: rank %d of %d joined (client %s)", job.label(), rank, world_size, client)
        self._send(identity, Header(MsgType.WELCOME, job=job.handle, rank=rank),
                   [pack_json({"job": name, "handle": job.handle, "world_size": world_size})])

    def _job_for(self, name: str, world_size: int, identity: bytes, hdr: Header, rank: int) -> _Job | None:
        """The job called ``name`` (created if new), or None after refusing a different world size.

        (Block sizes are checked per tensor, so that every rank hears of a difference.)"""
        handle = self._jobs_by_name.get(name)
        if handle is not None:
            job = self._jobs[handle]
            if job.world_size != world_size:
                self._reply_error(identity, hdr, ErrorCode.MISMATCH,
                                  f"job {name!r}: rank {rank} says world size {world_size} but the job has "
                                  f"{job.world_size} (from ranks {sorted(job.members)})")
                return None
            return job
        if len(self._jobs) >= self.limits.max_jobs:
            self._reply_error(identity, hdr, ErrorCode.LIMIT, f"too many jobs ({self.limits.max_jobs})")
            return None
        handle = int(self._rng.integers(1, 1 << 32))
        while handle in self._jobs:
            handle = int(self._rng.integers(1, 1 << 32))
        job = _Job(handle, name, world_size)
        self._jobs[handle] = job
        self._jobs_by_name[name] = handle
        return job

    def _takeover(self, job: _Job, rank: int, old: bytes, client: str) -> None:
        reason = (f"rank {rank} of {job.label()} was taken over by another worker process (client "
                  f"{client}); tensors in flight were aborted")
        log.warning("%s", reason)
        self._peers.pop(old, None)
        self._reply_error(old, Header(MsgType.ERROR, job=job.handle, seq=SEQ_ALL), ErrorCode.REPLACED,
                          reason, force=True)
        for seq in sorted({s for s, _ in job.slots}):
            self._abort(job, seq, ErrorCode.ABORTED, reason)

    def _member(self, identity: bytes, hdr: Header) -> _Job | None:
        """The job of a registered sender, or None after replying with an error."""
        job = self._jobs.get(hdr.job)
        peer = self._peers.get(identity)
        if job is None:
            self._reply_error(identity, hdr, ErrorCode.UNKNOWN_JOB,
                              f"unknown job handle {hdr.job}: say HELLO first (the aggregator may have "
                              "restarted)")
            return None
        if peer is None or peer.job != hdr.job or peer.rank != hdr.rank:
            self._reply_error(identity, hdr, ErrorCode.REFUSED,
                              f"this connection is not rank {hdr.rank} of {job.label()}")
            return None
        return job

    def _on_bootstrap(self, identity: bytes, hdr: Header, frames: list[Any]) -> None:
        job = self._member(identity, hdr)
        if job is None:
            return
        if len(frames) != 2:
            raise WireError(f"expected 2 frames after the header, got {len(frames)}")
        try:
            dtype = DType(hdr.dtype)
        except ValueError:
            raise WireError(f"unknown dtype code {hdr.dtype}") from None
        if hdr.block_size < 1 or hdr.lanes < 1 or hdr.slots < 1 or hdr.slot >= hdr.slots:
            raise WireError(f"bad geometry: block_size={hdr.block_size}, lanes={hdr.lanes}, "
                            f"slots={hdr.slots}, slot={hdr.slot}")
        if hdr.lanes * hdr.block_size * dtype.itemsize > self.limits.max_message_bytes:
            raise WireError(f"{hdr.lanes} lanes of {hdr.block_size} elements exceed the message limit")
        meta = TensorMeta(hdr.numel, dtype, hdr.block_size, hdr.lanes, hdr.slots)
        layout = Layout(meta.numel, meta.block_size, meta.lanes, meta.slots)
        rows = decode_row_frames(frames[0], frames[1], hdr.lanes, layout.row_width, "bootstrap rows")
        if hdr.seq in job.aborted:
            self._reply_error(identity, hdr, ErrorCode.ABORTED,
                              f"tensor {hdr.seq} of {job.label()} was aborted: {job.aborted[hdr.seq]}")
            return
        key = (hdr.seq, hdr.slot)
        state = job.slots.get(key)
        if state is None:
            if len(job.slots) >= self.limits.max_slots_per_job:
                self._abort(job, hdr.seq, ErrorCode.LIMIT,
                            f"{job.label()} has {len(job.slots)} tensor slots in flight, the limit is "
                            f"{self.limits.max_slots_per_job}")
                return
            state = job.slots[key] = SlotState(meta, hdr.slot, job.world_size, hdr.rank)
        elif state.meta != meta:
            diffs = "; ".join(f"{label}: rank {state.first_rank} has {a}, rank {hdr.rank} has {b}"
                              for label, a, b in state.meta.differences(meta))
            self._abort(job, hdr.seq, ErrorCode.MISMATCH,
                        f"ranks disagree about tensor {hdr.seq} of {job.label()}: {diffs}")
            return
        self._advance(job, hdr, state, lambda: state.bootstrap(hdr.rank, rows))

    def _on_contrib(self, identity: bytes, hdr: Header, frames: list[Any]) -> None:
        job = self._member(identity, hdr)
        if job is None:
            return
        if len(frames) != 3:
            raise WireError(f"expected 3 frames after the header, got {len(frames)}")
        state = job.slots.get((hdr.seq, hdr.slot))
        if state is None:
            self._reply_error(identity, hdr, ErrorCode.ABORTED if hdr.seq in job.aborted else ErrorCode.PROTOCOL,
                              f"tensor {hdr.seq} slot {hdr.slot} of {job.label()} is not in progress"
                              + (f" (aborted: {job.aborted[hdr.seq]})" if hdr.seq in job.aborted else ""))
            return
        if hdr.count != state.expected_count(hdr.rank):
            raise WireError(f"count {hdr.count}, but the instruction asks rank {hdr.rank} for "
                            f"{state.expected_count(hdr.rank)} blocks of slot {hdr.slot} in this round")
        nxt = decode_row_frames(frames[0], frames[1], hdr.count, state.layout.row_width, "next rows")
        storage = state.meta.dtype.storage
        nbytes = memoryview(frames[2].buffer).nbytes
        if nbytes % storage.itemsize:
            raise WireError(f"data frame of {nbytes} bytes is not a whole number of {storage} elements")
        data = data_array(frames[2], storage, nbytes // storage.itemsize, "block data")
        self._advance(job, hdr, state, lambda: state.contribute(hdr.rank, hdr.round, nxt, data))

    def _advance(self, job: _Job, hdr: Header, state: SlotState, step: Any) -> None:
        """Run ``step`` (a bootstrap or contribution of ``state``); broadcast the round it completes."""
        try:
            result: Round | None = step()
        except SlotViolation as e:
            self._abort(job, hdr.seq, ErrorCode.PROTOCOL,
                        f"tensor {hdr.seq} slot {hdr.slot} of {job.label()}: {e}")
            return
        if result is None:
            return
        out = Header(MsgType.RESULT, dtype=hdr.dtype, job=job.handle, seq=hdr.seq, slot=hdr.slot,
                     round=result.round, count=result.count)
        bitmap, packed = encode_rows(result.cur, state.layout.row_width)
        payload = [out.pack(), bitmap, packed, result.data]
        for _rank, ident in sorted(job.members.items()):
            self._send_raw(ident, payload)
        if result.finished:
            del job.slots[(hdr.seq, hdr.slot)]
            self.counters["slots_completed"] += 1

    def _on_query(self, identity: bytes, hdr: Header, frames: list[Any]) -> None:
        job = self._member(identity, hdr)
        if job is None:
            return
        slots = [{"slot": slot, "round": st.round + (1 if st.cur is not None else 0),
                  "phase": "bootstrap" if st.cur is None else "contribution", "missing": st.missing()}
                 for (seq, slot), st in sorted(job.slots.items()) if seq == hdr.seq]
        info: dict[str, Any] = {"seq": hdr.seq, "slots": slots, "members": sorted(job.members),
                                "world_size": job.world_size}
        if hdr.seq in job.aborted:
            info["aborted"] = job.aborted[hdr.seq]
        self._send(identity, Header(MsgType.STATUS, job=job.handle, seq=hdr.seq), [pack_json(info)])

    def _on_abort(self, identity: bytes, hdr: Header, frames: list[Any]) -> None:
        job = self._member(identity, hdr)
        if job is None:
            return
        reason = f"aborted by rank {hdr.rank}"
        if frames:
            reason += ": " + unpack_json(frames[0], "ABORT").get("reason", "")[:1000]
        if hdr.seq in job.aborted or not any(s == hdr.seq for s, _ in job.slots):
            self._remember_abort(job, hdr.seq, reason)
            return
        self._abort(job, hdr.seq, ErrorCode.ABORTED, reason)

    def _on_goodbye(self, identity: bytes, hdr: Header, frames: list[Any]) -> None:
        if self._member(identity, hdr) is None:
            return
        self._leave(identity)

    def _leave(self, identity: bytes) -> None:
        peer = self._peers.pop(identity, None)
        if peer is None:
            return
        job = self._jobs.get(peer.job)
        if job is None:
            return
        if job.members.get(peer.rank) == identity:
            del job.members[peer.rank]
        log.info("%s: rank %d left", job.label(), peer.rank)
        if not job.members:
            log.info("%s: no ranks left, freed (%d slots in flight dropped)", job.label(), len(job.slots))
            del self._jobs[job.handle]
            self._jobs_by_name.pop(job.name, None)

    _HANDLERS = {
        MsgType.HELLO: _on_hello,
        MsgType.BOOTSTRAP: _on_bootstrap,
        MsgType.CONTRIB: _on_contrib,
        MsgType.QUERY: _on_query,
        MsgType.ABORT: _on_abort,
        MsgType.GOODBYE: _on_goodbye,
    }

    # -- aborts and errors ---------------------------------------------------------------------

    def _remember_abort(self, job: _Job, seq: int, reason: str) -> None:
        job.aborted[seq] = reason
        while len(job.aborted) > 4096:
            job.aborted.popitem(last=False)

    def _abort(self, job: _Job, seq: int, code: ErrorCode, reason: str) -> None:
        """Drop every slot of tensor ``seq`` and tell every rank of the job why."""
        log.warning("%s", reason)
        for key in [k for k in job.slots if k[0] == seq]:
            del job.slots[key]
        self._remember_abort(job, seq, reason)
        self.counters["tensors_aborted"] += 1
        hdr = Header(MsgType.ERROR, job=job.handle, seq=seq)
        for ident in job.members.values():
            self._reply_error(ident, hdr, code, reason, force=True)

    def _reply_error(self, identity: bytes, about: Header, code: ErrorCode, message: str, *,
                     force: bool = False) -> None:
        if not force and not self._error_bucket(identity).take():
            self.counters["errors_suppressed"] += 1
            return
        self.counters["errors_sent"] += 1
        hdr = Header(MsgType.ERROR, flags=int(code), job=about.job, rank=about.rank, seq=about.seq,
                     slot=about.slot, round=about.round)
        self._send(identity, hdr, [pack_json({"code": code.name, "message": message})])

    def _error_bucket(self, identity: bytes) -> _TokenBucket:
        bucket = self._error_buckets.get(identity)
        if bucket is None:
            if len(self._error_buckets) >= 10000:
                self._error_buckets.clear()
            bucket = self._error_buckets[identity] = _TokenBucket(self.limits.error_replies_per_second)
        return bucket

    # -- sending -------------------------------------------------------------------------------

    def _send(self, identity: bytes, hdr: Header, frames: list[Any]) -> None:
        self._send_raw(identity, [hdr.pack(), *frames])

    def _send_raw(self, identity: bytes, frames: list[Any]) -> None:
        assert self._sock is not None
        try:
            self._sock.send_multipart([identity, *frames], copy=False)
        except zmq.ZMQError as e:  # peer gone (ROUTER_MANDATORY) or queue full
            self.counters["send_failures"] += 1
            log.debug("could not send to %r: %s", identity, e)
            return
        self.counters["messages_out"] += 1
        self.counters["bytes_out"] += frame_bytes(frames)
