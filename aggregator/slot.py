"""The state machine of one slot of one tensor at an aggregator: lockstep rounds over ``L`` lanes,
and the slot's recovery after an aggregator restart.

Sans-I/O: it knows nothing of sockets, of the job around it, or of the clock. The caller feeds it
decoded input (:meth:`SlotState.bootstrap`, :meth:`~SlotState.contribute`, :meth:`~SlotState.take_final`,
each with the time ``now`` it arrived, and the time alone in :meth:`~SlotState.expire`) and gets back
what to send: a :class:`Round` for every rank of the job, a :class:`Replay` for some ranks, what an
:class:`Expired` deadline means, or nothing yet. Every decision about the slot, recovery included, is
taken here, from the slot's own state.

Phases (:class:`Phase`; the only moves are those in ``_MOVES``, made by ``_move``)::

    BOOTSTRAP --every rank in--> ROUNDS --last round (maybe at once)--> DONE
    BOOTSTRAP --a FINAL--> REPLAYING --every rank accounted for--> DONE

BOOTSTRAP waits for every rank's first rows, ROUNDS runs the lockstep rounds, REPLAYING hands a
FINAL's sums out after a restart, DONE takes no more input (the job drops the slot).

Rounds. ``cur[lane] = min over ranks of next[rank][lane]`` is the block row each lane aggregates;
the ranks whose ``next`` equals ``cur`` on some lane are *expected* to send exactly those lanes; once
all expected contributions are in, the blocks of each lane are summed in rank order in float32
(starting from -0.0, the exact additive identity, so a lone block is returned bit for bit), the
contributors' ``next`` rows are updated, and the new ``cur`` is computed. All of it is vectorised
over lanes. In a one-round slot (every lane holds one row, ``layout.one_round``) each rank's
bootstrap carries its blocks already, which are exactly what the first instruction would ask of it:
the sums go out as soon as the last bootstrap is in (an ``eager`` round 1), one round trip earlier.

Recovery. A restarted aggregator knows no slot. A rank that had finished the slot before the restart
sends FINAL with the sums it received; the slot keeps them (``final``) and replays them to every rank
that bootstrapped it before, and to every rank that bootstraps it after, instead of running rounds.
A rank is *accounted for* once it bootstrapped or sent FINAL; when all are, the slot is done. A FINAL
that arrives while rounds run is ignored: every rank bootstrapped, so nobody needs it.

Memory. :attr:`SlotState.footprint` is what the slot holds; every change of it is reported to the
``tally`` the slot was opened with (see :mod:`omnireduce.aggregator.budget`), and :meth:`close`
gives it all back.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

import numpy as np

from omnireduce.aggregator.budget import Tally
from omnireduce.blocks import INF, ROW_DTYPE, Layout
from omnireduce.dtypes import DType, narrow
from omnireduce.sums import rank_order_sum
from omnireduce.wire import to_wire, unwire, wire_elements


def _sums_bytes(ids: np.ndarray, data: Any) -> int:
    """Bytes of a FINAL's sums: block ids and wire data."""
    return int(ids.nbytes + memoryview(data).nbytes)


class SlotViolation(Exception):
    """A rank sent something this slot cannot accept; the tensor cannot complete."""


class Phase(enum.Enum):
    """Where a slot is; see the module's docstring for the moves between phases."""

    BOOTSTRAP = "bootstrap"
    ROUNDS = "rounds"
    REPLAYING = "replaying"
    DONE = "done"


#: The moves between phases: a slot never goes back, and leaves DONE for nothing.
_MOVES: dict[Phase, frozenset[Phase]] = {
    Phase.BOOTSTRAP: frozenset({Phase.ROUNDS, Phase.REPLAYING}),
    Phase.ROUNDS: frozenset({Phase.DONE}),
    Phase.REPLAYING: frozenset({Phase.DONE}),
    Phase.DONE: frozenset(),
}


