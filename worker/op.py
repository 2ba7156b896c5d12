"""One tensor's all-reduce at a worker: the protocol state machine, without sockets or clocks.

Everything that decides what this rank says to the aggregators about one tensor lives here (in the
manner of a sans-I/O protocol library); the worker core (:mod:`omnireduce.worker.core`) keeps the
deadlines, the retries and the bytes, and the I/O thread (:mod:`omnireduce.worker.io_loop`) moves the
messages. The tensor's blocks come from a source
(:mod:`omnireduce.sources`: host memory, or a device tensor compacted on the device).

1. ``prepare()`` finds the non-zero blocks and orders them by lane; ``bootstraps()`` gives the
   bootstrap of every slot.
2. Each RESULT from an aggregator is fed to ``receive()`` (``on_result()``), which stages the
   summed blocks and returns this rank's contribution to the next round (or None when it holds
   none of the instructed blocks). A REPLAY (a slot's sums after an aggregator restart) is taken
   the same way (``on_replay()``).
3. When an aggregator has lost its state, ``recover(aggregator)`` gives, for each of its slots, a
   FINAL with the sums of a finished slot or a retry BOOTSTRAP that starts an unfinished one over.
4. Once ``done``, ``finish()`` scatters all staged blocks into the input in one go and completes the
   future (or, for a CUDA result that must be complete on the device first, returns the event to
   poll, and ``complete()`` completes the future once it has happened); ``fail()`` completes it
   with an error instead. The input is never written before, so a failed or retried reduction
   leaves it intact. Whatever goes wrong while the source's buffers are released, the future is
   completed first.

``prepare()`` blocks until the non-zero blocks are known; for a device tensor the I/O thread runs
it on the device's own thread (``source.defer``), so that it never waits for the device itself.

Phases. Where a tensor is in this sequence is one named :class:`Phase`, and the moves allowed
between phases are one table (``_MOVES``): ``NEW`` (queued; ``prepare()`` may run) -> ``ROUNDS``
(``bootstraps()`` taken: slots run their rounds, and start over or are replayed after a restart)
-> ``SUMMED`` (every slot's sums are here) -> ``COMPLETED`` (the future has its outcome; the sums
stay for replays), through ``SETTLING`` (the writes queued on the device, the future waiting for
them) for a synchronized CUDA result; ``FAILED`` (the future failed, nothing kept) from ``NEW``,
``ROUNDS`` or ``SUMMED`` (a settling tensor's writes that fail complete it with the error; failing
a failed tensor again changes nothing). A call that would make any other move raises
:class:`IllegalTransition`: a bug in the caller, never a peer's doing (a peer's message that does
not fit the state is an :class:`~omnireduce.errors.OmniReduceError`). Per slot, the progress is
in ``slot_round`` / ``slot_done``.
"""

from __future__ import annotations

import concurrent.futures
import enum
import logging
from typing import Any

import numpy as np

from omnireduce.blocks import INF, LaneIndex, Layout
from omnireduce.errors import OmniReduceError
from omnireduce.sources.base import Completing, Source
from omnireduce.wire import (
    FLAG_EAGER,
    FLAG_RETRY,
    Bootstrap,
    Contribution,
    Header,
    MsgType,
    Result,
    SlotSums,
    wire_elements,
)

log = logging.getLogger("omnireduce.worker")


class ReduceFuture(concurrent.futures.Future):
    """The future of one all-reduce. Once it has a result:

    ``info`` describes the reduction: ``blocks_total``: blocks of the tensor; ``blocks_nonzero``:
    those non-zero on this rank; ``blocks_union``: blocks non-zero on some rank (the summed blocks
    received, the same on every rank); ``bytes_sent`` / ``bytes_received``: this rank's message
    bytes for this tensor.

    ``stream`` is the CUDA stream that wrote the result into a CUDA tensor (None on the host path).
    The result is complete on the device when the future completes, unless the reduction was started
    with ``synchronize=False``: then a reader must first make its own stream wait for ``stream``.
    """

    def __init__(self) -> None:
        super().__init__()
        self.info: dict[str, int] = {}
        self.stream: Any = None


class Phase(enum.Enum):
    """Where one tensor's all-reduce stands at this rank (see the module docstring)."""

    NEW = "new"  # queued: its non-zero blocks are found (prepare), maybe on its device's thread
    ROUNDS = "rounds"  # bootstraps sent: its slots run their rounds (started over after a restart)
    SUMMED = "summed"  # every slot's sums are here; finish() writes them into the input
    SETTLING = "settling"  # the writes are queued on the device; the future waits for them
    COMPLETED = "completed"  # the future has its outcome; the sums are kept for replays (FINAL)
    FAILED = "failed"  # the future failed; nothing is kept


