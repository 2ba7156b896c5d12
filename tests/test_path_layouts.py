"""Flat or hierarchical, measured: the step check of three ways (every bucket through the hierarchy,
flat, dense) where the hierarchy runs beside the flat path, without sockets or processes.

The ranks of one job are :class:`tests.test_path_choice.Job`'s :class:`PathChoice` objects: every
rank asks for the same buckets in the same order, a test clock advances by each reduction's cost and
by what the step's other work costs given the paths taken (``overhead``: e.g. the hierarchy's in-node
steps taking the CPU the backward pass would have used), proposals are combined with ``min``.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from omnireduce.compression import BlockTopK
from omnireduce.ddp.bucket import Bucket
from omnireduce.ddp.options import Mode, Options
from omnireduce.ddp.recorder import Recorder
from omnireduce.ddp.routing.agreement import Agreement
from omnireduce.ddp.routing.path import Span
from omnireduce.ddp.routing.path_choice import DECIDED, PathChoice, split, via_hierarchy
from omnireduce.ddp.routing.router import Router, Ways
from omnireduce.ddp.routing.rules import ThresholdRule
from omnireduce.ddp.routing.step_check import StepCheck
from omnireduce.engines.ways import Way
from tests.test_path_choice import Job

DENSE, MEASURE, OMNIREDUCE = Way.DENSE, Mode.MEASURE, Way.AGGREGATORS

H_OMNI, H_DENSE = via_hierarchy(OMNIREDUCE), via_hierarchy(DENSE)
Costs = dict[str, float]
FLAT_OMNI = {OMNIREDUCE: 4.0, DENSE: 6.0, H_OMNI: 2.0, H_DENSE: 3.0}  # ms; flat, omnireduce is faster


def costs(per_key: dict[int, Costs], scale: float = 1.0) -> Callable[[tuple[int, int], str], float]:
    """Seconds a reduction of bucket ``key`` takes on ``path`` (ms in ``per_key``, times ``scale``)."""
    return lambda key, path: per_key[key[0]][path] * scale / 1e3


def in_node(ms: float) -> Callable[[int, dict[tuple[int, int], str]], float]:
    """What a step costs more whenever some bucket goes through the hierarchy."""
    return lambda rank, taken: ms / 1e3 if any(split(p)[0] for p in taken.values()) else 0.0


def layouts_job(per_rank: list[Callable[[tuple[int, int], str], float]], **kw) -> Job:
    kw.setdefault("trials", 3)
    kw.setdefault("warmup", 1)
    return Job(len(per_rank), per_rank, remeasure_every=0, step_check=True, hierarchy=True, **kw)


def run(job: Job, keys: list[tuple[int, int]], iterations: int) -> None:
    for _ in range(iterations):
        job.step(keys)
    assert job.taken[0] == job.taken[1], "every rank took the same path at every bucket"


KEYS = [(0, 100), (1, 200)]


def test_the_hierarchy_slower_on_whole_steps_keeps_the_buckets_flat() -> None:
    # through the hierarchy each bucket is faster (2 ms against 4), but its in-node steps cost the
    # rest of the step 30 ms: the step check keeps every bucket flat
    job = layouts_job([costs({0: FLAT_OMNI, 1: FLAT_OMNI}), costs({0: FLAT_OMNI, 1: FLAT_OMNI}, scale=1.5)],
                      overhead=in_node(30.0))
    run(job, KEYS, 30)
    for pc in job.ranks:
        (check,) = pc.check_stats()
        # the slowest rank's (rank 1: 1.5x) medians: hierarchical 2 x 3 + 30 ms, flat 2 x 6, dense 2 x 9
        assert check["chosen"] == "flat" and check["kept"], check
        assert (check["hierarchical_ms"], check["plan_ms"], check["dense_ms"]) == (36.0, 12.0, 18.0), check
        s = pc.stats()
        assert [(s[i]["path"], s[i]["phase"]) for i in range(2)] == [(OMNIREDUCE, DECIDED)] * 2
        assert "hier:aggregators_ms" not in s[0], "the hierarchy is timed on whole steps, not per bucket"
        assert pc.iterations_measuring == 2 * 4 + 3 * 3, "2 paths x (1 + 3) calls, then 3 ways x 3 steps"
    start = check["at"] - 9 - 1  # (the check's 9 steps, proposed at the last bucket of the next iteration)
    assert [t[(0, 100)] for t in job.taken[0][:8]] == [OMNIREDUCE, DENSE] * 4, "measured flat"
    assert [t[(0, 100)] for t in job.taken[0][start:start + 9]] == [H_OMNI, OMNIREDUCE, DENSE] * 3
    assert all(set(t.values()) == {OMNIREDUCE} for t in job.taken[0][check["at"]:])


def test_the_hierarchy_faster_on_whole_steps_takes_every_bucket_through_it() -> None:
    job = layouts_job([costs({0: FLAT_OMNI, 1: FLAT_OMNI})] * 2, overhead=in_node(1.0))
    run(job, KEYS, 30)
    for pc in job.ranks:
        (check,) = pc.check_stats()
        assert check["chosen"] == "hierarchical" and check["kept"], check
        assert (check["hierarchical_ms"], check["plan_ms"], check["dense_ms"]) == (5.0, 8.0, 12.0), check
        assert [pc.stats()[i]["path"] for i in range(2)] == [H_OMNI, H_OMNI]
    assert all(set(t.values()) == {H_OMNI} for t in job.taken[0][check["at"]:])


def test_dense_buckets_are_checked_through_the_hierarchy_against_dense_alone() -> None:
    # flat, every bucket is fastest dense (no omnireduce step check without the hierarchy); the
    # hierarchy's dense steps are faster: two ways (flat would be dense throughout), the hierarchy wins
    slow_omni = {OMNIREDUCE: 9.0, DENSE: 6.0, H_OMNI: 8.0, H_DENSE: 3.0}
    job = layouts_job([costs({0: slow_omni, 1: slow_omni})] * 2, trials=1, warmup=0)
    run(job, KEYS, 12)
    for pc in job.ranks:
        (check,) = pc.check_stats()
        assert check == {"at": check["at"], "buckets": [0, 1], "plan_ms": 12.0, "dense_ms": 12.0, "kept": True,
                         "hierarchical_ms": 6.0, "chosen": "hierarchical"}, check
        assert [pc.stats()[i]["path"] for i in range(2)] == [H_DENSE, H_DENSE]


def test_dense_steps_fastest_send_the_omnireduce_buckets_dense_and_flat() -> None:
    job = layouts_job([costs({0: FLAT_OMNI, 1: FLAT_OMNI})] * 2, overhead=lambda rank, taken: 0.05 * sum(
        p != DENSE for p in taken.values()), trials=1, warmup=0)
    run(job, KEYS, 14)
    for pc in job.ranks:
        (check,) = pc.check_stats()
        assert check["chosen"] == "dense" and not check["kept"], check
        s = pc.stats()
        assert [(s[i]["path"], s[i]["vetoed_by_step_check"]) for i in range(2)] == [(DENSE, True)] * 2


def test_a_decision_measured_again_unchanged_keeps_the_layout_and_a_changed_one_checks_again() -> None:
    key = (0, 100)
    per_key = {0: dict(FLAT_OMNI)}
    job = layouts_job([costs(per_key)] * 2, overhead=in_node(1.0), trials=1, warmup=0)
    job.ranks = [PathChoice(clock=c, density_of=job.densities.get, trials=1, warmup=0, remeasure_every=16,
                            step_check=True, hierarchy=True) for c in job.clocks]
    run(job, [key], 26)  # decided, checked (the hierarchy), measured again at 16: unchanged
    assert [c["chosen"] for c in job.ranks[0].check_stats()] == ["hierarchical"]
    assert job.ranks[0].stats()[0]["measurements"] >= 2 and job.taken[0][-1][key] == H_OMNI
    per_key[0].update({OMNIREDUCE: 9.0, H_DENSE: 1.0})  # flat, dense is faster now: decided dense, checked again
    run(job, [key], 30)
    for pc in job.ranks:
        assert [c["chosen"] for c in pc.check_stats()][:2] == ["hierarchical", "hierarchical"]
        assert pc.stats()[0]["path"] == H_DENSE


def test_the_winner_of_a_step_check_and_ties() -> None:
    assert StepCheck.winner([5.0, 5.0, 5.0]) == 2, "a tie goes dense"
    assert StepCheck.winner([5.0, 5.0, 6.0]) == 1, "then flat"
    assert StepCheck.winner([4.0, 5.0, 6.0]) == 0
    assert StepCheck.winner([None, 1.0, 2.0]) == 2, "the first way not timed: dense"
    assert StepCheck.winner([3.0, None, 4.0]) == 0
    assert StepCheck.winner([4.0, 3.0, None]) == 1
    assert StepCheck.keeps(1.0, 2.0) and not StepCheck.keeps(2.0, 2.0) and StepCheck.keeps(1.0, None)
    check = StepCheck(10, frozenset({(0, 1), (1, 2)}), trials=2, variants=[{}, {(0, 1): OMNIREDUCE}, {(0, 1): DENSE}])
    assert check.end == 16 and [check.way_at(i, (0, 1)) for i in range(10, 16)] == [None, OMNIREDUCE, DENSE] * 2
    assert [check.way_at(i, (1, 2)) for i in range(10, 13)] == [None] * 3, "not named: the plan's way"


def test_hierarchical_paths_name_their_way_across_the_nodes() -> None:
    assert split(H_OMNI) == (True, OMNIREDUCE) and split(DENSE) == (False, DENSE)
    with pytest.raises(ValueError, match="paths must be distinct"):
        PathChoice(paths=(DENSE, H_OMNI))


class Named:
    """A reducer that is only a name (the router hands reducers out; it never calls them)."""

    def __init__(self, name: str) -> None:
        self.name, self.across = name, None

    def through(self, across: object) -> Named:
        return Named(f"{self.name} by {across}")

    def __repr__(self) -> str:
        return self.name


class Compressing:
    """What the router asks of the compressed buckets' part: a reducer around the carrier."""

    def reducer(self, bucket: Bucket, carrier: Named, *, whole: bool = False) -> Named:
        return Named(f"compressed({carrier}{', whole' if whole else ''})")


