"""The aggregator's core driven without a socket: messages in through ``handle``, out through the
injected ``send`` hook; membership, a full round, recovery by FINAL and REPLAY, the memory budget."""

from __future__ import annotations

from typing import Any

import numpy as np

from omnireduce import wire
from omnireduce.aggregator.core import Core
from omnireduce.aggregator.limits import AggregatorLimits
from omnireduce.aggregator.slot import SlotState
from omnireduce.aggregator.telemetry import Telemetry
from omnireduce.blocks import INF, Layout
from omnireduce.dtypes import DType
from omnireduce.wire import ErrorCode, Header, MsgType

LAYOUT = Layout(16, 4, 2, 1)  # 4 blocks of 4 float32: lanes 0, 1 x rows 0, 1; one slot
GEOMETRY = {"dtype": int(DType.FLOAT32), "numel": 16, "block_size": 4, "lanes": 2, "slots": 1}


class Ranks:
    """A core whose sends are captured, and ranks (``b"rank-N"``) that joined one job."""

    def __init__(self, world: int, limits: AggregatorLimits | None = None) -> None:
        self.sent: list[tuple[bytes, wire.Message]] = []
        self.core = Core(self._capture, limits=limits or AggregatorLimits(), token=None, instance="test",
                         telemetry=Telemetry(0))
        self.handle = 0
        for rank in range(world):
            self.send(rank, wire.Hello(Header(MsgType.HELLO), "job", rank, world, 4, None, f"client-{rank}", 10.0))
            (welcome,) = self.take(rank)
            assert isinstance(welcome, wire.Welcome)
            self.handle = welcome.header.job

    def _capture(self, identity: bytes, frames: list[Any]) -> None:
        hdr = wire.unpack_header(bytes(frames[0]))
        layout = LAYOUT if hdr.mtype in (MsgType.RESULT, MsgType.REPLAY) else None
        self.sent.append((identity, wire.decode(hdr, [bytes(memoryview(f)) for f in frames[1:]], layout,
                                           DType.FLOAT32)))

    def send(self, rank: int, msg: wire.Message) -> None:
        self.core.handle(f"rank-{rank}".encode(), [bytes(memoryview(f)) for f in wire.encode(msg)])

    def header(self, mtype: MsgType, rank: int, **fields: int) -> Header:
        return Header(mtype, job=self.handle, rank=rank, **{**GEOMETRY, **fields})

    def take(self, rank: int) -> list[wire.Message]:
        """What was sent to ``rank`` since the last look."""
        mine = [m for ident, m in self.sent if ident == f"rank-{rank}".encode()]
        self.sent = [(ident, m) for ident, m in self.sent if ident != f"rank-{rank}".encode()]
        return mine


def test_a_round_trip_through_the_send_hook() -> None:
    ranks = Ranks(2)
    for r in range(2):
        ranks.send(r, wire.Bootstrap(ranks.header(MsgType.BOOTSTRAP, r), LAYOUT, np.array([0, INF], np.uint32)))
    for r in range(2):
        (result,) = ranks.take(r)
        assert isinstance(result, wire.Result) and result.header.round == 0 and result.cur.tolist() == [0, INF]
    for r in range(2):
        ranks.send(r, wire.Contribution(ranks.header(MsgType.CONTRIB, r, round=1, count=1), LAYOUT,
                                   np.array([INF], np.uint32), np.full(4, r + 1.0, np.float32)))
    for r in range(2):
        (result,) = ranks.take(r)
        assert isinstance(result, wire.Result) and result.data.tolist() == [3.0] * 4
        assert result.cur.tolist() == [INF, INF]
    assert ranks.core.gauges() == {"jobs": 1, "peers": 2, "slots_in_flight": 0, "held_bytes": 0}


def test_a_final_is_replayed_to_the_rank_that_starts_the_slot_again() -> None:
    ranks = Ranks(2)
    ids, sums = np.array([0], np.int64), np.full(4, 7.0, np.float32)
    ranks.send(0, wire.SlotSums(ranks.header(MsgType.FINAL, 0, count=1), LAYOUT, ids, sums))
    assert ranks.take(0) == [] and ranks.core.gauges()["slots_in_flight"] == 1
    ranks.send(1, wire.Bootstrap(ranks.header(MsgType.BOOTSTRAP, 1, flags=1), LAYOUT, np.array([0, INF], np.uint32)))
    (replay,) = ranks.take(1)
    assert isinstance(replay, wire.SlotSums) and replay.header.mtype is MsgType.REPLAY
    assert replay.ids.tolist() == [0] and replay.data.tolist() == [7.0] * 4
    assert ranks.core.gauges()["slots_in_flight"] == 0 and ranks.core.gauges()["held_bytes"] == 0
    assert ranks.core.telemetry.snapshot()["replays"] == 1


