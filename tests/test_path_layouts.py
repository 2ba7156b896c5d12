"""Flat or hierarchical, measured: the path choice's ways through the hierarchy (``"hier:..."``) and
the step check of three ways, without sockets or processes.

The ranks of one job are :class:`tests.test_path_choice.Job`'s :class:`PathChoice` objects: every
rank asks for the same buckets in the same order, a test clock advances by each reduction's cost and
by what the step's other work costs given the paths taken (``overhead``: e.g. the hierarchy's in-node
steps taking the CPU the backward pass would have used), proposals are combined with ``min``.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from omnireduce.ddp.agreement import Agreement
from omnireduce.ddp.bucket import Bucket
from omnireduce.ddp.densities import Densities
from omnireduce.ddp.options import DENSE, MEASURE, OMNIREDUCE, Options
from omnireduce.ddp.path_choice import DECIDED, PathChoice, split, via_hierarchy
from omnireduce.ddp.recorder import Recorder
from omnireduce.ddp.router import HIERARCHICAL, Router, ThresholdRule
from omnireduce.ddp.step_check import StepCheck
from tests.test_path_choice import Job

H_OMNI, H_DENSE = via_hierarchy(OMNIREDUCE), via_hierarchy(DENSE)
FOUR = (OMNIREDUCE, DENSE, H_OMNI, H_DENSE)
Costs = dict[str, float]


def costs(per_key: dict[int, Costs], scale: float = 1.0) -> Callable[[tuple[int, int], str], float]:
    """Seconds a reduction of bucket ``key`` takes on ``path`` (ms in ``per_key``, times ``scale``)."""
    return lambda key, path: per_key[key[0]][path] * scale / 1e3


def in_node(ms: float) -> Callable[[int, dict[tuple[int, int], str]], float]:
    """What a step costs more whenever some bucket goes through the hierarchy."""
    return lambda rank, taken: ms / 1e3 if any(split(p)[0] for p in taken.values()) else 0.0


FAST_HIER = {OMNIREDUCE: 4.0, DENSE: 6.0, H_OMNI: 2.0, H_DENSE: 3.0}  # per bucket: the hierarchy fastest


def run(job: Job, keys: list[tuple[int, int]], iterations: int) -> None:
    for _ in range(iterations):
        job.step(keys)
    assert job.taken[0] == job.taken[1], "every rank took the same path at every bucket"


def test_the_hierarchy_faster_per_bucket_but_slower_on_whole_steps_goes_flat() -> None:
    # each bucket is timed fastest through the hierarchy (2 ms against 4 flat), but its in-node steps
    # cost the rest of the step 30 ms: the step check keeps the buckets flat, on their fastest flat way
    keys = [(0, 100), (1, 200)]
    job = Job(2, [costs({0: FAST_HIER, 1: FAST_HIER}), costs({0: FAST_HIER, 1: FAST_HIER}, scale=1.5)],
              overhead=in_node(30.0), trials=3, warmup=1, remeasure_every=0, step_check=True, paths=FOUR)
    run(job, keys, 40)
    for pc in job.ranks:
        (check,) = pc.check_stats()
        # the slowest rank's (rank 1: 1.5x) medians: the plan 2 x 3 + 30 ms, flat 2 x 6, dense 2 x 9
        assert check["chosen"] == "flat" and not check["kept"], check
        assert (check["plan_ms"], check["flat_ms"], check["dense_ms"]) == (36.0, 12.0, 18.0), check
        s = pc.stats()
        for i in range(2):
            assert s[i]["path"] == OMNIREDUCE and s[i]["vetoed_by_step_check"] and s[i]["phase"] == DECIDED, s[i]
            assert (s[i]["omnireduce_ms"], s[i]["hier:omnireduce_ms"]) == (6.0, 3.0), "the bucket's own timings"
        assert pc.iterations_measuring == 4 * 4 + 3 * 3, "4 ways x (1 + 3) calls, then 3 ways x 3 steps"
    start = check["at"] - 9 - 1  # (the check's 9 steps, proposed at the last bucket of the next iteration)
    expected = [H_OMNI, OMNIREDUCE, DENSE] * 3  # the plan, its flat variant, dense: in turn
    assert [t[(0, 100)] for t in job.taken[0][start:start + 9]] == expected
    assert all(set(t.values()) == {OMNIREDUCE} for t in job.taken[0][check["at"]:])


def test_the_hierarchy_faster_on_whole_steps_stays() -> None:
    keys = [(0, 100), (1, 200)]
    job = Job(2, [costs({0: FAST_HIER, 1: FAST_HIER})] * 2, overhead=in_node(1.0), trials=3, warmup=1,
              remeasure_every=0, step_check=True, paths=FOUR)
    run(job, keys, 40)
    for pc in job.ranks:
        (check,) = pc.check_stats()
        assert check["chosen"] == "plan" and check["kept"], check
        assert (check["plan_ms"], check["flat_ms"], check["dense_ms"]) == (5.0, 8.0, 12.0), check
        assert [pc.stats()[i]["path"] for i in range(2)] == [H_OMNI, H_OMNI]
    assert all(set(t.values()) == {H_OMNI} for t in job.taken[0][-10:])


def test_a_plan_of_both_checks_its_hierarchical_buckets_flat_and_leaves_the_flat_ones() -> None:
    keys = [(0, 100), (1, 200)]
    flat_best = {OMNIREDUCE: 1.0, DENSE: 6.0, H_OMNI: 5.0, H_DENSE: 7.0}
    job = Job(2, [costs({0: FAST_HIER, 1: flat_best})] * 2, overhead=in_node(5.0), trials=2, warmup=1,
              remeasure_every=0, step_check=True, paths=FOUR)
    run(job, keys, 30)
    for pc in job.ranks:
        (check,) = pc.check_stats()
        # the plan: 2 + 1 + 5 ms; bucket 0 flat: 4 + 1; both dense: 12
        assert (check["plan_ms"], check["flat_ms"], check["dense_ms"], check["chosen"]) == (8.0, 5.0, 12.0, "flat")
        assert [pc.stats()[i]["path"] for i in range(2)] == [OMNIREDUCE, OMNIREDUCE]
        assert [pc.stats()[i]["vetoed_by_step_check"] for i in range(2)] == [True, False]
    start = check["at"] - 6 - 1
    during = [(t[(0, 100)], t[(1, 200)]) for t in job.taken[0][start:start + 6]]
    assert during == [(H_OMNI, OMNIREDUCE), (OMNIREDUCE, OMNIREDUCE), (DENSE, DENSE)] * 2


def test_a_hierarchical_bucket_whose_flat_way_is_dense_is_checked_against_dense_alone() -> None:
    # flat, the bucket is fastest dense; through the hierarchy, the rail's dense all-reduce is faster:
    # its flat variant is the dense one, so the check runs two ways (as without the hierarchy)
    key = (0, 100)
    job = Job(2, [costs({0: {OMNIREDUCE: 9.0, DENSE: 6.0, H_OMNI: 8.0, H_DENSE: 3.0}})] * 2, trials=1, warmup=0,
              remeasure_every=0, step_check=True, paths=FOUR)
    run(job, [key], 15)
    for pc in job.ranks:
        (check,) = pc.check_stats()
        assert check == {"at": check["at"], "buckets": [0], "plan_ms": 3.0, "dense_ms": 6.0, "kept": True}
        assert pc.stats()[0]["path"] == H_DENSE


def test_flat_ways_fastest_check_as_without_the_hierarchy() -> None:
    job = Job(2, [costs({0: {OMNIREDUCE: 1.0, DENSE: 6.0, H_OMNI: 5.0, H_DENSE: 7.0}})] * 2, trials=1, warmup=0,
              remeasure_every=0, step_check=True, paths=FOUR)
    run(job, [(0, 100)], 15)
    for pc in job.ranks:
        (check,) = pc.check_stats()
        assert "flat_ms" not in check and check["kept"] and pc.stats()[0]["path"] == OMNIREDUCE


def test_the_winner_of_a_step_check_and_ties() -> None:
    assert StepCheck.winner([5.0, 5.0, 5.0]) == 2, "a tie goes dense"
    assert StepCheck.winner([5.0, 5.0, 6.0]) == 1, "then flat"
    assert StepCheck.winner([4.0, 5.0, 6.0]) == 0
    assert StepCheck.winner([None, 1.0, 2.0]) == 2, "the plan not timed: dense"
    assert StepCheck.winner([3.0, None, 4.0]) == 0
    assert StepCheck.winner([4.0, 3.0, None]) == 1
    assert StepCheck.keeps(1.0, 2.0) and not StepCheck.keeps(2.0, 2.0) and StepCheck.keeps(1.0, None)
    check = StepCheck(10, frozenset({(0, 1), (1, 2)}), trials=2, variants=[{(0, 1): OMNIREDUCE}, {(0, 1): DENSE}])
    assert check.end == 16 and [check.way_at(i, (0, 1)) for i in range(10, 16)] == [None, OMNIREDUCE, DENSE] * 2
    assert [check.way_at(i, (1, 2)) for i in range(10, 13)] == [None] * 3, "not named: the plan's way"


def test_hierarchical_paths_are_known_ways() -> None:
    assert split(H_OMNI) == (True, OMNIREDUCE) and split(DENSE) == (False, DENSE)
    PathChoice(paths=(OMNIREDUCE, "collective", DENSE, H_OMNI, via_hierarchy("collective"), H_DENSE))
    with pytest.raises(ValueError, match="paths must be distinct"):
        PathChoice(paths=(DENSE, "hier:dense", "hier:other"))


def _router(layouts: bool, hierarchical: bool = False, path: str = MEASURE) -> Router:
    recorder = Recorder()
    rule = ThresholdRule(Densities(), 0.6, None, None, recorder)  # type: ignore[arg-type]  (no probe: measured)
    return Router(Options(path=path, measure_trials=1), (OMNIREDUCE,), Agreement(), rule, hierarchical, Densities(),
                  lambda key, message: None, layouts=layouts)


def test_the_router_sends_a_hierarchical_path_through_the_hierarchy_and_a_flat_one_flat() -> None:
    router = _router(layouts=True)
    assert router.choice.paths == FOUR
    routes = [router.route(Bucket(torch.zeros(64), 0, it, True, 16)) for it in range(8)]
    # 4 ways x (1 warmup + 1 trial) calls, in turn
    assert [(r.way, r.rail) for r in routes[:4]] == [(OMNIREDUCE, None), (DENSE, None), (HIERARCHICAL, OMNIREDUCE),
                                                      (HIERARCHICAL, DENSE)]
    assert [r.trial is not None for r in routes] == [False] * 4 + [True] * 4
    forced = _router(layouts=False, hierarchical=True)
    assert forced.choice.paths == (OMNIREDUCE, DENSE)
    assert {forced.route(Bucket(torch.zeros(64), 0, it, True, 16)).way for it in range(4)} == {HIERARCHICAL}
    with pytest.raises(ValueError, match="path='measure' only"):
        _router(layouts=True, path="threshold")
