"""The aggregator's bookkeeping of jobs and connections, and the limits that bound it.

A *job* is one training run: a name, a world size, the connection (zmq identity) of each rank,
the tensor slots in flight, recently aborted tensors (so late messages get a clear answer), each
rank's completion watermark, and a deadline. A *peer* is one worker connection. Nothing here talks
to sockets.
"""

from __future__ import annotations

import collections
import dataclasses
import time

from omnireduce.aggregator.slot import SlotState


@dataclasses.dataclass(frozen=True)
class AggregatorLimits:
    """Caps that bound what clients can make the aggregator hold.

    max_jobs: jobs registered at once.
    max_peers: worker connections registered at once.
    max_slots_per_job: tensor slots in flight per job.
    max_job_bytes: bytes a job's slots may hold (lane arrays, blocks waiting to be summed, replays).
    max_total_bytes: the same, for all jobs together.
    max_message_bytes: largest message accepted (zmq drops larger ones at the socket).
    max_world_size: largest world size a job may declare.
    error_replies_per_second: error replies per connection per second (the rest are dropped).
    idle_job_seconds: a job with no message and no tensor in flight for this long is forgotten.
    """

    max_jobs: int = 1024
    max_peers: int = 65536
    max_slots_per_job: int = 4096
    max_job_bytes: int = 8 << 30
    max_total_bytes: int = 16 << 30
    max_message_bytes: int = 1 << 30
    max_world_size: int = 4096
    error_replies_per_second: float = 20.0
    idle_job_seconds: float = 3600.0


@dataclasses.dataclass
class Job:
    handle: int
    name: str
    world_size: int
    deadline: float = 60.0  # seconds a slot may go without progress (the workers' timeout)
    members: dict[int, bytes] = dataclasses.field(default_factory=dict)  # rank -> identity
    slots: dict[tuple[int, int], SlotState] = dataclasses.field(default_factory=dict)
    aborted: collections.OrderedDict[int, str] = dataclasses.field(default_factory=collections.OrderedDict)
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

    footprint: int = 0  # sum of the slots' footprints, kept up to date by add/drop/adjust

    def add(self, key: tuple[int, int], state: SlotState) -> None:
        self.slots[key] = state
        self.footprint += state.footprint

    def drop(self, key: tuple[int, int]) -> int:
        """Forget a slot; returns the bytes it held."""
        state = self.slots.pop(key, None)
        if state is None:
            return 0
        self.footprint -= state.footprint
        return state.footprint

    def remember_abort(self, seq: int, reason: str) -> None:
        self.aborted[seq] = reason
        while len(self.aborted) > 4096:
            self.aborted.popitem(last=False)


@dataclasses.dataclass
class Peer:
    job: int
    rank: int
    client: str


class TokenBucket:
    """At most ``rate`` events per second, with bursts of up to ``rate``."""

    __slots__ = ("rate", "stamp", "tokens")

    def __init__(self, rate: float) -> None:
        self.rate, self.tokens, self.stamp = rate, rate, time.monotonic()

    def take(self) -> bool:
        now = time.monotonic()
        self.tokens = min(self.rate, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now
        if self.tokens < 1:
            return False
        self.tokens -= 1
        return True
