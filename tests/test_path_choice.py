"""The path choice's schedule and collective decision, without sockets or processes.

Two or three :class:`PathChoice` objects play the ranks of one job: each is asked for the path of
the same buckets in the same order, its trials are real ``torch.futures.Future`` objects completed
at times a test clock sets, and the proposals are combined element by element with ``min`` (what
the agreement's all-reduce MIN does) and handed back to every rank. A rank's clock advances by each
reduction's cost and, once per iteration, by what the step's other work costs given the paths
taken (``overhead``: e.g. omnireduce's CPU felt by the backward pass), so the step check sees
whole steps.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable

import pytest
import torch

from omnireduce.ddp.routing.path_choice import AWAITING, DECIDED, MEASURING, WHOLE, PathChoice
from omnireduce.ddp.routing.timing import median, negated_median_us
from omnireduce.engines.ways import Way

OMNIREDUCE, COLLECTIVE, DENSE = Way.AGGREGATORS, Way.COLLECTIVE, Way.DENSE  # (the ways' names)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Job:
    """Ranks of one job; ``costs[rank](key, path)``: the seconds a reduction takes on that rank."""

    def __init__(self, ranks: int, costs: list[Callable[[tuple[int, int], str], float]],
                 overhead: Callable[[int, dict[tuple[int, int], str]], float] = lambda rank, taken: 0.0,
                 by_plan: bool = False, **kw) -> None:
        self.clocks = [Clock() for _ in range(ranks)]
        self.densities: dict[tuple[int, int], float] = {}
        kw.setdefault("step_check", False)  # (the tests of the step check turn it on)
        self.ranks = [PathChoice(clock=c, density_of=self.densities.get, **kw) for c in self.clocks]
        self.costs, self.overhead = costs, overhead
        self.iteration = 0
        self.fallback = DENSE
        self.taken: list[list[dict[tuple[int, int], str]]] = [[] for _ in range(ranks)]  # per iteration
        self.by_plan = by_plan  # route the decided buckets by PathChoice.plan, as the router does
        self.called: list[list[tuple[int, int]]] = [[] for _ in range(ranks)]

    def step(self, keys: list[tuple[int, int]]) -> None:
        """One iteration: every bucket on every rank (the agreement at the first and last bucket)."""
        buf = torch.zeros(1)
        for r, pc in enumerate(self.ranks):
            self.taken[r].append({})
            if self.iteration > 0 and r == 0:  # first bucket: apply the previous iteration's agreement
                agreed = [min(vs) for vs in zip(*self._proposals, strict=True)]
                for each in self.ranks:
                    each.agreed(agreed, self.iteration)
            pc.mark(self.iteration, buf, self.called[r])
            self.called[r] = []
            plan = pc.plan(self.iteration) if self.by_plan else {}
            for key in keys:
                if key in plan:
                    path, trial = plan[key], None
                    self.called[r].append(key)
                else:
                    pc.mark(self.iteration, buf)
                    path, trial = pc.choose(key, self.iteration, buf, self.densities.get(key), lambda: self.fallback)
                self.taken[r][-1][key] = path
                fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
                if trial is not None:
                    trial.watch(fut)
                self.clocks[r].now += self.costs[r](key, path)
                fut.set_result(buf)
            self.clocks[r].now += self.overhead(r, self.taken[r][-1])
        self._proposals = [pc.proposal(self.iteration) for pc in self.ranks]  # last bucket
        assert len({len(p) for p in self._proposals}) == 1, "every rank proposes as many values"
        self.iteration += 1


def cost(omni: float, dense: float) -> Callable[[tuple[int, int], str], float]:
    return lambda key, path: omni if path == OMNIREDUCE else dense


def test_alternates_then_every_rank_takes_the_slowest_ranks_faster_path() -> None:
    # rank 0: omnireduce 1 ms, dense 5 ms; rank 1: omnireduce 9 ms, dense 6 ms -> slowest: 9 vs 6: dense
    job = Job(2, [cost(1e-3, 5e-3), cost(9e-3, 6e-3)], trials=3, warmup=1, remeasure_every=0)
    key = (0, 1000)
    for _ in range(10):
        job.step([key])
    paths = [t[key] for t in job.taken[0]]
    assert paths[:8] == [OMNIREDUCE, DENSE] * 4, "alternate, omnireduce first, warm-up included"
    assert paths[8] == job.fallback, "waiting for the agreement: the fallback"
    assert paths[9] == DENSE and job.taken[1] == job.taken[0]
    for pc in job.ranks:
        s = pc.stats()[0]
        assert (s["path"], s["phase"], s["decided_at"], s["measurements"]) == (DENSE, DECIDED, 9, 1)
        assert (s["aggregators_ms"], s["dense_ms"]) == (9.0, 6.0)
        assert pc.iterations_measuring == 8


def test_buckets_measured_together_take_both_paths_in_each_iteration() -> None:
    keys = [(i, 100 * (i + 1)) for i in range(4)]
    job = Job(2, [cost(1e-3, 5e-3)] * 2, trials=2, warmup=1, remeasure_every=0)
    for _ in range(6):
        job.step(keys)
    for taken in job.taken[0]:
        assert sorted(taken.values()) == sorted([DENSE, DENSE, OMNIREDUCE, OMNIREDUCE]), taken
    assert [job.taken[0][0][k] for k in keys] == [OMNIREDUCE, DENSE, OMNIREDUCE, DENSE]


def test_medians_of_the_timed_trials_only_and_ties_go_dense() -> None:
    seen: dict[str, list[float]] = {OMNIREDUCE: [], DENSE: []}
    # the warm-up call of each, then the timed ones (had the warm-up counted: medians 4 and 4.5)
    draws = {OMNIREDUCE: [5e-3, 2e-3, 100e-3, 3e-3], DENSE: [5e-3, 4e-3, 4e-3, 1.0]}

    def timed(key: tuple[int, int], path: str) -> float:
        seen[path].append(draws[path][len(seen[path])] if len(seen[path]) < 4 else 1e-3)
        return seen[path][-1]

    job = Job(1, [timed], trials=3, warmup=1, remeasure_every=0)
    for _ in range(10):
        job.step([(0, 10)])
    s = job.ranks[0].stats()[0]
    assert (s["aggregators_ms"], s["dense_ms"]) == (3.0, 4.0) and s["path"] == OMNIREDUCE  # medians

    tie = Job(2, [cost(2e-3, 2e-3), cost(1e-3, 2e-3)], trials=1, warmup=0, remeasure_every=0)
    for _ in range(4):
        tie.step([(0, 10)])
    assert tie.ranks[1].stats()[0]["path"] == DENSE, "a tie of the slowest ranks goes dense"


def test_a_path_never_timed_loses() -> None:
    job = Job(2, [cost(1e-3, 5e-3)] * 2, trials=2, warmup=0, remeasure_every=0)
    for _ in range(4):
        job.step([(0, 10)])
    for pc in job.ranks:  # the omnireduce trials failed on every rank: no time to propose
        for t in pc._buckets[(0, 10)].trials:
            t._failed = t._failed or t.path == OMNIREDUCE
    for _ in range(2):
        job.step([(0, 10)])
    assert [pc.stats()[0]["path"] for pc in job.ranks] == [DENSE, DENSE]
    assert job.ranks[0].stats()[0]["aggregators_ms"] is None


def test_density_drift_measures_a_bucket_again() -> None:
    job = Job(2, [cost(1e-3, 5e-3)] * 2, trials=1, warmup=0, remeasure_every=0, drift=2.0)
    key = (3, 500)
    job.densities[key] = 0.01
    for _ in range(4):
        job.step([key])
    assert job.ranks[0].stats()[3]["path"] == OMNIREDUCE
    job.densities[key] = 0.019  # within 2x: nothing
    job.step([key])
    assert job.ranks[0].stats()[3]["phase"] == DECIDED
    job.densities[key] = 0.021  # past 2x
    job.step([key])
    assert [pc.stats()[3]["phase"] for pc in job.ranks] == [MEASURING, MEASURING]
    assert [t[key] for t in job.taken[0][-1:]] == [DENSE], "an odd bucket index starts with the dense path"
    job.step([key])
    assert job.ranks[0].stats()[3]["phase"] == AWAITING
    job.step([key])
    job.step([key])
    assert [pc.stats()[3]["measurements"] for pc in job.ranks] == [2, 2]


def test_periodic_remeasurement_is_one_bucket_at_a_time_round_robin_and_skips_gone_buckets() -> None:
    keys = [(i, 100 + i) for i in range(4)]
    job = Job(2, [cost(1e-3, 5e-3)] * 2, trials=1, warmup=0, remeasure_every=5)
    starts: list[tuple[int, tuple[int, int]]] = []
    for it in range(60):
        bucket_keys = keys if it < 30 else keys[:2]  # buckets 2 and 3 are gone (DDP rebuilt them)
        before = {k: b.phase for k, b in job.ranks[0]._buckets.items()}
        job.step(bucket_keys)
        for k, b in job.ranks[0]._buckets.items():
            if before.get(k) == DECIDED and b.phase == MEASURING:
                starts.append((it, k))
        busy = [k for k, b in job.ranks[0]._buckets.items() if b.phase != DECIDED and k in bucket_keys]
        assert it < 3 or len(busy) <= 1, f"iteration {it}: {busy} measured at once"
    assert [k for _, k in starts[:4]] == keys, "round robin, in the order they were decided"
    assert all(k in keys[:2] for it, k in starts if it >= 31), "gone buckets are skipped"
    gaps = [b - a for (a, _), (b, _) in itertools.pairwise(starts)]
    assert min(gaps) >= 5 and len(starts) >= 8
    assert job.ranks[0].stats() == job.ranks[1].stats()
    # a re-measurement costs 2 iterations here (1 call of each path) every 5: 40% + the first 2
    assert job.ranks[0].iterations_measuring <= 2 + 2 * len(starts)


def test_random_costs_every_rank_always_agrees() -> None:
    rng = random.Random(7)
    keys = [(i, 64 * (i + 1)) for i in range(5)]
    table = [{(k, p): rng.choice([1e-3, 2e-3, 8e-3]) for k in keys for p in (OMNIREDUCE, DENSE)} for _ in range(3)]
    job = Job(3, [lambda k, p, t=t: t[(k, p)] for t in table], trials=2, warmup=1, remeasure_every=3)
    for it in range(40):
        for k in keys:
            job.densities[k] = rng.choice([0.01, 0.05, 0.5])
        job.step(keys)
        assert job.taken[0][-1] == job.taken[1][-1] == job.taken[2][-1], f"iteration {it}"
    for k in keys:
        s = job.ranks[0].stats()[k[0]]
        if s["aggregators_ms"] is not None and s["phase"] == DECIDED:
            slow = {p: max(t[(k, p)] for t in table) * 1e3 for p in (OMNIREDUCE, DENSE)}
            assert s["path"] == (OMNIREDUCE if slow[OMNIREDUCE] < slow[DENSE] else DENSE)


def test_routing_by_the_plan_takes_the_paths_choose_gives() -> None:
    """The router routes a decided bucket by the iteration's plan (a lookup) instead of asking
    :meth:`PathChoice.choose`: with drifting densities, periodic re-measurements and step checks,
    every iteration's paths, the decisions and the checks are the same both ways."""
    rng = random.Random(11)
    keys = [(i, 64 * (i + 1)) for i in range(6)]
    table = [{(k, p): rng.choice([1e-3, 2e-3, 8e-3]) for k in keys for p in (OMNIREDUCE, DENSE)} for _ in range(2)]
    costs = [lambda k, p, t=t: t[(k, p)] for t in table]
    jobs = [Job(2, costs, trials=2, warmup=1, remeasure_every=7, step_check=True, by_plan=by) for by in (False, True)]
    planned = 0
    for it in range(120):
        drift = rng.choice([0.01, 0.05, 0.5]) if it % 9 == 0 else None
        for job in jobs:
            if drift is not None:
                job.densities[keys[it % len(keys)]] = drift
            job.step(keys)
        assert jobs[0].taken[0][-1] == jobs[1].taken[0][-1], f"iteration {it}"
        planned += len(jobs[1].called[0])
    assert jobs[0].ranks[0].stats() == jobs[1].ranks[0].stats()
    assert jobs[0].ranks[0].check_stats() == jobs[1].ranks[0].check_stats()
    assert jobs[1].ranks[0].iterations_measuring == jobs[0].ranks[0].iterations_measuring
    assert planned > len(keys) * 60, "most calls went by the plan"


