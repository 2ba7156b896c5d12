"""The worker core's records (:mod:`omnireduce.worker.core`): a tensor in flight (:class:`Flight`),
a connection to one aggregator (:class:`Link`), a finished CUDA tensor whose writes are still
running (:class:`Settling`), how messages leave and arrive (:data:`Send`, :data:`Body`), the
exception each error code raises, and what a timed-out tensor was waiting for (:func:`waiting_for`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from omnireduce.blocks import Layout
from omnireduce.dtypes import DType
from omnireduce.errors import OmniReduceError, OmniReduceMismatchError, OmniReduceRefused, OmniReduceTimeout
from omnireduce.wire import ErrorCode, Message
from omnireduce.worker.op import TensorOp

MAX_RETRIES = 5

#: How a message leaves: ``send(aggregator index, message)``; returns the bytes sent.
Send = Callable[[int, Message], int]
#: A received message's body, decoded on demand: ``body(layout, dtype)`` decodes the frames after the
#: header, a RESULT or REPLAY against its tensor's layout and dtype, anything else with (None, None);
#: raises :class:`~omnireduce.errors.WireError` if they do not make that message.
Body = Callable[[Layout | None, DType | None], Message]

ERROR_TYPES: dict[ErrorCode, type[OmniReduceError]] = {
    ErrorCode.MISMATCH: OmniReduceMismatchError,
    ErrorCode.REFUSED: OmniReduceRefused,
    ErrorCode.REPLACED: OmniReduceRefused,
    ErrorCode.TIMEOUT: OmniReduceTimeout,
}


@dataclasses.dataclass
class Settling:
    """A finished CUDA tensor whose future waits for its writes to run on the device."""

    op: TensorOp
    completion: Any  # omnireduce.cuda.runtime.Completion
    deadline: float


@dataclasses.dataclass
class Flight:
    """The core's record of one tensor in flight (its protocol state is ``op``)."""

    op: TensorOp
    started: float  # when the tensor was submitted
    deadline: float  # when to ask the aggregators what the tensor waits for (QUERY)
    query_deadline: float | None = None  # QUERY sent: when to give up waiting for STATUS
    status: dict[int, dict[str, Any]] = dataclasses.field(default_factory=dict)  # aggregator -> STATUS
    retries: int = 0  # times an aggregator restart started (some of) the tensor again
    bytes_sent: int = 0  # every byte of this tensor's messages, headers included
    bytes_received: int = 0

    def rearm(self, deadline: float) -> None:
        """A new deadline (after a retry): any QUERY in progress is forgotten."""
        self.deadline, self.query_deadline, self.status = deadline, None, {}

    @property
    def wakeup(self) -> float:
        """When the core must look at this tensor again."""
        return self.query_deadline or self.deadline


class Link:
    """What the core knows about its connection to one aggregator."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.handle: int | None = None  # job handle; None until WELCOME
        self.instance: str | None = None  # the aggregator process that gave the handle
        self.dropped = False  # the connection went down since the last WELCOME
        self.hello_pending = True
        self.lost_job = False  # it answered UNKNOWN_JOB: whatever instance it is, our slots there are gone
        self.down_since: float | None = None  # when the connection went down (None: up, or never joined)


def waiting_for(flight: Flight, addresses: list[str]) -> list[str]:
    """What each unfinished slot of a timed-out tensor waits for, from its aggregators' STATUS
    replies (``flight.status``; ``addresses``: the aggregators'), one phrase per slot."""
    op = flight.op
    parts = []
    for slot, rnd in op.waiting_on():
        agg = op.aggregator_of(slot)
        address = addresses[agg]
        status = flight.status.get(agg)
        if status is None:
            parts.append(f"slot {slot} round {rnd} at {address}: the aggregator did not answer "
                         "(down or unreachable?)")
            continue
        info = next((x for x in status.get("slots", []) if x.get("slot") == slot), None)
        if info is None:
            parts.append(f"slot {slot} round {rnd} at {address}: the aggregator has no state for it"
                         + (f" (aborted: {status['aborted']})" if "aborted" in status else ""))
        else:
            parts.append(f"slot {slot} round {rnd} at {address}: waiting for ranks {info['missing']} "
                         f"({info['phase']})")
    return parts


def settle(items: list[Settling], now: float, job: str, timeout: float) -> list[Settling]:
    """Complete the futures of the finished CUDA tensors whose writes have run on the device (or
    failed, or passed their deadline); returns those still running."""
    still = []
    for item in items:
        op = item.op
        try:
            done = item.completion.done()
        except Exception as e:  # a CUDA error: the writes may not have happened
            op.complete(OmniReduceError(f"tensor {op.seq} of job {job!r}: writing the result on "
                                        f"the device failed: {type(e).__name__}: {e}"))
            continue
        if done:
            op.complete()
        elif now >= item.deadline:
            op.complete(OmniReduceTimeout(
                f"tensor {op.seq} of job {job!r} (rank {op.rank} of {op.world_size}): the device did "
                f"not run the writes of its result within {timeout:g} s (a stuck kernel?)"))
        else:
            still.append(item)
    return still
