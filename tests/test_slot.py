"""Unit tests of the aggregator's per-slot state machine (no sockets): rounds, expected ranks,
violations, recovery bookkeeping. Whole reductions through it, against the worker's side, are in
test_protocol.py."""

from __future__ import annotations

import numpy as np
import pytest

from omnireduce.aggregator.slot import Phase, SlotState, SlotViolation, TensorMeta
from omnireduce.blocks import INF
from omnireduce.dtypes import DType


def _meta(numel: int, lanes: int, slots: int = 1, B: int = 4, dtype: DType = DType.FLOAT32) -> TensorMeta:
    return TensorMeta(numel, dtype, B, lanes, slots)


def _booted(world: int = 2) -> tuple[SlotState, np.ndarray]:
    st = SlotState(_meta(16, 2), 0, world, 0, now=0.0)  # 4 blocks: lanes 0,1 x rows 0,1
    res = None
    for r in range(world):
        res = st.bootstrap(r, np.array([0, INF], np.uint32), now=0.0)
    assert res is not None
    return st, res.cur


def test_round_zero_instruction_and_expected_ranks() -> None:
    st = SlotState(_meta(16, 2), 0, 3, 0, now=0.0)
    assert st.bootstrap(0, np.array([1, INF], np.uint32), now=0.0) is None
    assert st.missing() == [1, 2]
    assert st.bootstrap(1, np.array([0, INF], np.uint32), now=0.0) is None
    res = st.bootstrap(2, np.array([INF, INF], np.uint32), now=0.0)
    assert res.cur.tolist() == [0, INF] and not res.finished
    assert [st.expected_count(r) for r in range(3)] == [0, 1, 0]
    assert st.missing() == [1]


@pytest.mark.parametrize("action,match", [
    (lambda st, cur: st.bootstrap(0, cur, now=0.0), "second bootstrap"),
    (lambda st, cur: st.contribute(0, 2, np.array([INF], np.uint32), np.ones(4, np.float32), now=0.0), "round 2"),
    (lambda st, cur: st.contribute(0, 1, np.array([INF, INF], np.uint32), np.ones(8, np.float32), now=0.0),
     "sent 2 blocks"),
    (lambda st, cur: st.contribute(0, 1, np.array([0], np.uint32), np.ones(4, np.float32), now=0.0),
     "not after the current row"),
    (lambda st, cur: st.contribute(0, 1, np.array([7], np.uint32), np.ones(4, np.float32), now=0.0), "past the end"),
    (lambda st, cur: st.contribute(0, 1, np.array([INF], np.uint32), np.ones(3, np.float32), now=0.0), "3 elements"),
])
def test_violations_are_refused(action, match: str) -> None:
    st, cur = _booted()
    with pytest.raises(SlotViolation, match=match):
        action(st, cur)


def test_unexpected_and_double_contributions_are_refused() -> None:
    st = SlotState(_meta(16, 2), 0, 2, 0, now=0.0)
    st.bootstrap(0, np.array([0, INF], np.uint32), now=0.0)
    st.bootstrap(1, np.array([1, INF], np.uint32), now=0.0)
    with pytest.raises(SlotViolation, match="holds none"):
        st.contribute(1, 1, np.zeros(0, np.uint32), np.zeros(0, np.float32), now=0.0)
    assert st.contribute(0, 1, np.array([INF], np.uint32), np.ones(4, np.float32), now=0.0) is not None
    st2 = SlotState(_meta(16, 2), 0, 3, 0, now=0.0)
    for r in range(3):
        st2.bootstrap(r, np.array([0, INF], np.uint32), now=0.0)
    st2.contribute(0, 1, np.array([INF], np.uint32), np.ones(4, np.float32), now=0.0)
    with pytest.raises(SlotViolation, match="twice"):
        st2.contribute(0, 1, np.array([INF], np.uint32), np.ones(4, np.float32), now=0.0)
    with pytest.raises(SlotViolation, match="past the end"):
        # lane 1 has 1 row (block 1)
        SlotState(_meta(10, 2), 0, 1, 0, now=0.0).bootstrap(0, np.array([0, 1], np.uint32), now=0.0)


def test_metadata_differences_are_named() -> None:
    a = TensorMeta(10, DType.FLOAT32, 4, 2, 1)
    b = TensorMeta(12, DType.BFLOAT16, 4, 2, 1)
    assert a.differences(b) == [("element count", 10, 12), ("dtype", "float32", "bfloat16")]


def test_in_recovery_the_missing_ranks_are_those_not_accounted_for() -> None:
    """After a restart a FINAL stands for the slot: ranks that sent FINAL or bootstrapped (and were
    sent the replay) are accounted for; only the others are missing (GOODBYE, STATUS, deadlines)."""
    st = SlotState(_meta(64, 16), 0, 3, 0, now=0.0)
    assert st.missing() == [0, 1, 2]
    none = np.full(16, INF, dtype=np.uint32)
    st.bootstrap(1, none, np.zeros(0, np.float32), now=0.0)  # (one row per lane: no blocks)
    assert st.missing() == [0, 2] and st.booted_ranks() == [1]
    replay = st.take_final(0, np.zeros(0, np.int64), np.zeros(0, np.float32), now=0.0)  # rank 0 sent the FINAL
    assert replay is not None and replay.ranks == [1] and st.phase is Phase.REPLAYING
    assert st.missing() == [2]
    replay = st.bootstrap(2, none, np.zeros(0, np.float32), now=0.0)
    assert replay is not None and replay.ranks == [2] and replay.finished
    assert st.missing() == [] and st.phase is Phase.DONE


