"""Who is connected: the aggregator's jobs, and the worker connections (*peers*) registered in them.

Design. HELLO is the only way in. :meth:`Registry.admit` checks it (the token in constant time, the
rank, the world size, the caps on connections and jobs), finds or creates the job, and settles whose
the rank is: a connection of the same worker process that came back keeps its place; a rank claimed
by another process is *taken over*, and :meth:`~Registry.admit` returns the old connection so that
the caller can tell it (and abort the job's tensors) before :meth:`~Registry.register` gives the rank
to the new one. Every later message must come from a registered connection and name its job handle
and rank (:meth:`~Registry.member`). A rank leaves with GOODBYE (:meth:`~Registry.leave`); a job
with no ranks left, or idle too long, is forgotten with its slots (:meth:`~Registry.forget`).

Handles are random 32-bit numbers, so that handles from before a restart are not mistaken for new
ones. Refusals are raised as :class:`Refused` (an error code and a message for the sender); this
module decides and never sends.
"""

from __future__ import annotations

import dataclasses
import hmac
import logging

import numpy as np

from omnireduce.aggregator.budget import Budget
from omnireduce.aggregator.job import Job
from omnireduce.aggregator.limits import AggregatorLimits
from omnireduce.wire import ErrorCode, Header, Hello

log = logging.getLogger("omnireduce.aggregator")


class Refused(Exception):
    """A message the registry does not let in; ``code`` and the message are for the sender.

    ``job``: set when the job's members must hear of it too (a rank that disagrees about the world
    size: the others would otherwise wait for it until their deadline, without knowing why)."""

    def __init__(self, code: ErrorCode, message: str, job: Job | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.job = job


@dataclasses.dataclass
class Peer:
    job: int
    rank: int
    client: str  # the worker process (a random id it sends in HELLO)


class Registry:
    """The jobs (by handle and by name) and the peers (by zmq identity)."""

    def __init__(self, limits: AggregatorLimits, token: str | None, budget: Budget) -> None:
        self.limits = limits
        self._token = token.encode() if token is not None else None
        self._budget = budget
        self.jobs: dict[int, Job] = {}
        self._by_name: dict[str, int] = {}
        self._peers: dict[bytes, Peer] = {}
        self._rng = np.random.default_rng()

    @property
    def peers(self) -> int:
        """How many connections are registered."""
        return len(self._peers)

    def rank_of(self, identity: bytes) -> int | None:
        """The rank a connection registered as (None if it did not)."""
        peer = self._peers.get(identity)
        return None if peer is None else peer.rank

    # -- joining ---------------------------------------------------------------------------------

    def admit(self, identity: bytes, msg: Hello) -> tuple[Job, bytes | None]:
        """Check a HELLO; returns its job (created if new) and the connection it takes the rank over
        from, if any (it is no longer registered). :class:`Refused` if the HELLO is not let in."""
        name, rank, world_size, client, token = msg.job, msg.rank, msg.world_size, msg.client, msg.token
        if self._token is not None:
            given = token.encode() if token is not None else b""
            if not hmac.compare_digest(given, self._token):
                why = "missing" if token is None else "wrong"
                log.warning("refused HELLO for job %r rank %d (client %s): %s token", name, rank, client, why)
                raise Refused(ErrorCode.REFUSED, f"{why} token for this aggregator")
        if not 1 <= world_size <= self.limits.max_world_size or not 0 <= rank < world_size:
            raise Refused(ErrorCode.REFUSED, f"rank {rank} / world size {world_size} out of range "
                                             f"(world size at most {self.limits.max_world_size})")
        if identity not in self._peers and len(self._peers) >= self.limits.max_peers:
            raise Refused(ErrorCode.LIMIT, f"too many connections ({self.limits.max_peers})")
        job = self._job_for(name, world_size, rank, msg.timeout)
        old = job.members.get(rank)
        if old is None or old == identity:
            return job, None
        previous = self._peers.pop(old, None)
        if previous is not None and previous.client == client and client:
            return job, None  # the same worker process, reconnected: keep its place
        return job, old

    def register(self, identity: bytes, job: Job, msg: Hello) -> None:
        """Give ``msg.rank`` of ``job`` to ``identity`` (after :meth:`admit`)."""
        rank = msg.rank
        prev = self._peers.get(identity)
        if prev is not None and (prev.job != job.handle or prev.rank != rank):
            self.leave(identity)
        job.members[rank] = identity
        job.deadline = max(job.deadline, msg.timeout)
        self._peers[identity] = Peer(job.handle, rank, msg.client)
        log.info("%s: rank %d of %d joined (client %s)", job.label(), rank, job.world_size, msg.client)

    def _job_for(self, name: str, world_size: int, rank: int, timeout: float) -> Job:
        """The job called ``name`` (created if new); :class:`Refused` for a different world size.

        (Block sizes are checked per tensor, so that every rank hears of a difference.)"""
        handle = self._by_name.get(name)
        if handle is not None:
            job = self.jobs[handle]
            if job.world_size != world_size:
                raise Refused(ErrorCode.MISMATCH, f"job {name!r}: rank {rank} says world size {world_size} but "
                                                  f"the job has {job.world_size} (from ranks {sorted(job.members)})",
                              job=job)
            return job
        if len(self.jobs) >= self.limits.max_jobs:
            raise Refused(ErrorCode.LIMIT, f"too many jobs ({self.limits.max_jobs})")
        handle = int(self._rng.integers(1, 1 << 32))
        while handle in self.jobs:
            handle = int(self._rng.integers(1, 1 << 32))
        job = Job(handle, name, world_size, deadline=timeout, held=self._budget.job_tally())
        self.jobs[handle] = job
        self._by_name[name] = handle
        return job

    # -- members -------------------------------------------------------------------------------

    def member(self, identity: bytes, hdr: Header, now: float) -> Job:
        """The job of a registered sender (seen at ``now``); :class:`Refused` if it is not one."""
        job = self.jobs.get(hdr.job)
        if job is None:
            raise Refused(ErrorCode.UNKNOWN_JOB, f"unknown job handle {hdr.job}: say HELLO first (the aggregator "
                                                 "may have restarted)")
        peer = self._peers.get(identity)
        if peer is None or peer.job != hdr.job or peer.rank != hdr.rank:
            raise Refused(ErrorCode.REFUSED, f"this connection is not rank {hdr.rank} of {job.label()}")
        job.last_seen = now
        return job

    def leave(self, identity: bytes) -> None:
        """The connection leaves its job; a job with no ranks left is forgotten."""
        peer = self._peers.pop(identity, None)
        if peer is None:
            return
        job = self.jobs.get(peer.job)
        if job is None:
            return
        if job.members.get(peer.rank) == identity:
            del job.members[peer.rank]
        log.info("%s: rank %d left", job.label(), peer.rank)
        if not job.members:
            self.forget(job, "no ranks left")

    def forget(self, job: Job, why: str) -> None:
        """Drop a job: its slots, its connections, its name."""
        log.info("%s: %s, freed (%d slots in flight dropped)", job.label(), why, len(job.slots))
        job.close()
        for ident in job.members.values():
            self._peers.pop(ident, None)
        self.jobs.pop(job.handle, None)
        if self._by_name.get(job.name) == job.handle:
            del self._by_name[job.name]