@dataclasses.dataclass(frozen=True)
class TensorMeta:
    """What every rank must agree on about a tensor (checked on each bootstrap)."""

    numel: int
    dtype: DType
    block_size: int
    lanes: int
    slots: int

    def differences(self, other: TensorMeta) -> list[tuple[str, object, object]]:
        # Named by what the user sets: lanes and slots follow from the tensor's size and the
        # Worker's lanes= / slots= (OMNIREDUCE_LANES / OMNIREDUCE_SLOTS, or the number of aggregators).
        names = {"numel": "element count", "dtype": "dtype", "block_size": "block size (OMNIREDUCE_BLOCK_SIZE)",
                 "lanes": "lanes (the lanes= setting, OMNIREDUCE_LANES)",
                 "slots": "slots (the slots= setting, OMNIREDUCE_SLOTS, or the number of aggregators listed)"}
        out = []
        for f, label in names.items():
            a, b = getattr(self, f), getattr(other, f)
            if a != b:
                out.append((label, a.name.lower() if isinstance(a, DType) else a,
                            b.name.lower() if isinstance(b, DType) else b))
        return out


@dataclasses.dataclass
class Round:
    """What the aggregator sends every rank after a round: summed blocks and the next instruction."""

    round: int
    count: int  # blocks in ``data``: one per lane of the previous instruction that was not INF
    cur: np.ndarray  # uint32[L], the next instruction; all INF when the slot is finished
    data: np.ndarray  # wire data (storage dtype), the short block trimmed
    finished: bool
    eager: bool = False  # the answer to eager bootstraps: ``cur`` is the instruction answered (finished)


@dataclasses.dataclass
class Replay:
    """What the aggregator sends after a FINAL, or a bootstrap in recovery: the slot's sums (as the
    FINAL carried them) to ``ranks`` as REPLAY."""

    ranks: list[int]  # who gets them now (may be none)
    ids: np.ndarray  # int64[count]: block ids, in the order the FINAL gave them
    data: Any  # their wire data
    finished: bool  # every rank is accounted for: the slot is done


@dataclasses.dataclass(frozen=True)
class Expired:
    """A slot went its job's deadline without progress.

    ``replayed``: it only held a FINAL's sums for ranks that never came for them (they finished the
    tensor before the restart, or are gone; a late one times out on its own deadline): drop it
    quietly. Otherwise the tensor timed out waiting for ``missing`` in round ``round``."""

    replayed: bool
    round: int
    missing: list[int]


