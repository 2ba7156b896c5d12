"""The aggregator without its socket: decoded messages in, frames out through an injectable ``send``.

Design. :class:`Core` is everything the aggregator does between receiving a message and sending the
answers, with no socket: :meth:`Core.handle` takes one message (the sender's zmq identity and the
frames after it), :meth:`Core.sweep` the clock, and every message leaves through ``core.send(identity,
frames)``. The service (service.py) passes its socket's send; tests wrap or replace it to watch, lose
or capture messages, and can drive a core with no socket at all.

Handling a message is: check the header, check that the sender is a member (:mod:`.registry`;
before the frames are decoded, so that a stranger learns nothing about them), decode it into a typed
message (:mod:`omnireduce.wire`), look up its job and slot, call the slot (:mod:`.slot`: rounds and
recovery), and send what the call returned. Membership is the registry's, memory limits the budget's
(:mod:`.budget`), the protocol the slot's; the core only checks the caps on slots and message sizes
and turns decisions into messages.

Faults. Anything wrong with a message is answered with an ERROR (rate-limited per connection,
:mod:`.throttle`) or dropped; nothing a client sends can stop the loop. A problem that makes a
tensor impossible to finish (ranks disagree, a rank breaks the protocol, a rank says GOODBYE or is
taken over, a limit is hit, a slot makes no progress within the job's deadline) aborts that tensor on
every rank of the job at once, saying why.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, ClassVar

from omnireduce.aggregator.budget import Budget
from omnireduce.aggregator.job import Job
from omnireduce.aggregator.limits import AggregatorLimits
from omnireduce.aggregator.registry import Refused, Registry
from omnireduce.aggregator.slot import Phase, Replay, Round, SlotState, SlotViolation, TensorMeta
from omnireduce.aggregator.telemetry import Telemetry
from omnireduce.aggregator.throttle import Throttle
from omnireduce.errors import WireError
from omnireduce.wire import (
    FLAG_EAGER,
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
    header_dtype,
    unpack_header,
)

log = logging.getLogger("omnireduce.aggregator")

#: How a message leaves: ``send(identity, frames)``, the header frame first.
Send = Callable[[bytes, list[Any]], None]


def tensor_meta(msg: Bootstrap | Contribution | SlotSums) -> TensorMeta:
    """What every rank must agree on about the tensor a message describes."""
    lay = msg.layout
    return TensorMeta(lay.numel, header_dtype(msg.header), lay.block_size, lay.lanes, lay.slots)


class Core:
    """The aggregator's jobs, slots and protocol, behind :meth:`handle` and :meth:`sweep`.

    ``send`` is the hook every message leaves through (see the module's docstring); it may be
    replaced at any time by assigning ``core.send``."""

    def __init__(self, send: Send, *, limits: AggregatorLimits, token: str | None, instance: str,
                 telemetry: Telemetry) -> None:
        self.send = send
        self.limits = limits
        self.instance = instance
        self.telemetry = telemetry
        self.budget = Budget(limits)
        self.registry = Registry(limits, token, self.budget)
        self._throttle = Throttle(limits.error_replies_per_second)

    def gauges(self) -> dict[str, int]:
        jobs = list(self.registry.jobs.values())
        return {"jobs": len(jobs), "peers": self.registry.peers,
                "slots_in_flight": sum(len(j.slots) for j in jobs), "held_bytes": self.budget.total.bytes}

    # -- dispatch ------------------------------------------------------------------------------

    def handle(self, identity: bytes, frames: list[Any], now: float | None = None) -> None:
        """One message from the connection ``identity``: its frames (buffers), the header first, which
        arrived at ``now`` (time.monotonic(); read here when not given)."""
        if now is None:
            now = time.monotonic()
        if not frames:
            self._reply_error(identity, Header(MsgType.ERROR), ErrorCode.BAD_MESSAGE, "empty message")
            return
        try:
            hdr = unpack_header(frames[0])
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
                hello = decode(hdr, frames[1:])
                if not isinstance(hello, Hello):
                    raise WireError(f"a HELLO header decoded as {type(hello).__name__}")
                self._on_hello(identity, hello)
                return
            job = self.registry.member(identity, hdr, now)  # before decoding (see above)
            msg = decode(hdr, frames[1:])
            if isinstance(msg, (Bootstrap, Contribution, SlotSums)):
                self._check_size(msg)
            handler(self, identity, job, msg, now)
        except Refused as e:
            self._reply_error(identity, hdr, e.code, str(e))
            if e.job is not None:  # the job cannot go on as its members think: tell them now
                for member in e.job.members.values():
                    self._reply_error(member, Header(MsgType.ERROR, job=e.job.handle, seq=SEQ_ALL), e.code,
                                      f"{e} (that rank was refused)", force=True)
        except WireError as e:
            self._reply_error(identity, hdr, ErrorCode.BAD_MESSAGE, f"{hdr.mtype.name}: {e}")
        except Exception:  # the loop must survive anything a client sends
            log.exception("internal error handling %s from %r", hdr.mtype.name, identity)
            self._reply_error(identity, hdr, ErrorCode.BAD_MESSAGE, "internal error in the aggregator")

    def _check_size(self, msg: Bootstrap | Contribution | SlotSums) -> None:
        """A tensor message's geometry must fit this aggregator's message limit."""
        hdr, lay = msg.header, msg.layout
        if lay.lanes * lay.block_size * header_dtype(hdr).itemsize > self.limits.max_message_bytes:
            raise WireError(f"{lay.lanes} lanes of {lay.block_size} elements exceed the message limit")

    # -- membership ----------------------------------------------------------------------------

    def _on_hello(self, identity: bytes, msg: Hello) -> None:
        job, replaced = self.registry.admit(identity, msg)
        if replaced is not None:
            self._takeover(job, msg.rank, replaced, msg.client)
        self.registry.register(identity, job, msg)
        self._send(identity, Welcome(Header(MsgType.WELCOME, job=job.handle, rank=msg.rank), msg.job,
                                     job.world_size, self.instance))

    def _takeover(self, job: Job, rank: int, old: bytes, client: str) -> None:
        """Tell the connection that had ``rank`` it lost it; abort the job's tensors in flight."""
        reason = (f"rank {rank} of {job.label()} was taken over by another worker process (client "
                  f"{client}); tensors in flight were aborted")
        log.warning("%s", reason)
        self._reply_error(old, Header(MsgType.ERROR, job=job.handle, seq=SEQ_ALL), ErrorCode.REPLACED,
                          reason, force=True)
        for seq in job.in_flight():
            self._abort(job, seq, ErrorCode.ABORTED, reason)

    def _on_goodbye(self, identity: bytes, job: Job, msg: Bare, now: float) -> None:
        rank = msg.header.rank
        for seq in job.waiting_for(rank):
            self._abort(job, seq, ErrorCode.ABORTED, f"rank {rank} left {job.label()} (GOODBYE) while "
                        f"tensor {seq} was waiting for it")
        self.registry.leave(identity)

    # -- tensors -------------------------------------------------------------------------------

    def _slot_for(self, job: Job, identity: bytes, msg: Bootstrap | SlotSums, now: float) -> SlotState | None:
        """The slot's state (opened on first sight), or None after an abort or error reply."""
        hdr, meta = msg.header, tensor_meta(msg)
        if hdr.seq in job.aborted:
            self._reply_error(identity, hdr, ErrorCode.ABORTED,
                              f"tensor {hdr.seq} of {job.label()} was aborted: {job.aborted[hdr.seq]}",
                              cause=job.abort_codes.get(hdr.seq))
            return None
        state = job.slots.get((hdr.seq, hdr.slot))
        if state is None:
            why = (f"{job.label()} has {len(job.slots)} tensor slots in flight, the limit is "
                   f"{self.limits.max_slots_per_job}" if len(job.slots) >= self.limits.max_slots_per_job
                   else self.budget.refuse(job, SlotState.base_bytes(job.world_size, meta.lanes)))
            if why:
                self._abort(job, hdr.seq, ErrorCode.LIMIT, why)
                return None
            return job.open(hdr.seq, hdr.slot, meta, hdr.rank, now)
        if state.meta != meta:
            diffs = "; ".join(f"{label}: rank {state.first_rank} has {a}, rank {hdr.rank} has {b}"
                              for label, a, b in state.meta.differences(meta))
            self._abort(job, hdr.seq, ErrorCode.MISMATCH,
                        f"ranks disagree about tensor {hdr.seq} of {job.label()}: {diffs}")
            return None
        return state

    def _on_bootstrap(self, identity: bytes, job: Job, msg: Bootstrap, now: float) -> None:
        hdr = msg.header
        job.note_watermark(hdr.rank, hdr.watermark)
        state = self._slot_for(job, identity, msg, now)
        if state is None:
            return
        if msg.data is not None and state.phase is Phase.BOOTSTRAP:
            why = self.budget.refuse(job, int(msg.data.nbytes))
            if why:
                self._abort(job, hdr.seq, ErrorCode.LIMIT, why)
                return
        self._step(job, hdr, state, lambda: state.bootstrap(hdr.rank, msg.rows, msg.data, now=now))

    def _on_contrib(self, identity: bytes, job: Job, msg: Contribution, now: float) -> None:
        hdr = msg.header
        state = job.slots.get((hdr.seq, hdr.slot))
        if state is None:
            aborted = job.aborted.get(hdr.seq)
            self._reply_error(identity, hdr, ErrorCode.ABORTED if aborted else ErrorCode.PROTOCOL,
                              f"tensor {hdr.seq} slot {hdr.slot} of {job.label()} is not in progress"
                              + (f" (aborted: {aborted})" if aborted else ""),
                              cause=job.abort_codes.get(hdr.seq) if aborted else None)
            return
        if tensor_meta(msg) != state.meta:
            raise WireError(f"the header describes another tensor than slot {hdr.slot} of tensor {hdr.seq}")
        if hdr.count != state.expected_count(hdr.rank):
            raise WireError(f"count {hdr.count}, but the instruction asks rank {hdr.rank} for "
                            f"{state.expected_count(hdr.rank)} blocks of slot {hdr.slot} in this round")
        why = self.budget.refuse(job, int(msg.data.nbytes))
        if why:
            self._abort(job, hdr.seq, ErrorCode.LIMIT, why)
            return
        self._step(job, hdr, state, lambda: state.contribute(hdr.rank, hdr.round, msg.rows, msg.data, now=now))

    def _on_final(self, identity: bytes, job: Job, msg: SlotSums, now: float) -> None:
        """A rank's sums of a slot it finished before this aggregator (re)started."""
        hdr = msg.header
        state = self._slot_for(job, identity, msg, now)
        if state is None:
            return
        cost = state.final_cost(msg.ids, msg.data)
        why = self.budget.refuse(job, cost) if cost else ""
        if why:
            self._abort(job, hdr.seq, ErrorCode.LIMIT, why)
            return
        self._step(job, hdr, state, lambda: state.take_final(hdr.rank, msg.ids, msg.data, now=now))

    def _step(self, job: Job, hdr: Header, state: SlotState, call: Callable[[], Round | Replay | None]) -> None:
        """Call the slot and send what it returns: a round's result to every rank, or a replay."""
        try:
            out = call()
        except SlotViolation as e:
            self._abort(job, hdr.seq, ErrorCode.PROTOCOL, f"tensor {hdr.seq} slot {hdr.slot} of {job.label()}: {e}")
            return
        if isinstance(out, Round):
            self._broadcast(job, hdr.seq, state, out)
        elif isinstance(out, Replay):
            self._replay(job, hdr.seq, state, out)

    def _broadcast(self, job: Job, seq: int, state: SlotState, result: Round) -> None:
        out = Header(MsgType.RESULT, dtype=int(state.meta.dtype), flags=FLAG_EAGER if result.eager else 0,
                     job=job.handle, seq=seq, slot=state.slot, round=result.round, count=result.count,
                     watermark=job.watermark)
        payload = encode(Result(out, state.layout, result.cur, result.data))
        if result.finished:  # counted before the ranks can learn of it (and ask the metrics endpoint)
            job.drop((seq, state.slot))
            self.telemetry.count(slots_completed=1, blocks_union=state.blocks_union,
                                 blocks_total=state.blocks_total)
        for _rank, ident in sorted(job.members.items()):
            self.send(ident, payload)

    def _replay(self, job: Job, seq: int, state: SlotState, replay: Replay) -> None:
        identities = [job.members[r] for r in replay.ranks if r in job.members]
        if identities:
            hdr = Header(MsgType.REPLAY, dtype=int(state.meta.dtype), job=job.handle, seq=seq, slot=state.slot,
                         count=int(replay.ids.size), watermark=job.watermark)
            payload = encode(SlotSums(hdr, state.layout, replay.ids, replay.data))
            for ident in identities:
                self.send(ident, payload)
        self.telemetry.count(replays=len(identities))
        if replay.finished:
            job.drop((seq, state.slot))

    def _on_query(self, identity: bytes, job: Job, msg: Bare, now: float) -> None:
        seq = msg.header.seq
        info: dict[str, Any] = {"seq": seq, "slots": [st.status() for (s, _), st in sorted(job.slots.items())
                                                      if s == seq],
                                "members": sorted(job.members), "world_size": job.world_size}
        if seq in job.aborted:
            info["aborted"] = job.aborted[seq]
        self._send(identity, Status(Header(MsgType.STATUS, job=job.handle, seq=seq), info))

    def _on_abort(self, identity: bytes, job: Job, msg: Abort, now: float) -> None:
        hdr = msg.header
        reason = f"aborted by rank {hdr.rank}" + (f": {msg.reason}" if msg.reason else "")
        code = ErrorCode.TIMEOUT if msg.timeout else ErrorCode.ABORTED  # the others timed out too
        if hdr.seq in job.aborted or not job.has_tensor(hdr.seq):
            job.remember_abort(hdr.seq, reason, job.abort_codes.get(hdr.seq, code))  # (the first cause stays)
            return
        self._abort(job, hdr.seq, code, reason)

    _HANDLERS: ClassVar[dict[MsgType, Callable[..., None]]] = {
        MsgType.HELLO: _on_hello,
        MsgType.BOOTSTRAP: _on_bootstrap,
        MsgType.CONTRIB: _on_contrib,
        MsgType.FINAL: _on_final,
        MsgType.QUERY: _on_query,
        MsgType.ABORT: _on_abort,
        MsgType.GOODBYE: _on_goodbye,
    }

    # -- deadlines, aborts and errors ----------------------------------------------------------

    def sweep(self, now: float) -> None:
        """Give up on slots that made no progress within their job's deadline; forget idle jobs.
        ``now``: time.monotonic()."""
        for job in list(self.registry.jobs.values()):
            for key, state in list(job.slots.items()):
                expired = state.expire(now, job.deadline)
                if expired is None or key not in job.slots:  # (an abort of its tensor may have dropped it)
                    continue
                self.telemetry.count(deadlines_expired=1)
                seq, slot = key
                if expired.replayed:
                    log.info("tensor %d slot %d of %s: replayed sums dropped; ranks %s never asked for them",
                             seq, slot, job.label(), expired.missing)
                    job.drop(key)
                    continue
                # Worded like the worker's own timeout (whichever reaches the rank first says the same).
                self._abort(job, seq, ErrorCode.TIMEOUT,
                            f"tensor {seq} of {job.label()} timed out after {job.deadline:g} s at the aggregator: "
                            f"slot {slot} round {expired.round}: waiting for ranks {expired.missing} (they did "
                            "not contribute); the tensor was dropped")
            if job.idle(now, self.limits.idle_job_seconds):
                self.registry.forget(job, f"idle for {self.limits.idle_job_seconds:g} s")

    def _abort(self, job: Job, seq: int, code: ErrorCode, reason: str) -> None:
        """Drop every slot of tensor ``seq`` and tell every rank of the job why."""
        log.warning("%s", reason)
        job.drop_tensor(seq)
        job.remember_abort(seq, reason, code)
        self.telemetry.count(tensors_aborted=1)
        hdr = Header(MsgType.ERROR, job=job.handle, seq=seq)
        for ident in job.members.values():
            self._reply_error(ident, hdr, code, reason, force=True)

    def _reply_error(self, identity: bytes, about: Header, code: ErrorCode, message: str, *,
                     force: bool = False, cause: ErrorCode | None = None) -> None:
        if not force and not self._throttle.allow(identity):
            self.telemetry.count(errors_suppressed=1)
            return
        self.telemetry.count(errors_sent=1)
        hdr = Header(MsgType.ERROR, flags=int(code), job=about.job, rank=about.rank, seq=about.seq,
                     slot=about.slot, round=about.round)
        self._send(identity, Error(hdr, code, message, cause))

    def _send(self, identity: bytes, msg: Message) -> None:
        self.send(identity, encode(msg))
