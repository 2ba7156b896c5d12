"""omnireduce.distributed: torch.distributed's all_reduce, sparse, for any torch.distributed code.

Real rank processes on real Gloo groups (the test pool), at 2 and 3 ranks (4 for a DeviceMesh): results
against the float64 sums of tests/harness.py and against torch's own all_reduce of the same inputs,
the same bits on every run; torch's expectations of all_reduce (in place, async handles, subgroups,
complex, coalesced, sparse, ranks outside a group); ranks that disagree; a rank that dies; the
aggregators instead of the collective engine. torch's own test suite run against it:
tests/scripts/torch_all_reduce_tests.py (make test-e2e).
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from omnireduce.launch.procs import free_port
from tests.harness import UNIT_ROUNDOFF, Case, RankPool, assert_matches, reference

ROOT = Path(__file__).resolve().parent.parent
_seeds = itertools.count(9100)


def _cases() -> list[Case]:
    s = lambda: next(_seeds)  # noqa: E731 (fresh inputs every time)
    return [Case(100_003, density=0.01, seed=s(), kind="torch"),  # 1%, off the block grid
            Case(70_001, density=0.3, seed=s(), specials=True, kind="torch"),  # NaN, Inf, -0.0, a -0.0 block
            Case(33_333, dtype="float16", density=0.5, seed=s(), specials=True),
            Case(25_000, dtype="bfloat16", density=0.05, seed=s()),
            Case(300_000, density=0.002, seed=s(), kind="torch", shape=(600, 500)),
            Case(4_097, density=1.0, seed=s(), placement="overlap", kind="torch"),
            Case(5_000, density=0.0, seed=s(), kind="torch"), Case(0, density=0.0, seed=s(), kind="torch"),
            Case(1, density=1.0, seed=s(), kind="torch"),
            Case(1 << 20, density=0.01, seed=s(), kind="torch")]  # (large enough for the sparse exchanges)


def _close_to_torch(case: Case, world: int, ours: np.ndarray, theirs: np.ndarray, average: bool) -> None:
    """omnireduce's result and torch's all_reduce's differ by no more than summation order can make them:
    each sums W values, each addition rounding to the dtype at most once (torch's Gloo adds half types in
    their own precision): 2 W unit roundoffs of the sum of magnitudes (NaN where torch has NaN)."""
    _, mag = reference(case, world)
    mag = mag / world if average else mag
    assert np.array_equal(np.isnan(ours), np.isnan(theirs)), "NaN positions differ from torch's"
    fin = np.isfinite(ours) & np.isfinite(theirs)
    assert np.array_equal(ours[~fin & ~np.isnan(ours)], theirs[~fin & ~np.isnan(theirs)]), "infinities differ"
    tol = 2 * world * UNIT_ROUNDOFF[case.dtype] * mag[fin] + 1e-30
    err = np.abs(ours[fin] - theirs[fin])
    assert (err <= tol).all(), f"{case}: {err.max():.3g} from torch's all_reduce"


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("average", [False, True], ids=["sum", "avg"])
def test_results_equal_the_references_and_torchs(pool: RankPool, world_size: int, average: bool) -> None:
    cases = _cases()
    results = pool.call("tests.distributed_cases:sums", world_size, port=free_port(), cases=cases, average=average)
    for rank, per_rank in enumerate(results):
        for case, r in zip(cases, per_rank[:-1], strict=True):
            assert_matches(case, world_size, r["values"], average=average)
            _close_to_torch(case, world_size, r["values"], r["torch"], average)
            assert r["bits"] == r["again"], f"rank {rank} {case}: a second run gave other bits"
            assert r["shape"] == (case.shape or (case.numel,))
        stats = per_rank[-1]["stats"]
        assert stats["way"] == "collective" and stats["reductions"] == 2 * sum(1 for c in cases if c.numel), stats
    for i in range(len(cases)):  # every rank holds the same numbers
        assert all(np.array_equal(results[0][i]["values"], results[r][i]["values"], equal_nan=True)
                   for r in range(1, world_size)), cases[i]


@pytest.mark.parametrize("world_size", [2, 3])
def test_torch_expectations_of_all_reduce(pool: RankPool, world_size: int) -> None:
    results = pool.call("tests.distributed_cases:torch_expectations", world_size, port=free_port())
    failed = [f"rank {rank} {name}: {detail}" for rank, checks in enumerate(results)
              for name, ok, detail in checks if not ok]
    assert not failed, "\n".join(failed)
    assert len(results[0]) == 22, [name for name, _, _ in results[0]]


@pytest.mark.parametrize("world_size", [2, 3])
def test_ranks_that_disagree_all_get_a_mismatch_error(pool: RankPool, world_size: int) -> None:
    results = pool.call("tests.distributed_cases:mismatch", world_size, port=free_port())
    for name, _ in results[0][::2]:
        said = {dict(r)[name] for r in results}
        assert len(said) == 1, f"{name}: the ranks got different errors: {said}"  # the same words on every rank
        (text,) = said
        assert text.startswith("OmniReduceMismatchError: omnireduce.distributed.all_reduce"), text
        last = world_size - 1
        assert f"rank {last}: call" in text and ("ranks 0, 1:" if world_size == 3 else "rank 0:") in text, text
    for r in results:
        assert all(v == "ok" for k, v in r if k.startswith("after ")), r  # the group goes on after each
    words = dict(results[0])
    assert "float32 tensor of shape (10,)" in words["numel"] and "(11,)" in words["numel"]
    assert "shape (3, 4)" in words["shape"] and "shape (2, 6)" in words["shape"]
    assert "bfloat16" in words["dtype"] and ", AVG" in words["op"] and ", SUM" in words["op"]
    assert "2 float32 tensors" in words["coalesced"] and "3 float32 tensors" in words["coalesced"]
    assert "sparse float32 tensor of shape (5, 4)" in words["sparse rows"]


def test_subgroups_and_a_device_mesh(pool: RankPool) -> None:
    results = pool.call("tests.distributed_cases:subgroups", 4, port=free_port())
    for rank, r in enumerate(results):
        for name in ("01", "12", "23"):
            members = [int(c) for c in name]
            assert r.get(name) == (sum(m + 1 for m in members) if rank in members else None), (rank, name, r)
        assert r["world"] == 10.0
        for dim in ("dp", "tp"):
            value, ranks = r[dim]
            assert rank in ranks and value == sum(m + 1 for m in ranks), (rank, dim, r[dim])


def test_the_aggregators_when_configured(pool: RankPool, aggregator) -> None:
    cases = _cases()[:5]
    env = {"OMNIREDUCE_AGGREGATORS": aggregator.address}
    results = pool.call("tests.distributed_cases:sums", 3, port=free_port(), cases=cases, average=False, env=env)
    for per_rank in results:
        for case, r in zip(cases, per_rank[:-1], strict=True):
            assert_matches(case, 3, r["values"], average=False)
            assert r["bits"] == r["again"]
        assert per_rank[-1]["stats"]["way"] == "aggregators" and per_rank[-1]["stats"]["bytes_sent"] > 0
    said = pool.call("tests.distributed_cases:mismatch", 2, port=free_port(), env=env)
    assert dict(said[0])["numel"].startswith("OmniReduceMismatchError"), said[0]


def test_a_dead_rank_fails_the_others_within_the_timeout(tmp_path: Path) -> None:
    world, victim, timeout = 3, 2, 10.0
    port = free_port()
    procs = []
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   OMNIREDUCE_TIMEOUT=str(timeout), PYTHONPATH=str(ROOT))
        procs.append(subprocess.Popen([sys.executable, str(ROOT / "tests/scripts/dist_dead_rank.py"), str(victim),
                                       str(tmp_path)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    t0 = time.monotonic()
    try:
        outputs = [p.communicate(timeout=timeout + 90)[0].decode(errors="replace") for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert time.monotonic() - t0 < timeout + 90
    for rank in range(world):
        if rank == victim:
            continue
        got = json.loads((tmp_path / f"rank{rank}.json").read_text()) if (tmp_path / f"rank{rank}.json").is_file() \
            else None
        assert got is not None, outputs[rank][-3000:]
        assert got["error"] and got["error"].startswith("OmniReduce"), got
        assert got["after"] < timeout + 30, got


TORCH_TESTS = ROOT / "tests/scripts/torch_all_reduce_tests.py"
# A representative set of torch's all_reduce tests (every one: the slow run below): sums on the world and a
# full new group, async handles, coalesced and sparse calls, complex and other ops through torch's own call;
# torch runs its subgroup tests from 8 ranks on (at fewer it skips them), so those run at 8.
TORCH_SUBSET = ["test_all_reduce_sum", "test_all_reduce_sum_async", "test_all_reduce_full_group_sum",
                "test_all_reduce_coalesced_sum", "test_sparse_all_reduce_sum",
                "test_all_reduce_complex_unsupported_ops", "test_all_reduce_max"]
TORCH_GROUPS = ["test_all_reduce_group_sum", "test_all_reduce_coalesced_group_sum"]


def _torchs_tests(world_size: int, names: list[str] | None, timeout: float) -> str:
    env = dict(os.environ, WORLD_SIZE=str(world_size), BACKEND="gloo", PYTHONPATH=str(ROOT))
    args = [f"TorchAllReduceTests.{n}" for n in names] if names else []
    proc = subprocess.run([sys.executable, str(TORCH_TESTS), *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=ROOT / "tests/scripts")
    assert proc.returncode == 0, proc.stderr[-6000:]
    return proc.stderr


@pytest.mark.e2e  # (torch's test harness spawns the ranks per test: about 10 s a test)
@pytest.mark.parametrize(("world_size", "names"), [(2, TORCH_SUBSET), (3, TORCH_SUBSET), (8, TORCH_GROUPS)],
                         ids=["2", "3", "8-subgroups"])
def test_torchs_own_all_reduce_tests(world_size: int, names: list[str]) -> None:
    said = _torchs_tests(world_size, names, 280)
    assert f"Ran {len(names)} tests" in said and said.rstrip().endswith("OK"), said[-500:]  # (none skipped)


@pytest.mark.slow  # (every all_reduce test of torch's, at 2 and 3 ranks: about 10 minutes each)
@pytest.mark.parametrize("world_size", [2, 3])
def test_every_one_of_torchs_all_reduce_tests(world_size: int) -> None:
    said = _torchs_tests(world_size, None, 1500)
    assert "FAILED" not in said and "\nOK" in said, said[-3000:]