def test_a_proposal_of_another_length_is_refused() -> None:
    job = Job(1, [cost(1e-3, 2e-3)], trials=1, warmup=0)
    for _ in range(2):
        job.step([(0, 1)])
    job.ranks[0].proposal(2)
    with pytest.raises(RuntimeError, match="3 values agreed for 1 buckets"):
        job.ranks[0].agreed([0, 0, 0], 3)


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="trials >= 1"):
        PathChoice(trials=0)
    with pytest.raises(ValueError, match="drift > 1"):
        PathChoice(drift=1.0)


def contention(seconds: float) -> Callable[[int, dict[tuple[int, int], str]], float]:
    """What a step's other work costs more when some bucket goes through omnireduce (its CPU)."""
    return lambda rank, taken: seconds if OMNIREDUCE in taken.values() else 0.0


def test_a_plan_whose_steps_are_faster_is_kept_after_the_step_check() -> None:
    keys = [(0, 100), (1, 200)]
    job = Job(2, [cost(1e-3, 5e-3)] * 2, trials=3, warmup=1, remeasure_every=0, step_check=True)
    for _ in range(20):
        job.step(keys)
    # 8 measuring iterations, the agreement at 9: the check runs iterations 9-14 (plan first),
    # proposed at the last bucket of 15, agreed at 16
    for key in keys:
        assert [t[key] for t in job.taken[0][9:15]] == [OMNIREDUCE, DENSE] * 3, key
        assert [t[key] for t in job.taken[0][15:]] == [OMNIREDUCE] * 5
    assert job.taken[0] == job.taken[1]
    for pc in job.ranks:
        (check,) = pc.check_stats()
        assert check == {"at": 16, "buckets": [0, 1], "plan_ms": 2.0, "dense_ms": 10.0, "kept": True}
        assert pc.iterations_measuring == 8 + 6
        assert not any(s["vetoed_by_step_check"] for s in pc.stats().values())


