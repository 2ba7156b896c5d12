"""The aggregator service: one ROUTER socket, one thread, many jobs and tensors.

Design. A single event loop owns the socket and all state, so nothing is locked. Workers connect
with a DEALER socket and say HELLO; the aggregator checks the token (constant-time), the rank and the
world size, and answers WELCOME with a job *handle* (a random 32-bit number, so that handles from
before a restart are not mistaken for new ones) and its *instance* id (random per process: a worker
that sees a new instance knows the aggregator restarted and recovers, see worker/io_loop.py). Every
later message names the handle and its rank; both must match what the sending connection
registered. A rank that reconnects from the same worker process keeps its place; a rank claimed by
another process is taken over, and the job's tensors in flight are aborted.

Tensors are tracked per ``(job, seq, slot)`` as :class:`~omnireduce.aggregator.slot.SlotState`; a
slot's state exists from its first bootstrap to its last round, and is freed then. Results are
broadcast to every rank of the job with zero-copy sends of one buffer, with the job's *watermark*
(the lowest tensor some rank has not finished) so workers can drop sums kept for replays.

Faults. Anything wrong with a message is answered with an ERROR (rate-limited per connection) or
dropped; nothing a client sends can stop the loop, and every kind of state is capped
(:class:`AggregatorLimits`). A problem that makes a tensor impossible to finish (ranks disagree, a
rank breaks the protocol, a rank says GOODBYE, a slot makes no progress within the job's deadline)
aborts that tensor on every rank of the job at once, naming the ranks that did not contribute. After a
restart, a rank that had finished a slot sends FINAL with its sums, which are replayed to the ranks
that start the slot again.
"""

from __future__ import annotations

import hmac
import logging
import threading
import time
import uuid
from typing import Any

import numpy as np
import zmq

from omnireduce.aggregator.registry import AggregatorLimits, Job, Peer, TokenBucket
from omnireduce.aggregator.slot import Round, SlotState, SlotViolation, TensorMeta
from omnireduce.aggregator.telemetry import Telemetry
from omnireduce.config import env_secret
from omnireduce.errors import WireError
from omnireduce.wire import (
    SEQ_ALL,
    Abort,
    Bare,
    Bootstrap,
    Contribution,
    Error,
    ErrorCode,
    Header,
    Hello,
    Message,
    MsgType,
    Result,
    SlotSums,
    Status,
    Welcome,
    decode,
    encode,
    frame_bytes,
    header_dtype,
    unpack_header,
)

log = logging.getLogger("omnireduce.aggregator")

_LOOPBACK_HOSTS = {"127.0.0.1", "localhost", "::1", "[::1]"}
_SWEEP_SECONDS = 0.25

__all__ = ["Aggregator", "AggregatorLimits", "is_loopback"]


def is_loopback(address: str) -> bool:
    host = address.partition("://")[2].rpartition(":")[0]
    return address.startswith(("ipc://", "inproc://")) or host in _LOOPBACK_HOSTS


