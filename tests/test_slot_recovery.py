"""Unit tests of a slot's recovery after an aggregator restart, its deadline and the bytes it reports
(no sockets): FINAL, REPLAY to the ranks that bootstrapped before and after it, accounting, expiry."""

from __future__ import annotations

import numpy as np
import pytest

from omnireduce.aggregator.budget import Tally
from omnireduce.aggregator.slot import Expired, Replay, Round, SlotState, TensorMeta
from omnireduce.blocks import INF
from omnireduce.dtypes import DType

META = TensorMeta(16, DType.FLOAT32, 4, 2, 1)  # 4 blocks of 4: lanes 0, 1 x rows 0, 1
NONE = np.full(2, INF, np.uint32)  # a rank with no non-zero block


def _sums() -> tuple[np.ndarray, np.ndarray]:
    """What a rank that finished the slot sends in FINAL: two blocks' ids and their sums."""
    return np.array([1, 0], np.int64), np.arange(8, dtype=np.float32)


def test_final_first_then_every_bootstrap_is_answered_with_the_sums() -> None:
    st = SlotState(META, 0, 3, 0, now=0.0)
    ids, data = _sums()
    replay = st.take_final(0, ids, data, now=0.0)
    assert isinstance(replay, Replay) and replay.ranks == [] and not replay.finished  # nobody waits yet
    assert st.missing() == [1, 2] and st.status()["phase"] == "bootstrap"
    out = st.bootstrap(2, NONE, now=0.0)
    assert isinstance(out, Replay) and out.ranks == [2] and not out.finished
    assert out.ids is ids and out.data is data  # the FINAL's sums, as they came
    out = st.bootstrap(1, np.array([0, 1], np.uint32), now=0.0)
    assert isinstance(out, Replay) and out.ranks == [1] and out.finished  # every rank accounted for
    assert st.missing() == [] and st.cur is None  # no round was ever started


def test_ranks_that_bootstrapped_before_the_final_get_it_when_it_comes() -> None:
    st = SlotState(META, 0, 3, 0, now=0.0)
    assert st.bootstrap(2, NONE, now=0.0) is None
    assert st.bootstrap(0, NONE, now=0.0) is None
    replay = st.take_final(1, *_sums(), now=0.0)
    assert isinstance(replay, Replay) and replay.ranks == [0, 2] and replay.finished


def test_a_second_final_only_accounts_for_its_rank() -> None:
    st = SlotState(META, 0, 3, 0, now=0.0)
    ids, data = _sums()
    st.take_final(0, ids, data, now=0.0)
    assert st.final_cost(ids, data) == 0  # the first one is kept: the next would cost nothing
    again = st.take_final(2, np.array([1], np.int64), np.ones(4, np.float32), now=0.0)
    assert isinstance(again, Replay) and again.ranks == [] and not again.finished
    assert again.ids is ids  # the first FINAL's sums stand
    assert st.missing() == [1]
    last = st.bootstrap(1, NONE, now=0.0)
    assert isinstance(last, Replay) and last.ranks == [1] and last.finished


def test_a_final_while_rounds_run_is_ignored() -> None:
    st = SlotState(META, 0, 2, 0, now=0.0)
    st.bootstrap(0, np.array([0, INF], np.uint32), now=0.0)
    round0 = st.bootstrap(1, NONE, now=0.0)
    assert isinstance(round0, Round)
    ids, data = _sums()
    assert st.final_cost(ids, data) == 0
    before = st.footprint
    assert st.take_final(1, ids, data, now=0.0) is None
    assert st.final is None and st.footprint == before
    res = st.contribute(0, 1, np.array([INF], np.uint32), np.ones(4, np.float32), now=0.0)  # rounds go on
    assert res is not None and res.finished


def test_final_cost_is_what_the_slot_then_holds() -> None:
    st = SlotState(META, 0, 2, 0, now=0.0)
    ids, data = _sums()
    cost = st.final_cost(ids, data)
    assert cost == ids.nbytes + data.nbytes
    before = st.footprint
    st.take_final(0, ids, data, now=0.0)
    assert st.footprint == before + cost


def test_the_tally_follows_the_footprint_until_the_slot_is_closed() -> None:
    total = Tally()
    job = Tally(total)
    st = SlotState(META, 0, 2, 0, tally=job, now=0.0)
    base = SlotState.base_bytes(2, META.lanes)
    assert job.bytes == total.bytes == st.footprint == base
    st.bootstrap(0, np.array([0, INF], np.uint32), now=0.0)
    st.bootstrap(1, np.array([0, INF], np.uint32), now=0.0)
    assert st.contribute(0, 1, np.array([INF], np.uint32), np.ones(4, np.float32), now=0.0) is None
    assert job.bytes == total.bytes == st.footprint == base + 16  # a block waiting to be summed
    assert st.contribute(1, 1, np.array([INF], np.uint32), np.ones(4, np.float32), now=0.0) is not None
    assert job.bytes == st.footprint == base  # summed and sent: nothing waits
    st.close()
    assert job.bytes == total.bytes == 0
    st.close()  # twice is harmless
    assert job.bytes == 0

    other = SlotState(META, 0, 2, 0, tally=job, now=0.0)
    other.take_final(0, *_sums(), now=0.0)
    assert job.bytes == total.bytes == other.footprint == base + 8 * 2 + 4 * 8
    other.close()
    assert total.bytes == 0


def test_expiry_says_what_happened() -> None:
    st = SlotState(META, 0, 3, 0, now=0.0)
    st.bootstrap(1, NONE, now=0.0)
    now = st.updated
    assert st.expire(now + 5, 5.0) is None  # within the deadline
    assert st.expire(now + 6, 5.0) == Expired(replayed=False, round=0, missing=[0, 2])

    running = SlotState(META, 0, 2, 0, now=0.0)
    running.bootstrap(0, np.array([0, INF], np.uint32), now=0.0)
    running.bootstrap(1, np.array([1, INF], np.uint32), now=0.0)
    assert running.expire(running.updated + 1, 0.5) == Expired(replayed=False, round=1, missing=[0])
    assert running.status() == {"slot": 0, "round": 1, "phase": "contribution", "missing": [0]}

    st.take_final(0, *_sums(), now=0.0)  # now it only holds sums for rank 2, which never comes
    assert st.expire(st.updated + 6, 5.0) == Expired(replayed=True, round=0, missing=[2])


@pytest.mark.parametrize("world", [1, 4])
def test_a_final_from_every_rank_finishes_the_slot(world: int) -> None:
    st = SlotState(META, 0, world, 0, now=0.0)
    outs = [st.take_final(r, *_sums(), now=0.0) for r in range(world)]
    assert all(isinstance(o, Replay) and o.ranks == [] for o in outs)
    assert [o.finished for o in outs] == [False] * (world - 1) + [True]