def test_a_bucket_settled_whole_is_reported_dense_never_measured_nor_checked() -> None:
    """A bucket the router sends dense untimed (every way through omnireduce would send it whole):
    reported as such, left out of the measurements and of the step check of the others."""
    key, whole = (0, 100), (1, 20)
    job = Job(2, [cost(1e-3, 5e-3)] * 2, trials=3, warmup=1, remeasure_every=0, step_check=True)
    for it in range(20):
        for pc in job.ranks:
            pc.settle(whole, it)
        job.step([key])
    for pc in job.ranks:
        stats = pc.stats()
        assert (stats[1]["path"], stats[1]["phase"], stats[1]["measurements"]) == (DENSE, WHOLE, 0)
        assert stats[1]["decided_at"] == 0 and not any(k.endswith("_ms") for k in stats[1])
        (check,) = pc.check_stats()
        assert check["buckets"] == [0] and check["kept"], check
        assert stats[0]["path"] == OMNIREDUCE and pc.iterations_measuring == 8 + 6


def test_a_plan_whose_steps_are_slower_goes_dense_on_every_rank() -> None:
    # each bucket is faster through omnireduce (1 vs 5 ms), but on rank 1 the step's other work
    # costs 20 ms more whenever a bucket goes that way: the slowest rank's steps decide
    keys = [(0, 100), (1, 200), (2, 300)]
    costs = [lambda k, p: (1e-3 if p == OMNIREDUCE else 5e-3) if k[0] < 2 else (9e-3 if p == OMNIREDUCE else 5e-3)]
    job = Job(2, costs * 2, overhead=lambda rank, taken: contention(20e-3)(rank, taken) if rank == 1 else 0.0,
              trials=3, warmup=1, remeasure_every=0, step_check=True)
    for _ in range(20):
        job.step(keys)
    assert job.taken[0] == job.taken[1]
    for pc in job.ranks:
        (check,) = pc.check_stats()
        assert check["buckets"] == [0, 1] and not check["kept"], "bucket 2 was decided dense: not checked"
        assert (check["plan_ms"], check["dense_ms"]) == (27.0, 15.0)
        s = pc.stats()
        assert [s[i]["path"] for i in range(3)] == [DENSE] * 3
        assert [s[i]["vetoed_by_step_check"] for i in range(3)] == [True, True, False]
        assert s[0]["aggregators_ms"] == 1.0, "the bucket's own timings stay reported"
    assert all(set(t.values()) == {DENSE} for t in job.taken[0][16:])


