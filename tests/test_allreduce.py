"""Integration: real worker processes, real aggregators, real zmq sockets; results against float64."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from tests.harness import Case, RankPool, assert_matches, reference, run_in_threads, wait_for

DENSITIES = [0.0, 0.001, 0.01, 0.1, 0.5, 1.0]


def _check(pool: RankPool, addresses: list[str], world_size: int, cases: list[Case], job: str,
           **options: object) -> list[dict]:
    """Every rank's result matches the float64 reference, and all ranks hold the same values.

    (Same values, not always the same bits: a block that is zero on every rank is never sent, so
    each rank keeps its own zeros there, +0.0 or -0.0.)"""
    outs = pool.run(addresses, world_size, cases, job=job, **options)
    for i, case in enumerate(cases):
        first = None
        for rank, out in enumerate(outs):
            status, *rest = out["results"][i]
            assert status == "ok", f"rank {rank}, {case}: {rest}"
            assert_matches(case, world_size, rest[0], average=bool(options.get("average")))
            if first is None:
                first = rest[0]
            else:
                assert np.array_equal(first, rest[0], equal_nan=True), f"{case}: rank {rank} differs from rank 0"
    return outs


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_densities_and_placements(pool: RankPool, aggregator, job: str, world_size: int) -> None:
    # 100_003 elements: not a multiple of the block size; each case a fresh random input
    cases = [Case(100_003, density=d, placement=p, seed=7 * world_size + i)
             for i, (d, p) in enumerate((d, p) for d in DENSITIES for p in ("random", "overlap"))]
    _check(pool, [aggregator.address], world_size, cases, job)


@pytest.mark.parametrize("dtype", ["float32", "float16", pytest.param("bfloat16", marks=pytest.mark.torch)])
def test_dtypes_specials_and_odd_sizes(pool: RankPool, aggregator, job: str, dtype: str) -> None:
    cases = [Case(n, dtype=dtype, density=d, seed=s, specials=True, block_size=B)
             for s, (n, d, B) in enumerate([(1, 1.0, 256), (255, 1.0, 256), (257, 0.5, 256), (9_999, 0.3, 100),
                                            (65_537, 0.05, 256), (131_072, 1.0, 128)])]
    cases += [Case(0, dtype=dtype, density=0.0), Case(5_000, dtype=dtype, density=0.0, seed=99)]
    for block_size in sorted({c.block_size for c in cases}):
        subset = [c for c in cases if c.block_size == block_size]
        _check(pool, [aggregator.address], 3, subset, f"{job}-{block_size}", block_size=block_size)


def test_two_aggregators_and_many_rows_per_lane(pool: RankPool, aggregators, job: str) -> None:
    addresses = [a.address for a in aggregators]

    def completed() -> list[int]:
        return [a.counters["slots_completed"] for a in aggregators]

    def check_both_served(before: list[int], total: int) -> None:
        # (an aggregator counts a slot after sending its results: poll, the ranks may be done first)
        assert wait_for(lambda: sum(completed()) - sum(before) >= total, 5.0), (before, completed())
        after = completed()
        assert all(a > b for a, b in zip(after, before, strict=True)), f"slots completed {before} -> {after}"

    cases = [Case(200_000, density=d, seed=i, placement="overlap" if i % 2 else "random", specials=i == 2)
             for i, d in enumerate([0.002, 0.05, 0.3, 1.0])]
    # few lanes per slot: many rows per lane, many rounds, slots spread over both aggregators
    before = completed()
    _check(pool, addresses, 4, cases, job, lanes=16, slots=5)
    check_both_served(before, 5 * len(cases))
    # default geometry: 600_000 elements are 3 slots (of 1024 lanes), slot s at aggregator s % 2
    cases = [dataclasses.replace(c, numel=600_000) for c in cases]
    before = completed()
    _check(pool, addresses, 4, cases, job + "-b")
    check_both_served(before, 3 * len(cases))


def test_bitwise_reproducible_across_runs(pool: RankPool, aggregator, job: str) -> None:
    cases = [Case(300_001, density=0.2, seed=5, specials=True), Case(50_000, dtype="float16", density=0.6, seed=6)]
    first = _check(pool, [aggregator.address], 4, cases, job)
    second = _check(pool, [aggregator.address], 4, cases, job + "-again", lanes=64, slots=3)
    for rank in range(4):
        for i in range(len(cases)):
            assert first[rank]["results"][i][2] == second[rank]["results"][i][2], \
                f"rank {rank}, {cases[i]}: results differ between runs"


@pytest.mark.torch
def test_async_many_in_flight_torch_and_shapes(pool: RankPool, aggregator, job: str) -> None:
    cases = [Case(n, density=d, seed=i, kind="torch" if i % 2 else "numpy", dtype=t,
                  shape=(n // 10, 10) if n % 10 == 0 and n else None)
             for i, (n, d, t) in enumerate([(40_000, 0.1, "float32"), (1_000, 1.0, "float16"),
                                            (123_457, 0.01, "bfloat16"), (0, 0.0, "float32"),
                                            (77_770, 0.5, "float32"), (10, 1.0, "float32")] * 2)]
    _check(pool, [aggregator.address], 3, cases, job, mode="async")


@pytest.mark.parametrize("dtype", ["float16", pytest.param("bfloat16", marks=pytest.mark.torch)])
def test_average(pool: RankPool, aggregator, job: str, dtype: str) -> None:
    cases = [Case(70_001, density=0.3, seed=1), Case(30_000, dtype=dtype, density=0.5, seed=2),
             Case(30_000, dtype="float16", density=1.0, seed=3)]
    _check(pool, [aggregator.address], 3, cases, job, average=True)


def test_bytes_sent_follow_density(pool: RankPool, aggregator, job: str) -> None:
    n = 4 * 1024 * 1024  # 16 MiB of float32
    outs = _check(pool, [aggregator.address], 2, [Case(n, density=0.01, seed=3)], job)
    dense = n * 4
    for out in outs:
        st = out["stats"]
        assert st["dense_bytes"] == dense
        assert st["blocks_nonzero"] == round(n // 256 * 0.01)
        assert st["blocks_sent"] == st["blocks_nonzero"]
        # upward: ~1% of the dense bytes (the blocks, plus headers and bitmaps of a few KB)
        assert 0.01 * dense <= st["bytes_sent"] <= 0.011 * dense, st
        # downward: the union of the two ranks' blocks, just under 2%
        assert 0.0195 * dense <= st["bytes_received"] <= 0.021 * dense, st


@pytest.mark.torch
def test_results_land_in_the_callers_memory(aggregator, job: str) -> None:
    """In-process ranks (threads): a non-contiguous view and a torch tensor are reduced in place."""
    import torch

    import omnireduce

    base = [np.arange(4000, dtype=np.float32).reshape(40, 100) * (r + 1) for r in range(2)]
    views = [b[:, ::2] for b in base]  # non-contiguous
    tensors = [torch.full((333,), float(r + 1)) for r in range(2)]

    def rank_main(r: int) -> None:
        with omnireduce.Worker([aggregator.address], rank=r, world_size=2, job=job, timeout=20) as w:
            assert w.allreduce(views[r]) is views[r]
            w.allreduce(tensors[r])

    run_in_threads(rank_main, 2, timeout=60)
    want = np.arange(4000, dtype=np.float32).reshape(40, 100)[:, ::2] * 3
    for r in range(2):
        np.testing.assert_array_equal(views[r], want)
        np.testing.assert_array_equal(base[r][:, 1::2], np.arange(4000, dtype=np.float32).reshape(40, 100)[:, 1::2]
                                      * (r + 1))  # untouched
        assert torch.equal(tensors[r], torch.full((333,), 3.0))


DEVICE_PATH = {"OMNIREDUCE_DEVICE_PATH": "1"}


@pytest.mark.torch
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_device_path_compact_and_scatter(pool: RankPool, aggregators, job: str, dtype: str,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """The CUDA path (compaction, compact host copy, one upload, scatter) run with torch ops on CPU."""
    import torch

    from omnireduce.sources.adapt import adapt
    from omnireduce.sources.device import DeviceSource
    from omnireduce.sources.host import HostSource

    # the switch works: with it a CPU tensor takes the device path, without it the host path; and
    # the rank processes see it for their commands
    tdtype = getattr(torch, dtype)
    assert isinstance(adapt(torch.zeros(4, dtype=tdtype)), HostSource)
    monkeypatch.setenv("OMNIREDUCE_DEVICE_PATH", "1")
    assert isinstance(adapt(torch.zeros(4, dtype=tdtype)), DeviceSource)
    monkeypatch.delenv("OMNIREDUCE_DEVICE_PATH")
    assert pool.call("tests.harness:device_path_active", 3, env=DEVICE_PATH, timeout=60) == [True] * 3
    addresses = [a.address for a in aggregators]
    cases = [Case(n, dtype=dtype, density=d, seed=s, specials=True, kind="torch", placement=p)
             for s, (n, d, p) in enumerate([(1, 1.0, "random"), (257, 0.5, "random"), (70_001, 0.02, "random"),
                                            (65_536, 0.3, "overlap"), (100_000, 1.0, "random"), (0, 0.0, "random"),
                                            (4_000, 0.0, "random")])]
    _check(pool, addresses, 3, cases, job, env=DEVICE_PATH, lanes=32, slots=3)
    _check(pool, addresses, 3, cases[:5], job + "-avg", env=DEVICE_PATH, average=True)


def _thresholded_reference(cases: list[Case], world_size: int, threshold: float) -> list[np.ndarray]:
    from tests.harness import make_values

    out = []
    for case in cases:
        total = np.zeros(case.numel)
        for r in range(world_size):
            x = make_values(case, r).astype(np.float64)
            B = case.block_size
            for b in range(0, case.numel, B):
                blk = x[b:b + B]
                if np.all(np.abs(blk) <= threshold):
                    blk[:] = 0.0
            total += x
        out.append(total)
    return out


@pytest.mark.torch
@pytest.mark.parametrize("env", [{}, DEVICE_PATH], ids=["host", "device"])
def test_lossy_threshold_drops_small_blocks_everywhere(pool: RankPool, aggregator, job: str, env: dict) -> None:
    threshold = 0.5
    cases = []
    for i in range(3):
        cases.append(Case(10_000 + 7 * i, density=0.3, seed=40 + i, kind="torch", small=0.5))
    outs = pool.run([aggregator.address], 2, cases, job=job, threshold=threshold, env=env)
    refs = _thresholded_reference(cases, 2, threshold)
    exact = [reference(c, 2)[0] for c in cases]
    assert any(np.abs(r - e).max() > 0 for r, e in zip(refs, exact, strict=True)), "no block was small enough"
    for out in outs:
        for (status, *rest), ref in zip(out["results"], refs, strict=True):
            assert status == "ok", rest
            np.testing.assert_allclose(rest[0], ref, rtol=1e-6, atol=1e-6)
