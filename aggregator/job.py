"""One job at the aggregator: its ranks' connections and the tensor slots it has in flight.

A *job* is one training run: a name, a world size, the connection (zmq identity) of each rank, the
slots of its tensors in flight keyed by ``(seq, slot)``, recently aborted tensors (so that late
messages get a clear answer), each rank's completion watermark, the deadline its slots must make
progress within, and the :class:`~omnireduce.aggregator.budget.Tally` of the bytes its slots hold.

Slots enter through :meth:`Job.open` and leave through :meth:`Job.drop` (or the whole job's through
:meth:`Job.close`), which closes them, so the job's tally always counts exactly the slots it has.
Who may be a member is decided by the registry; what a slot does, by the slot. Nothing here talks to
sockets.
"""

from __future__ import annotations

import collections
import dataclasses
import time

from omnireduce.aggregator.budget import Tally
from omnireduce.aggregator.slot import SlotState, TensorMeta
from omnireduce.wire import ErrorCode

_ABORTS_REMEMBERED = 4096


@dataclasses.dataclass
class Job:
    handle: int
    name: str
    world_size: int
    deadline: float = 60.0  # seconds a slot may go without progress (the workers' timeout)
    held: Tally = dataclasses.field(default_factory=Tally)  # bytes the slots hold
    members: dict[int, bytes] = dataclasses.field(default_factory=dict)  # rank -> identity
    slots: dict[tuple[int, int], SlotState] = dataclasses.field(default_factory=dict)
    aborted: collections.OrderedDict[int, str] = dataclasses.field(default_factory=collections.OrderedDict)
    abort_codes: dict[int, ErrorCode] = dataclasses.field(default_factory=dict)  # seq -> why it was aborted
    watermarks: dict[int, int] = dataclasses.field(default_factory=dict)  # rank -> its completion watermark
    last_seen: float = dataclasses.field(default_factory=time.monotonic)

    def label(self) -> str:
        return f"job {self.name!r}"

    @property
    def watermark(self) -> int:
        """Every tensor below this sequence number has finished on every rank of the job."""
        if len(self.watermarks) < self.world_size:
            return 0
        return min(self.watermarks.values())

    def note_watermark(self, rank: int, watermark: int) -> None:
        """``rank`` says every tensor below ``watermark`` is complete there (it never goes back)."""
        self.watermarks[rank] = max(self.watermarks.get(rank, 0), watermark)

    def idle(self, now: float, seconds: float) -> bool:
        """No tensor in flight and no message for more than ``seconds``."""
        return not self.slots and now - self.last_seen > seconds

    # -- slots ---------------------------------------------------------------------------------

    def open(self, seq: int, slot: int, meta: TensorMeta, first_rank: int, now: float) -> SlotState:
        """A new slot of tensor ``seq`` opened at ``now``, counted in the job's tally."""
        state = self.slots[(seq, slot)] = SlotState(meta, slot, self.world_size, first_rank, tally=self.held,
                                                    now=now)
        return state

    def drop(self, key: tuple[int, int]) -> None:
        """Forget a slot (if it is still here) and what it holds."""
        state = self.slots.pop(key, None)
        if state is not None:
            state.close()

    def drop_tensor(self, seq: int) -> None:
        """Forget every slot of tensor ``seq``."""
        for key in [k for k in self.slots if k[0] == seq]:
            self.drop(key)

    def close(self) -> None:
        """Forget every slot."""
        for key in list(self.slots):
            self.drop(key)

    def has_tensor(self, seq: int) -> bool:
        """Whether tensor ``seq`` has a slot here."""
        return any(s == seq for s, _ in self.slots)

    def in_flight(self) -> list[int]:
        """The tensors with a slot here, in order."""
        return sorted({seq for seq, _ in self.slots})

    def waiting_for(self, rank: int) -> list[int]:
        """The tensors with a slot that waits for a message from ``rank``, in order."""
        return sorted({seq for (seq, _), state in self.slots.items() if rank in state.missing()})

    def remember_abort(self, seq: int, reason: str, code: ErrorCode = ErrorCode.ABORTED) -> None:
        self.aborted[seq] = reason
        self.abort_codes[seq] = code
        while len(self.aborted) > _ABORTS_REMEMBERED:
            old, _ = self.aborted.popitem(last=False)
            self.abort_codes.pop(old, None)