#: The moves a tensor may make, and the only ones.
_MOVES: dict[Phase, frozenset[Phase]] = {
    Phase.NEW: frozenset({Phase.ROUNDS, Phase.FAILED}),
    Phase.ROUNDS: frozenset({Phase.SUMMED, Phase.FAILED}),
    Phase.SUMMED: frozenset({Phase.SETTLING, Phase.COMPLETED, Phase.FAILED}),
    Phase.SETTLING: frozenset({Phase.COMPLETED}),
    Phase.COMPLETED: frozenset(),
    Phase.FAILED: frozenset(),
}
#: The phases in which a tensor holds slots at the aggregators (so that it answers their restarts:
#: a slot in progress starts over, a finished one is sent as FINAL).
_HOLDS_SLOTS = frozenset({Phase.ROUNDS, Phase.SETTLING, Phase.COMPLETED})
_SUMMED = frozenset({Phase.SUMMED, Phase.SETTLING, Phase.COMPLETED})
_ROUNDS = frozenset({Phase.ROUNDS})
_SUMMED_ONLY = frozenset({Phase.SUMMED})


class IllegalTransition(RuntimeError):
    """A call that does not fit the tensor's phase (a bug in the caller)."""


class _Finished:
    """The source of a finished tensor: nothing to read, nothing to release."""

    device = "(finished)"
    defer = None

    def release(self) -> None:
        pass


_FINISHED: Any = _Finished()


def _completed() -> ReduceFuture:
    future = ReduceFuture()
    future.set_result(None)
    return future


#: Stands in for a completed tensor's future: the op no longer holds the caller's future, whose result
#: is the caller's tensor (a finished op is kept for replays after an aggregator restart, and must not
#: keep a gradient-sized buffer alive, e.g. a DDP bucket that was rebuilt meanwhile).
_COMPLETED = _completed()