def test_no_step_check_without_a_bucket_sent_to_omnireduce() -> None:
    job = Job(2, [cost(5e-3, 1e-3)] * 2, trials=2, warmup=0, remeasure_every=0, step_check=True)
    for _ in range(12):
        job.step([(0, 10), (1, 20)])
    assert job.ranks[0].check_stats() == [] and job.ranks[0].iterations_measuring == 4


def test_a_vetoed_bucket_measured_again_is_checked_again() -> None:
    key = (0, 100)
    job = Job(2, [cost(1e-3, 5e-3)] * 2, overhead=contention(20e-3), trials=1, warmup=0, remeasure_every=10,
              step_check=True)
    for _ in range(40):
        job.step([key])
    for pc in job.ranks:
        checks = pc.check_stats()
        assert len(checks) >= 2 and not any(c["kept"] for c in checks)
        assert pc.stats()[0]["path"] == DENSE and pc.stats()[0]["measurements"] >= 2
    assert job.taken[0] == job.taken[1]


def test_random_costs_and_contention_every_rank_always_agrees_with_the_step_check() -> None:
    rng = random.Random(11)
    keys = [(i, 64 * (i + 1)) for i in range(4)]
    choices = {OMNIREDUCE: [1e-3, 2e-3, 8e-3], DENSE: [2e-3, 8e-3]}  # (omnireduce faster for some buckets)
    table = [{(k, p): rng.choice(choices[p]) for k in keys for p in (OMNIREDUCE, DENSE)} for _ in range(3)]
    burden = [rng.choice([0.0, 1e-3, 30e-3]) for _ in range(3)]
    job = Job(3, [lambda k, p, t=t: t[(k, p)] for t in table],
              overhead=lambda rank, taken: burden[rank] * list(taken.values()).count(OMNIREDUCE),
              trials=2, warmup=0, remeasure_every=4, step_check=True)
    for it in range(120):
        if it % 30 == 0:  # (drifting densities: buckets measured again, and checked again)
            for k in keys:
                job.densities[k] = rng.choice([0.01, 0.05, 0.5])
        job.step(keys)
        assert job.taken[0][-1] == job.taken[1][-1] == job.taken[2][-1], f"iteration {it}"
    assert job.ranks[0].check_stats() == job.ranks[2].check_stats() != []