def _ways(through: bool) -> Ways:
    flat = {way: Named(f"flat {way}") for way in (OMNIREDUCE, DENSE)}
    hier = {way: Named(f"hier {way}") for way in (OMNIREDUCE, DENSE)} if through else {}
    return Ways((OMNIREDUCE,), flat, Named("flat dense, scanned"), Named("rows"), hier)  # type: ignore[arg-type]


def _router(layouts: bool, hierarchical: bool = False, path: str = MEASURE) -> Router:
    recorder = Recorder()
    rule = ThresholdRule(recorder.densities, 0.6, None, None, recorder)  # type: ignore[arg-type]  (no probe)
    return Router(Options(path=path, measure_trials=1), _ways(layouts or hierarchical), Agreement(), rule, recorder,
                  lambda key, message: None, measure_hierarchy=layouts)


def _compressing(hierarchical: bool, path: str) -> Router:
    """A router whose bucket (0, 64) goes compressed from iteration 0 (its union density known: 1)."""
    recorder = Recorder()
    rule = ThresholdRule(recorder.densities, 0.6, None, None, recorder)  # type: ignore[arg-type]
    rule.densities.remember((0, 64), 1.0)
    options = Options(path=path, measure_trials=1, compression=BlockTopK(density=0.25, block_size=16, warmup_steps=0))
    return Router(options, _ways(hierarchical), Agreement(), rule, recorder, lambda key, message: None,
                  compression=Compressing())  # type: ignore[arg-type]


