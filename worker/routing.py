"""Which aggregator serves which slot of a tensor, when some aggregators are lost.

Slot ``s`` of a tensor belongs to aggregator ``s mod A`` (its *nominal* aggregator). A rank may use
only the aggregators of its *usable* set: those the ranks last agreed to use (all of them until a
caller such as the DDP hook says otherwise, :meth:`omnireduce.Worker.use_aggregators`), less those
this rank has found lost since (unreachable for ``lost_after`` seconds). A slot whose nominal
aggregator is not usable goes to the next usable one after it, cyclically. The rule depends on
nothing but the usable set, so ranks holding the same set route every slot alike; and when an
aggregator dies, every rank finds it lost and moves exactly the same slots to the same place, each
in its own time (a moved slot starts over there, or is replayed from a rank that had finished it,
exactly as after an aggregator restart).

Nothing here touches a socket; the worker's I/O thread keeps the lost set and applies the routes.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping


def route(num_aggregators: int, usable: Iterable[int]) -> tuple[int, ...] | None:
    """For each nominal aggregator ``k``, the aggregator that serves its slots: ``k`` itself when
    usable, else the next usable one after it (cyclically). None when none is usable."""
    ok = set(usable)
    if not ok & set(range(num_aggregators)):
        return None
    n = num_aggregators
    return tuple(next((k + d) % n for d in range(n) if (k + d) % n in ok) for k in range(n))


def usable_for(agreed: Iterable[int], generation: int, lost: Mapping[int, int]) -> set[int]:
    """The aggregators a tensor may use: those agreed on when it was submitted (agreement number
    ``generation``), less those found lost under that agreement or a later one (``lost`` maps an
    aggregator to the agreement number in force when it was found lost). An aggregator found lost
    under an older agreement and agreed on again since (every rank reached it) is usable again."""
    return {a for a in agreed if lost.get(a, -1) < generation}