class TensorOp:
    """The all-reduce of one tensor (sequence number ``seq``) on one rank.

    ``user`` is the caller's tensor (the future's result), ``source`` its blocks (which fix the
    layout and dtype). ``synchronize``: see :class:`ReduceFuture` (``stream``).
    """

    def __init__(self, seq: int, user: Any, source: Source, *, rank: int, world_size: int,
                 num_aggregators: int, average: bool, threshold: float, future: ReduceFuture,
                 synchronize: bool = True) -> None:
        self.seq = seq
        self.user = user
        self.source: Source = source
        self.dtype = source.dtype
        self.layout: Layout = source.layout
        self.synchronize = synchronize
        self.rank = rank
        self.world_size = world_size
        self.num_aggregators = num_aggregators
        # which aggregator serves each nominal aggregator's slots (omnireduce.worker.routing): all
        # their own unless the I/O thread routes around lost ones; ``agreed`` / ``generation``: the
        # aggregators the caller let this tensor use, and that agreement's number
        self.route: tuple[int, ...] = tuple(range(num_aggregators))
        self.agreed: frozenset[int] = frozenset(range(num_aggregators))
        self.generation = 0
        self.average = average
        self.threshold = threshold
        self.future = future
        S = self.layout.slots
        self.slot_round = np.full(S, -1, dtype=np.int64)  # last RESULT round seen per slot
        self.slot_done = np.zeros(S, dtype=bool)
        self._cur: list[np.ndarray | None] = [None] * S
        self._staged: dict[int, list[tuple[np.ndarray, np.ndarray]]] = {s: [] for s in range(S)}
        self._index: LaneIndex | None = None
        self.blocks_nonzero = 0
        self.blocks_sent = 0
        self.blocks_received = 0
        self.gathered_bytes = 0  # what the blocks sent took in buffers of their own (not views of the input)
        self.sums_owned = False  # every kept sum is in an array of its own (:meth:`own_sums`)
        self.phase = Phase.NEW

    # -- phases --------------------------------------------------------------------------------

    def _move(self, to: Phase) -> None:
        """Move to phase ``to``; :class:`IllegalTransition` if ``_MOVES`` does not allow it."""
        if to not in _MOVES[self.phase]:
            raise IllegalTransition(f"tensor {self.seq}: {self.phase.name} -> {to.name} is not allowed")
        self.phase = to

    def _expect(self, phases: frozenset[Phase], doing: str) -> None:
        if self.phase not in phases:
            raise IllegalTransition(f"tensor {self.seq}: cannot {doing} in phase {self.phase.name}")

    # -- setup ---------------------------------------------------------------------------------

    def aggregator_of(self, slot: int) -> int:
        return self.route[slot % self.num_aggregators]

    def slots_on(self, aggregator: int) -> list[int]:
        """The slots aggregator ``aggregator`` serves."""
        n, r = self.num_aggregators, self.route
        return [s for s in range(self.layout.slots) if r[s % n] == aggregator]

    def reroute(self, new_route: tuple[int, ...]) -> list[tuple[int, Bootstrap | SlotSums]]:
        """Serve the slots from ``new_route`` from now on. For every slot that moves, (its new
        aggregator, the message that takes it there): FINAL if this rank had finished the slot, else
        a retry BOOTSTRAP that starts it over, as after a restart of its aggregator."""
        self._expect(_HOLDS_SLOTS, "move slots")
        old, self.route = self.route, new_route
        n = self.num_aggregators
        moved = [s for s in range(self.layout.slots) if old[s % n] != new_route[s % n]]
        return [(new_route[s % n], self.final_message(s) if self.slot_done[s] else self.restart_slot(s))
                for s in moved]

    def header(self, mtype: MsgType, **fields: int) -> Header:
        lay = self.layout
        return Header(mtype, dtype=int(self.dtype), rank=self.rank, seq=self.seq, numel=lay.numel,
                      block_size=lay.block_size, lanes=lay.lanes, slots=lay.slots, **fields)

    def prepare(self) -> None:
        """Find the non-zero blocks and index them by lane (the one full pass over the tensor)."""
        flags = self.source.nonzero(self.threshold)
        self.blocks_nonzero = int(np.count_nonzero(flags))
        self._index = LaneIndex(self.layout, flags)

    def bootstraps(self) -> list[tuple[int, Bootstrap]]:
        """(aggregator index, message) of every slot's bootstrap: the tensor's rounds begin."""
        self._move(Phase.ROUNDS)
        return [(self.aggregator_of(s), self._bootstrap(s, 0)) for s in range(self.layout.slots)]

    def _bootstrap(self, s: int, flags: int) -> Bootstrap:
        """Slot ``s``'s bootstrap: its lanes' first non-zero rows and, in a one-round layout, the blocks
        themselves (which are then sent: every one of them is summed in the first round)."""
        assert self._index is not None
        rows = self._index.pending(s)
        if not self.layout.one_round:
            return Bootstrap(self.header(MsgType.BOOTSTRAP, slot=s, flags=flags), self.layout, rows)
        rows = rows.copy()  # (the index moves on below)
        send = np.flatnonzero(rows != INF)
        data = self._gather(self.layout.slot_blocks(s, send, rows[send]))
        self._index.advance(s, send)
        self.blocks_sent += int(send.size)
        return Bootstrap(self.header(MsgType.BOOTSTRAP, slot=s, flags=flags | FLAG_EAGER, count=int(send.size)),
                         self.layout, rows, data)

    def _gather(self, ids: np.ndarray) -> np.ndarray:
        """The blocks ``ids`` as they go on the wire, counted in :attr:`gathered_bytes` where they were
        copied (a run of blocks of a host tensor is sent straight from it)."""
        data = self.source.gather(ids)
        raw = getattr(self.source, "raw", None)  # (a host source's input)
        if raw is None or not np.may_share_memory(data, raw):
            self.gathered_bytes += int(data.nbytes)
        return data

    # -- rounds --------------------------------------------------------------------------------

    def receive(self, msg: Result | SlotSums) -> Contribution | None:
        """Take a RESULT or a REPLAY; return the contribution to send for the next round, if any."""
        self._expect(_ROUNDS, "take a result")
        if isinstance(msg, SlotSums):
            self.on_replay(msg)
            return None
        return self.on_result(msg)

    def on_result(self, msg: Result) -> Contribution | None:
        """Take one RESULT; return the contribution to the next round, if this rank holds any of it."""
        assert self._index is not None
        hdr, cur = msg.header, msg.cur
        s, lay = hdr.slot, self.layout
        if s >= lay.slots:
            raise OmniReduceError(f"result for slot {s}, which does not exist")
        if self.slot_done[s]:
            return None  # a duplicate (e.g. also replayed after an aggregator restart)
        if msg.eager != lay.one_round:
            raise OmniReduceError(f"slot {s}: a {'one-round' if msg.eager else 'lockstep'} result for a tensor of "
                                  f"{lay.rows} row(s) per lane")
        if msg.eager:  # the sums of the blocks every rank sent with its bootstrap; ``cur`` names their lanes
            if hdr.round != 1 or self.slot_round[s] != -1:
                raise OmniReduceError(f"slot {s}: one-round result for round {hdr.round}, after round "
                                      f"{self.slot_round[s]}")
            self._cur[s] = cur
            cur = np.full(cur.size, INF, dtype=cur.dtype)  # and nothing follows
        elif hdr.round != self.slot_round[s] + 1:
            raise OmniReduceError(f"slot {s}: result for round {hdr.round}, expected {self.slot_round[s] + 1}")
        prev = self._cur[s]
        lanes = np.flatnonzero(prev != INF) if prev is not None else np.zeros(0, np.int64)
        if hdr.count != lanes.size:
            raise OmniReduceError(f"slot {s} round {hdr.round}: {hdr.count} summed blocks, the instruction "
                                  f"named {lanes.size}")
        if prev is not None and lanes.size:  # (lanes is empty when prev is None)
            ids = lay.slot_blocks(s, lanes, prev[lanes])
            expected = wire_elements(lay, lanes.size, lay.short_index(ids) is not None)
            if msg.data.size != expected:
                raise OmniReduceError(f"slot {s} round {hdr.round}: {msg.data.size} elements of sums, expected "
                                      f"{expected} for {lanes.size} blocks")
            self._staged[s].append((ids, msg.data))
            self.blocks_received += int(lanes.size)
        self._cur[s] = cur
        self.slot_round[s] = hdr.round
        live = cur != INF
        if not live.any():
            self._slot_finished(s)
            return None
        send = np.flatnonzero((self._index.pending(s) == cur) & live)
        if send.size == 0:
            return None
        ids = lay.slot_blocks(s, send, cur[send])
        data = self._gather(ids)
        nxt = self._index.advance(s, send)
        self.blocks_sent += int(send.size)
        return Contribution(self.header(MsgType.CONTRIB, slot=s, round=hdr.round + 1, count=int(send.size)), lay,
                            nxt, data)

    # -- recovery after an aggregator restart ------------------------------------------------------

    def recover(self, aggregator: int) -> list[Bootstrap | SlotSums]:
        """``aggregator`` lost its state: for each of its slots, FINAL if this rank finished the slot
        (its sums, for ranks that lost them), else a retry BOOTSTRAP that starts the slot over."""
        self._expect(_HOLDS_SLOTS, "recover slots")
        return [self.final_message(s) if self.slot_done[s] else self.restart_slot(s) for s in self.slots_on(aggregator)]

    def restart_slot(self, s: int) -> Bootstrap:
        """Start slot ``s`` over (its aggregator lost it): forget its rounds; return its bootstrap."""
        assert self._index is not None
        self._index.reset(s)
        self._cur[s] = None
        self.slot_round[s] = -1
        self._staged[s] = []
        return self._bootstrap(s, FLAG_RETRY)

    def final_message(self, s: int) -> SlotSums:
        """FINAL for finished slot ``s``: its summed blocks, for ranks that lost them."""
        parts = self._staged[s]
        ids = np.concatenate([i for i, _ in parts]) if parts else np.zeros(0, np.int64)
        data = np.concatenate([d for _, d in parts]) if parts else np.zeros(0, self.dtype.storage)
        return SlotSums(self.header(MsgType.FINAL, slot=s, count=int(ids.size)), self.layout, ids, data)

    def on_replay(self, msg: SlotSums) -> None:
        """Take slot ``hdr.slot``'s sums from a REPLAY (another rank's FINAL)."""
        s = msg.header.slot
        if s >= self.layout.slots or self.slot_done[s]:
            return
        self._staged[s] = [(msg.ids, msg.data)]
        self.blocks_received += int(msg.ids.size)
        self._slot_finished(s)

    def _slot_finished(self, s: int) -> None:
        self.slot_done[s] = True
        if self.slot_done.all():
            self._move(Phase.SUMMED)

    @property
    def done(self) -> bool:
        """Every slot's sums are here (and maybe written: the tensor finished)."""
        return self.phase in _SUMMED

    def waiting_on(self) -> list[tuple[int, int]]:
        """(slot, round) pairs still in progress: the round is the next RESULT this rank waits for."""
        return [(int(s), int(self.slot_round[s]) + 1) for s in np.flatnonzero(~self.slot_done)]

    # -- completion ----------------------------------------------------------------------------

    def finish(self, *, bytes_sent: int, bytes_received: int) -> Any:
        """Write the reduced tensor into the input and complete the future with it; the byte counts
        (kept by the I/O thread) go into its ``info``.

        Returns None when the future is complete. A CUDA result with ``synchronize`` is complete
        only once the writes queued on the device have run: then the future is left pending and the
        source's :class:`~omnireduce.cuda.runtime.Completion` is returned; the caller polls its
        ``done()`` and then calls :meth:`complete` (nothing blocks on the device here).

        The per-slot sums stay (as received, no copy) in case another rank needs them replayed
        after an aggregator restart; neither the input tensor nor the future (whose result it is),
        nor the lanes' index, is referenced once completed."""
        self._expect(_SUMMED_ONLY, "write the result")  # (before anything is written into the input)
        staged = [part for s in range(self.layout.slots) for part in self._staged[s]]
        stream = self.source.finish(staged, self.world_size if self.average else 1)
        pending = None
        if stream is not None and self.synchronize:
            if not isinstance(self.source, Completing):
                raise OmniReduceError(f"{type(self.source).__name__} wrote the sums on a CUDA stream but offers no "
                                      "completion() to wait for them")
            pending = self.source.completion()
        # The union counted from the final sums (not from what arrived, which retries can repeat): the
        # same on every rank, which the DDP hook's collective dense/sparse decision relies on.
        union = sum(int(ids.size) for ids, _ in staged)
        if pending is not None:
            self._move(Phase.SETTLING)
        self.future.stream = stream
        self.future.info = {"blocks_total": self.layout.num_blocks, "blocks_nonzero": self.blocks_nonzero,
                            "blocks_union": union, "bytes_sent": bytes_sent, "bytes_received": bytes_received}
        self._release_source()  # keep the sums for replays, not the user's tensor's buffers
        # nor the lanes' index and rounds (arrays of every lane: more than the sums at low density)
        self._index, self._cur = None, [None] * self.layout.slots
        if pending is None:
            self.complete()
        return pending

    def complete(self, error: BaseException | None = None) -> None:
        """Complete the future of a finished tensor: with the tensor, or with ``error`` (its writes
        did not complete on the device)."""
        self._move(Phase.COMPLETED)
        user, self.user = self.user, None
        future, self.future = self.future, _COMPLETED
        if error is None:
            future.set_result(user)
        else:
            future.set_exception(error)

    def retained_bytes(self) -> int:
        return sum(int(d.nbytes) for parts in self._staged.values() for _, d in parts)

    def own_sums(self) -> None:
        """Hold the finished tensor's kept sums in arrays of its own (copied once, on the I/O thread),
        not in the buffers they arrived in, as far as the blocks this rank sent took buffers of their
        own (:attr:`gathered_bytes`). The received buffers are allocated by zmq's I/O thread, whose arena
        is the process's main heap, where the training's own temporaries come and go every step: sums
        kept there for an iteration or more split that heap's free memory and make it grow. The copies
        go to the I/O thread's arena, where this tensor's gathered blocks were just freed, and are let
        go before the next tensor's are gathered, once every rank has finished this one (the DDP hook's
        per-iteration agreement: :meth:`omnireduce.Worker.release_kept`). Never more than that: a
        tensor whose blocks were sent straight from it (a dense one) freed nothing there, and a copy
        would only add its sums' size to the process. Each part is let go as soon as it is copied."""
        budget = self.gathered_bytes
        for parts in self._staged.values():
            for i, (ids, d) in enumerate(parts):
                if d.flags.owndata and ids.flags.owndata:
                    continue
                if d.nbytes > budget:
                    return
                budget -= d.nbytes
                parts[i] = (ids if ids.flags.owndata else ids.copy(), d if d.flags.owndata else d.copy())
        self.sums_owned = True

    def fail(self, error: BaseException) -> None:
        """Complete the future with ``error`` (first, so that it completes whatever happens next),
        then drop the sums and release the source. Failing a failed tensor again changes nothing."""
        if self.phase is Phase.FAILED:
            return
        self._move(Phase.FAILED)
        future, self.future = self.future, _COMPLETED
        future.set_exception(error)
        self._staged = {s: [] for s in range(self.layout.slots)}
        self.user = None
        self._release_source()

    def _release_source(self) -> None:
        """Release the source's buffers, never raising: after a sticky CUDA error recording the
        event that guards their reuse fails; the tensor's outcome is decided already."""
        source, self.source = self.source, _FINISHED
        try:
            source.release()
        except Exception as e:
            log.warning("omnireduce: tensor %d: releasing its buffers failed (%s: %s)", self.seq, type(e).__name__, e)
