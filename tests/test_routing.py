"""omnireduce.worker.routing: the slot-to-aggregator rule around lost aggregators, without sockets."""

from __future__ import annotations

import itertools

import numpy as np

from omnireduce.worker.routing import route, usable_for


def test_every_aggregator_usable_keeps_every_slot_home() -> None:
    for n in range(1, 6):
        assert route(n, range(n)) == tuple(range(n))


def test_a_lost_aggregator_goes_to_the_next_usable_one() -> None:
    assert route(4, {0, 1, 3}) == (0, 1, 3, 3)
    assert route(4, {1, 2}) == (1, 1, 2, 1)  # 3 wraps around to 1
    assert route(2, {0}) == (0, 0)
    assert route(3, set()) is None
    assert route(3, {7}) is None  # (no such aggregator)


def test_the_rule_depends_on_the_usable_set_only() -> None:
    rng = np.random.default_rng()
    for n in range(1, 7):
        for k in range(1, n + 1):
            for usable in itertools.combinations(range(n), k):
                order = list(usable)
                rng.shuffle(order)
                r = route(n, order)
                assert r == route(n, set(usable))
                assert r is not None and set(r) <= set(usable)
                assert all(r[a] == a for a in usable)  # a usable aggregator keeps its own slots


def test_usable_for_drops_aggregators_lost_under_this_agreement_or_a_later_one() -> None:
    agreed = frozenset({0, 1, 2})
    assert usable_for(agreed, 0, {}) == {0, 1, 2}
    assert usable_for(agreed, 0, {1: 0}) == {0, 2}  # lost under this tensor's agreement
    assert usable_for(agreed, 0, {1: 3}) == {0, 2}  # lost later: tensors of older agreements move too
    assert usable_for(agreed, 4, {1: 3}) == {0, 1, 2}  # agreed on again since it was lost
    assert usable_for(frozenset({0}), 4, {}) == {0}
