"""Unit tests of the aggregator's per-slot state machine (no sockets): rounds, sums, violations."""

from __future__ import annotations

import numpy as np
import pytest

from omnireduce.aggregator.slot import SlotState, SlotViolation, TensorMeta
from omnireduce.blocks import INF, LaneIndex, Layout, block_nonzero, gather_blocks
from omnireduce.dtypes import DType


def _meta(numel: int, lanes: int, slots: int = 1, B: int = 4, dtype: DType = DType.FLOAT32) -> TensorMeta:
    return TensorMeta(numel, dtype, B, lanes, slots)


def _drive(xs: list[np.ndarray], meta: TensorMeta, slot: int = 0) -> np.ndarray:
    """Run one slot to completion the way workers would; return the summed tensor of that slot."""
    lay = Layout(meta.numel, meta.block_size, meta.lanes, meta.slots)
    idx = [LaneIndex(lay, block_nonzero(x, meta.dtype, meta.block_size)) for x in xs]
    st = SlotState(meta, slot, len(xs), 0)
    res = None
    for r in range(len(xs)):
        res = st.bootstrap(r, idx[r].pending(slot).copy())
    assert res is not None and res.round == 0
    out = np.zeros(meta.numel, np.float32)
    while not res.finished:
        cur, rnd = res.cur, res.round + 1
        replies = []
        for r in range(len(xs)):
            send = np.flatnonzero((idx[r].pending(slot) == cur) & (cur != INF))
            assert send.size == st.expected_count(r)
            if send.size:
                data = gather_blocks(xs[r], lay, lay.slot_blocks(slot, send, cur[send]))
                replies.append((r, idx[r].advance(slot, send), data.copy()))  # as received
        for r, nxt, data in reversed(replies):  # arrival order must not matter
            res = st.contribute(r, rnd, nxt, data)
        assert res is not None and res.round == rnd
        active = np.flatnonzero(cur != INF)
        from omnireduce.blocks import scatter_blocks

        scatter_blocks(out, lay, lay.slot_blocks(slot, active, cur[active]), res.data)
    return out


@pytest.mark.parametrize("lanes", [1, 3, 8, 64])
def test_slot_sums_in_rank_order_bit_for_bit(lanes: int) -> None:
    rng = np.random.default_rng(lanes)
    n = 250  # 63 blocks of 4, the last one short
    xs = []
    for r in range(4):
        x = np.zeros(n, np.float32)
        on = rng.random(n) < (0.05 if r else 0.5)
        x[on] = rng.standard_normal(on.sum()).astype(np.float32) * np.float32(10.0) ** rng.integers(-6, 8, on.sum())
        xs.append(x)
    xs[0][:4] = [1e8, 1.0, -0.0, np.nan]
    xs[1][:4] = [1.0, 1e8, -0.0, 1.0]
    xs[2][:4] = [-1e8, -1e8, -0.0, 2.0]
    got = _drive(xs, _meta(n, lanes))
    want = ((xs[0] + xs[1]) + xs[2]) + xs[3]  # float32, rank order
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(got), nan)
    # bit for bit, except that a zero may differ in sign: ranks whose block is all zero do not send
    exact = ~nan & (want != 0)
    assert np.array_equal(got.view(np.uint32)[exact], want.view(np.uint32)[exact])
    assert not got[~nan & (want == 0)].any()
    # rank order: (1e8 + 1) rounds to 1e8, so element 0 is 0; summing -1e8 first would give 1
    assert got[0] == 0.0 and got[1] == 0.0 and np.isnan(got[3])


def test_half_precision_accumulates_in_float32() -> None:
    xs = [np.full(8, 2048, np.float16), np.full(8, 1, np.float16), np.full(8, 1, np.float16)]
    got = _drive(xs, _meta(8, 2, dtype=DType.FLOAT16))
    # float16 accumulation would give 2048 (2048 + 1 rounds back to 2048, twice); float32 gives 2050
    assert got.tolist() == [2050.0] * 8