def test_a_one_round_slot_sums_the_blocks_sent_with_the_bootstraps() -> None:
    """Every lane holds one row: the ranks send their blocks with the bootstrap, and the last one in
    gets the sums at once (round 1, eager), with the lanes they answer as ``cur``."""
    rng = np.random.default_rng(7)
    st = SlotState(_meta(10, 4), 0, 3, 0, now=0.0)  # 3 blocks (the last one short: 2 elements) in 4 lanes
    assert st.layout.one_round
    rows = [np.array([0, INF, 0, INF], np.uint32), np.array([INF, INF, 0, INF], np.uint32),
            np.full(4, INF, np.uint32)]
    blocks = [rng.standard_normal(n).astype(np.float32) for n in (4 + 2, 2, 0)]  # lane 2 holds the short block
    assert st.bootstrap(0, rows[0], blocks[0].copy(), now=0.0) is None
    assert st.held_bytes == 24 and st.missing() == [1, 2]
    assert st.bootstrap(1, rows[1], blocks[1].copy(), now=0.0) is None
    out = st.bootstrap(2, rows[2], blocks[2].copy(), now=0.0)
    assert out is not None and out.eager and out.finished and (out.round, out.count) == (1, 2)
    assert out.cur.tolist() == [0, INF, 0, INF]
    expected = np.concatenate([blocks[0][:4], (blocks[0][4:].astype(np.float64) + blocks[1]).astype(np.float32)])
    assert out.data.tolist() == expected.tolist() and st.held_bytes == 0


@pytest.mark.parametrize(("numel", "lanes", "data", "match"), [
    (10, 4, None, "without blocks"),  # one row per lane: the blocks must come with the bootstrap
    (16, 2, np.zeros(4, np.float32), "with blocks"),  # two rows per lane: they never do
    (10, 4, np.zeros(5, np.float32), "sent 5 elements for 1 blocks"),
])
def test_bootstrap_blocks_are_checked(numel: int, lanes: int, data: np.ndarray | None, match: str) -> None:
    st = SlotState(_meta(numel, lanes), 0, 2, 0, now=0.0)
    with pytest.raises(SlotViolation, match=match):
        st.bootstrap(0, np.array([0] + [INF] * (lanes - 1), np.uint32), data, now=0.0)


@pytest.mark.parametrize("dtype", [DType.FLOAT32, DType.FLOAT16, DType.BFLOAT16])
def test_a_dense_round_is_summed_in_chunks_with_the_bits_of_rank_order(dtype: DType) -> None:
    """Every rank sends every lane (a dense region): summed chunk by chunk, spanning several chunks
    of the cache-sized loop and a short last block, bit for bit the rank-order float32 sum."""
    from omnireduce.dtypes import narrow, widen

    world, B, lanes = 4, 256, 700  # 700 blocks of 1 KiB (float32): three chunks of 256 KiB
    numel = lanes * B - 100
    st = SlotState(_meta(numel, lanes, B=B, dtype=dtype), 0, world, 0, now=0.0)
    assert st.layout.one_round
    rng = np.random.default_rng(11)
    values = [narrow(rng.standard_normal(numel).astype(np.float32) * np.float32(10.0) ** rng.integers(-3, 4), dtype)
              for _ in range(world)]
    values[2][5] = narrow(np.array([np.nan], np.float32), dtype)[0]
    values[1][7] = narrow(np.array([-0.0], np.float32), dtype)[0]
    out = None
    for r in range(world):
        out = st.bootstrap(r, np.zeros(lanes, np.uint32), values[r].copy(), now=0.0)
    assert out is not None and out.eager and out.count == lanes
    expected = widen(values[0], dtype).copy()
    for v in values[1:]:
        expected += widen(v, dtype)
    assert out.data.view(np.uint8).tobytes() == narrow(expected, dtype).view(np.uint8).tobytes()


def test_phases_follow_the_slot_and_a_finished_slot_takes_nothing() -> None:
    """BOOTSTRAP until every rank is in, ROUNDS while instructions remain, DONE after the last round; the
    time of each input is the slot's last progress (it reads no clock of its own)."""
    st = SlotState(_meta(16, 2), 0, 2, 0, now=10.0)  # 4 blocks: lanes 0,1 x rows 0,1
    assert st.phase is Phase.BOOTSTRAP and st.updated == 10.0
    st.bootstrap(0, np.array([0, INF], np.uint32), now=11.0)
    assert st.phase is Phase.BOOTSTRAP and st.updated == 11.0
    st.bootstrap(1, np.array([1, INF], np.uint32), now=12.5)
    assert st.phase is Phase.ROUNDS and st.updated == 12.5
    assert st.expire(12.5 + 3.0, 2.0) is not None and st.expire(12.5 + 1.0, 2.0) is None
    res = st.contribute(0, 1, np.array([INF], np.uint32), np.ones(4, np.float32), now=13.0)
    assert res is not None and not res.finished and st.phase is Phase.ROUNDS
    res = st.contribute(1, 2, np.array([INF], np.uint32), np.full(4, 2.0, np.float32), now=14.0)
    assert res is not None and res.finished and st.phase is Phase.DONE
    assert st.missing() == [] and st.final_cost(np.zeros(1, np.int64), np.zeros(4, np.float32)) == 0
    with pytest.raises(SlotViolation, match="finished slot"):
        st.contribute(1, 3, np.array([INF], np.uint32), np.ones(4, np.float32), now=15.0)
    with pytest.raises(SlotViolation, match="second bootstrap"):
        st.bootstrap(0, np.array([0, INF], np.uint32), now=15.0)
    with pytest.raises(AssertionError, match="no move from DONE to ROUNDS"):
        st._move(Phase.ROUNDS)