class SlotState:
    """One slot of one tensor of one job, from the first bootstrap (or FINAL) to the last round (or
    the last rank accounted for)."""

    def __init__(self, meta: TensorMeta, slot: int, world_size: int, first_rank: int,
                 tally: Tally | None = None, *, now: float) -> None:
        self.meta = meta
        self.slot = slot
        self.world_size = world_size
        self.first_rank = first_rank
        self.layout = Layout(meta.numel, meta.block_size, meta.lanes, meta.slots)
        self._valid_rows = self.layout.valid_rows(slot)
        self._holds_short = self.layout.holds_short(slot)
        self.next = np.full((world_size, meta.lanes), INF, dtype=ROW_DTYPE)
        self.booted = np.zeros(world_size, dtype=bool)
        self.phase = Phase.BOOTSTRAP
        self.cur: np.ndarray | None = None  # the current instruction, from ROUNDS on
        self.round = 0
        self._expected = np.zeros(world_size, dtype=bool)
        self._expected_lanes: np.ndarray | None = None
        self._n_expected = 0
        self._received: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        self.updated = now  # last progress (for the job's deadline): the time of the last input
        self.held_bytes = 0  # bytes of received blocks waiting to be summed
        self.blocks_union = 0  # blocks summed so far
        # Recovery after a restart: a rank's FINAL (block ids, wire data) is replayed to the others.
        self.final: tuple[np.ndarray, Any] | None = None
        self.accounted: set[int] = set()  # ranks that bootstrapped or sent FINAL
        self._tally = tally
        self._reported = 0  # the footprint ``tally`` holds for this slot
        self._report()

    # -- state queries -------------------------------------------------------------------------

    def _move(self, to: Phase) -> None:
        if to not in _MOVES[self.phase]:
            raise AssertionError(f"slot {self.slot}: no move from {self.phase.name} to {to.name}")
        self.phase = to

    @staticmethod
    def base_bytes(world_size: int, lanes: int) -> int:
        """Bytes of a new slot's per-rank lane arrays (next rows and expected flags)."""
        return world_size * lanes * 6

    @property
    def footprint(self) -> int:
        """Bytes this slot holds: its per-rank lane arrays, blocks waiting to be summed, replay data."""
        final = _sums_bytes(*self.final) if self.final is not None else 0
        return self.base_bytes(self.world_size, self.meta.lanes) + self.held_bytes + final

    @property
    def blocks_total(self) -> int:
        return int(self._valid_rows.sum())

    @property
    def waiting_round(self) -> int:
        """The round the slot is waiting for: 0 until every rank bootstrapped, then the next one."""
        return self.round + (1 if self.phase in (Phase.ROUNDS, Phase.DONE) and self.cur is not None else 0)

    def status(self) -> dict[str, Any]:
        """The slot's part of a STATUS answer: its round, phase and the ranks it waits for."""
        return {"slot": self.slot, "round": self.waiting_round,
                "phase": "contribution" if self.phase is Phase.ROUNDS else "bootstrap",
                "missing": self.missing()}

    def booted_ranks(self) -> list[int]:
        """Ranks that bootstrapped this slot (before a FINAL arrived, these wait for its replay)."""
        return [int(r) for r in np.flatnonzero(self.booted)]

    def missing(self) -> list[int]:
        """Ranks whose message this slot is waiting for right now.

        In recovery (a rank sent FINAL) these are the ranks not yet accounted for: they have neither
        bootstrapped (and so been sent the replay) nor sent a FINAL of their own."""
        if self.phase is Phase.REPLAYING:
            return [r for r in range(self.world_size) if r not in self.accounted]
        if self.phase is Phase.BOOTSTRAP:
            return [int(r) for r in np.flatnonzero(~self.booted)]
        if self.phase is Phase.ROUNDS:
            return [int(r) for r in np.flatnonzero(self._expected) if int(r) not in self._received]
        return []

    # -- inputs --------------------------------------------------------------------------------

    def bootstrap(self, rank: int, rows: np.ndarray, data: np.ndarray | None = None, *,
                  now: float) -> Round | Replay | None:
        """Rank's first non-zero row per lane (INF for none). Returns round 0 once all ranks are in.

        A one-round slot (every lane holds one row) takes the rank's blocks with the bootstrap
        (``data``: the blocks of the lanes that hold a row, ascending; taken over like a
        contribution's) and, once all ranks are in, returns the sums at once: round 1, ``eager``,
        whose ``cur`` is the instruction they answer (the lanes summed).

        In recovery (a FINAL came first) the rank starts no round: it is sent the FINAL's sums."""
        if self.phase is Phase.REPLAYING:
            self.accounted.add(rank)
            self.updated = now
            return self._replay([rank])
        if self.phase is not Phase.BOOTSTRAP or self.booted[rank]:
            raise SlotViolation(f"rank {rank} sent a second bootstrap")
        if (data is not None) != self.layout.one_round:
            raise SlotViolation(f"rank {rank} sent a bootstrap {'without' if data is None else 'with'} blocks; "
                                f"this slot's lanes hold {self.layout.rows} row(s) each")
        self._check_rows(rank, rows, floor=None)
        if data is not None:
            lanes = np.flatnonzero(rows != INF)
            self._take(rank, 0, lanes, np.full(lanes.size, INF, dtype=ROW_DTYPE), rows[lanes], data)
        self.next[rank] = rows
        self.booted[rank] = True
        self.accounted.add(rank)
        self.updated = now
        if not self.booted.all():
            return None
        self.cur = self.next.min(axis=0)
        self._move(Phase.ROUNDS)
        if not self.layout.one_round:
            return self._start_round(0, np.zeros(0, self.meta.dtype.storage))
        answered = self.cur.copy()
        out = self._aggregate()
        return dataclasses.replace(out, cur=answered, eager=True)

    def expected_count(self, rank: int) -> int:
        """How many blocks ``rank`` must send in the current round (0 if it is not expected)."""
        if self._expected_lanes is None or not self._expected[rank]:
            return 0
        return int(np.count_nonzero(self._expected_lanes[rank]))

    def contribute(self, rank: int, rnd: int, nxt: np.ndarray, data: np.ndarray, *, now: float) -> Round | None:
        """Rank's blocks for round ``rnd``: one block for each lane where its announced row equals the
        instruction (ascending lanes), and each such lane's next row. Returns the round's result once
        every expected rank is in. ``data`` is taken over: the sum may be accumulated in it."""
        if self.phase is not Phase.ROUNDS:
            raise SlotViolation(f"rank {rank} contributed before every rank bootstrapped"
                                if self.phase is not Phase.DONE else f"rank {rank} contributed to a finished slot")
        if rnd != self.round + 1:
            raise SlotViolation(f"rank {rank} sent round {rnd}, the slot is at round {self.round + 1}")
        if not self._expected[rank]:
            raise SlotViolation(f"rank {rank} contributed to round {rnd} but holds none of its blocks")
        if rank in self._received:
            raise SlotViolation(f"rank {rank} contributed twice to round {rnd}")
        if self.cur is None or self._expected_lanes is None:
            raise RuntimeError(f"slot in phase {self.phase.name} without a current instruction")
        lanes = np.flatnonzero(self._expected_lanes[rank])
        if nxt.size != lanes.size:
            raise SlotViolation(f"rank {rank} sent {nxt.size} blocks in round {rnd}, the instruction asks it "
                                f"for {lanes.size}")
        rows = self.cur[lanes]
        self._check_rows(rank, nxt, floor=rows, lanes=lanes)
        self._take(rank, rnd, lanes, nxt, rows, data)
        self.updated = now
        if len(self._received) < self._n_expected:
            return None
        return self._aggregate()

    def _take(self, rank: int, rnd: int, lanes: np.ndarray, nxt: np.ndarray, rows: np.ndarray,
              data: np.ndarray) -> None:
        """Keep rank's blocks of ``lanes`` (at ``rows``) for the sum, once their size is checked."""
        pos = self._short_index(lanes, rows)
        expected_elems = wire_elements(self.layout, lanes.size, pos is not None)
        if data.size != expected_elems:
            raise SlotViolation(f"rank {rank} sent {data.size} elements for {lanes.size} blocks in round "
                                f"{rnd}, expected {expected_elems}")
        self._received[rank] = (lanes, nxt, unwire(data, lanes.size, self.meta.block_size, pos,
                                                   self.layout.tail))
        self.held_bytes += int(data.nbytes)
        self._report()

    # -- recovery after an aggregator restart ------------------------------------------------------

    def final_cost(self, ids: np.ndarray, data: Any) -> int:
        """Bytes :meth:`take_final` would keep for these sums (0: it would keep none)."""
        if self.phase is not Phase.BOOTSTRAP:
            return 0
        return _sums_bytes(ids, data)

    def take_final(self, rank: int, ids: np.ndarray, data: Any, *, now: float) -> Replay | None:
        """Rank's sums of this slot, which it finished before the aggregator restarted (block ids, in
        the order it received them, and their wire data). The first FINAL is kept and replayed to the
        ranks that bootstrapped; a later one only accounts for its rank. None while rounds run."""
        if self.phase in (Phase.ROUNDS, Phase.DONE):  # every rank bootstrapped: nobody needs this
            self.accounted.add(rank)
            self.updated = now
            return None
        self.accounted.add(rank)
        self.updated = now
        if self.phase is Phase.REPLAYING:
            return self._replay([])
        self.final = (ids, data)
        self._move(Phase.REPLAYING)
        self._report()
        return self._replay(self.booted_ranks())

    def expire(self, now: float, deadline: float) -> Expired | None:
        """What it means that the clock reads ``now`` (time.monotonic): None if the slot made progress
        within the last ``deadline`` seconds."""
        if now - self.updated <= deadline:
            return None
        return Expired(self.phase is Phase.REPLAYING, self.waiting_round, self.missing())

    def close(self) -> None:
        """The slot is dropped: give back to the tally all it holds (it reports nothing after)."""
        if self._tally is not None:
            self._tally.add(-self._reported)
        self._tally, self._reported = None, 0

    # -- internals -----------------------------------------------------------------------------

    def _replay(self, ranks: list[int]) -> Replay:
        assert self.final is not None
        ids, data = self.final
        finished = len(self.accounted) >= self.world_size
        if finished:
            self._move(Phase.DONE)
        return Replay(ranks, ids, data, finished=finished)

    def _report(self) -> None:
        """Pass a change of the footprint on to the tally."""
        if self._tally is not None:
            now = self.footprint
            self._tally.add(now - self._reported)
            self._reported = now

    def _check_rows(self, rank: int, rows: np.ndarray, floor: np.ndarray | None,
                    lanes: np.ndarray | None = None) -> None:
        valid = self._valid_rows if lanes is None else self._valid_rows[lanes]
        bad = (rows != INF) & (rows >= valid)
        if floor is not None:
            bad |= rows <= floor
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            lane = i if lanes is None else int(lanes[i])
            why = ("not after the current row" if floor is not None and rows[i] <= floor[i]
                   else "past the end of the tensor")
            raise SlotViolation(f"rank {rank} announced row {int(rows[i])} for lane {lane}, which is {why}")

    def _short_index(self, lanes: np.ndarray, rows: np.ndarray) -> int | None:
        """Position of the tensor's short last block among these (lane, row) pairs of the slot, if any."""
        if not self._holds_short:
            return None
        return self.layout.short_index(self.layout.slot_blocks(self.slot, lanes, rows))

    def _aggregate(self) -> Round:
        """Sum each active lane's blocks in rank order (float32), update ``next``, start the next round.

        Each lane's sum is ``((b_r0 + b_r1) + b_r2) + ...`` over its contributing ranks in ascending
        order (:func:`omnireduce.sums.rank_order_sum`, the sum every summer of the package makes, with
        no Python loop over blocks and no pass over lanes a rank does not touch).
        """
        assert self.cur is not None
        live = self.cur != INF
        active = np.flatnonzero(live)
        k, dtype = active.size, self.meta.dtype
        position: np.ndarray | None = None  # lane -> index in the active lanes
        parts = []
        for rank in sorted(self._received):
            lanes, nxt, blocks = self._received[rank]
            self.next[rank, lanes] = nxt
            if lanes.size == k:
                parts.append((None, blocks))
                continue
            if position is None:
                position = np.cumsum(live) - 1
            parts.append((position[lanes], blocks))
        acc = rank_order_sum(k, self.meta.block_size, parts, dtype)
        rows = self.cur[active]
        pos_short = self._short_index(active, rows)
        data = to_wire(narrow(acc, dtype), pos_short, self.layout.tail)
        self._received.clear()
        self.held_bytes = 0
        self._report()
        self.blocks_union += k
        self.cur = self.next.min(axis=0)
        self.round += 1
        return self._start_round(k, data)

    def _start_round(self, count: int, data: np.ndarray) -> Round:
        assert self.cur is not None
        live = self.cur != INF
        self._expected_lanes = (self.next == self.cur[None, :]) & live[None, :]
        self._expected = self._expected_lanes.any(axis=1)  # type: ignore[assignment]  # numpy stubs: any(axis) of a 2-d array is 1-d
        self._n_expected = int(np.count_nonzero(self._expected))
        finished = not live.any()
        if finished:
            self._move(Phase.DONE)
        return Round(self.round, count, self.cur.copy(), data, finished=finished)