def _booted(world: int = 2) -> tuple[SlotState, np.ndarray]:
    st = SlotState(_meta(16, 2), 0, world, 0)  # 4 blocks: lanes 0,1 x rows 0,1
    res = None
    for r in range(world):
        res = st.bootstrap(r, np.array([0, INF], np.uint32))
    assert res is not None
    return st, res.cur


def test_round_zero_instruction_and_expected_ranks() -> None:
    st = SlotState(_meta(16, 2), 0, 3, 0)
    assert st.bootstrap(0, np.array([1, INF], np.uint32)) is None
    assert st.missing() == [1, 2]
    assert st.bootstrap(1, np.array([0, INF], np.uint32)) is None
    res = st.bootstrap(2, np.array([INF, INF], np.uint32))
    assert res.cur.tolist() == [0, INF] and not res.finished
    assert [st.expected_count(r) for r in range(3)] == [0, 1, 0]
    assert st.missing() == [1]


@pytest.mark.parametrize("action,match", [
    (lambda st, cur: st.bootstrap(0, cur), "second bootstrap"),
    (lambda st, cur: st.contribute(0, 2, np.array([INF], np.uint32), np.ones(4, np.float32)), "round 2"),
    (lambda st, cur: st.contribute(0, 1, np.array([INF, INF], np.uint32), np.ones(8, np.float32)),
     "sent 2 blocks"),
    (lambda st, cur: st.contribute(0, 1, np.array([0], np.uint32), np.ones(4, np.float32)),
     "not after the current row"),
    (lambda st, cur: st.contribute(0, 1, np.array([7], np.uint32), np.ones(4, np.float32)), "past the end"),
    (lambda st, cur: st.contribute(0, 1, np.array([INF], np.uint32), np.ones(3, np.float32)), "3 elements"),
])
def test_violations_are_refused(action, match: str) -> None:
    st, cur = _booted()
    with pytest.raises(SlotViolation, match=match):
        action(st, cur)


def test_unexpected_and_double_contributions_are_refused() -> None:
    st = SlotState(_meta(16, 2), 0, 2, 0)
    st.bootstrap(0, np.array([0, INF], np.uint32))
    st.bootstrap(1, np.array([1, INF], np.uint32))
    with pytest.raises(SlotViolation, match="holds none"):
        st.contribute(1, 1, np.zeros(0, np.uint32), np.zeros(0, np.float32))
    assert st.contribute(0, 1, np.array([INF], np.uint32), np.ones(4, np.float32)) is not None
    st2 = SlotState(_meta(16, 2), 0, 3, 0)
    for r in range(3):
        st2.bootstrap(r, np.array([0, INF], np.uint32))
    st2.contribute(0, 1, np.array([INF], np.uint32), np.ones(4, np.float32))
    with pytest.raises(SlotViolation, match="twice"):
        st2.contribute(0, 1, np.array([INF], np.uint32), np.ones(4, np.float32))
    with pytest.raises(SlotViolation, match="past the end"):
        SlotState(_meta(10, 2), 0, 1, 0).bootstrap(0, np.array([0, 1], np.uint32))  # lane 1 has 1 row (block 1)


def test_metadata_differences_are_named() -> None:
    a = TensorMeta(10, DType.FLOAT32, 4, 2, 1)
    b = TensorMeta(12, DType.BFLOAT16, 4, 2, 1)
    assert a.differences(b) == [("element count", 10, 12), ("dtype", "float32", "bfloat16")]


def test_in_recovery_the_missing_ranks_are_those_not_accounted_for() -> None:
    """After a restart a FINAL stands for the slot: ranks that sent FINAL or bootstrapped (and were
    sent the replay) are accounted for; only the others are missing (GOODBYE, STATUS, deadlines)."""
    st = SlotState(_meta(64, 16), 0, 3, 0)
    assert st.missing() == [0, 1, 2]
    st.bootstrap(1, np.full(16, INF, dtype=np.uint32))
    assert st.missing() == [0, 2] and st.booted_ranks() == [1]
    st.final = (np.zeros(0, np.int64), np.zeros(0, np.float32))
    st.accounted.add(0)  # rank 0 sent the FINAL
    assert st.missing() == [2]
    st.accounted.add(2)
    assert st.missing() == []
