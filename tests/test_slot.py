"""Unit tests of the aggregator's per-slot state machine (no sockets): rounds, expected ranks,
violations, recovery bookkeeping. Whole reductions through it, against the worker's side, are in
test_protocol.py."""

from __future__ import annotations

import numpy as np
import pytest

from omnireduce.aggregator.slot import SlotState, SlotViolation, TensorMeta
from omnireduce.blocks import INF
from omnireduce.dtypes import DType


def _meta(numel: int, lanes: int, slots: int = 1, B: int = 4, dtype: DType = DType.FLOAT32) -> TensorMeta:
    return TensorMeta(numel, dtype, B, lanes, slots)


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