@pytest.mark.parametrize("path,rail", [(MEASURE, None), (Mode.OMNIREDUCE, OMNIREDUCE), (DENSE, DENSE),
                                       ("threshold", DENSE)])
def test_a_compressed_bucket_goes_through_the_hierarchy_where_every_bucket_does(path: str, rail: str | None) -> None:
    bucket = Bucket(torch.zeros(64), 0, 0, True, 16)
    routes = [_compressing(True, path).route(bucket), _compressing(False, path).route(bucket)]
    assert all(r.compressed for r in routes), routes
    assert routes[0].path.hierarchical and not routes[1].path.hierarchical, routes
    assert routes[0].path.flat == routes[1].path, "the hierarchy's rails take the way the flat path would"
    if rail is not None:
        assert routes[0].path.flat == rail, routes
    way = routes[1].path.way
    assert (repr(routes[0].carrier), repr(routes[1].carrier)) == (f"hier {way}", f"flat {way}"), routes
    assert repr(routes[1].reducer) == f"compressed(flat {way})", "the compression around its carrier"
    none_usable = _compressing(True, path)
    none_usable.agreement.none_usable = True
    route = none_usable.route(bucket)
    assert route.path == DENSE and route.compressed, "no aggregator: the process group's, flat"
    assert repr(route.carrier) == "flat dense", route