def test_a_step_check_proposal_of_another_length_is_refused() -> None:
    pc = PathChoice(trials=1, warmup=0, step_check=True)
    buf = torch.zeros(1)
    for it in range(6):
        pc.mark(it, buf)
        pc.choose((0, 1), it, buf, None, lambda: DENSE)
        if it == 1:
            assert pc.proposal(it) == [], "the last trial was in this iteration"
        if it == 2:
            assert len(pc.proposal(it)) == 2
            pc.agreed([-1000, -2000], it + 1)  # omnireduce 1 ms, dense 2 ms: a check from iteration 3
    assert pc._check is not None and (pc._check.start, pc._check.end) == (3, 5)
    assert len(pc.proposal(6)) == 2, "the check's two medians"
    with pytest.raises(RuntimeError, match="0 values agreed for 0 buckets and a step check"):
        pc.agreed([], 7)


def test_three_paths_taken_in_turn_staggered_and_the_fastest_kept() -> None:
    keys = [(0, 10), (1, 20), (2, 30)]
    three = (OMNIREDUCE, COLLECTIVE, DENSE)
    per_key = {0: {OMNIREDUCE: 3e-3, COLLECTIVE: 1e-3, DENSE: 2e-3},  # collective fastest
               1: {OMNIREDUCE: 1e-3, COLLECTIVE: 2e-3, DENSE: 3e-3},  # the aggregators fastest
               2: {OMNIREDUCE: 2e-3, COLLECTIVE: 2e-3, DENSE: 2e-3}}  # a tie: dense
    job = Job(2, [lambda k, p: per_key[k[0]][p]] * 2, trials=2, warmup=1, remeasure_every=0, paths=three)
    for _ in range(12):
        job.step(keys)
    for i in range(9):  # 3 paths x (1 + 2) calls: in turn, bucket i starting i paths later
        assert [job.taken[0][i][k] for k in keys] == [three[(i + j) % 3] for j in range(3)], i
    for pc in job.ranks:
        s = pc.stats()
        assert [s[i]["path"] for i in range(3)] == [COLLECTIVE, OMNIREDUCE, DENSE]
        assert (s[0]["aggregators_ms"], s[0]["collective_ms"], s[0]["dense_ms"]) == (3.0, 1.0, 2.0)
        assert pc.iterations_measuring == 9
    assert job.taken[0][-1] == job.taken[1][-1] == {(0, 10): COLLECTIVE, (1, 20): OMNIREDUCE, (2, 30): DENSE}
    with pytest.raises(ValueError, match="paths must be distinct"):
        PathChoice(paths=(OMNIREDUCE, COLLECTIVE))


def test_by_default_two_percent_of_the_iterations_remeasure() -> None:
    assert PathChoice().remeasure_every == 400  # 2 paths x (1 + 3) calls: 8 iterations every 400
    assert PathChoice(paths=(OMNIREDUCE, COLLECTIVE, DENSE)).remeasure_every == 600  # 12 every 600
    assert PathChoice(trials=1, warmup=0, remeasure_every=0).remeasure_every == 0