def test_the_budget_is_what_the_slots_hold_and_a_contribution_past_it_aborts() -> None:
    base = SlotState.base_bytes(2, 2)
    ranks = Ranks(2, AggregatorLimits(max_job_bytes=2 * base + 16))  # two slots and one block
    for seq in (1, 2):
        for r in range(2):
            ranks.send(r, wire.Bootstrap(ranks.header(MsgType.BOOTSTRAP, r, seq=seq), LAYOUT,
                                    np.array([0, INF], np.uint32)))
    assert ranks.core.gauges()["held_bytes"] == 2 * base
    ranks.sent.clear()

    def contribute(seq: int, rank: int) -> None:
        ranks.send(rank, wire.Contribution(ranks.header(MsgType.CONTRIB, rank, seq=seq, round=1, count=1), LAYOUT,
                                      np.array([INF], np.uint32), np.ones(4, np.float32)))

    contribute(1, 0)
    assert ranks.core.gauges()["held_bytes"] == 2 * base + 16
    contribute(2, 0)  # a second block would not fit: tensor 2 is aborted on every rank
    for r in range(2):
        (error,) = ranks.take(r)
        assert isinstance(error, wire.Error) and error.code is ErrorCode.LIMIT and error.header.seq == 2
    assert ranks.core.gauges()["held_bytes"] == base + 16
    contribute(1, 1)  # tensor 1 completes
    assert ranks.core.gauges()["held_bytes"] == 0 and ranks.core.gauges()["slots_in_flight"] == 0


def test_goodbye_aborts_what_waits_for_the_rank_and_the_last_one_out_forgets_the_job() -> None:
    ranks = Ranks(2)
    ranks.send(0, wire.Bootstrap(ranks.header(MsgType.BOOTSTRAP, 0, seq=5), LAYOUT, np.array([0, INF], np.uint32)))
    ranks.send(1, wire.Bare(ranks.header(MsgType.GOODBYE, 1)))
    (error,) = ranks.take(0)
    assert isinstance(error, wire.Error) and error.code is ErrorCode.ABORTED and "GOODBYE" in error.message
    ranks.send(0, wire.Bare(ranks.header(MsgType.GOODBYE, 0)))
    assert ranks.core.gauges() == {"jobs": 0, "peers": 0, "slots_in_flight": 0, "held_bytes": 0}


def test_a_rank_that_comes_after_a_mismatch_abort_is_told_its_cause() -> None:
    ranks = Ranks(3)
    ranks.send(0, wire.Bootstrap(ranks.header(MsgType.BOOTSTRAP, 0, seq=3), LAYOUT, np.array([0, INF], np.uint32)))
    odd = Layout(12, 4, 2, 1)
    ranks.send(1, wire.Bootstrap(ranks.header(MsgType.BOOTSTRAP, 1, seq=3, numel=12), odd,
                                 np.array([0, INF], np.uint32)))
    for r in range(3):  # the abort itself: MISMATCH, to every rank (no cause: it is the cause)
        (error,) = ranks.take(r)
        assert isinstance(error, wire.Error) and error.code is ErrorCode.MISMATCH and error.cause is None
    ranks.send(2, wire.Bootstrap(ranks.header(MsgType.BOOTSTRAP, 2, seq=3), LAYOUT, np.array([0, INF], np.uint32)))
    (late,) = ranks.take(2)
    assert isinstance(late, wire.Error) and late.code is ErrorCode.ABORTED and late.cause is ErrorCode.MISMATCH
    assert "ranks disagree" in late.message
    ranks.send(2, wire.Bootstrap(ranks.header(MsgType.BOOTSTRAP, 2, seq=4), LAYOUT, np.array([0, INF], np.uint32)))
    ranks.send(2, wire.Abort(ranks.header(MsgType.ABORT, 2, seq=4), "gave up"))
    ranks.sent.clear()
    ranks.send(0, wire.Bootstrap(ranks.header(MsgType.BOOTSTRAP, 0, seq=4), LAYOUT, np.array([0, INF], np.uint32)))
    (late,) = ranks.take(0)  # an abort by a rank: its cause is ABORTED
    assert late.code is ErrorCode.ABORTED and late.cause is ErrorCode.ABORTED
