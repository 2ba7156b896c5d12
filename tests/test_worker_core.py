"""The worker core alone: no sockets, no aggregator, a clock the test moves.

Each test plays the aggregators by hand: it reads what the core sent (its ``send`` records the
messages) and answers with messages built here, encoded and decoded through the wire format as
the I/O loop would. What the core must do is stated independently of it: the QUERY and the timeout
that names the ranks a STATUS said were missing, the retry bound, the kept sums and their release,
and TensorOp's phases.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import pytest

from omnireduce.blocks import INF, Layout
from omnireduce.config import WorkerConfig
from omnireduce.dtypes import DType
from omnireduce.errors import OmniReduceError, OmniReduceTimeout
from omnireduce.sources.host import HostSource
from omnireduce.wire import (
    FLAG_EAGER,
    FLAG_RETRY,
    Abort,
    Bare,
    Bootstrap,
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
    unpack_header,
)
from omnireduce.worker.core import MAX_RETRIES, WorkerCore
from omnireduce.worker.op import IllegalTransition, Phase, ReduceFuture, TensorOp

TIMEOUT = 10.0
T0 = 1000.0  # the clock at the start of each test (any number: the core never reads a clock)


class _Harness:
    """One rank's core, the messages it sent, and the aggregators' side played by the test."""

    def __init__(self, *, world: int, aggregators: int, rank: int = 0, retain_bytes: int = 1 << 30) -> None:
        self.addresses = tuple(f"tcp://agg-{a}:1" for a in range(aggregators))
        cfg = WorkerConfig(self.addresses, rank=rank, world_size=world, job="unit", timeout=TIMEOUT,
                           retain_bytes=retain_bytes)
        self.sent: list[tuple[int, Message]] = []
        self.core = WorkerCore(cfg, "client", self._send, T0)
        self.handles = [100 + a for a in range(aggregators)]

    def _send(self, agg: int, msg: Message) -> int:
        self.sent.append((agg, msg))
        return frame_bytes(encode(msg))

    def take(self, mtype: MsgType | None = None) -> list[tuple[int, Message]]:
        """The messages sent since the last call (of type ``mtype``; the others are dropped)."""
        out, self.sent = self.sent, []
        return [(a, m) for a, m in out if mtype is None or m.header.mtype is mtype]

    def deliver(self, agg: int, msg: Message, now: float) -> None:
        """``msg`` from aggregator ``agg``, through the wire format."""
        frames = [bytearray(f.tobytes() if isinstance(f, np.ndarray) else f) for f in encode(msg)]
        hdr = unpack_header(frames[0])
        self.core.receive(agg, hdr, functools.partial(decode, hdr, frames[1:]), frame_bytes(frames), now)

    def welcome(self, agg: int, instance: str, now: float = T0) -> None:
        self.deliver(agg, Welcome(Header(MsgType.WELCOME, job=self.handles[agg]), "unit",
                                  self.core.cfg.world_size, instance), now)

    def join(self) -> None:
        """HELLO to every aggregator, each welcomes this rank."""
        self.core.greet()
        hellos = self.take(MsgType.HELLO)
        assert sorted(a for a, _ in hellos) == list(range(len(self.addresses)))
        assert all(isinstance(m, Hello) and m.rank == self.core.cfg.rank for _, m in hellos)
        for a in range(len(self.addresses)):
            self.welcome(a, f"first-{a}")
        assert self.core.hello.done() and self.core.hello.exception() is None

    def submit(self, values: np.ndarray, layout: Layout, seq: int = 0,
               now: float = T0) -> tuple[TensorOp, ReduceFuture]:
        """Start a tensor; returns it and its future (the op lets go of the future once completed)."""
        future = ReduceFuture()
        future.set_running_or_notify_cancel()
        cfg = self.core.cfg
        op = TensorOp(seq, values, HostSource(values, DType.FLOAT32, layout, None), rank=cfg.rank,
                      world_size=cfg.world_size, num_aggregators=len(self.addresses), average=False,
                      threshold=0.0, future=future)
        self.core.start(self.core.flight(op, now), now)
        return op, future


def _values(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(n).astype(np.float32)


# -- deadlines -------------------------------------------------------------------------------------


def _timed_out_setup() -> tuple[_Harness, ReduceFuture]:
    h = _Harness(world=3, aggregators=2)
    h.join()
    layout = Layout(64, 4, 4, 2)  # two slots: slot 0 at aggregator 0, slot 1 at aggregator 1
    _, future = h.submit(_values(64, 1), layout)
    boots = h.take(MsgType.BOOTSTRAP)
    assert sorted((a, m.header.slot) for a, m in boots) == [(0, 0), (1, 1)]
    assert all(m.header.job == h.handles[a] for a, m in boots)  # under each connection's job handle
    return h, future


def test_a_passed_deadline_queries_the_aggregators_then_names_the_missing_ranks() -> None:
    h, future = _timed_out_setup()
    h.core.tick(T0 + TIMEOUT - 0.01)
    assert h.take() == [] and not future.done()
    assert h.core.next_wakeup(T0 + TIMEOUT - 0.01) == pytest.approx(T0 + TIMEOUT)  # (the deadline is due)
    h.core.tick(T0 + TIMEOUT)
    queries = h.take()
    assert sorted(a for a, _ in queries) == [0, 1]
    assert all(isinstance(m, Bare) and m.header.mtype is MsgType.QUERY and m.header.seq == 0 for _, m in queries)
    grace = min(1.0, TIMEOUT / 2)
    assert h.core.next_wakeup(T0 + TIMEOUT + grace - 0.1) == pytest.approx(T0 + TIMEOUT + grace)
    # aggregator 0 answers; aggregator 1 does not: the tensor fails when the grace period ends
    h.deliver(0, Status(Header(MsgType.STATUS, job=h.handles[0], seq=0),
                        {"seq": 0, "slots": [{"slot": 0, "missing": [1, 2], "phase": "bootstrap"}]}), T0 + TIMEOUT)
    assert not future.done()
    h.core.tick(T0 + TIMEOUT + grace - 0.01)
    assert not future.done()
    h.core.tick(T0 + TIMEOUT + grace)
    error = future.exception()
    assert isinstance(error, OmniReduceTimeout)
    text = str(error)
    assert f"timed out after {TIMEOUT + grace:.1f} s" in text
    assert "slot 0 round 0 at tcp://agg-0:1: waiting for ranks [1, 2] (bootstrap)" in text
    assert "slot 1 round 0 at tcp://agg-1:1: the aggregator did not answer" in text
    aborts = h.take()
    assert sorted(a for a, _ in aborts) == [0, 1]
    assert all(isinstance(m, Abort) and m.timeout and m.header.seq == 0 for _, m in aborts)
    assert h.core.snapshot()["tensors_failed"] == 1
    h.core.tick(T0 + 10 * TIMEOUT)
    assert h.take() == []  # failed once, and forgotten


def test_the_last_status_fails_the_tensor_at_once() -> None:
    h, future = _timed_out_setup()
    h.core.tick(T0 + TIMEOUT)
    h.take()
    h.deliver(1, Status(Header(MsgType.STATUS, job=h.handles[1], seq=0),
                        {"seq": 0, "slots": [], "aborted": "aborted by rank 2: out of memory"}), T0 + TIMEOUT)
    assert not future.done()
    h.deliver(0, Status(Header(MsgType.STATUS, job=h.handles[0], seq=0),
                        {"seq": 0, "slots": [{"slot": 0, "missing": [2], "phase": "round 1"}]}), T0 + TIMEOUT + 0.25)
    text = str(future.exception())
    assert "timed out after 10.2 s" in text
    assert "slot 0 round 0 at tcp://agg-0:1: waiting for ranks [2] (round 1)" in text
    assert ("slot 1 round 0 at tcp://agg-1:1: the aggregator has no state for it (aborted: aborted by rank 2: "
            "out of memory)") in text


def test_first_contact_has_a_deadline_too() -> None:
    h = _Harness(world=2, aggregators=2)
    h.core.greet()
    h.welcome(1, "only-one")
    h.core.tick(T0 + TIMEOUT - 0.01)
    assert not h.core.hello.done()
    h.core.tick(T0 + TIMEOUT)
    error = h.core.hello.exception()
    assert isinstance(error, OmniReduceTimeout) and "no answer from aggregator(s) tcp://agg-0:1 within" in str(error)


# -- retries after restarts ------------------------------------------------------------------------


def test_each_restart_retries_the_tensor_until_the_bound() -> None:
    h = _Harness(world=2, aggregators=1)
    h.join()
    layout = Layout(40, 4, 4, 1)
    values = _values(40, 2)
    before = values.copy()
    _, future = h.submit(values, layout)
    (first,) = h.take(MsgType.BOOTSTRAP)
    now = T0
    for retry in range(1, MAX_RETRIES + 2):
        now += 1.0
        h.core.disconnected(0, now)
        h.core.connected(0, now)
        assert [m.header.mtype for _, m in h.take()] == [MsgType.HELLO]
        h.welcome(0, f"restarted-{retry}", now)  # a new instance: it lost the slot
        if retry <= MAX_RETRIES:
            (_, boot), = h.take()
            assert isinstance(boot, Bootstrap) and boot.header.flags & FLAG_RETRY
            assert np.array_equal(boot.rows, first[1].rows)  # the slot starts over, from the same blocks
            assert not future.done()
            assert h.core.next_wakeup(now) <= now + TIMEOUT  # (its deadline restarted with the retry)
            h.core.tick(now + TIMEOUT - 0.01)  # ... so the first deadline has not passed
            assert h.take() == []
    error = future.exception()
    assert isinstance(error, OmniReduceTimeout)
    assert f"lost it {MAX_RETRIES + 1} times; giving up after {MAX_RETRIES} retries" in str(error)
    assert [type(m) for _, m in h.take()] == [Abort]
    assert h.core.snapshot()["retries"] == MAX_RETRIES
    assert np.array_equal(values, before)  # the input was never written


def test_a_welcome_from_the_same_instance_is_no_restart() -> None:
    h = _Harness(world=2, aggregators=1)
    h.join()
    _, future = h.submit(_values(40, 3), Layout(40, 4, 4, 1))
    h.take()
    h.core.disconnected(0, T0 + 1)
    h.core.connected(0, T0 + 1)
    h.welcome(0, "first-0", T0 + 1)  # a blip: the aggregator kept its state
    assert [m.header.mtype for _, m in h.take()] == [MsgType.HELLO]
    assert h.core.snapshot().get("retries", 0) == 0 and not future.done()


# -- kept sums -------------------------------------------------------------------------------------


def _finish_alone(h: _Harness, values: np.ndarray, layout: Layout, seq: int, now: float) -> TensorOp:
    """Submit a one-round tensor and answer its bootstrap with a RESULT whose sums are this rank's
    own blocks (as if the other ranks' were zero)."""
    op, future = h.submit(values, layout, seq, now)
    (agg, boot), = h.take(MsgType.BOOTSTRAP)
    assert isinstance(boot, Bootstrap) and boot.data is not None and layout.one_round
    count = int(np.count_nonzero(boot.rows != INF))
    h.deliver(agg, Result(Header(MsgType.RESULT, dtype=int(DType.FLOAT32), flags=FLAG_EAGER, job=h.handles[agg],
                                 seq=seq, slot=0, round=1, count=count), layout, boot.rows, boot.data), now)
    assert future.result(0) is values
    return op


def test_finished_sums_are_kept_until_the_watermark_passes_them() -> None:
    h = _Harness(world=2, aggregators=1)
    h.join()
    layout = Layout(40, 4, 16, 1)  # 10 blocks in 16 lanes: one round
    values = _values(40, 4)
    want = values.copy()
    op = _finish_alone(h, values, layout, 0, T0)
    assert np.array_equal(values, want)
    assert list(h.core.kept.tensors) == [0] and h.core.kept.nbytes == want.nbytes == op.retained_bytes()
    # an aggregator restart while they are kept: the finished slot goes as FINAL, with the sums
    h.core.disconnected(0, T0 + 1)
    h.core.connected(0, T0 + 1)
    h.welcome(0, "restarted", T0 + 1)
    (_, final), = h.take(MsgType.FINAL)
    assert isinstance(final, SlotSums) and np.array_equal(final.ids, np.arange(10))
    assert np.array_equal(final.data, want)
    # a RESULT (of any tensor) whose watermark does not pass tensor 0 keeps them; one that does drops them
    for watermark, kept in ((0, [0]), (1, [])):
        h.deliver(0, Result(Header(MsgType.RESULT, dtype=int(DType.FLOAT32), flags=FLAG_EAGER, job=h.handles[0],
                                   seq=7, slot=0, round=1, count=0, watermark=watermark), layout,
                            np.full(16, INF, np.uint32), np.zeros(0, np.float32)), T0 + 2)
        assert list(h.core.kept.tensors) == kept
    assert h.core.kept.nbytes == 0
    h.core.disconnected(0, T0 + 3)
    h.core.connected(0, T0 + 3)
    h.welcome(0, "restarted-again", T0 + 3)
    assert h.take(MsgType.FINAL) == []  # nothing kept, nothing replayed


def test_kept_sums_expire_after_twice_the_timeout_and_within_the_byte_limit() -> None:
    layout = Layout(40, 4, 16, 1)
    h = _Harness(world=2, aggregators=1, retain_bytes=2 * 160)  # room for two tensors' sums
    h.join()
    for seq in range(3):
        _finish_alone(h, _values(40, 10 + seq), layout, seq, T0 + seq)
    assert list(h.core.kept.tensors) == [1, 2] and h.core.kept.nbytes == 2 * 160  # the oldest went first
    h.core.tick(T0 + 1 + 2 * TIMEOUT - 0.01)
    assert list(h.core.kept.tensors) == [1, 2]
    h.core.tick(T0 + 1 + 2 * TIMEOUT)
    assert list(h.core.kept.tensors) == [2]
    h.core.tick(T0 + 2 + 2 * TIMEOUT)
    assert list(h.core.kept.tensors) == [] and h.core.kept.nbytes == 0


def test_one_rank_keeps_nothing() -> None:
    h = _Harness(world=1, aggregators=1)
    h.join()
    _finish_alone(h, _values(40, 5), Layout(40, 4, 16, 1), 0, T0)
    assert not h.core.kept.tensors and h.core.kept.nbytes == 0


def test_bootstraps_carry_the_watermark_of_this_rank() -> None:
    """A BOOTSTRAP says below which sequence number every tensor has finished (or failed) here."""
    h = _Harness(world=2, aggregators=1)
    h.join()
    layout = Layout(40, 4, 16, 1)
    _finish_alone(h, _values(40, 6), layout, 0, T0)
    h.submit(_values(40, 7), layout, 2, T0)
    h.submit(_values(40, 8), layout, 1, T0)
    assert [m.header.watermark for _, m in h.take(MsgType.BOOTSTRAP)] == [1, 1]


# -- TensorOp's phases ---------------------------------------------------------------------------------


def _op(values: np.ndarray, layout: Layout) -> TensorOp:
    future = ReduceFuture()
    future.set_running_or_notify_cancel()
    return TensorOp(0, values, HostSource(values, DType.FLOAT32, layout, None), rank=0, world_size=1,
                    num_aggregators=1, average=False, threshold=0.0, future=future)


def _result_for(op: TensorOp, boot: Any) -> Result:
    count = int(np.count_nonzero(boot.rows != INF))
    return Result(Header(MsgType.RESULT, dtype=int(DType.FLOAT32), flags=FLAG_EAGER, seq=0, slot=0, round=1,
                         count=count), op.layout, boot.rows, boot.data)


def test_phases_of_a_tensor_that_completes() -> None:
    values = _values(40, 20)
    op = _op(values, Layout(40, 4, 16, 1))
    future = op.future
    assert op.phase is Phase.NEW
    op.prepare()
    assert op.phase is Phase.NEW  # (prepared, maybe on another thread: nothing sent yet)
    ((_, boot),) = op.bootstraps()
    assert op.phase is Phase.ROUNDS and not op.done
    assert op.receive(_result_for(op, boot)) is None
    assert op.phase is Phase.SUMMED and op.done
    assert op.finish(bytes_sent=1, bytes_received=2) is None
    assert op.phase is Phase.COMPLETED and op.done and future.result(0) is values
    assert op.recover(0)[0].header.mtype is MsgType.FINAL  # kept for replays


def test_illegal_transitions_raise() -> None:
    values = _values(40, 21)
    before = values.copy()
    op = _op(values, Layout(40, 4, 16, 1))
    future = op.future
    with pytest.raises(IllegalTransition, match="cannot write the result in phase NEW"):
        op.finish(bytes_sent=0, bytes_received=0)
    assert np.array_equal(values, before) and not future.done()  # nothing written
    op.prepare()
    ((_, boot),) = op.bootstraps()
    with pytest.raises(IllegalTransition, match="ROUNDS -> ROUNDS"):
        op.bootstraps()
    op.receive(_result_for(op, boot))
    with pytest.raises(IllegalTransition, match="cannot take a result in phase SUMMED"):
        op.receive(_result_for(op, boot))
    assert not future.done()
    op.finish(bytes_sent=0, bytes_received=0)
    with pytest.raises(IllegalTransition, match="COMPLETED -> FAILED"):
        op.fail(OmniReduceError("too late"))
    with pytest.raises(IllegalTransition, match="COMPLETED -> COMPLETED"):
        op.complete()
    assert future.result(0) is values  # its outcome stands


def test_a_failed_tensor_holds_no_slots() -> None:
    op = _op(_values(40, 22), Layout(40, 4, 16, 1))
    op.prepare()
    op.bootstraps()
    future = op.future
    op.fail(OmniReduceError("gone"))
    assert op.phase is Phase.FAILED and isinstance(future.exception(), OmniReduceError)
    with pytest.raises(IllegalTransition, match="cannot recover slots in phase FAILED"):
        op.recover(0)
    op.fail(OmniReduceError("again"))  # (idempotent: nothing changes)
    assert op.phase is Phase.FAILED and str(future.exception()) == "gone"