def test_a_compressed_bucket_is_also_measured_whole_and_may_go_uncompressed() -> None:
    # a compressed bucket (key ending in 1) is measured on a third way, "uncompressed"; where that is the
    # fastest (fast links: the selection costs more than the bytes it saves) it wins; an ordinary bucket
    # measured beside it never takes that way
    fast_whole = {OMNIREDUCE: 4e-3, DENSE: 5e-3, "uncompressed": 2e-3}
    job = Job(2, [lambda key, path: fast_whole[path]] * 2, trials=3, warmup=1, remeasure_every=0)
    keys = [(0, 1000, 1), (1, 500)]
    for _ in range(16):
        job.step(keys)
    assert {t[(1, 500)] for t in job.taken[0]} <= {OMNIREDUCE, DENSE}
    assert sum(t[(0, 1000, 1)] == "uncompressed" for t in job.taken[0][:12]) == 4, "1 + 3 calls of each of 3 ways"
    for pc in job.ranks:
        s = pc.stats()
        assert (s[0]["path"], s[0]["compressed"], s[0]["uncompressed_ms"]) == ("uncompressed", True, 2.0), s[0]
        assert (s[1]["path"], s[1]["compressed"]) == (OMNIREDUCE, False) and "uncompressed_ms" not in s[1]
    assert job.taken[0][-1] == job.taken[1][-1] == {(0, 1000, 1): "uncompressed", (1, 500): OMNIREDUCE}


def test_the_step_check_sends_a_compressed_bucket_whole_when_its_plan_loses_on_whole_steps() -> None:
    # timed alone, the compacted blocks through the aggregators are fastest; on whole steps (the selection's
    # cost lands on the rest of the step) the bucket sent whole, as plain DDP would, wins: it goes uncompressed
    per_call = {OMNIREDUCE: 2e-3, DENSE: 3e-3, "uncompressed": 4e-3}
    job = Job(2, [lambda key, path: per_call[path]] * 2, trials=3, warmup=1, remeasure_every=0, step_check=True,
              overhead=lambda rank, taken: 0.0 if set(taken.values()) == {"uncompressed"} else 10e-3)
    key = (0, 1000, 1)
    for _ in range(24):
        job.step([key])
    for pc in job.ranks:
        (check,) = pc.check_stats()
        assert not check["kept"] and (check["plan_ms"], check["dense_ms"]) == (12.0, 4.0), check
        s = pc.stats()[0]
        assert (s["path"], s["vetoed_by_step_check"], s["aggregators_ms"]) == ("uncompressed", True, 2.0), s
    assert job.taken[0][-1][key] == job.taken[1][-1][key] == "uncompressed"


@pytest.mark.parametrize(("engine", "path", "backend", "want"), [
    ("auto", "measure", "gloo", (OMNIREDUCE, COLLECTIVE)),
    ("auto", "measure", "nccl", (OMNIREDUCE, COLLECTIVE)),  # run over NCCL on a GPU: measured there too
    ("auto", "measure", "cpu:gloo,cuda:nccl", (OMNIREDUCE, COLLECTIVE)),
    ("auto", "measure", "mpi", (OMNIREDUCE,)),  # never run there: the aggregators
    ("auto", "threshold", "nccl", (OMNIREDUCE,)),  # nothing measured: no engine to compare
    ("aggregators", "measure", "nccl", (OMNIREDUCE,)),
    ("collective", "threshold", "mpi", (COLLECTIVE,)),
])
def test_which_engines_a_state_may_use(engine: str, path: str, backend: str, want: tuple[str, ...]) -> None:
    from omnireduce.ddp.binding import sparse_paths

    assert sparse_paths(engine, path, backend) == want


def test_the_median_is_the_statistics_modules() -> None:
    """The path choice's median (its own, so that the hook does not import ``statistics``) is
    ``statistics.median``'s, for odd and even counts, ties and values of every scale."""
    import statistics

    rng = random.Random(5)
    for n in range(1, 12):
        for _ in range(300):
            values = [rng.choice([1e-7, 1e-3, 1.0, 1e3]) * rng.random() for _ in range(n)]
            if n > 2 and rng.random() < 0.3:
                values[1] = values[0]  # (ties)
            assert median(values) == statistics.median(values), values
            assert negated_median_us(values) == -min(2**31 - 1, max(1, round(statistics.median(values) * 1e6)))
    assert negated_median_us([]) == 0