def test_the_router_measures_flat_and_sends_a_hierarchical_path_through_the_hierarchy() -> None:
    router = _router(layouts=True)
    assert router.choice.paths == (OMNIREDUCE, DENSE) and router.choice.hierarchy
    routes = [router.route(Bucket(torch.zeros(64), 0, it, True, 16)) for it in range(4)]
    assert [(r.path, r.path.hierarchical, r.trial is not None) for r in routes] == [
        (OMNIREDUCE, False, False), (DENSE, False, False), (OMNIREDUCE, False, True), (DENSE, False, True)]
    assert [repr(r.reducer) for r in routes] == [f"flat {OMNIREDUCE}", "flat dense"] * 2, "each path's own reducer"
    router.choice.agreed(router.choice.proposal(4), 5)  # (one rank: its own medians)
    router.choice.span = Span.HIERARCHICAL  # (what a step check that chose the hierarchy leaves)
    route = router.route(Bucket(torch.zeros(64), 0, 5, True, 16))
    assert route.path.hierarchical and route.path.flat in (OMNIREDUCE, DENSE), route
    assert repr(route.reducer) == f"hier {route.path.flat}", route
    forced = _router(layouts=False, hierarchical=True)
    assert not forced.choice.hierarchy
    assert {forced.route(Bucket(torch.zeros(64), 0, it, True, 16)).path.hierarchical for it in range(4)} == {True}
    with pytest.raises(ValueError, match="path='measure' only"):
        _router(layouts=True, path="threshold")


def test_a_compressed_bucket_takes_the_hierarchy_with_the_others_where_it_wins() -> None:
    # bucket 1 goes compressed (its key ends in 1): the step check's hierarchical way takes its
    # compacted blocks through the hierarchy too, and so do the steps after the hierarchy won
    keys = [(0, 100), (1, 200, 1)]
    compressed = {**FLAT_OMNI, "uncompressed": 8.0}  # (measured too: the whole bucket, dense; slower here)
    job = layouts_job([costs({0: FLAT_OMNI, 1: compressed})] * 2, overhead=in_node(1.0))
    run(job, keys, 30)
    for pc in job.ranks:
        (check,) = pc.check_stats()
        assert check["chosen"] == "hierarchical", check
        s = pc.stats()
        assert (s[0]["path"], s[1]["path"]) == (H_OMNI, H_OMNI), s
        assert (s[0]["compressed"], s[1]["compressed"]) == (False, True)
    start = check["at"] - 9 - 1  # (the check's 9 steps: hierarchical, flat, dense in turn)
    assert [t[(1, 200, 1)] for t in job.taken[0][start:start + 3]] == [H_OMNI, OMNIREDUCE, "uncompressed"]
    assert {t[(1, 200, 1)] for t in job.taken[0][check["at"]:]} == {H_OMNI}
    assert {t[(0, 100)] for t in job.taken[0][check["at"]:]} == {H_OMNI}


def test_a_compressed_bucket_stays_flat_where_flat_wins() -> None:
    keys = [(0, 100), (1, 200, 1)]
    compressed = {**FLAT_OMNI, "uncompressed": 8.0}
    job = layouts_job([costs({0: FLAT_OMNI, 1: compressed})] * 2, overhead=in_node(30.0))
    run(job, keys, 30)
    for pc in job.ranks:
        (check,) = pc.check_stats()
        assert check["chosen"] == "flat", check
    assert {t[(1, 200, 1)] for t in job.taken[0][check["at"]:]} == {OMNIREDUCE}
