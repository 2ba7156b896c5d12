"""The caps that bound what clients can make an aggregator hold (:class:`AggregatorLimits`).

One frozen record, read by the parts that enforce each cap: the registry (jobs, connections, world
size), the budget (bytes), the core (slots per job, message size, error replies, idle jobs) and the
socket (message size). ``omnireduce-agg`` sets them from its ``--max-*`` flags.
"""

from __future__ import annotations

import dataclasses


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
