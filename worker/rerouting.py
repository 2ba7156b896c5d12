"""Routing around lost aggregators: the part of :class:`omnireduce.worker.core.WorkerCore` that finds
an aggregator lost (its connection down for ``lost_after`` seconds while another is reachable) and
moves its slots, of the tensors in flight and of those kept for replays, to the next usable
aggregator (:mod:`omnireduce.worker.routing` says where). A mixin: it works on the core's state.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from omnireduce.worker.routing import route, usable_for

if TYPE_CHECKING:
    from omnireduce.config import WorkerConfig
    from omnireduce.wire import Message
    from omnireduce.worker.flight import Flight, Link
    from omnireduce.worker.retention import KeptSums

log = logging.getLogger("omnireduce.worker")


class Rerouting:
    """Finding aggregators lost and moving their slots (see the module docstring)."""

    cfg: WorkerConfig
    links: list[Link]
    kept: KeptSums
    _flights: dict[int, Flight]
    _lost: dict[int, int]
    _generation: int
    _agreed: frozenset[int]

    if TYPE_CHECKING:  # the core's
        def count(self, **increments: int) -> None: ...

        def _send(self, i: int, msg: Message) -> int: ...

    # -- lost aggregators ----------------------------------------------------------------------------

    def _check_links(self, now: float) -> None:
        """Route around every aggregator whose connection has been down for ``lost_after`` seconds,
        as long as another one is reachable (with none, tensors wait for one to come back, or fail
        at their deadline)."""
        limit = self.cfg.lost_seconds
        for i, link in enumerate(self.links):
            if not link.dropped or link.down_since is None or now - link.down_since < limit:
                continue
            if not self._may_lose(i):
                continue  # not in use, or already routed around
            others = [j for j, lk in enumerate(self.links) if j != i and not lk.dropped and self._may_lose(j)]
            if not others:
                continue
            self._lost[i] = self._generation
            self.count(aggregators_lost=1)
            moved = self._reroute(now)
            log.warning("aggregator %s unreachable for %.0f s: routing its slots to the other aggregators "
                        "(%d tensor(s) in flight moved); it is used again once every rank reaches it",
                        link.address, now - link.down_since, moved)

    def _may_lose(self, i: int) -> bool:
        """Whether aggregator ``i`` is in use under the newest agreement (so it can be found lost)."""
        return i in self._agreed and self._lost.get(i, -1) < self._generation

    def _reroute(self, now: float) -> int:
        """Apply the lost set to every tensor in flight or kept for replays; returns how many moved."""
        moved = 0
        ops = [(f.op, f) for f in self._flights.values()] + [(op, None) for op in self.kept.tensors.values()]
        for op, flight in ops:
            new = route(op.num_aggregators, usable_for(op.agreed, op.generation, self._lost))
            if new is None or new == op.route:
                continue
            messages = op.reroute(new)
            self.count(slots_rerouted=len(messages))
            if flight is not None:
                moved += 1
                flight.rearm(now + self.cfg.timeout)
            for agg, msg in messages:
                n = self._send(agg, msg)
                if flight is not None:
                    flight.bytes_sent += n
        return moved