class Aggregator:
    """An omnireduce aggregator.

    ``Aggregator(listen="tcp://127.0.0.1:0", token=None)``; ``start()`` binds and serves from a
    background thread (``address`` is then the real address, port included), ``stop()`` ends it.
    It is also a context manager. ``serve_forever()`` serves from the calling thread instead (the
    CLI does this). A token is required to listen on anything but loopback unless ``insecure``.
    ``curve_secret_key`` (Z85) encrypts every connection with zmq CURVE; ``log_interval`` seconds
    between status log lines (0: none); ``socket_buffer`` bytes of TCP send/receive buffer per
    connection (0: the kernel's autotuning).
    """

    def __init__(self, listen: str = "tcp://127.0.0.1:0", token: str | None = None, *,
                 insecure: bool = False, limits: AggregatorLimits | None = None,
                 curve_secret_key: str | None = None, log_interval: float = 60.0, socket_buffer: int = 0) -> None:
        if token is None:
            token = env_secret("OMNIREDUCE_TOKEN")
        if not is_loopback(listen) and token is None and not insecure:
            raise ValueError(f"refusing to listen on {listen} without a token: anyone who can reach it "
                             "could join jobs. Set a token (--token-file / OMNIREDUCE_TOKEN) or pass "
                             "insecure=True (--insecure)")
        self.listen = listen
        self._token = token.encode() if token is not None else None
        self._curve_secret = curve_secret_key
        self._socket_buffer = socket_buffer
        self.limits = limits or AggregatorLimits()
        self.instance = uuid.uuid4().hex[:16]
        self.telemetry = Telemetry(log_interval)
        self._ctx: zmq.Context | None = None
        self._sock: zmq.Socket | None = None
        self._address: str | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._jobs: dict[int, Job] = {}
        self._jobs_by_name: dict[str, int] = {}
        self._peers: dict[bytes, Peer] = {}
        self._error_buckets: dict[bytes, TokenBucket] = {}
        self._rng = np.random.default_rng()
        self._next_sweep = 0.0
        self._footprint = 0  # all jobs' slot footprints

    @property
    def counters(self) -> dict[str, int]:
        return self.telemetry.snapshot()

    def gauges(self) -> dict[str, int]:
        return {"jobs": len(self._jobs), "peers": len(self._peers),
                "slots_in_flight": sum(len(j.slots) for j in list(self._jobs.values())),
                "held_bytes": self._footprint}

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
        if self._sock is None:
            self.bind()
        sock = self._sock
        assert sock is not None
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        log.info("serving on %s (instance %s)", self._address, self.instance)
        try:
            while not self._stop.is_set():
                if poller.poll(int(_SWEEP_SECONDS * 1000)):
                    for _ in range(256):
                        try:
                            frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
                        except zmq.Again:
                            break
                        self._handle(frames)
                now = time.monotonic()
                if now >= self._next_sweep:
                    self._next_sweep = now + _SWEEP_SECONDS
                    self._sweep(now)
                    self.telemetry.maybe_log(now, self.gauges)
        finally:
            if self._thread is None:
                self._close()

    # -- dispatch ------------------------------------------------------------------------------

    def _handle(self, frames: list[Any]) -> None:
        self.telemetry.count(messages_in=1, bytes_in=frame_bytes(frames))
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
            if hdr.mtype is MsgType.HELLO:
                self._on_hello(identity, decode(hdr, body[1:]))
                return
            job = self._member(identity, hdr)  # before decoding: a stranger learns nothing about its frames
            if job is None:
                return
            msg = decode(hdr, body[1:])
            if isinstance(msg, (Bootstrap, Contribution, SlotSums)):
                self._check_size(msg)
            handler(self, identity, job, msg)
        except WireError as e:
            self._reply_error(identity, hdr, ErrorCode.BAD_MESSAGE, f"{hdr.mtype.name}: {e}")
        except Exception:  # the loop must survive anything a client sends
            log.exception("internal error handling %s from %r", hdr.mtype.name, identity)
            self._reply_error(identity, hdr, ErrorCode.BAD_MESSAGE, "internal error in the aggregator")

    def _on_hello(self, identity: bytes, msg: Hello) -> None:
        hdr, name, rank, world_size = msg.header, msg.job, msg.rank, msg.world_size
        client, token, timeout = msg.client, msg.token, msg.timeout
        if self._token is not None:
            given = token.encode() if token is not None else b""
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
        if identity not in self._peers and len(self._peers) >= self.limits.max_peers:
            self._reply_error(identity, hdr, ErrorCode.LIMIT, f"too many connections ({self.limits.max_peers})")
            return
        job = self._job_for(name, world_size, identity, hdr, rank, timeout)
        if job is None:
            return
        old = job.members.get(rank)
        if old is not None and old != identity:
            previous = self._peers.get(old)
            if previous is not None and previous.client == client and client:
                self._peers.pop(old, None)  # the same worker process, reconnected: keep its place
            else:
                self._takeover(job, rank, old, client)
        prev = self._peers.get(identity)
        if prev is not None and (prev.job != job.handle or prev.rank != rank):
            self._leave(identity)
        job.members[rank] = identity
        job.deadline = max(job.deadline, timeout)
        self._peers[identity] = Peer(job.handle, rank, client)
        log.info("%s: rank %d of %d joined (client %s)", job.label(), rank, world_size, client)
        self._send(identity, Welcome(Header(MsgType.WELCOME, job=job.handle, rank=rank), name, world_size,
                                     self.instance))

    def _job_for(self, name: str, world_size: int, identity: bytes, hdr: Header, rank: int,
                 timeout: float) -> Job | None:
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
        job = Job(handle, name, world_size, deadline=timeout)
        self._jobs[handle] = job
        self._jobs_by_name[name] = handle
        return job

    def _takeover(self, job: Job, rank: int, old: bytes, client: str) -> None:
        reason = (f"rank {rank} of {job.label()} was taken over by another worker process (client "
                  f"{client}); tensors in flight were aborted")
        log.warning("%s", reason)
        self._peers.pop(old, None)
        self._reply_error(old, Header(MsgType.ERROR, job=job.handle, seq=SEQ_ALL), ErrorCode.REPLACED,
                          reason, force=True)
        for seq in sorted({s for s, _ in job.slots}):
            self._abort(job, seq, ErrorCode.ABORTED, reason)

    def _member(self, identity: bytes, hdr: Header) -> Job | None:
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
        job.last_seen = time.monotonic()
        return job

    def _check_size(self, msg: Bootstrap | Contribution | SlotSums) -> None:
        """A tensor message's geometry must fit this aggregator's message limit."""
        hdr, lay = msg.header, msg.layout
        if lay.lanes * lay.block_size * header_dtype(hdr).itemsize > self.limits.max_message_bytes:
            raise WireError(f"{lay.lanes} lanes of {lay.block_size} elements exceed the message limit")

    @staticmethod
    def _meta(msg: Bootstrap | Contribution | SlotSums) -> TensorMeta:
        """What every rank must agree on about the tensor a message describes."""
        lay = msg.layout
        return TensorMeta(lay.numel, header_dtype(msg.header), lay.block_size, lay.lanes, lay.slots)

    def _slot_for(self, job: Job, identity: bytes, msg: Bootstrap | SlotSums) -> SlotState | None:
        """The slot's state (created on first sight), or None after an abort or error reply."""
        hdr, meta = msg.header, self._meta(msg)
        if hdr.seq in job.aborted:
            self._reply_error(identity, hdr, ErrorCode.ABORTED,
                              f"tensor {hdr.seq} of {job.label()} was aborted: {job.aborted[hdr.seq]}")
            return None
        key = (hdr.seq, hdr.slot)
        state = job.slots.get(key)
        if state is None:
            need = SlotState.base_bytes(job.world_size, meta.lanes)
            why = (f"{job.label()} has {len(job.slots)} tensor slots in flight, the limit is "
                   f"{self.limits.max_slots_per_job}" if len(job.slots) >= self.limits.max_slots_per_job
                   else self._over_budget(job, need))
            if why:
                self._abort(job, hdr.seq, ErrorCode.LIMIT, why)
                return None
            state = SlotState(meta, hdr.slot, job.world_size, hdr.rank)
            job.add(key, state)
            self._footprint += state.footprint
        elif state.meta != meta:
            diffs = "; ".join(f"{label}: rank {state.first_rank} has {a}, rank {hdr.rank} has {b}"
                              for label, a, b in state.meta.differences(meta))
            self._abort(job, hdr.seq, ErrorCode.MISMATCH,
                        f"ranks disagree about tensor {hdr.seq} of {job.label()}: {diffs}")
            return None
        return state

    def _on_bootstrap(self, identity: bytes, job: Job, msg: Bootstrap) -> None:
        hdr = msg.header
        job.watermarks[hdr.rank] = max(job.watermarks.get(hdr.rank, 0), hdr.watermark)
        state = self._slot_for(job, identity, msg)
        if state is None:
            return
        if state.final is not None:  # recovery: another rank already sent this slot's sums
            state.accounted.add(hdr.rank)
            self._replay(job, hdr.seq, state, [identity])
            self._free_if_accounted(job, hdr.seq, state)
            return
        self._advance(job, hdr, state, lambda: state.bootstrap(hdr.rank, msg.rows))

    def _on_contrib(self, identity: bytes, job: Job, msg: Contribution) -> None:
        hdr = msg.header
        state = job.slots.get((hdr.seq, hdr.slot))
        if state is None:
            aborted = job.aborted.get(hdr.seq)
            self._reply_error(identity, hdr, ErrorCode.ABORTED if aborted else ErrorCode.PROTOCOL,
                              f"tensor {hdr.seq} slot {hdr.slot} of {job.label()} is not in progress"
                              + (f" (aborted: {aborted})" if aborted else ""))
            return
        if self._meta(msg) != state.meta:
            raise WireError(f"the header describes another tensor than slot {hdr.slot} of tensor {hdr.seq}")
        if hdr.count != state.expected_count(hdr.rank):
            raise WireError(f"count {hdr.count}, but the instruction asks rank {hdr.rank} for "
                            f"{state.expected_count(hdr.rank)} blocks of slot {hdr.slot} in this round")
        why = self._over_budget(job, int(msg.data.nbytes))
        if why:
            self._abort(job, hdr.seq, ErrorCode.LIMIT, why)
            return
        self._advance(job, hdr, state, lambda: state.contribute(hdr.rank, hdr.round, msg.rows, msg.data))

    def _over_budget(self, job: Job, more: int) -> str:
        """Why holding ``more`` bytes for ``job`` would break a memory limit ("" if it would not)."""
        if job.footprint + more > self.limits.max_job_bytes:
            return f"{job.label()} would hold more than {self.limits.max_job_bytes} bytes (limit per job)"
        if self._footprint + more > self.limits.max_total_bytes:
            return f"the aggregator would hold more than {self.limits.max_total_bytes} bytes (limit for all jobs)"
        return ""

    def _adjust(self, job: Job, state: SlotState, before: int) -> None:
        """Account for a change of ``state``'s footprint (it was ``before``)."""
        delta = state.footprint - before
        job.footprint += delta
        self._footprint += delta

    def _drop(self, job: Job, key: tuple[int, int]) -> None:
        self._footprint -= job.drop(key)

    def _on_final(self, identity: bytes, job: Job, msg: SlotSums) -> None:
        """A rank's sums of a slot it finished before this aggregator (re)started: replay them."""
        hdr = msg.header
        state = self._slot_for(job, identity, msg)
        if state is None:
            return
        state.accounted.add(hdr.rank)
        state.updated = time.monotonic()
        if state.cur is not None:  # rounds are running: every rank bootstrapped, nobody needs this
            return
        if state.final is None:
            why = self._over_budget(job, int(msg.ids.nbytes + msg.data.nbytes))
            if why:
                self._abort(job, hdr.seq, ErrorCode.LIMIT, why)
                return
            before = state.footprint
            state.final = (msg.ids, msg.data)
            self._adjust(job, state, before)
            waiting = [job.members[r] for r in state.booted_ranks() if r in job.members]
            self._replay(job, hdr.seq, state, waiting)
        self._free_if_accounted(job, hdr.seq, state)

    def _replay(self, job: Job, seq: int, state: SlotState, identities: list[bytes]) -> None:
        assert state.final is not None
        ids, data = state.final
        hdr = Header(MsgType.REPLAY, dtype=int(state.meta.dtype), job=job.handle, seq=seq, slot=state.slot,
                     count=int(ids.size), watermark=job.watermark)
        payload = encode(SlotSums(hdr, state.layout, ids, data))
        for ident in identities:
            self._send_raw(ident, payload)
        self.telemetry.count(replays=len(identities))

    def _free_if_accounted(self, job: Job, seq: int, state: SlotState) -> None:
        if len(state.accounted) >= job.world_size and job.slots.get((seq, state.slot)) is state:
            self._drop(job, (seq, state.slot))

    def _advance(self, job: Job, hdr: Header, state: SlotState, step: Any) -> None:
        """Run ``step`` (a bootstrap or contribution of ``state``); broadcast the round it completes."""
        before = state.footprint
        try:
            result: Round | None = step()
            self._adjust(job, state, before)
        except SlotViolation as e:
            self._abort(job, hdr.seq, ErrorCode.PROTOCOL,
                        f"tensor {hdr.seq} slot {hdr.slot} of {job.label()}: {e}")
            return
        if result is None:
            return
        out = Header(MsgType.RESULT, dtype=hdr.dtype, job=job.handle, seq=hdr.seq, slot=hdr.slot,
                     round=result.round, count=result.count, watermark=job.watermark)
        payload = encode(Result(out, state.layout, result.cur, result.data))
        for _rank, ident in sorted(job.members.items()):
            self._send_raw(ident, payload)
        if result.finished:
            self._drop(job, (hdr.seq, hdr.slot))
            self.telemetry.count(slots_completed=1, blocks_union=state.blocks_union,
                                 blocks_total=state.blocks_total)

    def _on_query(self, identity: bytes, job: Job, msg: Bare) -> None:
        hdr = msg.header
        slots = [{"slot": slot, "round": st.round + (1 if st.cur is not None else 0),
                  "phase": "bootstrap" if st.cur is None else "contribution", "missing": st.missing()}
                 for (seq, slot), st in sorted(job.slots.items()) if seq == hdr.seq]
        info: dict[str, Any] = {"seq": hdr.seq, "slots": slots, "members": sorted(job.members),
                                "world_size": job.world_size}
        if hdr.seq in job.aborted:
            info["aborted"] = job.aborted[hdr.seq]
        self._send(identity, Status(Header(MsgType.STATUS, job=job.handle, seq=hdr.seq), info))

    def _on_abort(self, identity: bytes, job: Job, msg: Abort) -> None:
        hdr = msg.header
        reason = f"aborted by rank {hdr.rank}" + (f": {msg.reason}" if msg.reason else "")
        code = ErrorCode.TIMEOUT if msg.timeout else ErrorCode.ABORTED  # the others timed out too
        if hdr.seq in job.aborted or not any(s == hdr.seq for s, _ in job.slots):
            job.remember_abort(hdr.seq, reason)
            return
        self._abort(job, hdr.seq, code, reason)

    def _on_goodbye(self, identity: bytes, job: Job, msg: Bare) -> None:
        hdr = msg.header
        for seq in sorted({seq for (seq, _), st in job.slots.items() if hdr.rank in st.missing()}):
            self._abort(job, seq, ErrorCode.ABORTED, f"rank {hdr.rank} left {job.label()} (GOODBYE) while "
                        f"tensor {seq} was waiting for it")
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
            self._forget(job, "no ranks left")

    def _forget(self, job: Job, why: str) -> None:
        log.info("%s: %s, freed (%d slots in flight dropped)", job.label(), why, len(job.slots))
        for key in list(job.slots):
            self._drop(job, key)
        for ident in job.members.values():
            self._peers.pop(ident, None)
        self._jobs.pop(job.handle, None)
        if self._jobs_by_name.get(job.name) == job.handle:
            del self._jobs_by_name[job.name]

    _HANDLERS = {
        MsgType.HELLO: _on_hello,
        MsgType.BOOTSTRAP: _on_bootstrap,
        MsgType.CONTRIB: _on_contrib,
        MsgType.FINAL: _on_final,
        MsgType.QUERY: _on_query,
        MsgType.ABORT: _on_abort,
        MsgType.GOODBYE: _on_goodbye,
    }

    # -- deadlines, aborts and errors ----------------------------------------------------------

    def _sweep(self, now: float) -> None:
        """Give up on slots that made no progress within their job's deadline; forget idle jobs."""
        for job in list(self._jobs.values()):
            for (seq, slot), st in list(job.slots.items()):
                if now - st.updated <= job.deadline or (seq, slot) not in job.slots:
                    continue
                self.telemetry.count(deadlines_expired=1)
                if st.final is not None:
                    # Every rank that bootstrapped was sent the replay; the others finished the tensor
                    # before the restart, or are gone (a late one times out on its own deadline).
                    log.info("tensor %d slot %d of %s: replayed sums dropped; ranks %s never asked for them",
                             seq, slot, job.label(), st.missing())
                    self._drop(job, (seq, slot))
                    continue
                # Worded like the worker's own timeout (whichever reaches the rank first says the same).
                rnd = st.round + (1 if st.cur is not None else 0)
                self._abort(job, seq, ErrorCode.TIMEOUT,
                            f"tensor {seq} of {job.label()} timed out after {job.deadline:g} s at the aggregator: "
                            f"slot {slot} round {rnd}: waiting for ranks {st.missing()} (they did not contribute); "
                            "the tensor was dropped")
            if not job.slots and now - job.last_seen > self.limits.idle_job_seconds:
                self._forget(job, f"idle for {self.limits.idle_job_seconds:g} s")

    def _abort(self, job: Job, seq: int, code: ErrorCode, reason: str) -> None:
        """Drop every slot of tensor ``seq`` and tell every rank of the job why."""
        log.warning("%s", reason)
        for key in [k for k in job.slots if k[0] == seq]:
            self._drop(job, key)
        job.remember_abort(seq, reason)
        self.telemetry.count(tensors_aborted=1)
        hdr = Header(MsgType.ERROR, job=job.handle, seq=seq)
        for ident in job.members.values():
            self._reply_error(ident, hdr, code, reason, force=True)

    def _reply_error(self, identity: bytes, about: Header, code: ErrorCode, message: str, *,
                     force: bool = False) -> None:
        if not force and not self._error_bucket(identity).take():
            self.telemetry.count(errors_suppressed=1)
            return
        self.telemetry.count(errors_sent=1)
        hdr = Header(MsgType.ERROR, flags=int(code), job=about.job, rank=about.rank, seq=about.seq,
                     slot=about.slot, round=about.round)
        self._send(identity, Error(hdr, code, message))

    def _error_bucket(self, identity: bytes) -> TokenBucket:
        bucket = self._error_buckets.get(identity)
        if bucket is None:
            if len(self._error_buckets) >= 10000:
                self._error_buckets.clear()
            bucket = self._error_buckets[identity] = TokenBucket(self.limits.error_replies_per_second)
        return bucket

    # -- sending -------------------------------------------------------------------------------

    def _send(self, identity: bytes, msg: Message) -> None:
        self._send_raw(identity, encode(msg))

    def _send_raw(self, identity: bytes, frames: list[Any]) -> None:
        assert self._sock is not None
        try:
            self._sock.send_multipart([identity, *frames], copy=False)
        except zmq.ZMQError as e:  # peer gone (ROUTER_MANDATORY) or queue full
            self.telemetry.count(send_failures=1)
            log.debug("could not send to %r: %s", identity, e)
            return
        self.telemetry.count(messages_out=1, bytes_out=frame_bytes(frames))
